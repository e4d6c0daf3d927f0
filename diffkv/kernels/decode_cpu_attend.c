/* Decode attention of one item straight from its pages (part of the compiled CPU decode step, decode_cpu.c).
 *
 * Built with reassociation allowed (the launcher's ATTEND_FLAGS), so the dot products and sums vectorize; the results
 * match the torch reference within float rounding, not bit for bit. Nothing here writes K/V bytes: the stores, which
 * must be bit-exact, live in decode_cpu.c (strict IEEE).
 *
 * Quantized rows are never dequantized into a buffer of values: with per-group (scale s, zero z),
 *   q . k = sum_groups s * (q . code) + z * sum(q),     p * v = (p * s) * code + p * z,
 * so each key / value row is widened from its codes once and shared by the G query heads of the GQA group.
 * Two passes over the tokens: logits (keys), then values weighted by the normalized probabilities.
 */
#include "decode_cpu.h"

/* lg[g * total + first + i] := scaling * (q_g . key_i) for the tokens of tier t. qsum: [G, groups] scratch. */
static void tier_logits(uint8_t *pool, int64_t page_bytes, const Tier *t, const float *q, int64_t g_count, int64_t d,
                        int meta_kind, int raw_kind, float scaling, float *lg, int64_t total, int64_t first,
                        float *kbuf, float *qsum) {
    const int64_t *L = t->lay;
    int64_t bits = L[KBITS], groups = L[KGROUPS], mb = t->meta_bytes, n = L[N_TOK], gs = d / groups;
    if (bits != 16)
        for (int64_t g = 0; g < g_count; g++)
            for (int64_t r = 0; r < groups; r++) {
                float s = 0.0f;
                for (int64_t e = 0; e < gs; e++) s += q[g * d + r * gs + e];
                qsum[g * groups + r] = s;
            }
    for (int64_t p = 0; p * n < t->count; p++) {
        const uint8_t *page = page_of(pool, page_bytes, t, p * n);
        int64_t m = t->count - p * n < n ? t->count - p * n : n;
        for (int64_t slot = 0; slot < m; slot++) {
            float *out = lg + first + p * n + slot;
            widen_row(page + L[K_OFF] + slot * t->krow, bits, d, raw_kind, kbuf);
            if (bits == 16) {
                for (int64_t g = 0; g < g_count; g++) {
                    float acc = 0.0f;
                    for (int64_t c = 0; c < d; c++) acc += q[g * d + c] * kbuf[c];
                    out[g * total] = acc * scaling;
                }
                continue;
            }
            const uint8_t *meta = page + L[KM_OFF] + slot * groups * 2 * mb;
            for (int64_t g = 0; g < g_count; g++) out[g * total] = 0.0f;
            for (int64_t r = 0; r < groups; r++) {
                float s = load_meta(meta + r * 2 * mb, meta_kind), z = load_meta(meta + r * 2 * mb + mb, meta_kind);
                const float *kr = kbuf + r * gs;
                for (int64_t g = 0; g < g_count; g++) {
                    const float *qg = q + g * d + r * gs;
                    float acc = 0.0f;
                    for (int64_t e = 0; e < gs; e++) acc += qg[e] * kr[e];
                    out[g * total] += s * acc + z * qsum[g * groups + r];
                }
            }
            for (int64_t g = 0; g < g_count; g++) out[g * total] *= scaling;
        }
    }
}

/* acc[g] += p[g, first + i] * value_i over the tokens of tier t. zsum: [G, groups] scratch. */
static void tier_values(uint8_t *pool, int64_t page_bytes, const Tier *t, const float *lg, int64_t total,
                        int64_t first, int64_t g_count, int64_t d, int meta_kind, int raw_kind, float *acc,
                        float *vbuf, float *zsum) {
    const int64_t *L = t->lay;
    int64_t bits = L[VBITS], groups = L[VGROUPS], mb = t->meta_bytes, n = L[N_TOK], gs = d / groups;
    for (int64_t x = 0; x < g_count * groups; x++) zsum[x] = 0.0f;
    for (int64_t p = 0; p * n < t->count; p++) {
        const uint8_t *page = page_of(pool, page_bytes, t, p * n);
        int64_t m = t->count - p * n < n ? t->count - p * n : n;
        for (int64_t slot = 0; slot < m; slot++) {
            const float *w = lg + first + p * n + slot;
            widen_row(page + L[V_OFF] + slot * t->vrow, bits, d, raw_kind, vbuf);
            if (bits == 16) {
                for (int64_t g = 0; g < g_count; g++) {
                    float wg = w[g * total];
                    for (int64_t c = 0; c < d; c++) acc[g * d + c] += wg * vbuf[c];
                }
                continue;
            }
            const uint8_t *meta = page + L[VM_OFF] + slot * groups * 2 * mb;
            for (int64_t r = 0; r < groups; r++) {
                float s = load_meta(meta + r * 2 * mb, meta_kind), z = load_meta(meta + r * 2 * mb + mb, meta_kind);
                const float *vr = vbuf + r * gs;
                for (int64_t g = 0; g < g_count; g++) {
                    float wg = w[g * total], ws = wg * s;
                    float *a = acc + g * d + r * gs;
                    for (int64_t e = 0; e < gs; e++) a[e] += ws * vr[e];
                    zsum[g * groups + r] += wg * z;
                }
            }
        }
    }
    if (bits != 16)
        for (int64_t g = 0; g < g_count; g++)
            for (int64_t r = 0; r < groups; r++)
                for (int64_t e = 0; e < gs; e++) acc[g * d + r * gs + e] += zsum[g * groups + r];
}

static void tier_add_scores(uint8_t *pool, int64_t page_bytes, const Tier *t, const float *gain) {
    int64_t n = t->lay[N_TOK];
    for (int64_t p = 0; p * n < t->count; p++) {
        float *sc = (float *)(page_of(pool, page_bytes, t, p * n) + t->lay[S_OFF]);
        int64_t m = t->count - p * n < n ? t->count - p * n : n;
        for (int64_t slot = 0; slot < m; slot++) sc[slot] += gain[p * n + slot];
    }
}

void diffkv_attend_item(uint8_t *pool, int64_t page_bytes, const Tier *high, const Tier *low, const float *q,
                        float *out, int64_t g_count, int64_t d, int meta_kind, int raw_kind, float scaling,
                        float *scratch) {
    int64_t total = high->count + low->count;
    float *lg = scratch, *gain = lg + g_count * (total > 0 ? total : 1), *buf = gain + total, *acc = buf + d;
    float *groupwise = acc + g_count * d;
    for (int64_t x = 0; x < g_count * d; x++) acc[x] = 0.0f;
    if (total == 0) {  /* no token: zero output, as the reference */
        memcpy(out, acc, (size_t)(g_count * d) * sizeof(float));
        return;
    }
    tier_logits(pool, page_bytes, high, q, g_count, d, meta_kind, raw_kind, scaling, lg, total, 0, buf, groupwise);
    tier_logits(pool, page_bytes, low, q, g_count, d, meta_kind, raw_kind, scaling, lg, total, high->count, buf,
                groupwise);
    for (int64_t i = 0; i < total; i++) gain[i] = 0.0f;
    for (int64_t g = 0; g < g_count; g++) {  /* softmax of each query head; gain = max over the group */
        float *row = lg + g * total, m = -INFINITY, l = 0.0f;
        for (int64_t i = 0; i < total; i++) m = row[i] > m ? row[i] : m;
        for (int64_t i = 0; i < total; i++) { row[i] = expf(row[i] - m); l += row[i]; }
        float inv = 1.0f / l;
        for (int64_t i = 0; i < total; i++) {
            row[i] *= inv;
            gain[i] = row[i] > gain[i] ? row[i] : gain[i];
        }
    }
    tier_values(pool, page_bytes, high, lg, total, 0, g_count, d, meta_kind, raw_kind, acc, buf, groupwise);
    tier_values(pool, page_bytes, low, lg, total, high->count, g_count, d, meta_kind, raw_kind, acc, buf, groupwise);
    memcpy(out, acc, (size_t)(g_count * d) * sizeof(float));
    tier_add_scores(pool, page_bytes, high, gain);
    tier_add_scores(pool, page_bytes, low, gain + high->count);
}
