/* Ring free-list operations for the CPU: reserve and release as one compiled demand -> prefix sum -> scatter pass.
 *
 * The same computation as the Triton kernels in diffkv/kernels/ring.py, with the prefix sum as a serial scan (one
 * core: a running offset). Loaded by diffkv/memory/ring_cpu.py; the torch ops in diffkv/memory/alloc.py are the
 * reference. Arrays (all contiguous):
 *   ring int32 [N] page ids; ref int32 [N] refcounts; table int32 [stride, width] page tables;
 *   counts int32 [4, stride] (tokens high, tokens low, pages high, pages low); items int64 [K] flat head ids;
 *   demote int8 [K] or NULL; state int64 [3] (ring start, free pages, refused); out int64 [4] (reserve), [1].
 * Every check runs before the first write: a call that returns an error changed nothing.
 */
#include <stdint.h>

#define BAD_ITEM (-3)
#define BAD_PAGE (-4)

static inline int64_t next(int64_t at, int64_t num_pages) { return at + 1 == num_pages ? 0 : at + 1; }

/* Pages taken -> out[0]; pages needed -> out[1]; widest row after -> out[2]; free pages before -> out[3].
 * Returns 0, or -1 if the pool is short, -2 if a row would outgrow the table (then state[2] += count_refusal and
 * nothing else changed), BAD_ITEM, or BAD_PAGE (a free ring slot holds no valid page id). */
int64_t diffkv_ring_reserve(int32_t *ring, int32_t *ref, int32_t *table, int32_t *counts, const int64_t *items,
                            const int8_t *demote, int64_t *state, int64_t *out, int64_t num_items, int64_t stride,
                            int64_t num_pages, int64_t width, int64_t tokens_hi, int64_t tokens_lo, int64_t recent,
                            int64_t two_tier, int64_t count_refusal) {
    int32_t *n_hi = counts, *n_lo = counts + stride, *p_hi = counts + 2 * stride, *p_lo = counts + 3 * stride;
    int64_t need_hi = 0, need_lo = 0, widest = 0;
    for (int64_t k = 0; k < num_items; k++) {
        int64_t i = items[k];
        if (i < 0 || i >= stride) return BAD_ITEM;
        int64_t d_hi = n_hi[i] >= (int64_t)p_hi[i] * tokens_hi;
        int64_t may = demote ? demote[k] != 0 : n_hi[i] >= recent;
        int64_t d_lo = two_tier && may && n_lo[i] >= (int64_t)p_lo[i] * tokens_lo;
        need_hi += d_hi;
        need_lo += d_lo;
        if (p_hi[i] + p_lo[i] + d_hi + d_lo > widest) widest = p_hi[i] + p_lo[i] + d_hi + d_lo;
    }
    int64_t start = state[0], free = state[1];
    out[0] = 0;
    out[1] = need_hi + need_lo;
    out[2] = widest;
    out[3] = free;
    if (widest > width || need_hi + need_lo > free) {
        state[2] += count_refusal;
        return widest > width ? -2 : -1;
    }
    for (int64_t j = 0, at = start; j < need_hi + need_lo; j++, at = next(at, num_pages))
        if (ring[at] < 0 || ring[at] >= num_pages) return BAD_PAGE;
    /* exclusive prefix sums seeded with the ring start: high pages first, then low */
    int64_t at_hi = start, at_lo = (start + need_hi) % num_pages;
    for (int64_t k = 0; k < num_items; k++) {
        int64_t i = items[k];
        int32_t *row = table + i * width;
        if (n_hi[i] >= (int64_t)p_hi[i] * tokens_hi) {
            int32_t page = ring[at_hi];
            at_hi = next(at_hi, num_pages);
            row[p_hi[i]++] = page;
            ref[page] = 1;
        }
        int64_t may = demote ? demote[k] != 0 : n_hi[i] >= recent;
        if (two_tier && may && n_lo[i] >= (int64_t)p_lo[i] * tokens_lo) {
            int32_t page = ring[at_lo];
            at_lo = next(at_lo, num_pages);
            row[width - 1 - p_lo[i]++] = page;
            ref[page] = 1;
        }
    }
    state[0] = (start + need_hi + need_lo) % num_pages;
    state[1] = free - need_hi - need_lo;
    out[0] = need_hi + need_lo;
    return 0;
}

/* Every page of these heads to the ring tail, head by head in column order (high 0, 1, ..., then low pages from
 * column width - pages_low to width - 1); cells -1, refcounts and counts 0. Pages freed -> out[0]. Returns 0, or
 * BAD_ITEM / BAD_PAGE (an item out of range, or a page count or page id the tables cannot hold). */
int64_t diffkv_ring_release(int32_t *ring, int32_t *ref, int32_t *table, int32_t *counts, const int64_t *items,
                            int64_t *state, int64_t *out, int64_t num_items, int64_t stride, int64_t num_pages,
                            int64_t width) {
    int32_t *p_hi = counts + 2 * stride, *p_lo = counts + 3 * stride;
    int64_t total = 0;
    for (int64_t k = 0; k < num_items; k++) {
        int64_t i = items[k];
        if (i < 0 || i >= stride) return BAD_ITEM;
        if (p_hi[i] < 0 || p_lo[i] < 0 || p_hi[i] + p_lo[i] > width) return BAD_PAGE;
        const int32_t *row = table + i * width;
        for (int64_t c = 0; c < p_hi[i]; c++)
            if (row[c] < 0 || row[c] >= num_pages) return BAD_PAGE;
        for (int64_t c = width - p_lo[i]; c < width; c++)
            if (row[c] < 0 || row[c] >= num_pages) return BAD_PAGE;
        total += p_hi[i] + p_lo[i];
    }
    if (total > num_pages - state[1]) return BAD_PAGE;
    int64_t at = (state[0] + state[1]) % num_pages;
    for (int64_t k = 0; k < num_items; k++) {
        int64_t i = items[k];
        int32_t *row = table + i * width;
        for (int64_t c = 0; c < p_hi[i]; c++, at = next(at, num_pages)) {
            ring[at] = row[c];
            ref[row[c]] = 0;
            row[c] = -1;
        }
        for (int64_t c = width - p_lo[i]; c < width; c++, at = next(at, num_pages)) {
            ring[at] = row[c];
            ref[row[c]] = 0;
            row[c] = -1;
        }
        for (int f = 0; f < 4; f++) counts[f * stride + i] = 0;
    }
    state[1] += total;
    out[0] = total;
    return 0;
}
