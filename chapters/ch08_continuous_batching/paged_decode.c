/* Decode attention over the paged KV cache: one query per row, each row reading its own blocks where
 * they lie. Chapter 8's `kernel` backend (attention_kernel.py) builds this file with the system's C
 * compiler and calls it through ctypes, one call per layer for every decode row of a step.
 *
 * First every row's new key and value go into its slot (slots[r], rounded to the cache's dtype); then,
 * for each row: where each position it attends to lies (position t in slot
 * tables[r][t / block] * block + t % block), every head's scores over those positions, a softmax over
 * the whole row at once (its length is known: no running maximum, no rescaling), then the weighted
 * sum of the values. Everything accumulates in fp32.
 *
 * Why it is written this way. A decode step reads every running sequence's keys and values once per
 * layer and does little with each: per position and head, a dot product of head_dim numbers. So
 *  - each position's row (every head) is read once per pass, in order, and the rows AHEAD positions
 *    on are asked for early: the blocks lie anywhere in the pool, and the CPU's own prefetcher finds
 *    no stream across a block boundary;
 *  - the arithmetic is in vectors of LANES floats (GCC's and clang's vector extensions: one AVX-512
 *    register where the CPU has them, one AVX2 register otherwise), and the LANES positions' partial
 *    sums are reduced together (sum_lanes), as vLLM's CPU attention scores a block of positions at
 *    once: one position at a time, each dot product would end in a chain of shuffles of its own;
 *  - e^x is a vector polynomial (exp_lanes), as in vLLM's and llama.cpp's CPU softmax: the C library's
 *    expf takes one number at a time;
 *  - a bf16 cache is widened sixteen (or eight) numbers at a time, which is the whole of bf16 -> fp32.
 * No -ffast-math: the compiler reorders no sum, so a result depends on LANES and on nothing else.
 *
 * q, k_new, v_new  fp32; element (r, h, d) at r * token_stride + h * head_stride + d: the model's own
 *                  (1, heads, rows, head_dim) views, read where they are, no copy
 * slots (rows) int64: where each row's new key and value go
 * k, v  one layer's key and value planes: (slots, heads * head_dim), fp32 or bf16 (as uint16 bits)
 * tables (rows, width) int32: each row's blocks, already offset to the pool's first block
 * lens (rows) int32: positions each row attends to (its context, this step's token included)
 * logits: scratch of at least heads * (max(lens) + 16) floats: each head's scores padded to whole vectors
 * out   fp32; element (r, h, d) at r * out_stride + h * head_dim + d
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi" /* vectors wider than the ABI's registers: only between inline functions */
#endif

#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif

typedef float floats __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t ints __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint32_t uints __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef uint16_t halves __attribute__((vector_size(LANES * sizeof(uint16_t))));

#if LANES == 16
#define LANE_INDEX ((ints){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15})
#else
#define LANE_INDEX ((ints){0, 1, 2, 3, 4, 5, 6, 7})
#endif

#if defined(__clang__)
#define PICK(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define PICK(a, b, ...) __builtin_shuffle(a, b, (ints){__VA_ARGS__})
#endif

static inline float from_bf16(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest, ties to even, as torch's float -> bfloat16 conversion does (NaN stays NaN). */
static inline uint16_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if (isnan(f)) return 0x7fc0;
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static inline float from_fp32(float x) { return x; }
static inline float to_fp32(float x) { return x; }

/* LANES numbers from memory, any alignment. */
static inline floats lanes_fp32(const float *p) {
    floats v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline floats lanes_bf16(const uint16_t *p) {
    halves h;
    memcpy(&h, p, sizeof h);
    return (floats)(__builtin_convertvector(h, uints) << 16); /* a bf16 is the top half of its float */
}

/* LANES positions' partial-sum vectors (part[p]: lane j holds the terms j, j + LANES, ... of position
 * p's dot product) to their LANES sums, position p in lane p. Each level adds lane j to lane j + half
 * within groups of lanes and packs two vectors' results into one: the lanes are added in the order
 * of a tree within one vector (j + LANES / 2, ..., j + 2, j + 1), for LANES positions at once. */
#if LANES == 16
static inline floats sum_lanes(const floats part[LANES]) {
    floats eight[8], four[4], two[2];
    for (int i = 0; i < 8; ++i)
        eight[i] = PICK(part[2 * i], part[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                   PICK(part[2 * i], part[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; ++i)
        four[i] = PICK(eight[2 * i], eight[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                  PICK(eight[2 * i], eight[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; ++i)
        two[i] = PICK(four[2 * i], four[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                 PICK(four[2 * i], four[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return PICK(two[0], two[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           PICK(two[0], two[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#else
static inline floats sum_lanes(const floats part[LANES]) {
    floats four[4], two[2];
    for (int i = 0; i < 4; ++i)
        four[i] = PICK(part[2 * i], part[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
                  PICK(part[2 * i], part[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; ++i)
        two[i] = PICK(four[2 * i], four[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
                 PICK(four[2 * i], four[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return PICK(two[0], two[1], 0, 2, 4, 6, 8, 10, 12, 14) + PICK(two[0], two[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
#endif

/* e^x for x <= 0 (a score minus its row's highest), to about one unit in the last place: x = n ln 2 + r
 * with |r| <= ln 2 / 2, e^r by Cephes' degree-6 polynomial, 2^n written into the exponent's bits. */
static inline floats exp_lanes(floats x) {
    const ints tiny = x < -87.0f; /* all ones where e^x would be denormal or less: those give 0 */
    x = (floats)(((ints)x & ~tiny) | ((ints)((floats){0} - 87.0f) & tiny));
    const ints n = __builtin_convertvector(x * 1.44269504f - 0.5f, ints); /* round(x / ln 2), for x <= 0 */
    const floats nf = __builtin_convertvector(n, floats);
    const floats r = x - nf * 0.693359375f + nf * 2.12194440e-4f; /* ln 2 in two parts, so r is exact */
    floats p = 1.9875691500e-4f + (floats){0};
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const floats e = (p * r * r + r + 1.0f) * (floats)((n + 127) << 23);
    return (floats)((ints)e & ~tiny);
}

/* The blocks of a row lie anywhere in the pool, so at each block boundary the CPU's own prefetcher
 * has no stream to follow and a position's row arrives from memory only when it is read. Asking for
 * the rows AHEAD positions on (every cache line of each) overlaps that wait with the work on the
 * positions before it; it changes no result. */
#ifndef AHEAD
#define AHEAD 8 /* -DAHEAD=0 builds it without (benchmarks/studies/kernel_prefetch/) */
#endif

static inline void prefetch_row(const void *row, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch((const char *)row + at, 0, 3);
}

/* One row's attention, every head. `head_dim` is a constant where the caller passes one (64: the
 * compiler then keeps a head's sums in registers), else read at run time. */
#define ATTEND_ROW(NAME, T, LOAD, LANES_OF)                                                                      \
    static inline __attribute__((always_inline)) void NAME(                                                      \
        const float *q, int64_t head_stride, const T *k, const T *v, const int32_t *table, int64_t n,            \
        int64_t heads, int64_t head_dim, int64_t block, float scale, float *logits, int64_t *where, float *out) { \
        const int64_t stride = heads * head_dim, row_bytes = stride * (int64_t)sizeof(T);                       \
        const int64_t chunks = head_dim / LANES, vector_end = chunks * LANES;                                   \
        for (int64_t t = 0, b = 0; t < n; ++b) /* each position's row in a plane, block by block */             \
            for (int64_t j = 0, base = (int64_t)table[b] * block; j < block && t < n; ++j, ++t)                \
                where[t] = (base + j) * stride;                                                                \
        const int64_t span = (n + LANES - 1) / LANES * LANES; /* a head's scores, padded to whole vectors */   \
        floats top[heads]; /* each head's highest score so far, lane by lane */                                \
        for (int64_t h = 0; h < heads; ++h) top[h] = (floats){0} - INFINITY;                                   \
        floats part[heads][LANES];                                                                             \
        float tail[heads][LANES];                                                                              \
        for (int64_t t0 = 0; t0 < n; t0 += LANES) { /* scores, LANES positions at a time */                     \
            const int64_t m = n - t0 < LANES ? n - t0 : LANES;                                                 \
            for (int64_t p = 0; p < LANES; ++p) { /* each position's row once, every head */                    \
                const int64_t t = t0 + p;                                                                      \
                if (AHEAD && t + AHEAD < n) prefetch_row(k + where[t + AHEAD], row_bytes);                     \
                for (int64_t h = 0; h < heads; ++h) {                                                          \
                    floats sum = {0};                                                                          \
                    float rest = 0.f;                                                                          \
                    if (p < m) {                                                                               \
                        const float *qh = q + h * head_stride;                                                 \
                        const T *kh = k + where[t] + h * head_dim;                                             \
                        for (int64_t d = 0; d < vector_end; d += LANES) sum += lanes_fp32(qh + d) * LANES_OF(kh + d); \
                        for (int64_t d = vector_end; d < head_dim; ++d) rest += qh[d] * LOAD(kh[d]);           \
                    }                                                                                          \
                    part[h][p] = sum;                                                                          \
                    tail[h][p] = rest;                                                                         \
                }                                                                                              \
            }                                                                                                  \
            const ints past_end = LANE_INDEX >= (int32_t)m; /* positions beyond the row: score -inf, weight 0 */ \
            for (int64_t h = 0; h < heads; ++h) {                                                              \
                floats score = (sum_lanes(part[h]) + lanes_fp32(tail[h])) * scale;                             \
                score = (floats)(((ints)score & ~past_end) | ((ints)((floats){0} - INFINITY) & past_end));     \
                memcpy(logits + h * span + t0, &score, sizeof score);                                          \
                top[h] = (floats)(((ints)top[h] & (ints)(top[h] >= score)) | ((ints)score & (ints)(top[h] < score))); \
            }                                                                                                  \
        }                                                                                                      \
        for (int64_t h = 0; h < heads; ++h) { /* softmax: e^(score - highest), then divided by their sum */    \
            float *row = logits + h * span, highest = -INFINITY;                                               \
            for (int p = 0; p < LANES; ++p) highest = top[h][p] > highest ? top[h][p] : highest;               \
            floats total = {0};                                                                                \
            for (int64_t t0 = 0; t0 < span; t0 += LANES) {                                                     \
                const floats e = exp_lanes(lanes_fp32(row + t0) - highest);                                    \
                total += e;                                                                                    \
                memcpy(row + t0, &e, sizeof e);                                                                \
            }                                                                                                  \
            float sum = 0.f;                                                                                   \
            for (int p = 0; p < LANES; ++p) sum += total[p];                                                   \
            const floats inverse = (floats){0} + 1.f / sum;                                                    \
            for (int64_t t0 = 0; t0 < span; t0 += LANES) {                                                     \
                const floats weight = lanes_fp32(row + t0) * inverse;                                          \
                memcpy(row + t0, &weight, sizeof weight);                                                      \
            }                                                                                                  \
        }                                                                                                      \
        memset(out, 0, (size_t)stride * sizeof(float));                                                        \
        for (int64_t t = 0; t < n; ++t) { /* the values, weighted: each position's row once, every head */      \
            const T *values = v + where[t];                                                                    \
            if (AHEAD && t + AHEAD < n) prefetch_row(v + where[t + AHEAD], row_bytes);                         \
            for (int64_t h = 0; h < heads; ++h) {                                                              \
                const float weight = logits[h * span + t];                                                        \
                float *o = out + h * head_dim;                                                                 \
                const T *vh = values + h * head_dim;                                                              \
                for (int64_t d = 0; d < vector_end; d += LANES) {                                              \
                    floats sum = lanes_fp32(o + d) + weight * LANES_OF(vh + d);                                \
                    memcpy(o + d, &sum, sizeof sum);                                                           \
                }                                                                                              \
                for (int64_t d = vector_end; d < head_dim; ++d) o[d] += weight * LOAD(vh[d]);                  \
            }                                                                                                  \
        }                                                                                                      \
    }

#define PAGED_DECODE(NAME, T, LOAD, LANES_OF, STORE)                                                             \
    ATTEND_ROW(NAME##_row, T, LOAD, LANES_OF)                                                                    \
    void NAME(const float *q, const float *k_new, const float *v_new, int64_t token_stride,                     \
              int64_t head_stride, const int64_t *slots, T *k, T *v, const int32_t *tables, int64_t width,      \
              const int32_t *lens, int64_t rows, int64_t heads, int64_t head_dim, int64_t block,                \
              float scale, float *logits, float *out, int64_t out_stride) {                                     \
        const int64_t stride = heads * head_dim;                                                                \
        for (int64_t r = 0; r < rows; ++r)                                                                      \
            for (int64_t h = 0; h < heads; ++h) {                                                               \
                const int64_t from = r * token_stride + h * head_stride, to = slots[r] * stride + h * head_dim; \
                for (int64_t d = 0; d < head_dim; ++d) {                                                        \
                    k[to + d] = STORE(k_new[from + d]);                                                         \
                    v[to + d] = STORE(v_new[from + d]);                                                         \
                }                                                                                               \
            }                                                                                                   \
        int64_t most = 0;                                                                                       \
        for (int64_t r = 0; r < rows; ++r) most = lens[r] > most ? lens[r] : most;                              \
        int64_t where[most > 0 ? most : 1];                                                                     \
        for (int64_t r = 0; r < rows; ++r) {                                                                    \
            const float *qr = q + r * token_stride;                                                             \
            const int32_t *table = tables + r * width;                                                          \
            float *o = out + r * out_stride;                                                                    \
            if (head_dim == 64) /* GPT-2's every size: the same code with the head's width known */             \
                NAME##_row(qr, head_stride, k, v, table, lens[r], heads, 64, block, scale, logits, where, o);   \
            else                                                                                                \
                NAME##_row(qr, head_stride, k, v, table, lens[r], heads, head_dim, block, scale, logits, where, o); \
        }                                                                                                       \
    }

PAGED_DECODE(paged_decode_fp32, float, from_fp32, lanes_fp32, to_fp32)
PAGED_DECODE(paged_decode_bf16, uint16_t, from_bf16, lanes_bf16, to_bf16)
