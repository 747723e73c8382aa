/* Decode attention over the paged KV cache: one query per row, each row reading its own blocks where
 * they lie. Chapter 8's `kernel` backend (paged_attention.py) builds this file with the system's C
 * compiler and calls it through ctypes, one call per layer for every decode row of a step.
 *
 * For row r and head h: scores over positions 0 .. lens[r] - 1 (the slot of position t is
 * tables[r][t / block] * block + t % block), a softmax over the whole row at once (its length is known:
 * no running maximum, no rescaling), then the weighted sum of the values. Everything accumulates in
 * fp32. The dot product keeps LANES partial sums, which the compiler turns into vector registers
 * without reordering a single sum (no -ffast-math: the result does not depend on the flags).
 *
 * q    (rows, heads, head_dim) fp32, contiguous
 * k, v one layer's key and value planes: (slots, heads * head_dim), fp32 or bf16 (as uint16 bits)
 * tables (rows, width) int32: each row's blocks, already offset to the pool's first block
 * lens (rows) int32: positions each row attends to (its context, this step's token included)
 * logits: scratch of at least max(lens) floats; out (rows, heads, head_dim) fp32
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

static inline float from_fp32(float x) { return x; }

#define PAGED_DECODE(NAME, T, LOAD)                                                                         \
    void NAME(const float *q, const T *k, const T *v, const int32_t *tables, int64_t width,                \
              const int32_t *lens, int64_t rows, int64_t heads, int64_t head_dim, int64_t block,            \
              float scale, float *logits, float *out) {                                                     \
        const int64_t stride = heads * head_dim, vector_end = head_dim - head_dim % LANES;                 \
        for (int64_t r = 0; r < rows; ++r) {                                                                \
            const int64_t n = lens[r];                                                                      \
            const int32_t *table = tables + r * width;                                                      \
            for (int64_t h = 0; h < heads; ++h) {                                                           \
                const float *qh = q + (r * heads + h) * head_dim;                                           \
                float highest = -INFINITY;                                                                  \
                for (int64_t t = 0; t < n; ++t) {                                                           \
                    const T *key = k + ((int64_t)table[t / block] * block + t % block) * stride + h * head_dim; \
                    float partial[LANES] = {0};                                                             \
                    for (int64_t d = 0; d < vector_end; d += LANES)                                         \
                        for (int j = 0; j < LANES; ++j) partial[j] += qh[d + j] * LOAD(key[d + j]);         \
                    float score = 0.f;                                                                      \
                    for (int j = 0; j < LANES; ++j) score += partial[j];                                    \
                    for (int64_t d = vector_end; d < head_dim; ++d) score += qh[d] * LOAD(key[d]);          \
                    score *= scale;                                                                         \
                    logits[t] = score;                                                                      \
                    if (score > highest) highest = score;                                                   \
                }                                                                                           \
                float total = 0.f;                                                                          \
                for (int64_t t = 0; t < n; ++t) {                                                           \
                    logits[t] = expf(logits[t] - highest);                                                  \
                    total += logits[t];                                                                     \
                }                                                                                           \
                float *o = out + (r * heads + h) * head_dim;                                                \
                memset(o, 0, (size_t)head_dim * sizeof(float));                                             \
                for (int64_t t = 0; t < n; ++t) {                                                           \
                    const T *value = v + ((int64_t)table[t / block] * block + t % block) * stride + h * head_dim; \
                    const float weight = logits[t] / total;                                                 \
                    for (int64_t d = 0; d < head_dim; ++d) o[d] += weight * LOAD(value[d]);                 \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
    }

PAGED_DECODE(paged_decode_fp32, float, from_fp32)
PAGED_DECODE(paged_decode_bf16, uint16_t, from_bf16)
