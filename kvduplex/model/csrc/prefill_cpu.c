/*
 * Prefill attention over a paged KV pool, float32, one thread: the new tokens of one
 * sequence attend causally (optionally within a sliding window) to its keys, read in place
 * through its block table, its own new keys included (they are in the pool already).
 *
 * Built at first use by kvduplex/model/cpu_prefill.py with the system C compiler
 * (-O3 -march=native), once per head size and query-heads-per-KV-head group, which are
 * compile-time constants here (KVD_HEAD_DIM, KVD_GROUP).
 *
 * Flash-style, everything "transposed" so that no step needs a horizontal reduction: a
 * tile of query rows (MT tokens x GROUP heads sharing one KV head, row = g * MT + t) is
 * held as Qt[dim][rows], scaled by scale * log2(e); per tile of KEYS keys, the scores are
 * St[key][rows] = K . Qt (each key's row is broadcast from the pool, lane by lane over
 * query rows), the running maximum, exp2 and row sums are lane-wise over rows, and the
 * output accumulates as Ot[dim][rows] += V^T St (each value broadcast from the pool). Key
 * tiles wholly above the diagonal (or below the window) are never visited; only tiles
 * crossing them are masked.
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
#define DIM KVD_HEAD_DIM
#define GROUP KVD_GROUP
#define MT (GROUP >= 4 ? 16 : 32) /* query tokens per tile */
#define ROWS (GROUP * MT)         /* query rows per tile */
#define VECS (ROWS / LANES)       /* vectors of rows */
#define KEYS 64                   /* keys per tile */
#define KG 8                      /* keys per micro-tile of the scores */
#define CG 8                      /* output dims per micro-tile of V^T St */
#define RV 2                      /* vectors of rows per micro-tile: each broadcast feeds RV FMAs */

#if DIM % CG != 0
#error "KVD_HEAD_DIM must be a multiple of 8"
#endif

typedef float vf __attribute__((vector_size(LANES * 4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4)));
typedef float vfu __attribute__((vector_size(LANES * 4), aligned(4), may_alias));

static inline vf load(const float *p) { return *(const vfu *)p; }
static inline void store(float *p, vf v) { *(vfu *)p = v; }
static inline vf splat(float x) { return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
static inline vf select_gt(vf a, vf b) { /* max(a, b), -inf aware */
    vi gt = a > b;
    return (vf)((gt & (vi)a) | (~gt & (vi)b));
}

/* 2^x lane-wise for x <= 0 (or -inf): 2^n * p(f), n the nearest integer, f in [-0.5, 0.5];
 * lanes below -126 give exactly 0 (masked keys, and weights too small for a float). */
static inline vf exp2_nonpositive(vf x) {
    const vi tiny = x < splat(-126.0f);
    vi keep = ~tiny;
    vf xc = (vf)((keep & (vi)x) | (tiny & (vi)splat(-126.0f)));
    vf n = (xc + splat(12582912.0f)) - splat(12582912.0f); /* round to nearest */
    vf f = xc - n;
    vf p = splat(1.535336188319500e-4f);
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    return (vf)(keep & (vi)(p * (vf)bits));
}

static const float zero_row[DIM] __attribute__((aligned(64)));

/* St[n][v0 .. v0 + nv) for keys n0 .. n0 + KG: nv vectors of rows times KG keys. */
static inline __attribute__((always_inline)) void scores_tile(
    const float *qt, const float *const *kp, int n0, int v0, int nv, float *st)
{
    vf acc[KG][RV];
    for (int i = 0; i < KG; i++)
        for (int r = 0; r < nv; r++) acc[i][r] = (vf){};
    for (int c = 0; c < DIM; c++) {
        vf qv[RV];
        for (int r = 0; r < nv; r++) qv[r] = load(qt + c * ROWS + (v0 + r) * LANES);
        for (int i = 0; i < KG; i++) {
            const vf b = splat(kp[n0 + i][c]);
            for (int r = 0; r < nv; r++) acc[i][r] += b * qv[r];
        }
    }
    for (int i = 0; i < KG; i++)
        for (int r = 0; r < nv; r++) store(st + (n0 + i) * ROWS + (v0 + r) * LANES, acc[i][r]);
}

/* Ot[c0 .. c0 + CG][v0 .. v0 + nv) += sum over keys n < nk of V[n][c] * St[n][...]. */
static inline __attribute__((always_inline)) void values_tile(
    const float *st, const float *const *vp, int nk, int c0, int v0, int nv, float *ot)
{
    vf acc[CG][RV];
    for (int i = 0; i < CG; i++)
        for (int r = 0; r < nv; r++) acc[i][r] = load(ot + (c0 + i) * ROWS + (v0 + r) * LANES);
    for (int n = 0; n < nk; n++) {
        vf pv[RV];
        for (int r = 0; r < nv; r++) pv[r] = load(st + n * ROWS + (v0 + r) * LANES);
        const float *v = vp[n] + c0;
        for (int i = 0; i < CG; i++) {
            const vf b = splat(v[i]);
            for (int r = 0; r < nv; r++) acc[i][r] += b * pv[r];
        }
    }
    for (int i = 0; i < CG; i++)
        for (int r = 0; r < nv; r++) store(ot + (c0 + i) * ROWS + (v0 + r) * LANES, acc[i][r]);
}

/* One query tile of one KV head: tokens t0 .. t0 + nt of the chunk. */
static void attend_tile(
    const float *q, int64_t q_stride, const float *k_pool, const float *v_pool,
    const int64_t *table, int64_t start_pos, int64_t t0, int64_t nt, int64_t kv_heads,
    int64_t head, int64_t block_size, int64_t window, float scale, float *out, int64_t out_stride)
{
    float qt[DIM * ROWS] __attribute__((aligned(64)));
    float ot[DIM * ROWS] __attribute__((aligned(64)));
    float st[KEYS * ROWS] __attribute__((aligned(64)));
    vf mx[VECS], sum[VECS], qpos[VECS];
    const float *kp[KEYS], *vp[KEYS];
    const float qscale = scale * 1.44269504088896341f;
    const int64_t token_stride = kv_heads * DIM, block_stride = block_size * token_stride;

    for (int g = 0; g < GROUP; g++) {
        const float *qh = q + (head * GROUP + g) * DIM;
        for (int64_t t = 0; t < MT; t++)
            for (int c = 0; c < DIM; c++)
                qt[c * ROWS + g * MT + t] = t < nt ? qh[(t0 + t) * q_stride + c] * qscale : 0.0f;
    }
    memset(ot, 0, sizeof ot);
    for (int v = 0; v < VECS; v++) {
        mx[v] = splat(-__builtin_inff());
        sum[v] = (vf){};
        for (int l = 0; l < LANES; l++) qpos[v][l] = (float)(start_pos + t0 + (v * LANES) % MT + l);
    }
    const int64_t p_first = start_pos + t0, p_last = start_pos + t0 + nt - 1;
    const int64_t k_begin = window > 0 && p_first - window + 1 > 0 ? p_first - window + 1 : 0;
    for (int64_t k0 = k_begin; k0 <= p_last; k0 += KEYS) {
        const int nk = p_last + 1 - k0 < KEYS ? (int)(p_last + 1 - k0) : KEYS;
        const int nk8 = (nk + KG - 1) / KG * KG;
        for (int n = 0; n < nk8; n++) {
            if (n < nk) {
                const int64_t pos = k0 + n;
                const int64_t at = table[pos / block_size] * block_stride + (pos % block_size) * token_stride
                                 + head * DIM;
                kp[n] = k_pool + at;
                vp[n] = v_pool + at;
            } else {
                kp[n] = vp[n] = zero_row;
            }
        }
        for (int n0 = 0; n0 < nk8; n0 += KG) {
            int v = 0;
            for (; v + RV <= VECS; v += RV) scores_tile(qt, kp, n0, v, RV, st);
            for (; v < VECS; v++) scores_tile(qt, kp, n0, v, 1, st);
        }
        /* keys past the last query, or at or before first query - window, are hidden somewhere */
        const int masked = k0 + nk8 - 1 > p_first || (window > 0 && k0 <= p_last - window);
        if (masked) {
            const vf lim = splat(-__builtin_inff());
            for (int n = 0; n < nk8; n++) {
                const vf kpos = splat((float)(k0 + n));
                for (int v = 0; v < VECS; v++) {
                    vi hide = kpos > qpos[v];
                    if (window > 0) hide |= kpos <= qpos[v] - (float)window;
                    float *s = st + n * ROWS + v * LANES;
                    store(s, (vf)((hide & (vi)lim) | (~hide & (vi)load(s))));
                }
            }
        }
        for (int v = 0; v < VECS; v++) {
            vf tile_max = splat(-__builtin_inff());
            for (int n = 0; n < nk8; n++) tile_max = select_gt(load(st + n * ROWS + v * LANES), tile_max);
            const vf m_new = select_gt(tile_max, mx[v]);
            const vi none = m_new == splat(-__builtin_inff());
            const vf m_use = (vf)(~none & (vi)m_new); /* a lane that saw no key yet: 0 */
            const vf alpha = exp2_nonpositive(mx[v] - m_use);
            vf s = (vf){};
            for (int n = 0; n < nk8; n++) {
                float *row = st + n * ROWS + v * LANES;
                const vf p = exp2_nonpositive(load(row) - m_use);
                store(row, p);
                s += p;
            }
            sum[v] = sum[v] * alpha + s;
            mx[v] = m_new;
            int grew = 0;
            for (int l = 0; l < LANES; l++) grew |= alpha[l] != 1.0f;
            if (grew)
                for (int c = 0; c < DIM; c++) store(ot + c * ROWS + v * LANES, load(ot + c * ROWS + v * LANES) * alpha);
        }
        for (int c0 = 0; c0 < DIM; c0 += CG) {
            int v = 0;
            for (; v + RV <= VECS; v += RV) values_tile(st, vp, nk8, c0, v, RV, ot);
            for (; v < VECS; v++) values_tile(st, vp, nk8, c0, v, 1, ot);
        }
    }
    float inv[ROWS];
    for (int v = 0; v < VECS; v++) store(inv + v * LANES, splat(1.0f) / sum[v]);
    for (int g = 0; g < GROUP; g++) {
        float *oh = out + (head * GROUP + g) * DIM;
        for (int64_t t = 0; t < nt; t++) {
            const int r = g * MT + (int)t;
            for (int c = 0; c < DIM; c++) oh[(t0 + t) * out_stride + c] = ot[c * ROWS + r] * inv[r];
        }
    }
}

/* Query tokens per tile, for callers splitting the work. */
int64_t kvd_prefill_tile_tokens(void) { return MT; }

/* Returns 0, or -1 for a bad range. The chunk's q_len new tokens sit at positions
 * start_pos .. start_pos + q_len - 1 and their K/V are in the pool already; token i sees
 * keys max(0, pos - window + 1) .. pos (window 0: from 0). The work is kv_heads x tiles
 * units (unit = head * tiles + tile, a tile being kvd_prefill_tile_tokens() tokens); only
 * units [unit_lo, unit_hi) are computed and written, so callers may split one chunk over
 * threads. */
int kvd_prefill_f32(
    const float *q,          /* (q_len, kv_heads * GROUP, DIM), token stride q_stride floats */
    int64_t q_stride,
    const float *k_pool,     /* (num_blocks, block_size, kv_heads, DIM) */
    const float *v_pool,
    const int64_t *table,    /* block ids of the sequence */
    int64_t start_pos, int64_t q_len, int64_t kv_heads, int64_t block_size, int64_t window,
    float scale, int64_t unit_lo, int64_t unit_hi,
    float *out,              /* (q_len, kv_heads * GROUP, DIM), token stride out_stride floats */
    int64_t out_stride)
{
    const int64_t tiles = (q_len + MT - 1) / MT;
    if (unit_lo < 0 || unit_hi > kv_heads * tiles || unit_lo > unit_hi || start_pos < 0 || window < 0
        || block_size <= 0)
        return -1;
    for (int64_t unit = unit_lo; unit < unit_hi; unit++) {
        const int64_t head = unit / tiles, t0 = unit % tiles * MT, nt = q_len - t0 < MT ? q_len - t0 : MT;
        attend_tile(q, q_stride, k_pool, v_pool, table, start_pos, t0, nt, kv_heads, head, block_size,
                    window, scale, out, out_stride);
    }
    return 0;
}
