/* Greedy sampling's argmax over float32 logits rows, as torch.argmax defines it: the first
 * index of the row's largest value; a row holding NaN gives its first NaN (NaN compares above
 * every number); a row of -inf gives 0.
 *
 * Layout: `rows` rows of `dim` values, a row's values contiguous, rows `stride` values apart;
 * out: one int64 per row. One pass over a row keeps each of 16 lanes' largest value and its
 * first index, and whether a NaN or an inf was met (x * 0 summed); only a row that met one is
 * scanned again for its first NaN. Returns 0.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PARALLEL_VALUES 65536 /* below this many values the rows run on one thread */

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

static inline f32x8 load8(const float *x) {
    f32x8 v;
    memcpy(&v, x, sizeof v);
    return v;
}

/* Per lane: the larger value and its index (the earlier one on a tie; NaN never wins here). */
static inline void keep_larger(f32x8 *acc, i32x8 *at, f32x8 v, i32x8 index) {
    const i32x8 larger = v > *acc;
    *acc = (f32x8)(((i32x8)v & larger) | ((i32x8)*acc & ~larger));
    *at = (index & larger) | (*at & ~larger);
}

static int64_t argmax_row(const float *x, int64_t dim) {
    const f32x8 zero = {0}, lowest = zero - INFINITY;
    const i32x8 lanes = {0, 1, 2, 3, 4, 5, 6, 7};
    f32x8 acc0 = lowest, acc1 = lowest, flag0 = zero, flag1 = zero;
    i32x8 at0 = lanes, at1 = lanes + 8;
    int64_t i = 0;
    if (dim < INT32_MAX) {
        for (; i + 16 <= dim; i += 16) {
            const f32x8 a = load8(x + i), b = load8(x + i + 8);
            keep_larger(&acc0, &at0, a, lanes + (int32_t)i);
            keep_larger(&acc1, &at1, b, lanes + (int32_t)(i + 8));
            flag0 += a * zero; /* NaN once the lane met a NaN or an inf */
            flag1 += b * zero;
        }
    }
    float best = -INFINITY, flag = 0.0f;
    int64_t best_at = 0;
    for (int l = 0; l < 8; l++) {
        const float v[2] = {acc0[l], acc1[l]};
        const int64_t where[2] = {at0[l], at1[l]};
        for (int k = 0; k < 2; k++) {
            if (v[k] > best || (v[k] == best && where[k] < best_at)) best = v[k], best_at = where[k];
        }
        flag += flag0[l] + flag1[l];
    }
    for (; i < dim; i++) {
        if (x[i] > best) best = x[i], best_at = i;
        flag += x[i] * 0.0f;
    }
    if (flag != flag) { /* rare: a NaN wins if there is one; infinities compared as above */
        for (int64_t j = 0; j < dim; j++)
            if (x[j] != x[j]) return j;
    }
    return best_at; /* 0 for a row of -inf, as torch */
}

int argmax_f32(const float *x, int64_t stride, int64_t rows, int64_t dim, int64_t *out,
               int threads) {
#pragma omp parallel for num_threads(threads) if (rows > 1 && rows * dim >= PARALLEL_VALUES)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * stride, dim);
    return 0;
}
