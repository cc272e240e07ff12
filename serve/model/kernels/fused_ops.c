/* The elementwise work of a decoder layer, one pass each, for the eager CPU engine: RMSNorm
 * (optionally after a residual add, or between a norm-and-add and the next norm, as Gemma's
 * sandwich norms), per-head RMSNorm with the rotary embedding in place, and act(gate) x up.
 *
 * Layout: row-major; each op takes `rows` rows of `dim` values, a row's values contiguous, rows
 * `stride` values apart (so a column slice of a merged projection is read in place).
 * T is float or uint16_t (bfloat16 bits). Every result is rounded to T where transformers'
 * eager modules round it, in the same order. A norm's weight is either
 *   of type T (Llama's RMSNorm):          norm(x) = T(w * T(x * inv))
 *   float32 holding 1 + w (Gemma's):      norm(x) = T(x * inv * w)
 * with inv = 1 / sqrt(mean(x^2) + eps) (mean in float32); `f32_weight` says which.
 *   rms_norm          out = norm(x)
 *   add_rms_norm      sum = T(a + b); out = norm(sum)
 *   norm_add_rms_norm sum = T(b + norm_a(a)); out = norm(sum) when w is not NULL
 *   norm_rotary       in place on `heads` heads of head_dim values per row: each head normed
 *                     (when w is not NULL: q/k norms), then rotated, h = head_dim / 2:
 *                     x[:h] = T(T(x[:h] cos[:h]) - T(x[h:] sin[:h]))
 *                     x[h:] = T(T(x[h:] cos[h:]) + T(x[:h] sin[h:]))   (cos, sin [rows, head_dim])
 *   act_mul           out = T(T(act(gate)) * up); act SILU (x sigmoid(x)) or GELU_TANH
 *                     (0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) = x sigmoid(2 inner))
 * Compiled without -ffast-math and with -ffp-contract=off: the rotary embedding and the products
 * match torch's float32 results bit for bit; the norm's sum and the activations' exp differ in
 * the last bits (GELU also where torch's 1 + tanh cancels, far below one float32 ulp of 1).
 * Returns 0.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define PARALLEL_VALUES 32768 /* below this many values an op runs on one thread */
enum { SILU = 0, GELU_TANH = 1 };

/* Rounding to T: identity for float, through bfloat16 for bf16. */
static inline float round_f32(float x) { return x; }
static inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

#define F32_LOAD(x) (x)
#define F32_STORE(x) (x)

/* e^x for x <= 0 (clamped below at -87.3), within 2 ulp: Cephes' expf polynomial, written so
 * that the compiler vectorizes the loops that call it. */
static inline float exp_vec(float x) {
    x = x < -87.3f ? -87.3f : x; /* not fmaxf: a libm call here */
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* x * sigmoid(z) through e^-|z| (no overflow, one division). */
static inline float times_sigmoid(float x, float z) {
    const float e = exp_vec(z < 0.0f ? z : -z);
    const float s = 1.0f / (1.0f + e);
    return x * (z < 0.0f ? e * s : s);
}

static inline float silu(float x) { return times_sigmoid(x, x); }

static inline float gelu_tanh(float x) {
    const float inner = 0.7978845608028654f * (x + 0.044715f * (x * x * x));
    return times_sigmoid(x, 2.0f * inner);
}

#define DEFINE_OPS(SUFFIX, T, LOAD, STORE, ROUND)                                                  \
    /* out may be x (in place): each value is read before it is written */                        \
    static inline void norm_row_##SUFFIX(const T *x, const void *w, int f32_weight, T *out,       \
                                         int64_t dim, float eps) {                                 \
        float sum = 0.0f;                                                                          \
        _Pragma("omp simd reduction(+ : sum)") for (int64_t i = 0; i < dim; i++) {                 \
            const float v = LOAD(x[i]);                                                            \
            sum += v * v;                                                                          \
        }                                                                                          \
        const float inv = 1.0f / sqrtf(sum / (float)dim + eps);                                    \
        if (f32_weight) {                                                                          \
            const float *wf = (const float *)w;                                                    \
            for (int64_t i = 0; i < dim; i++) out[i] = STORE(LOAD(x[i]) * inv * wf[i]);            \
        } else {                                                                                   \
            const T *wt = (const T *)w;                                                            \
            for (int64_t i = 0; i < dim; i++) out[i] = STORE(LOAD(wt[i]) * ROUND(LOAD(x[i]) * inv)); \
        }                                                                                          \
    }                                                                                              \
                                                                                                   \
    int rms_norm_##SUFFIX(const T *x, int64_t stride, const void *w, int f32_weight, T *out,       \
                          int64_t rows, int64_t dim, float eps, int threads) {                     \
        _Pragma("omp parallel for num_threads(threads) if (rows * dim >= PARALLEL_VALUES)")        \
        for (int64_t r = 0; r < rows; r++)                                                         \
            norm_row_##SUFFIX(x + r * stride, w, f32_weight, out + r * dim, dim, eps);             \
        return 0;                                                                                  \
    }                                                                                              \
                                                                                                   \
    int add_rms_norm_##SUFFIX(const T *a, const T *b, T *sum, const void *w, int f32_weight,       \
                              T *out, int64_t rows, int64_t dim, float eps, int threads) {         \
        _Pragma("omp parallel for num_threads(threads) if (rows * dim >= PARALLEL_VALUES)")        \
        for (int64_t r = 0; r < rows; r++) {                                                       \
            const T *ar = a + r * dim, *br = b + r * dim;                                          \
            T *sr = sum + r * dim;                                                                 \
            for (int64_t i = 0; i < dim; i++) sr[i] = STORE(LOAD(ar[i]) + LOAD(br[i]));            \
            norm_row_##SUFFIX(sr, w, f32_weight, out + r * dim, dim, eps);                         \
        }                                                                                          \
        return 0;                                                                                  \
    }                                                                                              \
                                                                                                   \
    int norm_add_rms_norm_##SUFFIX(const T *a, const void *wa, const T *b, T *sum, const void *w,  \
                                   int f32_weight, T *out, int64_t rows, int64_t dim, float eps,   \
                                   int threads) {                                                  \
        _Pragma("omp parallel for num_threads(threads) if (rows * dim >= PARALLEL_VALUES)")        \
        for (int64_t r = 0; r < rows; r++) {                                                       \
            const T *br = b + r * dim;                                                             \
            T *sr = sum + r * dim;                                                                 \
            norm_row_##SUFFIX(a + r * dim, wa, f32_weight, sr, dim, eps);                          \
            for (int64_t i = 0; i < dim; i++) sr[i] = STORE(LOAD(br[i]) + LOAD(sr[i]));            \
            if (w != NULL) norm_row_##SUFFIX(sr, w, f32_weight, out + r * dim, dim, eps);          \
        }                                                                                          \
        return 0;                                                                                  \
    }                                                                                              \
                                                                                                   \
    int norm_rotary_##SUFFIX(T *x, int64_t stride, int64_t heads, int64_t head_dim,                \
                             const void *w, int f32_weight, float eps, const T *cos,               \
                             const T *sin, int64_t rows, int threads) {                            \
        const int64_t h = head_dim / 2;                                                            \
        _Pragma("omp parallel for num_threads(threads) if (rows * heads * head_dim >= PARALLEL_VALUES)") \
        for (int64_t r = 0; r < rows; r++) {                                                       \
            const T *c = cos + r * head_dim, *s = sin + r * head_dim;                              \
            for (int64_t k = 0; k < heads; k++) {                                                  \
                T *lo = x + r * stride + k * head_dim, *hi = lo + h;                               \
                if (w != NULL) norm_row_##SUFFIX(lo, w, f32_weight, lo, head_dim, eps);            \
                for (int64_t i = 0; i < h; i++) {                                                  \
                    const float x1 = LOAD(lo[i]), x2 = LOAD(hi[i]);                                \
                    const float a = ROUND(x1 * LOAD(c[i])) - ROUND(x2 * LOAD(s[i]));               \
                    const float b = ROUND(x2 * LOAD(c[h + i])) + ROUND(x1 * LOAD(s[h + i]));       \
                    lo[i] = STORE(a);                                                              \
                    hi[i] = STORE(b);                                                              \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        return 0;                                                                                  \
    }                                                                                              \
                                                                                                   \
    int act_mul_##SUFFIX(const T *gate, int64_t gate_stride, const T *up, int64_t up_stride,       \
                         T *out, int64_t rows, int64_t dim, int act, int threads) {                \
        _Pragma("omp parallel for num_threads(threads) if (rows * dim >= PARALLEL_VALUES)")        \
        for (int64_t r = 0; r < rows; r++) {                                                       \
            const T *g = gate + r * gate_stride, *u = up + r * up_stride;                          \
            T *o = out + r * dim;                                                                  \
            if (act == GELU_TANH) {                                                                \
                _Pragma("omp simd") for (int64_t i = 0; i < dim; i++) {                            \
                    o[i] = STORE(ROUND(gelu_tanh(LOAD(g[i]))) * LOAD(u[i]));                       \
                }                                                                                  \
            } else {                                                                               \
                _Pragma("omp simd") for (int64_t i = 0; i < dim; i++) {                            \
                    o[i] = STORE(ROUND(silu(LOAD(g[i]))) * LOAD(u[i]));                            \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        return 0;                                                                                  \
    }

DEFINE_OPS(f32, float, F32_LOAD, F32_STORE, round_f32)
DEFINE_OPS(bf16, uint16_t, bf16_to_f32, f32_to_bf16, round_bf16)
