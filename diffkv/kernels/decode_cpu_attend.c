/* Decode attention of one item straight from its pages (part of the compiled CPU decode step, decode_cpu.c).
 *
 * Built with reassociation allowed (the launcher's ATTEND_FLAGS), so the dot products and sums vectorize; the results
 * match the torch reference within float rounding, not bit for bit. Nothing here writes K/V bytes: the stores, which
 * must be bit-exact, live in decode_cpu.c (strict IEEE).
 *
 * Page by page: the page's keys are dequantized into a small tile (transposed, [D, N], so each of the G query heads
 * of the GQA group sweeps it with four 8-token accumulators held in registers), its values into a [N, D] tile; a
 * tile is one page's worth of floats, reused for every page. Two passes over the pages: logits (keys), softmax over both
 * tiers, then values weighted by the normalized probabilities.
 */
#include "decode_cpu.h"

typedef float v8 __attribute__((vector_size(32)));  /* GCC/clang generic vectors: AVX2 here, lowered elsewhere */

static inline v8 load8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }
static inline v8 splat8(float x) { return (v8){x, x, x, x, x, x, x, x}; }

typedef int32_t v8i __attribute__((vector_size(32)));

/* exp of 8 lanes, x <= 0 (logit - max): 2^n * e^r, n = round(x / ln 2), |r| <= ln 2 / 2, degree-6 Taylor (relative
 * error < 2e-7); x below -87 is clamped (e^-87 ~ 1.6e-38). About 20 instructions for 8 values, vs a libm call each. */
static inline v8 exp8(v8 x) {
    v8i low = x < splat8(-87.0f);
    x = (v8)(((v8i)x & ~low) | ((v8i)splat8(-87.0f) & low));
    v8 y = x * splat8(1.44269504f) + splat8(0.5f);
    v8i n = __builtin_convertvector(y, v8i);  /* truncates: floor(y) for y >= 0; one less below where it rounded up */
    n += __builtin_convertvector(n, v8) > y;  /* a true comparison is -1 */
    v8 f = __builtin_convertvector(n, v8);
    v8 r = x - f * splat8(0.693359375f) - f * splat8(-2.12194440e-4f);
    v8 p = splat8(1.0f / 720) * r + splat8(1.0f / 120);
    p = p * r + splat8(1.0f / 24);
    p = p * r + splat8(1.0f / 6);
    p = p * r + splat8(0.5f);
    p = p * r + splat8(1.0f);
    p = p * r + splat8(1.0f);
    return p * (v8)((n + 127) << 23);
}

/* Dequantize the first m rows (tokens) of a page's key or value segment into tile: transposed [d, stride] when
 * transposed, else [m, d]. row: d floats of scratch. */
static void dequant_tile(const uint8_t *page, const Tier *t, int value, int64_t m, int64_t d, int meta_kind,
                         int raw_kind, float *row, float *tile, int64_t stride, int transposed) {
    const int64_t *L = t->lay;
    int64_t bits = L[value ? VBITS : KBITS], groups = L[value ? VGROUPS : KGROUPS], mb = t->meta_bytes;
    int64_t rb = value ? t->vrow : t->krow, gs = d / groups;
    const uint8_t *codes = page + L[value ? V_OFF : K_OFF], *meta = page + L[value ? VM_OFF : KM_OFF];
    int64_t fields = value ? 2 : L[K_FIELDS];
    for (int64_t s = 0; s < m; s++) {
        float *x = transposed ? row : tile + s * d;
        widen_row(codes + s * rb, bits, d, raw_kind, x);
        if (bits != 16)
            for (int64_t r = 0; r < groups; r++) {
                const uint8_t *mp = meta + (s * groups + r) * fields * mb;
                float sc = load_meta(mp, meta_kind);
                float z = fields == 2 ? load_meta(mp + mb, meta_kind) : symmetric_zero(sc, bits);
                for (int64_t e = r * gs; e < (r + 1) * gs; e++) x[e] = x[e] * sc + z;
            }
        if (transposed)  /* NOTE: whole-vector reloads of the row: narrow loads of a wide store stall forwarding */
            for (int64_t c0 = 0; c0 < d; c0 += 8) {
                v8 xv = load8(x + c0);
                for (int j = 0; j < 8; j++) tile[(c0 + j) * stride + s] = xv[j];
            }
    }
}

/* y[j] += sum_i x[i] * M[i * ld + j] for j < n (rows of M readable up to n rounded up to 8): 32 outputs in four
 * registers at a time (independent FMA chains, i in order), then 8. */
static void vec_mat(const float *x, int64_t rows, const float *M, int64_t ld, int64_t n, float *y) {
    int64_t j0 = 0;
    for (; j0 + 32 <= n; j0 += 32) {
        v8 a0 = load8(y + j0), a1 = load8(y + j0 + 8), a2 = load8(y + j0 + 16), a3 = load8(y + j0 + 24);
        for (int64_t i = 0; i < rows; i++) {
            const float *r = M + i * ld + j0;
            v8 xi = splat8(x[i]);
            a0 += xi * load8(r);
            a1 += xi * load8(r + 8);
            a2 += xi * load8(r + 16);
            a3 += xi * load8(r + 24);
        }
        store8(y + j0, a0), store8(y + j0 + 8, a1), store8(y + j0 + 16, a2), store8(y + j0 + 24, a3);
    }
    for (; j0 < n; j0 += 8) {
        float tmp[8] = {0};
        size_t w = (size_t)(n - j0 < 8 ? n - j0 : 8) * sizeof(float);
        memcpy(tmp, y + j0, w);
        v8 a = load8(tmp);
        for (int64_t i = 0; i < rows; i++) a += splat8(x[i]) * load8(M + i * ld + j0);
        store8(tmp, a);
        memcpy(y + j0, tmp, w);
    }
}

/* out[s] = sum_c q[c] * kt[c * stride + s] for s < m (stride >= m rounded up to 8). */
static void logits_page(const float *q, const float *kt, int64_t stride, int64_t m, int64_t d, float *out) {
    memset(out, 0, (size_t)m * sizeof(float));
    vec_mat(q, d, kt, stride, m, out);
}

/* acc[c] += sum_s w[s] * v[s * d + c] for c < d (a multiple of 8). */
static void values_page(const float *w, const float *v, int64_t m, int64_t d, float *acc) {
    vec_mat(w, m, v, d, d, acc);
}

/* lg[g * total + first + i] := scaling * (q_g . key_i) for the tokens of tier t. */
static void tier_logits(uint8_t *pool, int64_t page_bytes, const Tier *t, const float *q, int64_t g_count, int64_t d,
                        int meta_kind, int raw_kind, float scaling, float *lg, int64_t total, int64_t first,
                        float *row, float *tile) {
    int64_t n = t->lay[N_TOK], stride = (n + 7) / 8 * 8;
    for (int64_t p = 0; p * n < t->count; p++) {
        int64_t m = t->count - p * n < n ? t->count - p * n : n;
        dequant_tile(page_of(pool, page_bytes, t, p * n), t, 0, m, d, meta_kind, raw_kind, row, tile, stride, 1);
        for (int64_t g = 0; g < g_count; g++) {
            for (int64_t c = 0; c < d; c++) row[c] = q[g * d + c] * scaling;
            logits_page(row, tile, stride, m, d, lg + g * total + first + p * n);
        }
    }
}

/* acc[g] += p[g, first + i] * value_i over the tokens of tier t. */
static void tier_values(uint8_t *pool, int64_t page_bytes, const Tier *t, const float *lg, int64_t total,
                        int64_t first, int64_t g_count, int64_t d, int meta_kind, int raw_kind, float *acc,
                        float *row, float *tile) {
    int64_t n = t->lay[N_TOK];
    for (int64_t p = 0; p * n < t->count; p++) {
        int64_t m = t->count - p * n < n ? t->count - p * n : n;
        dequant_tile(page_of(pool, page_bytes, t, p * n), t, 1, m, d, meta_kind, raw_kind, row, tile, d, 0);
        for (int64_t g = 0; g < g_count; g++)
            values_page(lg + g * total + first + p * n, tile, m, d, acc + g * d);
    }
}

void diffkv_attend_item(uint8_t *pool, int64_t page_bytes, const Tier *high, const Tier *low, const float *q,
                        float *out, int64_t g_count, int64_t d, int meta_kind, int raw_kind, float scaling,
                        int64_t position, int64_t lag, float *scratch) {
    int64_t total = high->count + low->count;
    float *lg = scratch, *gain = lg + g_count * (total > 0 ? total : 1), *row = gain + total, *acc = row + d;
    float *tile = acc + g_count * d;
    for (int64_t x = 0; x < g_count * d; x++) acc[x] = 0.0f;
    if (total == 0) {  /* no token: zero output, as the reference */
        memcpy(out, acc, (size_t)(g_count * d) * sizeof(float));
        return;
    }
    tier_logits(pool, page_bytes, high, q, g_count, d, meta_kind, raw_kind, scaling, lg, total, 0, row, tile);
    tier_logits(pool, page_bytes, low, q, g_count, d, meta_kind, raw_kind, scaling, lg, total, high->count, row, tile);
    for (int64_t i = 0; i < total; i++) gain[i] = 0.0f;
    for (int64_t g = 0; g < g_count; g++) {  /* softmax of each query head; gain = max over the group */
        float *r = lg + g * total, m = -INFINITY, l = 0.0f;
        for (int64_t i = 0; i < total; i++) m = r[i] > m ? r[i] : m;
        int64_t i = 0;
        for (; i + 8 <= total; i += 8) {
            v8 e = exp8(load8(r + i) - splat8(m));
            store8(r + i, e);
        }
        for (; i < total; i++) r[i] = expf(r[i] - m);
        for (i = 0; i < total; i++) l += r[i];
        float inv = 1.0f / l;
        for (int64_t i = 0; i < total; i++) {
            r[i] *= inv;
            gain[i] = r[i] > gain[i] ? r[i] : gain[i];
        }
    }
    tier_values(pool, page_bytes, high, lg, total, 0, g_count, d, meta_kind, raw_kind, acc, row, tile);
    tier_values(pool, page_bytes, low, lg, total, high->count, g_count, d, meta_kind, raw_kind, acc, row, tile);
    memcpy(out, acc, (size_t)(g_count * d) * sizeof(float));
    diffkv_add_scores(pool, page_bytes, high, gain, position, lag);
    diffkv_add_scores(pool, page_bytes, low, gain + high->count, position, lag);
}
