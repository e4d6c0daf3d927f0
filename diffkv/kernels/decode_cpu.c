/* One DiffKV decode step of one layer on the CPU, for every (sequence, KV head) item at once, straight from the pages.
 *
 * Per item (docs/algorithm.md §4.4; backends: docs/design.md §5), the same computation as the torch reference
 * (diffkv/ops/decode_step.py: policy.place_decode, PagedKV stores, paged_decode_attention_ref) and the Triton kernels:
 *   1. placement: the weakest eligible token of each tier (mean = score / max(age - lag, 1), age >= max(recent
 *      window, lag + 1), the first slot wins a tie) and the single-victim decision (thresholds
 *      fp32(1 / max(position, 1)) * fp32(alpha)); with lag > 0 (score_after_window) the score of the token whose
 *      age is lag is reset to 0 before the attention (phase 2);
 *   2. demotion: the victim dequantized from its high slot and re-quantized into its low slot (bit-exact with
 *      diffkv/core/quant.py: mul then add, IEEE division, round half to even, fp16/bf16 scales rounded outwards);
 *   3. the new token quantized into its high slot (score 0, pos = position); the counts updated;
 *   4. attention of the item's G query heads over both tiers in one softmax: each key and value row is read from
 *      its page once for the whole GQA group and dequantized on the fly (nothing dense is kept: the logits of the
 *      item, G x tokens floats, are the only scratch); then score += max over the group of the probabilities
 *      (decode_cpu_attend.c, built with reassociation allowed so it vectorizes; this file is strict IEEE).
 * Items run in parallel (OpenMP when built with it). Every check runs before the first write: a call that returns
 * an error changed nothing. Arrays (all contiguous): pool uint8 [num_pages, page_bytes]; rows int32 [stride, width];
 * counts int32 [4, stride] (tokens high, tokens low, pages high, pages low); items int64 [K]; query fp32 [K*G, D];
 * key, value fp32 [K, D]; position int64 [K]; out fp32 [K*G, D]; hi, lo int64 [LAYOUT_FIELDS] tier layouts.
 */
#include "decode_cpu.h"

/* Dequantize (or widen) one stored row of d channels: code * scale, then + zero (two roundings, as torch).
 * fields: meta values per group, 2 (scale, zero) or 1 (symmetric: zero = -scale * qmax / 2, quant.symmetric_zero). */
static void dequant_row(const uint8_t *codes, const uint8_t *meta, int64_t bits, int64_t groups, int64_t d,
                        int meta_kind, int raw_kind, int64_t meta_bytes, int64_t fields, float *x) {
    if (bits == 16) {
        for (int64_t c = 0; c < d; c++) {
            if (raw_kind == KIND_F32) memcpy(&x[c], codes + 4 * c, 4);
            else { uint16_t h; memcpy(&h, codes + 2 * c, 2); x[c] = half_to_f32(h, raw_kind); }
        }
        return;
    }
    int64_t gs = d / groups;
    for (int64_t g = 0; g < groups; g++) {
        float s = load_meta(meta + g * fields * meta_bytes, meta_kind);
        float z = fields == 2 ? load_meta(meta + g * 2 * meta_bytes + meta_bytes, meta_kind) : symmetric_zero(s, bits);
        for (int64_t e = 0; e < gs; e++) {
            int64_t c = g * gs + e;
            float q = (float)code_at(codes, c, bits, d);
            float y = q * s;
            x[c] = y + z;
        }
    }
}

/* Check that x [d] can be stored in a tier of these bits/groups (finite, scales and zeros representable). */
static int representable(const float *x, int64_t bits, int64_t groups, int64_t d, int meta_kind, int raw_kind,
                         int64_t fields) {
    for (int64_t c = 0; c < d; c++) if (!isfinite(x[c])) return 0;
    if (bits == 16) {
        if (raw_kind == KIND_F32) return 1;
        for (int64_t c = 0; c < d; c++) if (!isfinite(half_to_f32(raw_kind == KIND_BF16 ? f32_to_bf16(x[c]) : f32_to_f16(x[c]), raw_kind))) return 0;
        return 1;
    }
    int64_t gs = d / groups;
    float qmax = (float)((1 << bits) - 1);
    for (int64_t g = 0; g < groups; g++) {
        float lo = x[g * gs], hi = x[g * gs];
        for (int64_t e = 1; e < gs; e++) { lo = fminf(lo, x[g * gs + e]); hi = fmaxf(hi, x[g * gs + e]); }
        uint32_t b;
        if (fields == 1) {
            float amax = fmaxf(fabsf(lo), fabsf(hi));
            if (!isfinite(round_meta(fmaxf(amax / (qmax * 0.5f), 0x1p-24f), meta_kind, 1, &b))) return 0;
            continue;
        }
        float z = round_meta(lo + 0.0f, meta_kind, 0, &b);
        float s = round_meta(fmaxf((hi - z) / qmax, 0x1p-24f), meta_kind, 1, &b);
        if (!isfinite(z) || !isfinite(s)) return 0;
    }
    return 1;
}

/* quant.quantize + pack (or the raw cast) of x [d] into codes / meta (bit-exact with diffkv/core/page_io.py). */
static void quant_row(const float *x, int64_t bits, int64_t groups, int64_t d, int meta_kind, int raw_kind,
                      int64_t meta_bytes, int64_t fields, uint8_t *codes, uint8_t *meta) {
    if (bits == 16) {
        for (int64_t c = 0; c < d; c++) {
            if (raw_kind == KIND_F32) memcpy(codes + 4 * c, &x[c], 4);
            else { uint16_t h = raw_kind == KIND_BF16 ? f32_to_bf16(x[c]) : f32_to_f16(x[c]); memcpy(codes + 2 * c, &h, 2); }
        }
        return;
    }
    int64_t gs = d / groups;
    float qmax = (float)((1 << bits) - 1);
    memset(codes, 0, (size_t)(d * bits / 8));
    for (int64_t g = 0; g < groups; g++) {
        const float *xg = x + g * gs;
        float lo = xg[0], hi = xg[0];
        for (int64_t e = 1; e < gs; e++) { lo = fminf(lo, xg[e]); hi = fmaxf(hi, xg[e]); }
        uint32_t zbits, sbits;
        float z, s;
        if (fields == 1) {  /* quant.quantize(symmetric=True): the scale only */
            float amax = fmaxf(fabsf(lo), fabsf(hi));
            s = round_meta(fmaxf(amax / (qmax * 0.5f), 0x1p-24f), meta_kind, 1, &sbits);
            z = symmetric_zero(s, bits);
            store_meta(meta + g * meta_bytes, sbits, meta_kind);
        } else {
            z = round_meta(lo + 0.0f, meta_kind, 0, &zbits);
            s = round_meta(fmaxf((hi - z) / qmax, 0x1p-24f), meta_kind, 1, &sbits);
            store_meta(meta + g * 2 * meta_bytes, sbits, meta_kind);
            store_meta(meta + g * 2 * meta_bytes + meta_bytes, zbits, meta_kind);
        }
        for (int64_t e = 0; e < gs; e++) {
            float q = rintf((xg[e] - z) / s);
            q = fminf(fmaxf(q, 0.0f), qmax);
            int64_t c = g * gs + e;
            put_code(codes, c, (uint32_t)q, bits, d);
        }
    }
}

/* Store one token (k, v [d], the score's stored bits, position) into slot i of tier t. */
static void store_token(uint8_t *pool, int64_t page_bytes, const Tier *t, int64_t i, const float *k, const float *v,
                        uint32_t score_bits, int64_t pos, int64_t d, int meta_kind, int raw_kind) {
    const int64_t *L = t->lay;
    uint8_t *page = page_of(pool, page_bytes, t, i);
    int64_t slot = i % L[N_TOK], mb = t->meta_bytes;
    quant_row(k, L[KBITS], L[KGROUPS], d, meta_kind, raw_kind, mb, L[K_FIELDS], page + L[K_OFF] + slot * t->krow,
              page + L[KM_OFF] + slot * L[KGROUPS] * L[K_FIELDS] * mb);
    quant_row(v, L[VBITS], L[VGROUPS], d, meta_kind, raw_kind, mb, 2, page + L[V_OFF] + slot * t->vrow,
              page + L[VM_OFF] + slot * L[VGROUPS] * 2 * mb);
    if (is_compact(t)) {  /* little-endian: the low half of score_bits is the fp16 mean */
        uint16_t s16 = (uint16_t)score_bits, p16 = (uint16_t)(pos & 0xFFFF);
        memcpy(page + L[S_OFF] + slot * 2, &s16, 2);
        memcpy(page + L[P_OFF] + slot * 2, &p16, 2);
    } else {
        int32_t p32 = (int32_t)pos;
        memcpy(page + L[S_OFF] + slot * 4, &score_bits, 4);
        memcpy(page + L[P_OFF] + slot * 4, &p32, 4);
    }
}

void diffkv_add_scores(uint8_t *pool, int64_t page_bytes, const Tier *t, const float *gain, int64_t position,
                       int64_t lag) {
    int64_t n = t->lay[N_TOK];
    for (int64_t p = 0; p * n < t->count; p++) {
        uint8_t *page = page_of(pool, page_bytes, t, p * n);
        int64_t m = t->count - p * n < n ? t->count - p * n : n;
        const float *g = gain + p * n;
        if (t->lay[PEAK]) {  /* s = max(s, gain), rounded once to the stored dtype */
            for (int64_t s = 0; s < m; s++) {
                float peak = fmaxf(load_score(page, t, s), g[s]);
                if (is_compact(t)) { uint16_t h = f32_to_f16(peak); memcpy(page + t->lay[S_OFF] + s * 2, &h, 2); }
                else memcpy(page + t->lay[S_OFF] + s * 4, &peak, 4);
            }
            continue;
        }
        if (!is_compact(t)) {
            float *sc = (float *)(page + t->lay[S_OFF]);
            for (int64_t s = 0; s < m; s++) sc[s] += g[s];
            continue;
        }
        for (int64_t s = 0; s < m; s++) {  /* m += (gain - m) / max(age + 1 - lag, 1), rounded once to fp16 */
            int64_t c = token_age(page, t, s, position) + 1 - lag;
            float mean = load_score(page, t, s);
            uint16_t h = f32_to_f16(mean + (g[s] - mean) / (float)(c > 1 ? c : 1));
            memcpy(page + t->lay[S_OFF] + s * 2, &h, 2);
        }
    }
}

/* argmin of the mean, score / max(age - lag, 1) (compact: the stored mean; peak: the stored peak), over the eligible tokens (age >= max(recent,
 * lag + 1)); (inf, 0) when none; first slot wins ties. */
static float weakest(uint8_t *pool, int64_t page_bytes, const Tier *t, int64_t position, int64_t recent, int64_t lag,
                     int64_t *idx) {
    float best = INFINITY;
    int64_t min_age = recent > lag + 1 ? recent : lag + 1;
    *idx = 0;
    int64_t n = t->lay[N_TOK];
    for (int64_t p = 0; p * n < t->count; p++) {
        const uint8_t *page = page_of(pool, page_bytes, t, p * n);
        int64_t m = t->count - p * n < n ? t->count - p * n : n;
        for (int64_t s = 0; s < m; s++) {
            int64_t age = token_age(page, t, s, position);
            if (age < min_age) continue;
            float mean = is_compact(t) || t->lay[PEAK] ? load_score(page, t, s)
                                       : load_score(page, t, s) / (float)(age - lag > 1 ? age - lag : 1);
            if (mean < best) { best = mean; *idx = p * n + s; }
        }
    }
    return best;
}

static void make_tier(Tier *t, const int64_t *lay, const int32_t *row, int64_t width, int low, int64_t count,
                      int64_t d, int meta_kind, int raw_kind) {
    t->lay = lay;
    t->row = row;
    t->col0 = low ? width - 1 : 0;
    t->step = low ? -1 : 1;
    t->count = count;
    t->meta_bytes = meta_kind == KIND_F32 ? 4 : 2;
    t->raw_bytes = raw_kind == KIND_F32 ? 4 : 2;
    t->krow = row_bytes(lay[KBITS], d, t->raw_bytes);
    t->vrow = row_bytes(lay[VBITS], d, t->raw_bytes);
}

/* Whether the table cells of pages [0, pages) of a tier hold valid page ids. */
static int pages_valid(const int32_t *row, int64_t width, int low, int64_t pages, int64_t num_pages) {
    for (int64_t p = 0; p < pages; p++) {
        int32_t id = row[low ? width - 1 - p : p];
        if (id < 0 || id >= num_pages) return 0;
    }
    return 1;
}

/* Placement (phase 1, read-only) of item k: case, high slot iL, low slot; 0 or an error code. */
static int64_t place(uint8_t *pool, int64_t num_pages, int64_t page_bytes, const int32_t *rows, int64_t width,
                     const int32_t *counts, int64_t stride, int64_t item, int64_t position, const float *key,
                     const float *value, int64_t d, const int64_t *hi, const int64_t *lo, int meta_kind, int raw_kind,
                     float alpha_low, float alpha_quant, int64_t recent, int64_t lag, int64_t two_tier,
                     int64_t *plan) {
    if (item < 0 || item >= stride) return BAD_ITEM;
    const int32_t *row = rows + item * width;
    int64_t n_hi = counts[item], n_lo = counts[stride + item], p_hi = counts[2 * stride + item];
    int64_t p_lo = counts[3 * stride + item];
    if (n_hi < 0 || n_lo < 0 || p_hi < 0 || p_lo < 0 || p_hi + p_lo > width) return BAD_PAGE;
    if (!pages_valid(row, width, 0, p_hi, num_pages) || !pages_valid(row, width, 1, p_lo, num_pages)) return BAD_PAGE;
    if (n_hi > p_hi * hi[N_TOK] || n_lo > p_lo * lo[N_TOK]) return BAD_PAGE;
    if (!representable(key, hi[KBITS], hi[KGROUPS], d, meta_kind, raw_kind, hi[K_FIELDS]) ||
        !representable(value, hi[VBITS], hi[VGROUPS], d, meta_kind, raw_kind, 2)) return NOT_REPRESENTABLE;
    Tier th, tl;
    make_tier(&th, hi, row, width, 0, n_hi, d, meta_kind, raw_kind);
    make_tier(&tl, lo, row, width, 1, n_lo, d, meta_kind, raw_kind);
    int64_t iL, iR = 0;
    float mL = weakest(pool, page_bytes, &th, position, recent, lag, &iL);
    float mR = two_tier ? weakest(pool, page_bytes, &tl, position, recent, lag, &iR) : INFINITY;
    float rcp = 1.0f / (float)(position > 1 ? position : 1);
    float prune_thr = rcp * alpha_low, quant_thr = rcp * alpha_quant;
    int keep = n_hi + n_lo + 1 > recent;
    int prune_high = mL < prune_thr && mL < mR && keep;
    int demote = mL < quant_thr && !prune_high && keep;
    int over_low = demote && mR < prune_thr;
    int64_t c = prune_high ? PRUNE_HIGH : demote ? (over_low ? DEMOTE_OVER_LOW : DEMOTE_APPEND_LOW) : APPEND;
    if (c == APPEND && n_hi + 1 > p_hi * hi[N_TOK]) return NO_ROOM;
    if (c == DEMOTE_APPEND_LOW && n_lo + 1 > p_lo * lo[N_TOK]) return NO_ROOM;
    plan[0] = c;
    plan[1] = iL;
    plan[2] = over_low ? iR : n_lo;
    return 0;
}

/* score := 0 for the tokens of a tier whose age is exactly lag (policy.window_exits: score_after_window). */
static void reset_window_exits(uint8_t *pool, int64_t page_bytes, const Tier *t, int64_t position, int64_t lag) {
    int64_t n = t->lay[N_TOK];
    for (int64_t p = 0; p * n < t->count; p++) {
        uint8_t *page = page_of(pool, page_bytes, t, p * n);
        int64_t m = t->count - p * n < n ? t->count - p * n : n;
        for (int64_t s = 0; s < m; s++)
            if (token_age(page, t, s, position) == lag) memset(page + t->lay[S_OFF] + s * t->lay[S_BYTES], 0,
                                                                 (size_t)t->lay[S_BYTES]);
    }
}

/* Phase 2 of one item: the window-exit score reset, the victim's demotion, the new token's store, the counts, then
 * the attention. */
static void step_item(uint8_t *pool, int64_t page_bytes, const int32_t *rows, int64_t width, int32_t *counts,
                      int64_t stride, int64_t item, int64_t position, int64_t lag, const int64_t *plan, const float *q,
                      const float *key, const float *value, float *out, int64_t g_count, int64_t d, const int64_t *hi,
                      const int64_t *lo, int meta_kind, int raw_kind, float scaling, float *scratch) {
    const int32_t *row = rows + item * width;
    int64_t n_hi = counts[item], n_lo = counts[stride + item];
    int64_t c = plan[0], iL = plan[1], low_slot = plan[2];
    float *kbuf = scratch, *vbuf = scratch + d;
    Tier th, tl;
    make_tier(&th, hi, row, width, 0, n_hi, d, meta_kind, raw_kind);
    make_tier(&tl, lo, row, width, 1, n_lo, d, meta_kind, raw_kind);
    if (lag > 0) reset_window_exits(pool, page_bytes, &th, position, lag);
    if (c == DEMOTE_OVER_LOW || c == DEMOTE_APPEND_LOW) {  /* the victim: high slot iL -> low slot, re-quantized */
        uint8_t *src = page_of(pool, page_bytes, &th, iL);
        int64_t slot = iL % hi[N_TOK], mb = th.meta_bytes;
        dequant_row(src + hi[K_OFF] + slot * th.krow, src + hi[KM_OFF] + slot * hi[KGROUPS] * hi[K_FIELDS] * mb,
                    hi[KBITS], hi[KGROUPS], d, meta_kind, raw_kind, mb, hi[K_FIELDS], kbuf);
        dequant_row(src + hi[V_OFF] + slot * th.vrow, src + hi[VM_OFF] + slot * hi[VGROUPS] * 2 * mb, hi[VBITS],
                    hi[VGROUPS], d, meta_kind, raw_kind, mb, 2, vbuf);
        uint32_t score_bits = 0;
        memcpy(&score_bits, src + hi[S_OFF] + slot * hi[S_BYTES], (size_t)hi[S_BYTES]);
        int64_t pos = position - token_age(src, &th, slot, position);
        tl.count = n_lo + (c == DEMOTE_APPEND_LOW);
        store_token(pool, page_bytes, &tl, low_slot, kbuf, vbuf, score_bits, pos, d, meta_kind, raw_kind);
    }
    th.count = n_hi + (c == APPEND);
    store_token(pool, page_bytes, &th, c == APPEND ? n_hi : iL, key, value, 0u, position, d, meta_kind, raw_kind);
    counts[item] = (int32_t)th.count;
    counts[stride + item] = (int32_t)tl.count;
    diffkv_attend_item(pool, page_bytes, &th, &tl, q, out, g_count, d, meta_kind, raw_kind, scaling, position, lag,
                       scratch);
}

#define PARALLEL_TOKENS 32768

#ifdef _OPENMP
#include <omp.h>
#define THREAD_ID() omp_get_thread_num()
#else
#define THREAD_ID() 0
#endif

/* The decode step of K distinct items (a HeadSet). plan: int64 [K, 4] scratch (case, high slot, low slot, error).
 * Returns 0, or the first item's error code with failed[0] = that item's index; then nothing was changed. */
int64_t diffkv_decode_step(uint8_t *pool, int64_t num_pages, int64_t page_bytes, const int32_t *rows, int64_t width,
                           int32_t *counts, int64_t stride, const int64_t *items, int64_t num_items, int64_t g_count,
                           int64_t d, const float *query, const float *key, const float *value,
                           const int64_t *position, float *out, const int64_t *hi, const int64_t *lo,
                           int64_t meta_kind, int64_t raw_kind, double scaling, double alpha_low,
                           double alpha_quant, int64_t recent, int64_t lag, int64_t two_tier, int64_t threads,
                           int64_t *plan,
                           int64_t *failed) {
    float a_low = (float)alpha_low, a_quant = (float)alpha_quant;
    threads = threads < 1 ? 1 : threads > num_items ? num_items : threads;
    int64_t stored = 0;
    for (int64_t k = 0; k < num_items; k++)
        stored += items[k] >= 0 && items[k] < stride ? counts[items[k]] + counts[stride + items[k]] : 0;
    /* NOTE: threads only for steps of >= PARALLEL_TOKENS stored tokens: OpenMP workers spin at the barrier, which on a
     * busy machine costs far more than a small step (measured: 0.2 ms -> 17 ms at 2 x 500 tokens, 2 threads, load 4) */
    int parallel = threads > 1 && stored >= PARALLEL_TOKENS;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (parallel)
    for (int64_t k = 0; k < num_items; k++)
        plan[4 * k + 3] = place(pool, num_pages, page_bytes, rows, width, counts, stride, items[k], position[k],
                                key + k * d, value + k * d, d, hi, lo, (int)meta_kind, (int)raw_kind, a_low, a_quant,
                                recent, lag, two_tier, plan + 4 * k);
    int64_t widest = 0;
    for (int64_t k = 0; k < num_items; k++) {
        if (plan[4 * k + 3]) { failed[0] = k; return plan[4 * k + 3]; }
        int64_t i = items[k], total = counts[i] + counts[stride + i] + 1;
        widest = total > widest ? total : widest;
    }
    int64_t per_thread = attend_scratch_floats(widest, g_count, d, hi[N_TOK] > lo[N_TOK] ? hi[N_TOK] : lo[N_TOK]);
    float *scratch = malloc((size_t)(per_thread * (parallel ? threads : 1)) * sizeof(float));
    if (!scratch) { failed[0] = 0; return NO_MEMORY; }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (parallel)
    for (int64_t k = 0; k < num_items; k++)
        step_item(pool, page_bytes, rows, width, counts, stride, items[k], position[k], lag, plan + 4 * k,
                  query + k * g_count * d, key + k * d, value + k * d, out + k * g_count * d, g_count, d, hi, lo,
                  (int)meta_kind, (int)raw_kind, (float)scaling, scratch + per_thread * THREAD_ID());
    free(scratch);
    return 0;
}
