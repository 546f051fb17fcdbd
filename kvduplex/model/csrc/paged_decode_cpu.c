/*
 * Decode attention over a paged KV pool, one query token per sequence, float32, one thread.
 *
 * Built at first use by kvduplex/model/cpu_decode.py with the system C compiler
 * (-O3 -march=native), once per head size and query-heads-per-KV-head group, which are
 * compile-time constants here (KVD_HEAD_DIM, KVD_GROUP).
 *
 * Pool layout, per layer: K and V each (num_blocks, block_size, kv_heads, head_dim),
 * contiguous, so all KV heads of a token are one run of kv_heads * head_dim floats. Each
 * sequence's blocks are read in place through its block table, token by token in table
 * order (two passes: scores, then the weighted sum of V), with the next block prefetched.
 * The scores of one sequence (heads x keys) stay in a scratch buffer the caller gives.
 */
#include <stdint.h>
#include <string.h>

#ifndef KVD_HEAD_DIM
#error "KVD_HEAD_DIM must be defined"
#endif
#ifndef KVD_GROUP
#error "KVD_GROUP must be defined"
#endif

#define LANES 16
#define CHUNKS (KVD_HEAD_DIM / LANES)
#define GROUP KVD_GROUP
#define MAX_HEADS 1024
#define LINE_FLOATS 16

#if KVD_HEAD_DIM % LANES != 0
#error "KVD_HEAD_DIM must be a multiple of 16"
#endif

typedef float vf __attribute__((vector_size(LANES * 4)));
typedef float vfu __attribute__((vector_size(LANES * 4), aligned(4), may_alias));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));

static inline vf load(const float *p) { return *(const vfu *)p; }
static inline void store(float *p, vf v) { *(vfu *)p = v; }

static inline float hsum(vf v) {
#if defined(__clang__) || __GNUC__ >= 12
    vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7)
          + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
#else
    float s = 0.0f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
#endif
}

/* exp(x) for x <= 0: 2^n * p(f), n the nearest integer to x / ln 2 (so f in [-0.5, 0.5],
 * the range the degree-6 coefficients are fitted on; after the clamp n >= -126, a normal
 * float). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.44269504088896341f;
    float n = __builtin_rintf(t);
    float f = t - n;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &bits, sizeof s);
    return p * s;
}

enum { SCORES, VALUES };

/* One pass over a sequence's keys [first, end), token by token in table order: SCORES
 * writes scaled q.k into scores (and each head's maximum into mx); VALUES adds p * v into
 * out. Inlined with `pass` constant, so each pass is its own loop. */
static inline __attribute__((always_inline)) void walk(
    int pass, const float *pool, const int64_t *table, int64_t first, int64_t end,
    int64_t kv_heads, int64_t head_lo, int64_t head_hi, int64_t block_size, const float *qs,
    float scale, float *scores, float *mx, float *os)
{
    const int64_t dim = KVD_HEAD_DIM, width = end - first;
    const int64_t token_stride = kv_heads * dim, block_stride = block_size * token_stride;
    int64_t t = first;
    while (t < end) {
        const int64_t b = t / block_size, slot = t % block_size;
        const int64_t n = (end - t < block_size - slot) ? end - t : block_size - slot;
        const float *blk = pool + table[b] * block_stride + slot * token_stride;
        const float *next = t + n < end ? pool + table[b + 1] * block_stride : blk;
        for (int64_t i = 0; i < n; i++, t++) {
            const float *tok = blk + i * token_stride;
            for (int64_t l = head_lo * dim; l < head_hi * dim; l += LINE_FLOATS)
                __builtin_prefetch(next + i * token_stride + l);
            const int64_t col = t - first;
            for (int64_t h = head_lo; h < head_hi; h++) {
                vf x[CHUNKS];
                for (int c = 0; c < CHUNKS; c++) x[c] = load(tok + h * dim + c * LANES);
                for (int g = 0; g < GROUP; g++) {
                    const int64_t r = h * GROUP + g;
                    if (pass == SCORES) {
                        const float *qr = qs + r * dim;
                        vf acc = load(qr) * x[0];
                        for (int c = 1; c < CHUNKS; c++) acc += load(qr + c * LANES) * x[c];
                        const float score = hsum(acc) * scale;
                        scores[r * width + col] = score;
                        mx[r] = score > mx[r] ? score : mx[r];
                    } else {
                        const float p = scores[r * width + col];
                        float *o = os + r * dim;
                        for (int c = 0; c < CHUNKS; c++) store(o + c * LANES, load(o + c * LANES) + p * x[c]);
                    }
                }
            }
        }
    }
}

/* Returns 0, or -1 for more heads than MAX_HEADS or a bad head range. Sequence s attends
 * to its keys [starts[s], lens[s]) (positions; the block of position t is
 * tables[s][t / block_size]). Only KV heads [head_lo, head_hi) and their query heads are
 * computed and written, so callers may split one step's work over threads by sequence
 * and by KV head, each with its own scratch. */
int kvd_paged_decode_f32(
    const float *q,          /* (num_seqs, kv_heads * GROUP, KVD_HEAD_DIM) */
    const float *k_pool,     /* (num_blocks, block_size, kv_heads, KVD_HEAD_DIM) */
    const float *v_pool,
    const int64_t *tables,   /* (num_seqs, table_stride) block ids */
    int64_t table_stride,
    const int64_t *starts,   /* (num_seqs,) first key seen */
    const int64_t *lens,     /* (num_seqs,) keys up to here (the new token's included) */
    int64_t num_seqs, int64_t kv_heads, int64_t head_lo, int64_t head_hi, int64_t block_size,
    float scale,
    float *scores,           /* scratch: kv_heads * GROUP * max(lens - starts) floats */
    float *out)              /* (num_seqs, kv_heads * GROUP, KVD_HEAD_DIM) */
{
    const int64_t dim = KVD_HEAD_DIM, heads = kv_heads * GROUP;
    float mx[MAX_HEADS], inv[MAX_HEADS];
    if (heads > MAX_HEADS || head_lo < 0 || head_hi > kv_heads || head_lo >= head_hi) return -1;
    const int64_t r_lo = head_lo * GROUP, r_hi = head_hi * GROUP;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t first = starts[s], end = lens[s], width = end - first;
        const int64_t *table = tables + s * table_stride;
        const float *qs = q + s * heads * dim;
        float *os = out + s * heads * dim;
        memset(os + r_lo * dim, 0, sizeof(float) * (r_hi - r_lo) * dim);
        if (width <= 0) continue;
        for (int64_t r = r_lo; r < r_hi; r++) mx[r] = -3.0e38f;
        walk(SCORES, k_pool, table, first, end, kv_heads, head_lo, head_hi, block_size, qs, scale,
             scores, mx, os);
        for (int64_t r = r_lo; r < r_hi; r++) {
            float *row = scores + r * width;
            const float m = mx[r];
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < width; j++) {
                const float e = exp_nonpositive(row[j] - m);
                row[j] = e;
                sum += e;
            }
            inv[r] = 1.0f / sum;
        }
        walk(VALUES, v_pool, table, first, end, kv_heads, head_lo, head_hi, block_size, qs, scale,
             scores, mx, os);
        for (int64_t r = r_lo; r < r_hi; r++)
            for (int64_t d = 0; d < dim; d++) os[r * dim + d] *= inv[r];
    }
    return 0;
}
