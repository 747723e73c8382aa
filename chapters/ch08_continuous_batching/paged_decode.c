/* Decode attention over the paged KV cache: one query per row, each row reading its own blocks where
 * they lie. Chapter 8's `kernel` backend (attention_kernel.py) builds this file with the system's C
 * compiler and calls it through ctypes, one call per layer for every decode row of a step.
 *
 * First every row's new key and value go into its slot (slots[r], rounded to the cache's dtype); then,
 * for row r and head h: scores over positions 0 .. lens[r] - 1 (the slot of position t is
 * tables[r][t / block] * block + t % block), a softmax over the whole row at once (its length is known:
 * no running maximum, no rescaling), then the weighted sum of the values. Everything accumulates in
 * fp32. The dot product keeps LANES partial sums, which the compiler turns into vector registers
 * without reordering a single sum (no -ffast-math: the result does not depend on the flags).
 *
 * q, k_new, v_new  fp32; element (r, h, d) at r * token_stride + h * head_stride + d: the model's own
 *                  (1, heads, rows, head_dim) views, read where they are, no copy
 * slots (rows) int64: where each row's new key and value go
 * k, v  one layer's key and value planes: (slots, heads * head_dim), fp32 or bf16 (as uint16 bits)
 * tables (rows, width) int32: each row's blocks, already offset to the pool's first block
 * lens (rows) int32: positions each row attends to (its context, this step's token included)
 * logits: scratch of at least heads * max(lens) floats
 * out   fp32; element (r, h, d) at r * out_stride + h * head_dim + d
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16

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

/* The blocks of a row lie anywhere in the pool, so at each block boundary the CPU's own prefetcher
 * has no stream to follow and the next position's row arrives from memory only when it is read.
 * Asking for the row AHEAD positions on (every cache line of it) overlaps that wait with the work
 * on the positions before it; it changes no result. */
#ifndef AHEAD
#define AHEAD 8 /* -DAHEAD=0 builds it without (benchmarks/studies/kernel_prefetch/) */
#endif

static inline int64_t slot_of(const int32_t *table, int64_t t, int64_t block) {
    return (int64_t)table[t / block] * block + t % block;
}

static inline void prefetch_row(const void *row, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch((const char *)row + at, 0, 3);
}

#define PAGED_DECODE(NAME, T, LOAD, STORE)                                                                  \
    void NAME(const float *q, const float *k_new, const float *v_new, int64_t token_stride,                 \
              int64_t head_stride, const int64_t *slots, T *k, T *v, const int32_t *tables, int64_t width,  \
              const int32_t *lens, int64_t rows, int64_t heads, int64_t head_dim, int64_t block,            \
              float scale, float *logits, float *out, int64_t out_stride) {                                 \
        const int64_t stride = heads * head_dim, vector_end = head_dim - head_dim % LANES;                 \
        const int64_t row_bytes = stride * (int64_t)sizeof(T);                                             \
        for (int64_t r = 0; r < rows; ++r)                                                                  \
            for (int64_t h = 0; h < heads; ++h) {                                                           \
                const int64_t from = r * token_stride + h * head_stride, to = slots[r] * stride + h * head_dim; \
                for (int64_t d = 0; d < head_dim; ++d) {                                                    \
                    k[to + d] = STORE(k_new[from + d]);                                                     \
                    v[to + d] = STORE(v_new[from + d]);                                                     \
                }                                                                                           \
            }                                                                                               \
        for (int64_t r = 0; r < rows; ++r) {                                                                \
            const int64_t n = lens[r];                                                                      \
            const int32_t *table = tables + r * width;                                                      \
            float highest[heads], total[heads];                                                             \
            for (int64_t h = 0; h < heads; ++h) highest[h] = -INFINITY, total[h] = 0.f;                     \
            for (int64_t t = 0; t < n; ++t) {                                                               \
                const T *key = k + slot_of(table, t, block) * stride;                                       \
                if (AHEAD && t + AHEAD < n) prefetch_row(k + slot_of(table, t + AHEAD, block) * stride, row_bytes);   \
                for (int64_t h = 0; h < heads; ++h) {                                                       \
                    const float *qh = q + r * token_stride + h * head_stride;                               \
                    const T *kh = key + h * head_dim;                                                       \
                    float partial[LANES] = {0};                                                             \
                    for (int64_t d = 0; d < vector_end; d += LANES)                                         \
                        for (int j = 0; j < LANES; ++j) partial[j] += qh[d + j] * LOAD(kh[d + j]);          \
                    for (int width_ = LANES / 2; width_ > 0; width_ /= 2)                                   \
                        for (int j = 0; j < width_; ++j) partial[j] += partial[j + width_];                 \
                    float score = partial[0];                                                               \
                    for (int64_t d = vector_end; d < head_dim; ++d) score += qh[d] * LOAD(kh[d]);           \
                    score *= scale;                                                                         \
                    logits[h * n + t] = score;                                                              \
                    if (score > highest[h]) highest[h] = score;                                             \
                }                                                                                           \
            }                                                                                               \
            for (int64_t h = 0; h < heads; ++h) {                                                           \
                float *row = logits + h * n;                                                                \
                for (int64_t t = 0; t < n; ++t) {                                                           \
                    row[t] = expf(row[t] - highest[h]);                                                     \
                    total[h] += row[t];                                                                     \
                }                                                                                           \
                memset(out + r * out_stride + h * head_dim, 0, (size_t)head_dim * sizeof(float));           \
            }                                                                                               \
            for (int64_t t = 0; t < n; ++t) {                                                               \
                const T *value = v + slot_of(table, t, block) * stride;                                     \
                if (AHEAD && t + AHEAD < n) prefetch_row(v + slot_of(table, t + AHEAD, block) * stride, row_bytes);   \
                for (int64_t h = 0; h < heads; ++h) {                                                       \
                    float *o = out + r * out_stride + h * head_dim;                                         \
                    const T *vh = value + h * head_dim;                                                     \
                    const float weight = logits[h * n + t] / total[h];                                      \
                    for (int64_t d = 0; d < head_dim; ++d) o[d] += weight * LOAD(vh[d]);                    \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
    }

PAGED_DECODE(paged_decode_fp32, float, from_fp32, to_fp32)
PAGED_DECODE(paged_decode_bf16, uint16_t, from_bf16, to_bf16)
