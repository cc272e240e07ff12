/* Paged decode attention on the CPU: one query token per sequence, keys and values read from
 * their KV blocks where they sit (no gather, no padding to the longest sequence).
 *
 * Layout (row-major, contiguous):
 *   q, out        [S, H, D]                   S decoding sequences, H query heads
 *   k, v          [num_blocks, block_size, KVH, D]
 *   block_tables  [S, table_width] int64       physical block of each logical block
 *   seq_lens      [S] int64                    tokens in context, this step's included
 *   window        0, or W: the query at position p sees keys at p - W + 1 .. p only
 *                 (sliding-window layers); keys before that are not read
 * Query head h reads KV head h / (H / KVH) (grouped-query attention). Work items are
 * sequences (with at least SEQ_ITEMS_PER_THREAD a thread) or (sequence, KV head) pairs; each
 * reads its keys once for the scores of its query heads, then its values once, so every cached
 * byte is read once per layer.
 * T is float or uint16_t (bfloat16 bits); scores, softmax and sums are float32.
 * int8 caches (the `_i8_` functions): k and v hold int8 codes in the same layout, and
 *   k_scales, v_scales [num_blocks, block_size, KVH] float: a key is its codes x its scale, so
 *   the scale multiplies the finished dot product (keys) and the probability (values).
 * Returns 0, 1 for shapes past the limits below, 2 when scratch memory could not be had.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define MAX_GROUP 16
#define MAX_HEAD_DIM 512
#define STACK_FLOATS 4096 /* an item's small scratch on the stack up to this size (16 KB) */

#define F32_LOAD(x) (x)
#define F32_STORE(x) (x)

#define I8_LOAD(x) ((float)(x))

/* In place: each of the n rows of `len` scores becomes exp(score - its row's max); sums[r] is
 * row r's total (the softmax's denominator). */
static inline void exp_rows(float *scores, int64_t n, int64_t len, const float *maxs, float *sums) {
    for (int64_t r = 0; r < n; r++) {
        float sum = 0.0f;
        for (int64_t t = 0; t < len; t++) {
            const float p = expf(scores[r * len + t] - maxs[r]);
            scores[r * len + t] = p;
            sum += p;
        }
        sums[r] = sum;
    }
}

/* A sequence's cached tokens at positions first .. end - 1, in order: `slot` is the token's
 * cache slot, `t` its index from first. */
#define FOR_EACH_TOKEN(table, first, end, block_size, ...)                                     \
    for (int64_t t0 = first - first % block_size; t0 < end; t0 += block_size) {                \
        const int64_t slot0 = table[t0 / block_size] * block_size;                             \
        const int64_t n = end - t0 < block_size ? end - t0 : block_size;                       \
        for (int64_t i = t0 < first ? first - t0 : 0; i < n; i++) {                            \
            const int64_t slot = slot0 + i, t = t0 + i - first;                                \
            __VA_ARGS__                                                                        \
        }                                                                                      \
    }

/* One work item: KV heads kv0 .. kv1 - 1 of one sequence and their query heads. A cached token's
 * keys (then values) for every KV head are one row of KVH x D, read front to back: an item of
 * every KV head streams the cache in order, an item of one reads D of each row. `D` is a literal
 * at the hot call sites, so the head-dim loops are unrolled. KT is the cache's element type,
 * KLOAD its conversion to float; SCALED (a literal) says whether ks / vs hold a scale per
 * (slot, KV head), so the float caches' items compile without them. Scratch: scores [heads,
 * len] (heap); the scaled queries and the value accumulators [heads, D], the score maxima and
 * the softmax denominators [heads] (stack, heap when larger). */
#define DEFINE_ITEM(NAME, T, KT, LOAD, STORE, KLOAD, SCALED)                                   \
    static inline __attribute__((always_inline)) int NAME(                                     \
        const T *q, const KT *k, const KT *v, const float *ks, const float *vs,                 \
        const int64_t *table, int64_t first, int64_t end, T *out, int64_t KVH, int64_t G,      \
        int64_t kv0, int64_t kv1, int64_t block_size, float scale, const int64_t D) {          \
        const int64_t h0 = kv0 * G, heads = (kv1 - kv0) * G, len = end - first;               \
        float small[STACK_FLOATS];                                                             \
        const size_t need = (size_t)(2 * heads * D + 2 * heads);                               \
        float *scores = malloc(sizeof(float) * (size_t)(heads * (len > 0 ? len : 1)));         \
        float *qf = need <= STACK_FLOATS ? small : malloc(sizeof(float) * need);               \
        if (!scores || !qf) {                                                                  \
            free(scores);                                                                      \
            if (qf != small) free(qf);                                                         \
            return 2;                                                                          \
        }                                                                                      \
        float *acc = qf + heads * D, *maxs = acc + heads * D, *sums = maxs + heads;            \
        for (int64_t h = 0; h < heads; h++) {                                                  \
            for (int64_t d = 0; d < D; d++) qf[h * D + d] = LOAD(q[(h0 + h) * D + d]) * scale; \
            for (int64_t d = 0; d < D; d++) acc[h * D + d] = 0.0f;                             \
            maxs[h] = -FLT_MAX;                                                                \
        }                                                                                      \
        FOR_EACH_TOKEN(table, first, end, block_size, {                                        \
            const KT *row = k + slot * KVH * D;                                                \
            for (int64_t kvh = kv0; kvh < kv1; kvh++) {                                        \
                const float s = SCALED ? ks[slot * KVH + kvh] : 1.0f;                          \
                for (int64_t h = (kvh - kv0) * G; h < (kvh - kv0 + 1) * G; h++) {              \
                    float dot = 0.0f;                                                          \
                    for (int64_t d = 0; d < D; d++) dot += qf[h * D + d] * KLOAD(row[kvh * D + d]); \
                    dot *= s;                                                                  \
                    scores[h * len + t] = dot;                                                 \
                    maxs[h] = dot > maxs[h] ? dot : maxs[h];                                   \
                }                                                                              \
            }                                                                                  \
        })                                                                                     \
        exp_rows(scores, heads, len, maxs, sums);                                              \
        FOR_EACH_TOKEN(table, first, end, block_size, {                                        \
            const KT *row = v + slot * KVH * D;                                                \
            for (int64_t kvh = kv0; kvh < kv1; kvh++) {                                        \
                const float s = SCALED ? vs[slot * KVH + kvh] : 1.0f;                          \
                for (int64_t h = (kvh - kv0) * G; h < (kvh - kv0 + 1) * G; h++) {              \
                    const float p = scores[h * len + t] * s;                                   \
                    for (int64_t d = 0; d < D; d++) acc[h * D + d] += p * KLOAD(row[kvh * D + d]); \
                }                                                                              \
            }                                                                                  \
        })                                                                                     \
        for (int64_t h = 0; h < heads; h++) {                                                  \
            const float inv = sums[h] > 0.0f ? 1.0f / sums[h] : 0.0f;                          \
            for (int64_t d = 0; d < D; d++) out[(h0 + h) * D + d] = STORE(acc[h * D + d] * inv); \
        }                                                                                      \
        free(scores);                                                                          \
        if (qf != small) free(qf);                                                             \
        return 0;                                                                              \
    }

/* The exported entry, `D` a literal for the common head dims (32, 64, 128, 256), so each call
 * site unrolls its head-dim loops (at 64 sequences, head dim 32 took 0.5-0.9x the generic loop's
 * time, 256 0.8-1.05x). Work items are sequences when there are at least SEQ_ITEMS_PER_THREAD of
 * them a thread (each streams its rows in order), else (sequence, KV head) pairs, so that a few
 * long sequences still spread over every thread. */
#define SEQ_ITEMS_PER_THREAD 4
#define ITEM_AT(ITEM, KS, VS, H0, H1, DIM)                                                     \
    ITEM(qs, k, v, KS, VS, table, first, end, os, KVH, G, H0, H1, block_size, scale, DIM)
/* r = the item over KV heads H0 .. H1 - 1, through the call site of its head dim. */
#define ITEM_WITH_LITERAL_D(ITEM, KS, VS, H0, H1)                                              \
    switch (D) {                                                                               \
    case 32: r = ITEM_AT(ITEM, KS, VS, H0, H1, 32); break;                                     \
    case 64: r = ITEM_AT(ITEM, KS, VS, H0, H1, 64); break;                                     \
    case 128: r = ITEM_AT(ITEM, KS, VS, H0, H1, 128); break;                                   \
    case 256: r = ITEM_AT(ITEM, KS, VS, H0, H1, 256); break;                                   \
    default: r = ITEM_AT(ITEM, KS, VS, H0, H1, D);                                             \
    }
#define DEFINE_PAGED_DECODE(NAME, ITEM, T, KT, SCALE_PARAMS, KS, VS)                           \
    int NAME(const T *q, const KT *k, const KT *v, SCALE_PARAMS const int64_t *block_tables,   \
             int64_t table_width, const int64_t *seq_lens, T *out, int64_t S, int64_t H,       \
             int64_t KVH, int64_t D, int64_t block_size, float scale, int64_t window,          \
             int num_threads) {                                                                \
        if (H % KVH || H / KVH > MAX_GROUP || D > MAX_HEAD_DIM) return 1;                      \
        const int64_t G = H / KVH;                                                             \
        const int64_t per_seq = S >= (int64_t)SEQ_ITEMS_PER_THREAD * num_threads;              \
        const int64_t items = per_seq ? S : S * KVH;                                           \
        int rc = 0;                                                                            \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")              \
        for (int64_t item = 0; item < items; item++) {                                         \
            const int64_t s = per_seq ? item : item / KVH, kv0 = per_seq ? 0 : item % KVH;     \
            const T *qs = q + s * H * D;                                                       \
            T *os = out + s * H * D;                                                           \
            const int64_t *table = block_tables + s * table_width;                             \
            const int64_t end = seq_lens[s];                                                   \
            const int64_t first = window > 0 && end > window ? end - window : 0;               \
            /* each call site inlined with its head range and D known (a pair's one KV head \
             * as a literal range: 8-15% of a long single sequence's time) */                \
            int r;                                                                             \
            if (per_seq) {                                                                     \
                ITEM_WITH_LITERAL_D(ITEM, KS, VS, 0, KVH)                                      \
            } else {                                                                           \
                ITEM_WITH_LITERAL_D(ITEM, KS, VS, kv0, kv0 + 1)                                \
            }                                                                                  \
            if (r) rc = r;                                                                     \
        }                                                                                      \
        return rc;                                                                             \
    }

#define SCALES const float *k_scales, const float *v_scales,
#define NO_SCALES

DEFINE_ITEM(item_f32, float, float, F32_LOAD, F32_STORE, F32_LOAD, 0)
DEFINE_ITEM(item_bf16, uint16_t, uint16_t, bf16_to_f32, f32_to_bf16, bf16_to_f32, 0)
DEFINE_ITEM(item_i8_f32, float, int8_t, F32_LOAD, F32_STORE, I8_LOAD, 1)
DEFINE_ITEM(item_i8_bf16, uint16_t, int8_t, bf16_to_f32, f32_to_bf16, I8_LOAD, 1)
DEFINE_PAGED_DECODE(paged_decode_f32, item_f32, float, float, NO_SCALES, NULL, NULL)
DEFINE_PAGED_DECODE(paged_decode_bf16, item_bf16, uint16_t, uint16_t, NO_SCALES, NULL, NULL)
DEFINE_PAGED_DECODE(paged_decode_i8_f32, item_i8_f32, float, int8_t, SCALES, k_scales, v_scales)
DEFINE_PAGED_DECODE(paged_decode_i8_bf16, item_i8_bf16, uint16_t, int8_t, SCALES, k_scales,
                    v_scales)
