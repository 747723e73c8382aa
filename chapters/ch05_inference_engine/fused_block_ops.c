/*
 * The element-wise work of a Llama block around its bf16 products, each stage one pass over a step's rows
 * instead of several eager PyTorch operators (a dispatch, an allocation and a pass over memory each):
 *
 *   rms_norm_bf16       x (fp32)                -> bf16(weight * x / sqrt(mean(x^2) + eps))      the products' input
 *   add_rms_norm_bf16   x (fp32), y (bf16)      -> x + y (fp32), and its norm in bf16           the residual, then the norm
 *   rope_from_bf16      qkv (bf16)              -> qkv (fp32), queries and keys rotated for their positions
 *   silu_mul_bf16       gate|up (bf16)          -> bf16(bf16(silu(gate)) * up)                    the MLP's gate
 *   add_bf16            x (fp32), y (bf16)      -> x + y (fp32)                                    the residual
 *   rows_bf16           x (fp32)                -> bf16(x)                                         attention's output
 *
 * Each computes what the eager operators compute, rounding where they round: a product, a sum or a conversion
 * to bf16 rounds once, in the same order (built with -ffp-contract=off, so no product and sum are fused into
 * one rounding; -fno-trapping-math lets the compiler vectorise the branch-free exponential). Two stages sum in another order than PyTorch's: the norm's mean of squares (16 partial sums)
 * and SiLU's exponential (a polynomial, to about one unit in the last place), so those results can differ from eager in the last bit of
 * fp32, and now and then in the last bit of bf16 after rounding.
 *
 * Rows past `rows` up to `padded` (the products run on row counts rounded up) are written as zeros.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PARTS 16

static inline float from_bf16(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest, ties to even, as torch's float -> bfloat16 conversion does (NaN stays NaN); the decode kernel's
 * conversion, written as a select so a loop of it is vectorised. */
static inline uint16_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return isnan(f) ? 0x7fc0 : (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* e^x to about one unit in the last place, with no branch or call, so a loop of it is vectorised (given
 * -fno-trapping-math): x clamped to [-87, 89], x = n ln 2 + r with |r| <= ln 2 / 2 (n rounded by truncating
 * a positive number), e^r by Cephes' degree-6 polynomial, 2^n written into a float's exponent bits. */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 89.0f ? 89.0f : x; /* from about 88.4, n = 128, written as infinity (expf's overflow is at 88.72) */
    const int32_t n = (int32_t)(x * 1.44269504f + 128.5f) - 128;
    const float nf = (float)n;
    const float r = x - nf * 0.693359375f + nf * 2.12194440e-4f; /* ln 2 in two parts, so r is exact */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const int32_t bits = (n + 127) << 23;
    float two_to_n;
    memcpy(&two_to_n, &bits, sizeof two_to_n);
    return (p * r * r + r + 1.0f) * two_to_n;
}

static void norm_row(const float *x, const float *weight, int64_t width, float eps, uint16_t *out) {
    float part[PARTS] = {0};
    int64_t i = 0;
    for (; i + PARTS <= width; i += PARTS)
        for (int j = 0; j < PARTS; j++) part[j] += x[i + j] * x[i + j];
    float sum = 0.0f;
    for (int j = 0; j < PARTS; j++) sum += part[j];
    for (; i < width; i++) sum += x[i] * x[i];
    float scale = 1.0f / sqrtf(sum / (float)width + eps);
    for (i = 0; i < width; i++) out[i] = to_bf16(weight[i] * (x[i] * scale));
}

void rms_norm_bf16(const float *x, const float *weight, int64_t rows, int64_t padded, int64_t width, float eps,
                   uint16_t *out) {
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * width, weight, width, eps, out + r * width);
    memset(out + rows * width, 0, (size_t)((padded - rows) * width) * sizeof *out);
}

void add_rms_norm_bf16(const float *x, const uint16_t *y, const float *weight, int64_t rows, int64_t padded,
                       int64_t width, float eps, float *sum, uint16_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < width; i++) sum[r * width + i] = x[r * width + i] + from_bf16(y[r * width + i]);
        norm_row(sum + r * width, weight, width, eps, out + r * width);
    }
    memset(out + rows * width, 0, (size_t)((padded - rows) * width) * sizeof *out);
}

void add_bf16(const float *x, const uint16_t *y, int64_t rows, int64_t width, float *sum) {
    for (int64_t i = 0; i < rows * width; i++) sum[i] = x[i] + from_bf16(y[i]);
}

void rows_bf16(const float *x, int64_t rows, int64_t padded, int64_t width, uint16_t *out) {
    for (int64_t i = 0; i < rows * width; i++) out[i] = to_bf16(x[i]);
    memset(out + rows * width, 0, (size_t)((padded - rows) * width) * sizeof *out);
}

/* Each row: its first `rotated_heads` heads of `head_dim` turned by the angles of `positions[row]`
 * (pairs i, i + head_dim/2: first * cos - second * sin, second * cos + first * sin, with the sign in
 * `signed_sin`); the rest of the row (the values) widened as it is. */
void rope_from_bf16(const uint16_t *qkv, int64_t rows, int64_t width, int64_t rotated_heads, int64_t head_dim,
                    const int64_t *positions, const float *cos, const float *signed_sin, float *out) {
    int64_t half = head_dim / 2;
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *in_row = qkv + r * width;
        float *out_row = out + r * width;
        const float *c = cos + positions[r] * head_dim, *s = signed_sin + positions[r] * head_dim;
        for (int64_t h = 0; h < rotated_heads; h++) {
            const uint16_t *head = in_row + h * head_dim;
            float *to = out_row + h * head_dim;
            for (int64_t i = 0; i < half; i++) to[i] = from_bf16(head[i]) * c[i] + from_bf16(head[i + half]) * s[i];
            for (int64_t i = half; i < head_dim; i++) to[i] = from_bf16(head[i]) * c[i] + from_bf16(head[i - half]) * s[i];
        }
        for (int64_t i = rotated_heads * head_dim; i < width; i++) out_row[i] = from_bf16(in_row[i]);
    }
}

void silu_mul_bf16(const uint16_t *gate_up, int64_t rows, int64_t inter, uint16_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *restrict gate = gate_up + r * 2 * inter, *restrict up = gate + inter;
        uint16_t *restrict to = out + r * inter;
        for (int64_t i = 0; i < inter; i++) {
            const float g = from_bf16(gate[i]);
            const float silu = from_bf16(to_bf16(g / (1.0f + exp_approx(-g)))); /* rounded as eager SiLU gives it */
            to[i] = to_bf16(silu * from_bf16(up[i]));
        }
    }
}
