/* Linear layers over 4-bit lookup-table weights (bitsandbytes' nf4 and fp4) for the CPU engine.
 *
 * Weight: W[n, k] = lut[c(n, k)] * absmax[(n * K + k) / blocksize], float32, where the codes are
 * stored two a byte in row-major order, element k of row n in byte (n * K + k) / 2, the even
 * element in the high nibble (bitsandbytes' layout), and `lut` holds the 16 values of the code.
 *   fourbit_dequantize  rows [lo, hi) of W into `out` ([hi - lo, K], row-major): the same float32
 *                       products bitsandbytes' `dequantize_4bit` writes, bit for bit.
 *   fourbit_linear      y[M, N] = x[M, K] W^T (+ bias[N]): each thread decodes a tile of W's rows
 *                       into a buffer that stays in cache, then multiplies every row of x by it.
 *                       Float32 throughout: bitsandbytes' dequantize + `F.linear` up to the order
 *                       of the sums.
 * Contract (checked by the caller): K % 8 == 0, blocksize % 8 == 0, all arrays contiguous.
 * Returns 0, or 1 where a tile buffer cannot be allocated.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef __AVX2__
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

int fourbit_linear(const float *x, int64_t M, int64_t K, const uint8_t *codes, const float *absmax,
                   const float *lut, int64_t blocksize, int64_t N, const float *bias, float *y) {
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
            decode_rows(codes, absmax, lut, blocksize, K, lo, hi, w);
            tile_product(x, M, K, w, hi - lo, lo, N, bias, y);
        }
        free(w);
    }
    return failed;
}
