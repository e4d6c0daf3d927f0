/* Shared by decode_cpu.c (placement and stores, strict IEEE) and decode_cpu_attend.c (attention, vectorized):
 * error codes, the tier layout fields the launcher passes, 16-bit float formats, and where a token lives. */
#ifndef DIFFKV_DECODE_CPU_H
#define DIFFKV_DECODE_CPU_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BAD_ITEM (-3)
#define BAD_PAGE (-4)
#define NO_ROOM (-5)
#define NOT_REPRESENTABLE (-6)
#define NO_MEMORY (-7)

enum { N_TOK, KBITS, VBITS, KGROUPS, VGROUPS, K_OFF, KM_OFF, V_OFF, VM_OFF, S_OFF, P_OFF, S_BYTES, K_FIELDS,
       PEAK, LAYOUT_FIELDS };  /* PEAK: the score field holds peaks (DiffKVConfig.importance), not a sum or mean */
enum { KIND_F16, KIND_BF16, KIND_F32 };
enum { APPEND, PRUNE_HIGH, DEMOTE_OVER_LOW, DEMOTE_APPEND_LOW };

/* ---- 16-bit float formats (round to nearest even, as torch's .to()) ---- */
static inline float bits_to_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f32_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0) return sign ? -(float)m * 0x1p-24f : (float)m * 0x1p-24f;  /* zero / subnormal: exact */
    if (e == 31) return bits_to_f32(sign | 0x7f800000 | (m << 13));
    return bits_to_f32(sign | ((e + 112) << 23) | (m << 13));
}

static inline uint16_t f32_to_f16(float f) {
    uint32_t x = f32_to_bits(f), sign = (x >> 16) & 0x8000, ax = x & 0x7fffffff;
    if (ax >= 0x7f800000) return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000 ? 0x200 : 0));
    if (ax >= 0x477ff000) return (uint16_t)(sign | 0x7c00);  /* >= 65520 rounds to inf */
    if (ax < 0x38800000) return (uint16_t)(sign | (uint32_t)rintf(bits_to_f32(ax) * 0x1p24f));  /* subnormal */
    uint32_t r = ax - 0x38000000;
    r += 0xfff + ((r >> 13) & 1);
    return (uint16_t)(sign | (r >> 13));
}

static inline float bf16_to_f32(uint16_t h) { return bits_to_f32((uint32_t)h << 16); }

static inline uint16_t f32_to_bf16(float f) {
    uint32_t x = f32_to_bits(f);
    if ((x & 0x7fffffff) > 0x7f800000) return (uint16_t)((x >> 16) | 0x40);
    return (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

static inline float half_to_f32(uint16_t h, int kind) { return kind == KIND_BF16 ? bf16_to_f32(h) : f16_to_f32(h); }

/* The next 16-bit value towards +inf (up) or -inf: both formats are sign-magnitude. */
static inline uint16_t half_next(uint16_t h, int up) {
    if ((h & 0x7fff) == 0) return up ? 0x0001 : 0x8001;
    return (uint16_t)(((h & 0x8000) != 0) == (up != 0) ? h - 1 : h + 1);
}

/* quant.round_to: x rounded to the meta dtype towards +inf (up) or -inf; the value and its stored bits. */
static inline float round_meta(float x, int kind, int up, uint32_t *bits) {
    if (kind == KIND_F32) { *bits = f32_to_bits(x); return x; }
    uint16_t h = kind == KIND_BF16 ? f32_to_bf16(x) : f32_to_f16(x);
    float hf = half_to_f32(h, kind);
    if (up ? hf < x : hf > x) { h = half_next(h, up); hf = half_to_f32(h, kind); }
    *bits = h;
    return hf;
}

static inline float load_meta(const uint8_t *p, int kind) {
    if (kind == KIND_F32) { float f; memcpy(&f, p, 4); return f; }
    uint16_t h; memcpy(&h, p, 2);
    return half_to_f32(h, kind);
}

static inline void store_meta(uint8_t *p, uint32_t bits, int kind) { memcpy(p, &bits, kind == KIND_F32 ? 4 : 2); }

/* The zero of a scale-only (symmetric) group: -scale * qmax / 2, exact in fp32 (quant.symmetric_zero). */
static inline float symmetric_zero(float scale, int64_t bits) { return scale * -((float)((1 << bits) - 1) * 0.5f); }

/* ---- one tier of one item: where token i lives ---- */
typedef struct {
    const int64_t *lay;   /* TierLayout fields */
    const int32_t *row;   /* the item's table row */
    int64_t col0, step;   /* column of page 0 and the direction (high: 0, +1; low: width - 1, -1) */
    int64_t count;        /* tokens held */
    int64_t meta_bytes, raw_bytes, krow, vrow;
} Tier;

static inline uint8_t *page_of(uint8_t *pool, int64_t page_bytes, const Tier *t, int64_t i) {
    return pool + (int64_t)t->row[t->col0 + t->step * (i / t->lay[N_TOK])] * page_bytes;
}

/* ---- score and position fields (diffkv.core.bookkeeping): fp32 sum + int32 position, or (compact, 2-byte
 * fields) the fp16 mean + the position mod 2^16 ---- */
static inline int is_compact(const Tier *t) { return t->lay[S_BYTES] == 2; }

static inline int64_t token_age(const uint8_t *page, const Tier *t, int64_t slot, int64_t position) {
    if (is_compact(t)) { uint16_t p; memcpy(&p, page + t->lay[P_OFF] + slot * 2, 2); return (position - p) & 0xFFFF; }
    int32_t p;
    memcpy(&p, page + t->lay[P_OFF] + slot * 4, 4);
    return position - p;
}

static inline float load_score(const uint8_t *page, const Tier *t, int64_t slot) {
    if (is_compact(t)) { uint16_t h; memcpy(&h, page + t->lay[S_OFF] + slot * 2, 2); return f16_to_f32(h); }
    float f;
    memcpy(&f, page + t->lay[S_OFF] + slot * 4, 4);
    return f;
}

/* One step's attention gain [count] into a tier's scores (bookkeeping.updated). Defined in decode_cpu.c, whose
 * strict flags keep the compact mean update bit-exact with torch. */
void diffkv_add_scores(uint8_t *pool, int64_t page_bytes, const Tier *t, const float *gain, int64_t position,
                       int64_t lag);

static inline int64_t row_bytes(int64_t bits, int64_t d, int64_t raw_bytes) {
    return bits == 16 ? d * raw_bytes : d * bits / 8;
}

/* Widen one row of d codes of `bits` bits (little-endian packed) to floats; 16-bit rows are converted. */
/* Code c of a packed row of d codes (quant.pack: little-endian in bytes; 3 bits: 2-bit plane, then 1-bit plane). */
static inline uint32_t code_at(const uint8_t *codes, int64_t c, int64_t bits, int64_t d) {
    if (bits == 3)
        return ((codes[c / 4] >> ((c % 4) * 2)) & 3u) | (((codes[d / 4 + c / 8] >> (c % 8)) & 1u) << 2);
    int64_t per = 8 / bits;
    return (codes[c / per] >> ((c % per) * bits)) & ((1u << bits) - 1);
}

/* Set code c (< 2^bits) of a zeroed packed row (the inverse of code_at). */
static inline void put_code(uint8_t *codes, int64_t c, uint32_t q, int64_t bits, int64_t d) {
    if (bits == 3) {
        codes[c / 4] |= (uint8_t)((q & 3u) << ((c % 4) * 2));
        codes[d / 4 + c / 8] |= (uint8_t)(((q >> 2) & 1u) << (c % 8));
        return;
    }
    int64_t per = 8 / bits;
    codes[c / per] |= (uint8_t)(q << ((c % per) * bits));
}

static inline void widen_row(const uint8_t *codes, int64_t bits, int64_t d, int raw_kind, float *x) {
    if (bits == 8) {
        for (int64_t c = 0; c < d; c++) x[c] = (float)codes[c];
    } else if (bits == 4) {
        for (int64_t b = 0; b < d / 2; b++) { x[2 * b] = (float)(codes[b] & 15); x[2 * b + 1] = (float)(codes[b] >> 4); }
    } else if (bits == 2) {
        for (int64_t b = 0; b < d / 4; b++)
            for (int s = 0; s < 4; s++) x[4 * b + s] = (float)((codes[b] >> (2 * s)) & 3);
    } else if (bits == 1) {
        for (int64_t b = 0; b < d / 8; b++)
            for (int s = 0; s < 8; s++) x[8 * b + s] = (float)((codes[b] >> s) & 1);
    } else if (bits == 3) {  /* a 2-bit plane of the low bits [d / 4], then a 1-bit plane of the high bit [d / 8] */
        widen_row(codes, 2, d, raw_kind, x);
        for (int64_t b = 0; b < d / 8; b++)
            for (int s = 0; s < 8; s++) x[8 * b + s] += (float)(((codes[d / 4 + b] >> s) & 1) << 2);
    } else if (raw_kind == KIND_F32) {
        memcpy(x, codes, (size_t)d * 4);
    } else {
        for (int64_t c = 0; c < d; c++) { uint16_t v; memcpy(&v, codes + 2 * c, 2); x[c] = half_to_f32(v, raw_kind); }
    }
}

/* Attention of one item's G queries [G, D] over its tiers (after the stores), output [G, D], scores updated
 * (diffkv_add_scores; position: the step's, lag: the config's score lag).
 * scratch: at least attend_scratch_floats(tokens of the item, G, D, most tokens per page) floats (also >= 2 D).
 * Defined in decode_cpu_attend.c. */
void diffkv_attend_item(uint8_t *pool, int64_t page_bytes, const Tier *high, const Tier *low, const float *q,
                        float *out, int64_t g_count, int64_t d, int meta_kind, int raw_kind, float scaling,
                        int64_t position, int64_t lag, float *scratch);

static inline int64_t attend_scratch_floats(int64_t total, int64_t g_count, int64_t d, int64_t tokens_per_page) {
    return g_count * (total > 0 ? total : 1) + total + d + g_count * d + (tokens_per_page + 7) / 8 * 8 * d;
}

#endif


