/* Paged causal prefill attention on the CPU: every prefill chunk of a step in one call, keys and
 * values read from their KV blocks where they sit (no gather), key blocks past a query tile's
 * last position never read.
 *
 * Layout (row-major, contiguous):
 *   q, out        [T, H, D]                   the step's flat token rows
 *   k, v          [num_blocks, block_size, KVH, D]
 *   starts        [P] int64                   first flat row of prefill i's queries
 *   query_lens    [P] int64                   its queries: the last query_lens[i] positions
 *   seq_lens      [P] int64                   its tokens in context, this step's included
 *   block_tables  [P, table_width] int64      physical block of each logical block
 *   window        0, or W: the query at position p sees keys at p - W + 1 .. p only
 * Query i of prefill s sits at position seq_lens[s] - query_lens[s] + i and sees keys 0 .. its
 * position (within the window). Query head h reads KV head h / (H / KVH).
 *
 * Model: a work item is (prefill, KV head, tile of query positions): its rows are the tile's
 * (position, query head) pairs of that KV head, RV of them at most (64 with AVX-512, 32 with
 * AVX2, 16 with 128-bit vectors), laid out across SIMD lanes. The item walks its keys in chunks
 * of KC, flash-attention style: scores S^T [key][row] = K . Q^T (a key's scalar broadcast against
 * the rows' vectors),
 * the online softmax per row (a running max and sum, earlier sums rescaled), then
 * O^T [dim][row] += V^T . P^T the same way, so both products run on row vectors in registers
 * and no key or value is transposed. Rows are normalised and written back at the end.
 * T is float or uint16_t (bfloat16 bits: queries and the chunk's keys and values widened to
 * float first); scores, softmax and sums are float32.
 * int8 caches (the `_i8_` functions): k and v hold int8 codes in the same layout, and
 *   k_scales, v_scales [num_blocks, block_size, KVH] float: each chunk's keys and values are
 *   decoded (codes x scale) into float rows first.
 * Returns 0, 1 for shapes past the limits below, 2 when scratch memory could not be had.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4 /* 128-bit registers: SSE, NEON */
#endif
#define NV 4            /* vectors across an item's rows */
#define RV (NV * VW)    /* rows of an item at most */
#define KC 64           /* keys per chunk */
#define MAX_GROUP 16
#define MAX_HEAD_DIM 512
#define NEG (-FLT_MAX)  /* a masked score (no infinities under -ffast-math) */

typedef float vf __attribute__((vector_size(VW * sizeof(float))));
/* A vector loaded once and used from a register by the four products after it (compilers fold
 * the load into each FMA otherwise: four loads where one does). */
#if defined(__x86_64__) || defined(__i386__)
#define IN_REGISTER(x) __asm__("" : "+x"(x))
#elif defined(__aarch64__)
#define IN_REGISTER(x) __asm__("" : "+w"(x))
#else
#define IN_REGISTER(x) ((void)0)
#endif

/* st[j][0:RV] = sum_d krow_j[d] * qt[d][0:RV] for four keys. */
static inline void scores4(const float *qt, const float *const *krows, int64_t D, float *st) {
    vf a0[NV] = {0}, a1[NV] = {0}, a2[NV] = {0}, a3[NV] = {0};
    const float *k0 = krows[0], *k1 = krows[1], *k2 = krows[2], *k3 = krows[3];
    for (int64_t d = 0; d < D; d++) {
        const vf *qv = (const vf *)(qt + d * RV);
        const float x0 = k0[d], x1 = k1[d], x2 = k2[d], x3 = k3[d];
        for (int c = 0; c < NV; c++) {
            vf qc = qv[c];
            IN_REGISTER(qc);
            a0[c] += x0 * qc;
            a1[c] += x1 * qc;
            a2[c] += x2 * qc;
            a3[c] += x3 * qc;
        }
    }
    vf *s = (vf *)st;
    for (int c = 0; c < NV; c++) {
        s[c] = a0[c];
        s[NV + c] = a1[c];
        s[2 * NV + c] = a2[c];
        s[3 * NV + c] = a3[c];
    }
}

static inline void scores1(const float *qt, const float *krow, int64_t D, float *st) {
    vf a[NV] = {0};
    for (int64_t d = 0; d < D; d++) {
        const vf *qv = (const vf *)(qt + d * RV);
        for (int c = 0; c < NV; c++) a[c] += krow[d] * qv[c];
    }
    for (int c = 0; c < NV; c++) ((vf *)st)[c] = a[c];
}

/* ot[d0 .. d0 + 3][0:RV] += sum_j vrow_j[d] * pt[j][0:RV]. */
static inline void values4(float *ot, const float *pt, const float *const *vrows, int64_t kc,
                           int64_t d0) {
    vf *o = (vf *)(ot + d0 * RV);
    vf a0[NV], a1[NV], a2[NV], a3[NV];
    for (int c = 0; c < NV; c++) {
        a0[c] = o[c];
        a1[c] = o[NV + c];
        a2[c] = o[2 * NV + c];
        a3[c] = o[3 * NV + c];
    }
    for (int64_t j = 0; j < kc; j++) {
        const vf *pv = (const vf *)(pt + j * RV);
        const float *vr = vrows[j] + d0;
        const float x0 = vr[0], x1 = vr[1], x2 = vr[2], x3 = vr[3];
        for (int c = 0; c < NV; c++) {
            vf pc = pv[c];
            IN_REGISTER(pc);
            a0[c] += x0 * pc;
            a1[c] += x1 * pc;
            a2[c] += x2 * pc;
            a3[c] += x3 * pc;
        }
    }
    for (int c = 0; c < NV; c++) {
        o[c] = a0[c];
        o[NV + c] = a1[c];
        o[2 * NV + c] = a2[c];
        o[3 * NV + c] = a3[c];
    }
}

/* Masked scores of chunk keys c0 .. c0 + kc - 1 become NEG: row r is at position pos[r]
 * (p0 .. p1) and sees keys 0 (or its window's first) .. pos[r]. */
static void mask_chunk(float *st, int64_t c0, int64_t kc, const int64_t *pos, int64_t p0,
                       int64_t p1, int64_t window) {
    for (int64_t j = 0; j < kc; j++) {
        const int64_t t = c0 + j;
        if (t <= p0 && (window <= 0 || t > p1 - window)) continue; /* every row sees it */
        for (int64_t r = 0; r < RV; r++)
            if (t > pos[r] || (window > 0 && t <= pos[r] - window)) st[j * RV + r] = NEG;
    }
}

/* e^x for x <= 0 (a score less its row's maximum), within 2 ulp of expf: x = n ln 2 + f with
 * |f| <= ln 2 / 2 (ln 2 in two parts, Cody-Waite), e^f by Cephes' degree-6 polynomial, 2^n
 * added to the exponent bits; below -87, e^-87 (1.6e-38: no term of a softmax's sum). Written
 * scalar so that loops over rows vectorise it inline (libmvec's expf is a call per vector and
 * took a sixth of the kernel). */
static inline float exp_nonpositive(float x) {
    x = x > -87.0f ? x : -87.0f;
    const float n = rintf(x * 1.44269504088896341f);
    const float f = __builtin_fmaf(n, 2.12194440e-4f, __builtin_fmaf(n, -0.693359375f, x));
    float p = 1.9875691500e-4f;
    p = __builtin_fmaf(p, f, 1.3981999507e-3f);
    p = __builtin_fmaf(p, f, 8.3334519073e-3f);
    p = __builtin_fmaf(p, f, 4.1665795894e-2f);
    p = __builtin_fmaf(p, f, 1.6666665459e-1f);
    p = __builtin_fmaf(p, f, 5.0000001201e-1f);
    const float y = __builtin_fmaf(p * f, f, f + 1.0f);
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

/* The online softmax over one chunk: maxima, rescale factors, probabilities (in place of the
 * scores) and the rows' running sums. Loops over rows, so they vectorise. */
static void softmax_chunk(float *st, int64_t kc, float *m, float *l, float *alpha) {
    float mnew[RV];
    for (int64_t r = 0; r < RV; r++) mnew[r] = m[r];
    for (int64_t j = 0; j < kc; j++)
        for (int64_t r = 0; r < RV; r++) {
            const float s = st[j * RV + r];
            mnew[r] = s > mnew[r] ? s : mnew[r];
        }
    for (int64_t r = 0; r < RV; r++) alpha[r] = exp_nonpositive(m[r] - mnew[r]);
    float sums[RV] = {0};
    for (int64_t j = 0; j < kc; j++)
        for (int64_t r = 0; r < RV; r++) {
            const float s = st[j * RV + r], seen = s > 0.5f * NEG; /* no branch: vectorises */
            const float p = exp_nonpositive(s - mnew[r]) * seen;
            st[j * RV + r] = p;
            sums[r] += p;
        }
    for (int64_t r = 0; r < RV; r++) {
        l[r] = l[r] * alpha[r] + sums[r];
        m[r] = mnew[r];
    }
}

/* Row pointers of chunk keys c0 .. c0 + kc - 1 of KV head g: into the cache (float), or into
 * `widened` after converting them (bfloat16; int8 codes x their scale). */
static void chunk_rows(const void *cache, const float *scales, int bf16, const int64_t *table,
                       int64_t block_size, int64_t KVH, int64_t g, int64_t D, int64_t c0,
                       int64_t kc, float *widened, const float **rows) {
    for (int64_t j = 0; j < kc; j++) {
        const int64_t t = c0 + j;
        const int64_t slot = (table[t / block_size] * block_size + t % block_size) * KVH + g;
        float *dst = widened + j * D;
        if (scales) {
            const int8_t *src = (const int8_t *)cache + slot * D;
            const float scale = scales[slot];
            for (int64_t d = 0; d < D; d++) dst[d] = (float)src[d] * scale;
            rows[j] = dst;
        } else if (bf16) {
            const uint16_t *src = (const uint16_t *)cache + slot * D;
            for (int64_t d = 0; d < D; d++) dst[d] = bf16_to_f32(src[d]);
            rows[j] = dst;
        } else {
            rows[j] = (const float *)cache + slot * D;
        }
    }
}

typedef struct {
    const void *q, *k, *v;
    const float *ks, *vs; /* int8 caches' scales; NULL for float caches */
    void *out;
    const int64_t *table;
    int64_t start, n, seq_len, H, KVH, D, block_size, window;
    float scale;
    int bf16;
} Prefill;

/* Where row r of an item (KV head g, tile from query index i0) starts in q and out: the query
 * at index i0 + r / G, query head g * G + r % G. */
static inline int64_t row_at(const Prefill *pf, int64_t g, int64_t i0, int64_t r, int64_t G) {
    return ((pf->start + i0 + r / G) * pf->H + g * G + r % G) * pf->D;
}

/* One work item: KV head g, the tile of query indices i0 .. i1 - 1. */
static int item(const Prefill *pf, int64_t g, int64_t i0, int64_t i1) {
    const int64_t H = pf->H, D = pf->D, G = H / pf->KVH, rows = (i1 - i0) * G;
    const int64_t first_pos = pf->seq_len - pf->n, p0 = first_pos + i0, p1 = first_pos + i1 - 1;
    const size_t floats = (size_t)(2 * D * RV + KC * RV + 2 * RV + 2 * KC * D);
    float *qt = aligned_alloc(64, ((sizeof(float) * floats + 63) / 64) * 64);
    if (!qt) return 2;
    float *ot = qt + D * RV, *st = ot + D * RV, *m = st + KC * RV, *l = m + RV;
    float *kw = l + RV, *vw = kw + KC * D, alpha[RV];
    const float *krows[KC], *vrows[KC];
    int64_t pos[RV]; /* each row's position; padding rows: the tile's last */
    for (int64_t r = 0; r < RV; r++) pos[r] = r < rows ? p0 + r / G : p1;
    memset(qt, 0, sizeof(float) * (size_t)(2 * D * RV)); /* qt's padding rows, and ot */
    for (int64_t r = 0; r < rows; r++) {
        const int64_t at = row_at(pf, g, i0, r, G);
        if (pf->bf16)
            for (int64_t d = 0; d < D; d++)
                qt[d * RV + r] = bf16_to_f32(((const uint16_t *)pf->q)[at + d]) * pf->scale;
        else
            for (int64_t d = 0; d < D; d++)
                qt[d * RV + r] = ((const float *)pf->q)[at + d] * pf->scale;
    }
    for (int64_t r = 0; r < RV; r++) {
        m[r] = NEG;
        l[r] = 0.0f;
    }
    const int64_t kfirst = pf->window > 0 && p0 - pf->window + 1 > 0 ? p0 - pf->window + 1 : 0;
    for (int64_t c0 = kfirst; c0 <= p1; c0 += KC) {
        const int64_t kc = p1 + 1 - c0 < KC ? p1 + 1 - c0 : KC;
        chunk_rows(pf->k, pf->ks, pf->bf16, pf->table, pf->block_size, pf->KVH, g, D, c0, kc, kw,
                   krows);
        chunk_rows(pf->v, pf->vs, pf->bf16, pf->table, pf->block_size, pf->KVH, g, D, c0, kc, vw,
                   vrows);
        int64_t j = 0;
        for (; j + 4 <= kc; j += 4) scores4(qt, krows + j, D, st + j * RV);
        for (; j < kc; j++) scores1(qt, krows[j], D, st + j * RV);
        mask_chunk(st, c0, kc, pos, p0, p1, pf->window);
        softmax_chunk(st, kc, m, l, alpha);
        for (int64_t d = 0; d < D; d++)
            for (int64_t r = 0; r < RV; r++) ot[d * RV + r] *= alpha[r];
        for (int64_t d0 = 0; d0 < D; d0 += 4) values4(ot, st, vrows, kc, d0);
    }
    float inv[RV];
    for (int64_t r = 0; r < RV; r++) inv[r] = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    for (int64_t d = 0; d < D; d++)
        for (int64_t r = 0; r < RV; r++) ot[d * RV + r] *= inv[r];
    /* back to rows, a block of 16 x 16 at a time (each side's lines touched once a block) */
    for (int64_t r0 = 0; r0 < rows; r0 += 16)
        for (int64_t d0 = 0; d0 < D; d0 += 16)
            for (int64_t r = r0; r < r0 + 16 && r < rows; r++) {
                const int64_t at = row_at(pf, g, i0, r, G);
                for (int64_t d = d0; d < d0 + 16 && d < D; d++) {
                    if (pf->bf16)
                        ((uint16_t *)pf->out)[at + d] = f32_to_bf16(ot[d * RV + r]);
                    else
                        ((float *)pf->out)[at + d] = ot[d * RV + r];
                }
            }
    free(qt);
    return 0;
}

static int paged_prefill(const void *q, const void *k, const void *v, const float *k_scales,
                         const float *v_scales, const int64_t *starts,
                         const int64_t *query_lens, const int64_t *seq_lens,
                         const int64_t *block_tables, int64_t table_width, void *out, int64_t P,
                         int64_t H, int64_t KVH, int64_t D, int64_t block_size, float scale,
                         int64_t window, int num_threads, int bf16) {
    if (H % KVH || H / KVH > MAX_GROUP || D > MAX_HEAD_DIM || D % 4) return 1;
    const int64_t tile = RV / (H / KVH); /* query positions per item */
    int64_t *firsts = malloc(sizeof(int64_t) * (size_t)(P + 1));
    if (!firsts) return 2;
    firsts[0] = 0; /* prefill s's items: firsts[s] .. firsts[s + 1] - 1 */
    for (int64_t s = 0; s < P; s++)
        firsts[s + 1] = firsts[s] + KVH * ((query_lens[s] + tile - 1) / tile);
    int rc = 0;
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")
    for (int64_t it = 0; it < firsts[P]; it++) {
        int64_t s = 0;
        while (firsts[s + 1] <= it) s++;
        const int64_t local = it - firsts[s], tiles = (query_lens[s] + tile - 1) / tile;
        const int64_t g = local % KVH, t = tiles - 1 - local / KVH; /* the longest tiles first */
        const int64_t i0 = t * tile, i1 = i0 + tile < query_lens[s] ? i0 + tile : query_lens[s];
        const Prefill pf = {.q = q, .k = k, .v = v, .ks = k_scales, .vs = v_scales, .out = out,
                            .table = block_tables + s * table_width, .start = starts[s],
                            .n = query_lens[s], .seq_len = seq_lens[s], .H = H, .KVH = KVH,
                            .D = D, .block_size = block_size, .window = window, .scale = scale,
                            .bf16 = bf16};
        const int r = item(&pf, g, i0, i1);
        if (r) rc = r;
    }
    free(firsts);
    return rc;
}

/* The SIMD lanes across an item's rows in this build; 0 where the engine should keep SDPA: without
 * hardware FMA each `__builtin_fmaf` is a libm call, and the kernel measured 1.5-4x slower than
 * SDPA (x86-64 baseline: 44 ms a 1,024-token layer against 11.6). */
int paged_prefill_lanes(void) {
#if defined(__FMA__)
    return VW;
#else
    return 0;
#endif
}

#define DEFINE_PAGED_PREFILL(NAME, BF16, SCALE_PARAMS, KS, VS)                                 \
    int NAME(const void *q, const void *k, const void *v, SCALE_PARAMS const int64_t *starts,   \
             const int64_t *query_lens, const int64_t *seq_lens, const int64_t *block_tables,  \
             int64_t table_width, void *out, int64_t P, int64_t H, int64_t KVH, int64_t D,     \
             int64_t block_size, float scale, int64_t window, int num_threads) {               \
        return paged_prefill(q, k, v, KS, VS, starts, query_lens, seq_lens, block_tables,      \
                             table_width, out, P, H, KVH, D, block_size, scale, window,        \
                             num_threads, BF16);                                               \
    }

#define SCALES const float *k_scales, const float *v_scales,
#define NO_SCALES

DEFINE_PAGED_PREFILL(paged_prefill_f32, 0, NO_SCALES, NULL, NULL)
DEFINE_PAGED_PREFILL(paged_prefill_bf16, 1, NO_SCALES, NULL, NULL)
DEFINE_PAGED_PREFILL(paged_prefill_i8_f32, 0, SCALES, k_scales, v_scales)
DEFINE_PAGED_PREFILL(paged_prefill_i8_bf16, 1, SCALES, k_scales, v_scales)
