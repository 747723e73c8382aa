/* Decode attention over the paged KV cache: one query per row, each row reading its own blocks where
 * they lie. Chapter 8's `kernel` backend (attention_kernel.py) builds this file with the system's C
 * compiler and calls it through ctypes, one call per layer for every decode row of a step.
 *
 * First every row's new key and value go into its slot (slots[r], rounded to the cache's dtype); then,
 * for each row: where each position it attends to lies (position t in slot
 * tables[r][t / block] * block + t % block), then key/value head after key/value head, for the query
 * heads that read it: their scores over those positions, a softmax over the whole row at once (its
 * length is known: no running maximum, no rescaling), then the weighted sum of the values. Everything
 * accumulates in fp32. Under grouped-query attention the cache holds kv_heads key/value heads, each
 * shared by a group of heads / kv_heads consecutive query heads: query head h reads key/value head
 * h / (heads / kv_heads) where it lies, nothing copied per query head.
 *
 * Why it is written this way. A decode step reads every running sequence's keys and values once per
 * layer and does little with each: per position and head, a dot product of head_dim numbers. So
 *  - the query heads of a group are attended together (up to TOGETHER at a time): each key and value
 *    is loaded, and widened from bf16, once for all of them, not once per query head;
 *  - the heads' queries and output sums stay in registers for the whole row; the row's own keys and
 *    values stay in the core's caches from one group to the next, and the first group's passes ask for
 *    the rows AHEAD positions on early: the blocks lie anywhere in the pool, and the CPU's own
 *    prefetcher finds no stream across a block boundary;
 *  - the arithmetic is in vectors of LANES floats (GCC's and clang's vector extensions: one AVX-512
 *    register where the CPU has them, one AVX2 register otherwise), and the LANES positions' partial
 *    sums are reduced together (sum_lanes), as vLLM's CPU attention scores a block of positions at
 *    once: one position at a time, each dot product would end in a chain of shuffles of its own;
 *  - e^x is a vector polynomial (exp_lanes), as in vLLM's and llama.cpp's CPU softmax: the C library's
 *    expf takes one number at a time;
 *  - a bf16 cache is read 2 * LANES numbers at a time and widened with a shift and a mask, its even and
 *    odd numbers apart (pair_bf16): the query is split to match once per head, the output joined once.
 * No -ffast-math: the compiler reorders no sum, so a result depends on LANES and the cache's dtype only.
 *
 * q, k_new, v_new  fp32; element (r, h, d) at r * token_stride + h * head_stride + d: the model's own
 *                  (1, heads, rows, head_dim) query and (1, kv_heads, rows, head_dim) key and value
 *                  views, read where they are, no copy
 * slots (rows) int64: where each row's new key and value go
 * k, v  one layer's key and value planes: (slots, kv_heads * head_dim), fp32 or bf16 (as uint16 bits)
 * tables (rows, width) int32: each row's blocks, already offset to the pool's first block
 * lens (rows) int32: positions each row attends to (its context, this step's token included)
 * heads, kv_heads: query heads, and key/value heads (a divisor of heads)
 * logits: scratch of at least heads * (max(lens) + 16) floats: each query head's scores padded to whole vectors
 * out   fp32; element (r, h, d) at r * out_stride + h * head_dim + d, h a query head
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

/* 2 * LANES numbers of a cache row as two vectors, `first` and `second`: for fp32, the first LANES
 * numbers and the next LANES; for bf16, the even-numbered and the odd-numbered ones. A bf16 is the top
 * half of its float, so one load of 2 * LANES bf16 as LANES 32-bit words gives both vectors with a
 * shift and a mask and no shuffle: widening them in order (a shuffle each) cost more than the products.
 * The query is split the same way once per head (split_*), and the output joined once (join_*): a dot
 * product and a weighted sum do not care in which order their terms lie. */
static inline void pair_fp32(const float *p, floats *first, floats *second) {
    *first = lanes_fp32(p);
    *second = lanes_fp32(p + LANES);
}

static inline void pair_bf16(const uint16_t *p, floats *first, floats *second) {
    uints words;
    memcpy(&words, p, sizeof words);
    *first = (floats)(words << 16);
    *second = (floats)(words & 0xffff0000u);
}

static inline void split_fp32(const float *q, floats *first, floats *second) { pair_fp32(q, first, second); }

static inline void join_fp32(float *out, floats first, floats second) {
    memcpy(out, &first, sizeof first);
    memcpy(out + LANES, &second, sizeof second);
}

#if LANES == 16
#define EVENS 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define ODDS 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
#define LOW_HALVES 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23
#define HIGH_HALVES 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31
#else
#define EVENS 0, 2, 4, 6, 8, 10, 12, 14
#define ODDS 1, 3, 5, 7, 9, 11, 13, 15
#define LOW_HALVES 0, 8, 1, 9, 2, 10, 3, 11
#define HIGH_HALVES 4, 12, 5, 13, 6, 14, 7, 15
#endif

static inline void split_bf16(const float *q, floats *first, floats *second) {
    const floats low = lanes_fp32(q), high = lanes_fp32(q + LANES);
    *first = PICK(low, high, EVENS);
    *second = PICK(low, high, ODDS);
}

static inline void join_bf16(float *out, floats first, floats second) {
    join_fp32(out, PICK(first, second, LOW_HALVES), PICK(first, second, HIGH_HALVES));
}

/* LANES positions' partial-sum vectors (part[p]: each lane holds some of the terms of position p's dot
 * product) to their LANES sums, position p in lane p. Each level adds lane j to lane j + half
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

/* Up to TOGETHER query heads of one group, attended together: each key and value of their key/value head
 * `kv` is loaded (and widened, for bf16) once for all of them; each head's own sums are those it would
 * have alone, in the same order. `count` and `head_dim` are constants where the caller passes them (the
 * compiler then keeps the heads' queries and output sums in registers), else read at run time. */
#define TOGETHER 4
#define MOST_PAIRS (256 / (2 * LANES)) /* in registers: up to 256 numbers of a head; any beyond, one at a time */
#define ATTEND_HEADS(NAME, T, LOAD, KIND)                                                                                \
    static inline __attribute__((always_inline)) void NAME(                                                              \
        const float *q, int64_t head_stride, const T *k, const T *v, int64_t n, int64_t first_head, int64_t count,       \
        int64_t kv, int64_t head_dim, int64_t row_bytes, int first_pass, float scale, float *logits,                     \
        const int64_t *where, float *out) {                                                                              \
        const int64_t pairs = head_dim < 256 ? head_dim / (2 * LANES) : MOST_PAIRS;                                      \
        const int64_t vector_end = pairs * 2 * LANES;                                                                    \
        const int64_t span = (n + LANES - 1) / LANES * LANES; /* a head's scores, padded to whole vectors */             \
        const int64_t offset = kv * head_dim; /* where key/value head kv lies in a position's row */                     \
        floats query[TOGETHER][MOST_PAIRS][2], top[TOGETHER], first, second; /* top: the highest score, lane by lane */  \
        for (int64_t i = 0; i < count; ++i) {                                                                            \
            top[i] = (floats){0} - INFINITY;                                                                             \
            for (int64_t c = 0; c < pairs; ++c)                                                                          \
                split_##KIND(q + (first_head + i) * head_stride + c * 2 * LANES, &query[i][c][0], &query[i][c][1]);      \
        }                                                                                                                \
        for (int64_t t0 = 0; t0 < n; t0 += LANES) { /* scores, LANES positions at a time */                              \
            const int64_t m = n - t0 < LANES ? n - t0 : LANES;                                                           \
            floats part[TOGETHER][LANES];                                                                                \
            float tail[TOGETHER][LANES];                                                                                 \
            for (int64_t p = 0; p < LANES; ++p) {                                                                        \
                const int64_t t = t0 + p;                                                                                \
                for (int64_t i = 0; i < count; ++i) {                                                                    \
                    part[i][p] = (floats){0};                                                                            \
                    tail[i][p] = 0.f;                                                                                    \
                }                                                                                                        \
                if (p < m) {                                                                                             \
                    if (AHEAD && first_pass && t + AHEAD < n) prefetch_row(k + where[t + AHEAD], row_bytes);             \
                    const T *kh = k + where[t] + offset;                                                                 \
                    for (int64_t c = 0; c < pairs; ++c) {                                                                \
                        pair_##KIND(kh + c * 2 * LANES, &first, &second);                                                \
                        for (int64_t i = 0; i < count; ++i) part[i][p] += query[i][c][0] * first + query[i][c][1] * second; \
                    }                                                                                                    \
                    for (int64_t d = vector_end; d < head_dim; ++d)                                                      \
                        for (int64_t i = 0; i < count; ++i) tail[i][p] += q[(first_head + i) * head_stride + d] * LOAD(kh[d]); \
                }                                                                                                        \
            }                                                                                                            \
            const ints past_end = LANE_INDEX >= (int32_t)m; /* beyond the row: score -inf, weight 0 */                   \
            for (int64_t i = 0; i < count; ++i) {                                                                        \
                floats score = (sum_lanes(part[i]) + lanes_fp32(tail[i])) * scale;                                       \
                score = (floats)(((ints)score & ~past_end) | ((ints)((floats){0} - INFINITY) & past_end));               \
                memcpy(logits + (first_head + i) * span + t0, &score, sizeof score);                                     \
                top[i] = (floats)(((ints)top[i] & (ints)(top[i] >= score)) | ((ints)score & (ints)(top[i] < score)));    \
            }                                                                                                            \
        }                                                                                                                \
        float inverse[TOGETHER];                                                                                         \
        for (int64_t i = 0; i < count; ++i) { /* softmax: e^(score - highest), then divided by their sum */              \
            float *row = logits + (first_head + i) * span, highest = -INFINITY;                                          \
            for (int p = 0; p < LANES; ++p) highest = top[i][p] > highest ? top[i][p] : highest;                         \
            floats total = {0};                                                                                          \
            for (int64_t t0 = 0; t0 < span; t0 += LANES) {                                                               \
                const floats e = exp_lanes(lanes_fp32(row + t0) - highest);                                              \
                total += e;                                                                                              \
                memcpy(row + t0, &e, sizeof e);                                                                          \
            }                                                                                                            \
            float sum = 0.f;                                                                                             \
            for (int p = 0; p < LANES; ++p) sum += total[p];                                                             \
            inverse[i] = 1.f / sum;                                                                                      \
        }                                                                                                                \
        floats output[TOGETHER][MOST_PAIRS][2]; /* the values, weighted */                                               \
        for (int64_t i = 0; i < count; ++i) {                                                                            \
            for (int64_t c = 0; c < pairs; ++c) output[i][c][0] = output[i][c][1] = (floats){0};                         \
            for (int64_t d = vector_end; d < head_dim; ++d) out[(first_head + i) * head_dim + d] = 0.f;                  \
        }                                                                                                                \
        for (int64_t t = 0; t < n; ++t) {                                                                                \
            float weight[TOGETHER];                                                                                      \
            for (int64_t i = 0; i < count; ++i) weight[i] = logits[(first_head + i) * span + t] * inverse[i];            \
            const T *vh = v + where[t] + offset;                                                                         \
            if (AHEAD && first_pass && t + AHEAD < n) prefetch_row(v + where[t + AHEAD], row_bytes);                     \
            for (int64_t c = 0; c < pairs; ++c) {                                                                        \
                pair_##KIND(vh + c * 2 * LANES, &first, &second);                                                        \
                for (int64_t i = 0; i < count; ++i) {                                                                    \
                    output[i][c][0] += weight[i] * first;                                                                \
                    output[i][c][1] += weight[i] * second;                                                               \
                }                                                                                                        \
            }                                                                                                            \
            for (int64_t d = vector_end; d < head_dim; ++d)                                                              \
                for (int64_t i = 0; i < count; ++i) out[(first_head + i) * head_dim + d] += weight[i] * LOAD(vh[d]);     \
        }                                                                                                                \
        for (int64_t i = 0; i < count; ++i)                                                                              \
            for (int64_t c = 0; c < pairs; ++c)                                                                          \
                join_##KIND(out + (first_head + i) * head_dim + c * 2 * LANES, output[i][c][0], output[i][c][1]);        \
    }

/* One row's attention, key/value head after key/value head, its group's query heads TOGETHER at a time. */
#define ATTEND_ROW(NAME, T, LOAD, KIND)                                                                                  \
    ATTEND_HEADS(NAME##_heads, T, LOAD, KIND)                                                                            \
    static inline __attribute__((always_inline)) void NAME(                                                              \
        const float *q, int64_t head_stride, const T *k, const T *v, const int32_t *table, int64_t n,                    \
        int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block, float scale, float *logits,                    \
        int64_t *where, float *out) {                                                                                    \
        const int64_t stride = kv_heads * head_dim, row_bytes = stride * (int64_t)sizeof(T);                             \
        const int64_t group = heads / kv_heads; /* query heads per key/value head */                                     \
        for (int64_t t = 0, b = 0; t < n; ++b) /* each position's row in a plane, block by block */                      \
            for (int64_t j = 0, base = (int64_t)table[b] * block; j < block && t < n; ++j, ++t)                          \
                where[t] = (base + j) * stride;                                                                          \
        for (int64_t kv = 0; kv < kv_heads; ++kv)                                                                        \
            for (int64_t h = kv * group; h < (kv + 1) * group; h += TOGETHER) {                                          \
                const int64_t count = (kv + 1) * group - h < TOGETHER ? (kv + 1) * group - h : TOGETHER;                 \
                const int first_pass = h == 0; /* the first pass asks for every row's cache lines ahead */               \
                if (head_dim == 64) { /* GPT-2's every size and SmolLM2's: each count its own code, widths known */      \
                    switch (count) {                                                                                     \
                    case 1:                                                                                              \
                        NAME##_heads(q, head_stride, k, v, n, h, 1, kv, 64, row_bytes, first_pass, scale, logits,        \
                                     where, out);                                                                        \
                        break;                                                                                           \
                    case 2:                                                                                              \
                        NAME##_heads(q, head_stride, k, v, n, h, 2, kv, 64, row_bytes, first_pass, scale, logits,        \
                                     where, out);                                                                        \
                        break;                                                                                           \
                    case 3:                                                                                              \
                        NAME##_heads(q, head_stride, k, v, n, h, 3, kv, 64, row_bytes, first_pass, scale, logits,        \
                                     where, out);                                                                        \
                        break;                                                                                           \
                    default:                                                                                             \
                        NAME##_heads(q, head_stride, k, v, n, h, 4, kv, 64, row_bytes, first_pass, scale, logits,        \
                                     where, out);                                                                        \
                    }                                                                                                    \
                } else /* any other width: the same code, read at run time */                                            \
                    NAME##_heads(q, head_stride, k, v, n, h, count, kv, head_dim, row_bytes, first_pass, scale, logits,  \
                                 where, out);                                                                            \
            }                                                                                                            \
    }

#define PAGED_DECODE(NAME, T, LOAD, KIND, STORE)                                                             \
    ATTEND_ROW(NAME##_row, T, LOAD, KIND)                                                                    \
    void NAME(const float *q, const float *k_new, const float *v_new, int64_t token_stride,                     \
              int64_t head_stride, const int64_t *slots, T *k, T *v, const int32_t *tables, int64_t width,      \
              const int32_t *lens, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,             \
              int64_t block, float scale, float *logits, float *out, int64_t out_stride) {                      \
        const int64_t stride = kv_heads * head_dim;                                                             \
        for (int64_t r = 0; r < rows; ++r)                                                                      \
            for (int64_t h = 0; h < kv_heads; ++h) {                                                            \
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
            NAME##_row(qr, head_stride, k, v, table, lens[r], heads, kv_heads, head_dim, block, scale, logits,      \
                       where, o);                                                                   \
        }                                                                                                       \
    }

PAGED_DECODE(paged_decode_fp32, float, from_fp32, fp32, to_fp32)
PAGED_DECODE(paged_decode_bf16, uint16_t, from_bf16, bf16, to_bf16)
