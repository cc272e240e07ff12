/* Linear layers over bitsandbytes' quantized weights for the CPU engine: 4-bit lookup-table
 * weights (nf4, fp4) and LLM.int8's int8 weights.
 *
 * 4-bit: W[n, k] = lut[c(n, k)] * absmax[(n * K + k) / blocksize], float32, where the codes are
 * stored two a byte in row-major order, element k of row n in byte (n * K + k) / 2, the even
 * element in the high nibble (bitsandbytes' layout), and `lut` holds the 16 values of the code.
 *   fourbit_dequantize  rows [lo, hi) of W into `out` ([hi - lo, K], row-major): the same float32
 *                       products bitsandbytes' `dequantize_4bit` writes, bit for bit.
 *   fourbit_linear      y[M, N] = x[M, K] W^T (+ bias[N]).
 * int8: W[n, k] = (float)codes[n * K + k]; with x holding int8 values too, every product and
 * partial sum is an integer, exact in float32 below 2^24: the int32 product bitsandbytes computes
 * (as a float32 matmul, or `torch._int_mm`).
 *   llm_int8_linear     LLM.int8 as bitsandbytes 0.50's torch ops compute it (`MatMul8bitLt` at
 *                       inference), step for step in the same float32 / float16 roundings:
 *                       h = float16(x); with threshold t > 0, elements |h| >= t are outliers
 *                       (zeroed, their columns listed); s[m] = max |h[m, :]|;
 *                       q = round_half_even(h * ((1 / s[m]) * 127)) as int8 (NaN, inf -> 0), outlier
 *                       columns zeroed when M > 1; i = q W^T (exact); y = i * (s[m] * scales[n])
 *                       * 6.200124e-05f (+ bias[n]). The caller adds the outlier columns'
 *                       float product (bitsandbytes' addmm) when any were listed.
 *   llm_int8_quantize, llm_int8_dequantize: its two sides alone, around another product.
 * Each thread decodes a tile of W's rows into a buffer that stays in cache, then multiplies every
 * row of x by it; float32 throughout: bitsandbytes' dequantize + matmul up to the order of sums.
 * Contract (checked by the caller): K % 8 == 0, blocksize % 8 == 0, all arrays contiguous.
 * Returns 0, or 1 where a tile buffer cannot be allocated.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <math.h>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define TILE_BYTES (128 * 1024) /* decoded rows a thread keeps at once: half a typical L2 */

/* Eight weights from four code bytes, times their block's scale. */
#ifdef __AVX2__
static inline void decode8(const uint8_t *codes, __m256 lut_lo, __m256 lut_hi, __m256 scale,
                           float *out) {
    uint32_t four;
    memcpy(&four, codes, sizeof four);
    const __m128i pairs = _mm_shuffle_epi8(
        _mm_cvtsi32_si128((int)four), _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1, -1, -1, -1, -1, -1));
    __m256i idx = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(pairs), _mm256_setr_epi32(4, 0, 4, 0, 4, 0, 4, 0));
    idx = _mm256_and_si256(idx, _mm256_set1_epi32(15));
    const __m256 low = _mm256_permutevar8x32_ps(lut_lo, idx);
    const __m256 high = _mm256_permutevar8x32_ps(lut_hi, idx);
    const __m256 upper = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)); /* bit 3 -> sign */
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_blendv_ps(low, high, upper), scale));
}
#endif

static void decode_rows(const uint8_t *codes, const float *absmax, const float *lut,
                        int64_t blocksize, int64_t K, int64_t lo, int64_t hi, float *out) {
#ifdef __AVX2__
    const __m256 lut_lo = _mm256_loadu_ps(lut), lut_hi = _mm256_loadu_ps(lut + 8);
#endif
    for (int64_t n = lo; n < hi; n++) {
        const int64_t first = n * K;
        float *row = out + (n - lo) * K;
        for (int64_t k = 0; k < K;) {
            const int64_t block = (first + k) / blocksize;
            int64_t end = (block + 1) * blocksize - first;
            end = end < K ? end : K;
            const float scale = absmax[block];
#ifdef __AVX2__
            const __m256 s = _mm256_set1_ps(scale);
            for (; k < end; k += 8) decode8(codes + (first + k) / 2, lut_lo, lut_hi, s, row + k);
#else
            for (; k < end; k += 2) {
                const uint8_t byte = codes[(first + k) / 2];
                row[k] = lut[byte >> 4] * scale;
                row[k + 1] = lut[byte & 15] * scale;
            }
#endif
        }
    }
}

static void decode_int8_rows(const int8_t *codes, int64_t K, int64_t lo, int64_t hi, float *out) {
    for (int64_t n = lo; n < hi; n++) {
        const int8_t *c = codes + n * K;
        float *row = out + (n - lo) * K;
#ifdef __AVX2__
        for (int64_t k = 0; k < K; k += 8) {
            const __m128i eight = _mm_loadl_epi64((const __m128i *)(c + k));
            _mm256_storeu_ps(row + k, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight)));
        }
#else
        for (int64_t k = 0; k < K; k++) row[k] = (float)c[k];
#endif
    }
}

int fourbit_dequantize(const uint8_t *codes, const float *absmax, const float *lut,
                       int64_t blocksize, int64_t K, int64_t lo, int64_t hi, float *out) {
#pragma omp parallel for schedule(static) if ((hi - lo) * K >= 65536)
    for (int64_t n = lo; n < hi; n++) decode_rows(codes, absmax, lut, blocksize, K, n, n + 1, out + (n - lo) * K);
    return 0;
}

#ifdef __AVX2__
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

/* MR (<= 4) rows of x against NR (<= 3) decoded weight rows: 12 accumulators, 3 weight and 1 x
 * register in the widest case; MR and NR are constants at each call site, so
 * the accumulators stay in registers. */
static inline __attribute__((always_inline)) void micro(const float *x, int64_t K, const float *w,
                                                        int MR, int NR, float *y, int64_t N,
                                                        const float *bias) {
    __m256 acc[4][3];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        __m256 wv[3];
        for (int j = 0; j < NR; j++) wv[j] = _mm256_loadu_ps(w + j * K + k);
        for (int i = 0; i < MR; i++) {
            const __m256 xv = _mm256_loadu_ps(x + i * K + k);
            for (int j = 0; j < NR; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) y[i * N + j] = hsum(acc[i][j]) + (bias ? bias[j] : 0.0f);
}
#else
static inline void micro(const float *x, int64_t K, const float *w, int MR, int NR, float *y,
                         int64_t N, const float *bias) {
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++) s += x[i * K + k] * w[j * K + k];
            y[i * N + j] = s + (bias ? bias[j] : 0.0f);
        }
}
#endif

/* Every row of x against a tile of `rows` decoded weight rows (output columns n0 ..). */
static void tile_product(const float *x, int64_t M, int64_t K, const float *w, int64_t rows,
                         int64_t n0, int64_t N, const float *bias, float *y) {
    const float *b = bias ? bias + n0 : NULL;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
        int64_t j = 0;
        for (; j + 3 <= rows; j += 3)
            micro(x + m * K, K, w + j * K, 4, 3, y + m * N + n0 + j, N, b ? b + j : NULL);
        for (; j < rows; j++) micro(x + m * K, K, w + j * K, 4, 1, y + m * N + n0 + j, N, b ? b + j : NULL);
    }
    for (; m < M; m++) {
        int64_t j = 0;
        for (; j + 3 <= rows; j += 3)
            micro(x + m * K, K, w + j * K, 1, 3, y + m * N + n0 + j, N, b ? b + j : NULL);
        for (; j < rows; j++) micro(x + m * K, K, w + j * K, 1, 1, y + m * N + n0 + j, N, b ? b + j : NULL);
    }
}

/* A quantized weight as one of the decoders above reads it. */
typedef struct {
    const void *codes;
    const float *absmax, *lut; /* 4-bit only; NULL for int8 */
    int64_t blocksize;
} weight_t;

static void decode_tile(const weight_t *w, int64_t K, int64_t lo, int64_t hi, float *out) {
    if (w->lut == NULL)
        decode_int8_rows((const int8_t *)w->codes, K, lo, hi, out);
    else
        decode_rows((const uint8_t *)w->codes, w->absmax, w->lut, w->blocksize, K, lo, hi, out);
}

static int tiled_linear(const float *x, int64_t M, int64_t K, const weight_t *weight, int64_t N,
                        const float *bias, float *y) {
    int64_t tile = TILE_BYTES / (K * (int64_t)sizeof(float));
    tile = tile < 3 ? 3 : (tile > 18 ? 18 : tile / 3 * 3);
    const int64_t tiles = (N + tile - 1) / tile;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *w = aligned_alloc(64, (size_t)(tile * K * (int64_t)sizeof(float) + 63) / 64 * 64);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (w == NULL) {
                failed = 1;
                continue;
            }
            const int64_t lo = t * tile, hi = lo + tile < N ? lo + tile : N;
            decode_tile(weight, K, lo, hi, w);
            tile_product(x, M, K, w, hi - lo, lo, N, bias, y);
        }
        free(w);
    }
    return failed;
}

int fourbit_linear(const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *absmax,
                   const float *lut, int64_t blocksize, int64_t N, const float *bias, float *y) {
    const weight_t weight = {codes, absmax, lut, blocksize};
    return tiled_linear(x, M, K, &weight, N, bias, y);
}

static inline float to_float16(float v) {
#ifdef __F16C__
    return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT));
#else
    return (float)(_Float16)v;
#endif
}

/* h = float16(x) with outliers zeroed (flags[k] set for their columns); returns max |h|. */
static float half_row(const float *x, int64_t K, float threshold, float *h, char *flags) {
    float top = 0.0f;
    for (int64_t k = 0; k < K; k++) {
        float v = to_float16(x[k]);
        if (threshold > 0.0f && fabsf(v) >= threshold) {
#pragma omp atomic write
            flags[k] = 1;
            v = 0.0f;
        }
        h[k] = v;
        top = fabsf(v) > top ? fabsf(v) : top;
    }
    return top;
}

/* LLM.int8's input side: x [M, K] -> q (int8 values as float32, [M, K]) and s [M]; outlier
 * columns listed in ascending order. */
int llm_int8_quantize(const float *x, int64_t M, int64_t K, float threshold, float *q,
                      float *row_scale, int64_t *outlier_cols, int64_t *outliers) {
    char *flags = calloc((size_t)K, 1);
    if (flags == NULL) return 1;
#pragma omp parallel for schedule(static) if (M * K >= 65536)
    for (int64_t m = 0; m < M; m++) row_scale[m] = half_row(x + m * K, K, threshold, q + m * K, flags);
    *outliers = 0;
    for (int64_t k = 0; k < K; k++)
        if (flags[k]) outlier_cols[(*outliers)++] = k;
#pragma omp parallel for schedule(static) if (M * K >= 65536)
    for (int64_t m = 0; m < M; m++) {
        const float factor = (1.0f / row_scale[m]) * 127.0f; /* torch's 127 / s: s.reciprocal() * 127 */
        float *row = q + m * K;
        for (int64_t k = 0; k < K; k++) {
            const float v = rintf(row[k] * factor);
            row[k] = (M > 1 && flags[k]) || !isfinite(v) ? 0.0f : v;
        }
    }
    free(flags);
    return 0;
}

/* LLM.int8's output side, in place: y [M, N] holds the exact integer products. */
int llm_int8_dequantize(float *y, int64_t M, int64_t N, const float *row_scale, const float *scales,
                        const float *bias) {
#pragma omp parallel for schedule(static) if (M * N >= 65536)
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
            const float v = (float)(int32_t)y[m * N + n] * (row_scale[m] * scales[n]) * 6.200124e-05f;
            y[m * N + n] = bias ? v + bias[n] : v;
        }
    return 0;
}

int llm_int8_linear(const float *x, int64_t M, int64_t K, const int8_t *codes, const float *scales,
                    int64_t N, const float *bias, float threshold, float *y, int64_t *outlier_cols,
                    int64_t *outliers) {
    float *q = malloc((size_t)(M * K + M) * sizeof(float));
    if (q == NULL) return 1;
    float *row_scale = q + M * K;
    const weight_t weight = {codes, NULL, NULL, 0};
    int failed = llm_int8_quantize(x, M, K, threshold, q, row_scale, outlier_cols, outliers);
    failed = failed || tiled_linear(q, M, K, &weight, N, NULL, y);
    if (!failed) llm_int8_dequantize(y, M, N, row_scale, scales, bias);
    free(q);
    return failed;
}
