/* Greedy sampling's argmax over float32 logits rows, as torch.argmax defines it: the first
 * index of the row's largest value; a row holding NaN gives its first NaN (NaN compares above
 * every number); a row of -inf gives 0. `argmax_allowed_f32`: the same over the tokens a packed
 * bitmask allows (bit t % 32 of word t / 32), as torch.argmax of the row with every other value
 * set to -inf: the first allowed NaN, else the first index of the largest allowed value, else 0.
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

/* 16 lanes' largest values and their first indices, and whether a lane met a NaN or an inf. */
typedef struct {
    f32x8 acc0, acc1, flag0, flag1;
    i32x8 at0, at1;
} Lanes;

static inline Lanes lanes_start(void) {
    const f32x8 zero = {0};
    const i32x8 lanes = {0, 1, 2, 3, 4, 5, 6, 7};
    return (Lanes){zero - INFINITY, zero - INFINITY, zero, zero, lanes, lanes + 8};
}

/* Values i .. i + 15 of x into the lanes (i < INT32_MAX). */
static inline void lanes_add16(Lanes *l, const float *x, int64_t i) {
    const f32x8 zero = {0};
    const i32x8 lanes = {0, 1, 2, 3, 4, 5, 6, 7};
    const f32x8 a = load8(x + i), b = load8(x + i + 8);
    keep_larger(&l->acc0, &l->at0, a, lanes + (int32_t)i);
    keep_larger(&l->acc1, &l->at1, b, lanes + (int32_t)(i + 8));
    l->flag0 += a * zero; /* NaN once the lane met a NaN or an inf */
    l->flag1 += b * zero;
}

/* The lanes folded into a running best (the earlier index on a tie) and NaN flag. */
static inline void lanes_merge(const Lanes *l, float *best, int64_t *best_at, float *flag) {
    for (int k = 0; k < 8; k++) {
        const float v[2] = {l->acc0[k], l->acc1[k]};
        const int64_t where[2] = {l->at0[k], l->at1[k]};
        for (int j = 0; j < 2; j++) {
            if (v[j] > *best || (v[j] == *best && where[j] < *best_at))
                *best = v[j], *best_at = where[j];
        }
        *flag += l->flag0[k] + l->flag1[k];
    }
}

static int64_t argmax_row(const float *x, int64_t dim) {
    Lanes lanes = lanes_start();
    int64_t i = 0;
    if (dim < INT32_MAX) {
        for (; i + 16 <= dim; i += 16) lanes_add16(&lanes, x, i);
    }
    float best = -INFINITY, flag = 0.0f;
    int64_t best_at = 0;
    lanes_merge(&lanes, &best, &best_at, &flag);
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

/* One row through its bitmask: words of 32 allowed tokens in the lanes, as `argmax_row`; other
 * words token by token; a word of none skipped. */
static int64_t argmax_allowed_row(const float *x, int64_t dim, const int32_t *words) {
    Lanes lanes = lanes_start();
    float best = -INFINITY, flag = 0.0f;
    int64_t best_at = 0;
    const int64_t full = dim < INT32_MAX ? dim / 32 : 0;
    for (int64_t w = 0; w * 32 < dim; w++) {
        const int64_t i = w * 32;
        uint32_t bits = (uint32_t)words[w];
        if (w < full && bits == 0xffffffffu) {
            lanes_add16(&lanes, x, i);
            lanes_add16(&lanes, x, i + 16);
            continue;
        }
        for (; bits; bits &= bits - 1) {
            const int64_t t = i + __builtin_ctz(bits);
            if (t >= dim) break;
            if (x[t] > best || (x[t] == best && t < best_at)) best = x[t], best_at = t;
            flag += x[t] * 0.0f;
        }
    }
    lanes_merge(&lanes, &best, &best_at, &flag);
    if (flag != flag) { /* rare: the first allowed NaN wins if there is one */
        for (int64_t t = 0; t < dim; t++)
            if (((uint32_t)words[t / 32] >> (t % 32)) & 1u && x[t] != x[t]) return t;
    }
    return best == -INFINITY ? 0 : best_at;
}

int argmax_allowed_f32(const float *x, int64_t stride, int64_t rows, int64_t dim,
                       const int32_t *words, int64_t words_stride, int64_t *out, int threads) {
#pragma omp parallel for num_threads(threads) if (rows > 1 && rows * dim >= PARALLEL_VALUES)
    for (int64_t r = 0; r < rows; r++)
        out[r] = argmax_allowed_row(x + r * stride, dim, words + r * words_stride);
    return 0;
}

int argmax_f32(const float *x, int64_t stride, int64_t rows, int64_t dim, int64_t *out,
               int threads) {
#pragma omp parallel for num_threads(threads) if (rows > 1 && rows * dim >= PARALLEL_VALUES)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * stride, dim);
    return 0;
}
