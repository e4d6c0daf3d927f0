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

/* Codes 8c .. 8c + 7 of a packed row of BITS-bit codes (1, 2, 4 or 8) as floats (exact), 8 lanes at once: the 8
 * codes fill BITS bytes, little-endian (an arithmetic shift of bit 31 is masked off). */
#define WIDEN8(codes, c, BITS, out)                                                                           \
    do {                                                                                                      \
        v8i v_;                                                                                               \
        if ((BITS) == 8) {                                                                                    \
            uint8_t b_[8];                                                                                    \
            memcpy(b_, (codes) + 8 * (c), 8);                                                                 \
            v_ = (v8i){b_[0], b_[1], b_[2], b_[3], b_[4], b_[5], b_[6], b_[7]};                               \
        } else {                                                                                              \
            uint32_t w_ = 0;                                                                                  \
            memcpy(&w_, (codes) + (c) * (BITS), (BITS) == 8 ? 1 : (BITS)); /* (8: not this branch) */        \
            v_ = ((v8i){0, 0, 0, 0, 0, 0, 0, 0} + (int32_t)w_) >> ((v8i){0, 1, 2, 3, 4, 5, 6, 7} * (BITS));   \
        }                                                                                                     \
        (out) = __builtin_convertvector(v_ & (int32_t)((1u << (BITS)) - 1), v8);                              \
    } while (0)

/* r[j] := column j of the 8 x 8 block r (rows: tokens, columns: channels), in registers. */
static inline void transpose8(v8 *r) {
    v8 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = __builtin_shufflevector(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[i + 1] = __builtin_shufflevector(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    for (int i = 0; i < 8; i += 4)
        for (int h = 0; h < 2; h++) {
            u[i + 2 * h] = __builtin_shufflevector(t[i + h], t[i + h + 2], 0, 1, 8, 9, 4, 5, 12, 13);
            u[i + 2 * h + 1] = __builtin_shufflevector(t[i + h], t[i + h + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        }
    for (int i = 0; i < 4; i++) {
        r[i] = __builtin_shufflevector(u[i], u[i + 4], 0, 1, 2, 3, 8, 9, 10, 11);
        r[i + 4] = __builtin_shufflevector(u[i], u[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    }
}

/* Tokens s0 .. s0 + nb - 1 (nb <= 8) of a page's key (value = 0) or value segment, 1/2/4/8-bit codes in groups a
 * multiple of 8 wide, dequantized 8 channels at a time in registers: transposed, into tile [d, stride] columns
 * s0 .. s0 + 7 (past nb: zeros); else into tile rows s0 .. [m, d]. sc, z: 8 x groups floats of scratch. */
#define FAST_BLOCK(BITS)                                                                                      \
    for (int64_t c0 = 0; c0 < d; c0 += 8) {                                                                   \
        v8 r[8];                                                                                              \
        for (int64_t j = 0; j < nb; j++) {                                                                    \
            WIDEN8(codes + (s0 + j) * rb, c0 / 8, BITS, r[j]);                                                \
            r[j] = r[j] * splat8(sc[j * groups + c0 / gs]) + splat8(z[j * groups + c0 / gs]);                 \
        }                                                                                                     \
        if (transposed) {                                                                                     \
            for (int64_t j = nb; j < 8; j++) r[j] = splat8(0.0f);                                             \
            transpose8(r);                                                                                    \
            for (int64_t j = 0; j < 8; j++) store8(tile + (c0 + j) * stride + s0, r[j]);                      \
        } else {                                                                                              \
            for (int64_t j = 0; j < nb; j++) store8(tile + (s0 + j) * d + c0, r[j]);                          \
        }                                                                                                     \
    }

static void dequant_block(const uint8_t *page, const Tier *t, int value, int64_t s0, int64_t nb, int64_t d,
                          int meta_kind, float *sc, float *z, float *tile, int64_t stride, int transposed) {
    const int64_t *L = t->lay;
    int64_t bits = L[value ? VBITS : KBITS], groups = L[value ? VGROUPS : KGROUPS], gs = d / groups;
    int64_t fields = value ? 2 : L[K_FIELDS], mb = t->meta_bytes, rb = value ? t->vrow : t->krow;
    const uint8_t *codes = page + L[value ? V_OFF : K_OFF], *meta = page + L[value ? VM_OFF : KM_OFF];
    for (int64_t j = 0; j < nb; j++)
        for (int64_t r = 0; r < groups; r++) {
            const uint8_t *mp = meta + ((s0 + j) * groups + r) * fields * mb;
            sc[j * groups + r] = load_meta(mp, meta_kind);
            z[j * groups + r] = fields == 2 ? load_meta(mp + mb, meta_kind) : symmetric_zero(sc[j * groups + r], bits);
        }
    switch (bits) {  /* one loop per width: constant shifts */
    case 1: FAST_BLOCK(1) break;
    case 2: FAST_BLOCK(2) break;
    case 4: FAST_BLOCK(4) break;
    default: FAST_BLOCK(8) break;
    }
}

/* Dequantize the first m rows (tokens) of a page's key or value segment into tile: transposed [d, stride] when
 * transposed (stride >= m rounded up to 8), else [m, d]. row: d floats of scratch. Codes of 1/2/4/8 bits in
 * groups a multiple of 8 wide go 8 tokens at a time through dequant_block; 3-bit codes, raw 16-bit rows and other
 * group widths row by row. */
static void dequant_tile(const uint8_t *page, const Tier *t, int value, int64_t m, int64_t d, int meta_kind,
                         int raw_kind, float *row, float *tile, int64_t stride, int transposed) {
    const int64_t *L = t->lay;
    int64_t bits = L[value ? VBITS : KBITS], groups = L[value ? VGROUPS : KGROUPS], mb = t->meta_bytes;
    if (bits != 3 && bits <= 8 && d % 8 == 0 && (d / groups) % 8 == 0 && 16 * groups <= d) {
        for (int64_t s0 = 0; s0 < m; s0 += 8)
            dequant_block(page, t, value, s0, m - s0 < 8 ? m - s0 : 8, d, meta_kind, row, row + 8 * groups, tile,
                          stride, transposed);
        return;
    }
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

/* Ask for the key (value = 0) or value codes and metadata of the first m tokens of a page before they are needed:
 * pages are scattered in the pool, so each one's first reads would otherwise wait on memory. */
static void prefetch_page(const uint8_t *page, const Tier *t, int value, int64_t m) {
    const int64_t *L = t->lay;
    int64_t groups = L[value ? VGROUPS : KGROUPS], fields = value ? 2 : L[K_FIELDS];
    const uint8_t *codes = page + L[value ? V_OFF : K_OFF], *meta = page + L[value ? VM_OFF : KM_OFF];
    int64_t code_bytes = m * (value ? t->vrow : t->krow), meta_bytes = m * groups * fields * t->meta_bytes;
    for (int64_t b = 0; b < code_bytes; b += 64) __builtin_prefetch(codes + b);
    for (int64_t b = 0; b < meta_bytes; b += 64) __builtin_prefetch(meta + b);
}

/* Tokens of tier t on its page p. */
static inline int64_t page_tokens(const Tier *t, int64_t p) {
    int64_t n = t->lay[N_TOK];
    return t->count - p * n < n ? t->count - p * n : n;
}

/* lg[g * total + first + i] := scaling * (q_g . key_i) for the tokens of tier t. */
static void tier_logits(uint8_t *pool, int64_t page_bytes, const Tier *t, const float *q, int64_t g_count, int64_t d,
                        int meta_kind, int raw_kind, float scaling, float *lg, int64_t total, int64_t first,
                        float *row, float *tile) {
    int64_t n = t->lay[N_TOK], stride = (n + 7) / 8 * 8;
    for (int64_t p = 0; p * n < t->count; p++) {
        int64_t m = t->count - p * n < n ? t->count - p * n : n;
        if ((p + 1) * n < t->count)  /* the next page, while this one is computed */
            prefetch_page(page_of(pool, page_bytes, t, (p + 1) * n), t, 0, page_tokens(t, p + 1));
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
        if ((p + 1) * n < t->count)  /* the next page, while this one is computed */
            prefetch_page(page_of(pool, page_bytes, t, (p + 1) * n), t, 1, page_tokens(t, p + 1));
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
    const Tier *tiers[2] = {high, low};
    for (int i = 0; i < 2; i++)  /* the first page of each tier: keys now, values for after the softmax */
        for (int value = 0; value < 2 && tiers[i]->count > 0; value++)
            prefetch_page(page_of(pool, page_bytes, tiers[i], 0), tiers[i], value, page_tokens(tiers[i], 0));
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
