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
 * St[key][rows] = K . Qt (each key's component broadcast, lane by lane over query rows,
 * from the head's keys packed tile by tile once per call), the running maximum, exp2 and
 * row sums are lane-wise over rows, and the output accumulates as Ot[dim][rows] += V^T St
 * (each value broadcast from the pool in place). Key tiles wholly above the diagonal (or
 * below the window) are never visited; only tiles crossing them are masked.
 *
 * Tile sizes, measured on one Zen 4 core (64-dim heads, group 1-8): 16 query tokens and
 * 128 keys ran a 2k chunk over 2k cached keys at 94-100 GFLOP/s against 91-94 for 32 x 64
 * (the query, output and score tiles then stay in L1); 8 keys x 2 vectors of rows per
 * micro-tile of the scores beat 4 x 4 and 16 x 1.
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
#define MT 16                     /* query tokens per tile (more ran slower: L1) */
#define ROWS (GROUP * MT)         /* query rows per tile */
#define VECS (ROWS / LANES)       /* vectors of rows */
#define KEYS 128                  /* keys per tile */
#define KG 8                      /* keys per micro-tile of the scores */
#define CG 8                      /* output dims per micro-tile of V^T St */
#define TILE_PAD 16               /* floats between the tiles in the scratch: one line, so that
                                     they do not start on the same L1 set */
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
 * masked keys (-inf) give exactly 0. */
static inline vf exp2_fraction(vf f) { /* 2^f for f in [-0.5, 0.5], degree 6 */
    vf p = splat(1.535336188319500e-4f);
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    return p * f + 1.0f;
}

#if defined(__AVX512F__) && LANES == 16
#include <immintrin.h>
static inline vf exp2_nonpositive(vf x) {
    /* below -150, 2^n * p(f) rounds to 0 (scalef rounds as a multiply would) */
    /* max(-150, x): a NaN x comes through (MAXPS returns its second operand on NaN) */
    const __m512 xc = _mm512_max_ps(_mm512_set1_ps(-150.0f), (__m512)x);
    const __m512 n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const vf f = (vf)_mm512_sub_ps(xc, n);
    const vf p = exp2_fraction(f);
    return (vf)_mm512_scalef_ps((__m512)p, n);
}
#else
static inline vf exp2_nonpositive(vf x) {
    const vi tiny = x < splat(-126.0f); /* lanes below -126 give exactly 0 */
    vi keep = ~tiny;
    vf xc = (vf)((keep & (vi)x) | (tiny & (vi)splat(-126.0f)));
    vf n = (xc + splat(12582912.0f)) - splat(12582912.0f); /* round to nearest */
    vf f = xc - n;
    const vf p = exp2_fraction(f);
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    return (vf)(keep & (vi)(p * (vf)bits));
}
#endif

static const float zero_row[DIM] __attribute__((aligned(64))); /* the V of keys past the end */

/* Which keys each query row may not see: none, or some (causal diagonal, window edge). */
struct mask {
    int any;          /* whether this key tile hides any key from any row */
    int64_t k0;       /* the tile's first key, relative to the query tile's first token */
    int64_t window;   /* 0: none */
    const vf *qpos;   /* each row's token relative to the query tile's first (0 .. MT - 1) */
};

/* St[n][v0 .. v0 + nv) for keys n0 .. n0 + KG of a packed key tile kt[c][KEYS], hidden
 * keys set to -inf, and each row's maximum folded into tmax. */
static inline __attribute__((always_inline)) void scores_tile(
    const float *qt, const float *kt, int n0, int v0, int nv, struct mask m, float *st, vf *tmax)
{
    vf acc[KG][RV];
    for (int i = 0; i < KG; i++)
        for (int r = 0; r < nv; r++) acc[i][r] = (vf){};
    for (int c = 0; c < DIM; c++) {
        vf qv[RV];
        for (int r = 0; r < nv; r++) qv[r] = load(qt + c * ROWS + (v0 + r) * LANES);
        const float *k = kt + c * KEYS + n0;
        for (int i = 0; i < KG; i++) {
            const vf b = splat(k[i]);
            for (int r = 0; r < nv; r++) acc[i][r] += b * qv[r];
        }
    }
    if (m.any) {
        const vi ninf = (vi)splat(-__builtin_inff());
        for (int i = 0; i < KG; i++) {
            const vf kpos = splat((float)(m.k0 + n0 + i)); /* exact: a masked tile is near the
                                                             diagonal or the window's edge */
            for (int r = 0; r < nv; r++) {
                vi hide = kpos > m.qpos[v0 + r];
                if (m.window > 0) hide |= kpos <= m.qpos[v0 + r] - (float)m.window;
                acc[i][r] = (vf)((hide & ninf) | (~hide & (vi)acc[i][r]));
            }
        }
    }
    for (int r = 0; r < nv; r++) {
        vf t = tmax[v0 + r];
        for (int i = 0; i < KG; i++) t = select_gt(acc[i][r], t);
        tmax[v0 + r] = t;
    }
    for (int i = 0; i < KG; i++)
        for (int r = 0; r < nv; r++) store(st + (n0 + i) * ROWS + (v0 + r) * LANES, acc[i][r]);
}

/* Keys [first, end) of one KV head, packed tile by tile for the scores: key pos goes to
 * kpack[(pos / KEYS - first / KEYS) * DIM * KEYS + c * KEYS + pos % KEYS]. A tile's KEYS
 * keys at one dimension are then one run, read as KG broadcasts from the same lines (read
 * in place, the KG keys of a micro-tile are KG rows of the pool a token stride apart).
 * The rest of the last tile is zero. */
static void pack_keys(
    const float *k_pool, const int64_t *table, int64_t first, int64_t end, int64_t kv_heads,
    int64_t head, int64_t block_size, float *kpack)
{
    const int64_t token_stride = kv_heads * DIM, block_stride = block_size * token_stride;
    const int64_t base = first / KEYS * KEYS;
    int64_t b = first / block_size, slot = first % block_size; /* walked, not divided, per key */
    for (int64_t pos = first; pos < end; pos++) {
        const float *src = k_pool + table[b] * block_stride + slot * token_stride + head * DIM;
        float *dst = kpack + (pos - base) / KEYS * DIM * KEYS + (pos - base) % KEYS;
        for (int c = 0; c < DIM; c++) dst[c * KEYS] = src[c];
        if (++slot == block_size) {
            slot = 0;
            b++;
        }
    }
    for (int64_t pos = end; (pos - base) % KEYS != 0; pos++) {
        float *dst = kpack + (pos - base) / KEYS * DIM * KEYS + (pos - base) % KEYS;
        for (int c = 0; c < DIM; c++) dst[c * KEYS] = 0.0f;
    }
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

/* The first key a token at pos sees, down to a multiple of KEYS (key tiles start there;
 * keys before a window's start are masked). */
static int64_t first_key(int64_t pos, int64_t window) {
    return window > 0 && pos - window + 1 > 0 ? (pos - window + 1) / KEYS * KEYS : 0;
}

/* One query tile of one KV head: tokens t0 .. t0 + nt of the chunk. */
static void attend_tile(
    const float *q, int64_t q_stride, const float *k_pool, const float *v_pool,
    const int64_t *table, int64_t start_pos, int64_t t0, int64_t nt, int64_t kv_heads,
    int64_t head, int64_t block_size, int64_t window, float scale, const float *kpack,
    int64_t kpack_first, float *tiles, float *out, int64_t out_stride)
{
    /* the query, output and score tiles, in the caller's scratch (not the stack: up to
     * 320 KiB at head size 256 and group 8), each 64-byte aligned */
    float *qt = tiles, *ot = qt + DIM * ROWS + TILE_PAD, *st = ot + DIM * ROWS + TILE_PAD;
    vf mx[VECS], sum[VECS], qpos[VECS];
    const float *vp[KEYS];
    const float qscale = scale * 1.44269504088896341f;
    const int64_t token_stride = kv_heads * DIM, block_stride = block_size * token_stride;

    for (int g = 0; g < GROUP; g++) {
        const float *qh = q + (head * GROUP + g) * DIM;
        for (int64_t t = 0; t < MT; t++)
            for (int c = 0; c < DIM; c++)
                qt[c * ROWS + g * MT + t] = t < nt ? qh[(t0 + t) * q_stride + c] * qscale : 0.0f;
    }
    memset(ot, 0, sizeof(float) * DIM * ROWS);
    for (int v = 0; v < VECS; v++) {
        mx[v] = splat(-__builtin_inff());
        sum[v] = (vf){};
        for (int l = 0; l < LANES; l++) qpos[v][l] = (float)((v * LANES) % MT + l);
    }
    const int64_t p_first = start_pos + t0, p_last = start_pos + t0 + nt - 1;
    for (int64_t k0 = first_key(p_first, window); k0 <= p_last; k0 += KEYS) {
        const int nk = p_last + 1 - k0 < KEYS ? (int)(p_last + 1 - k0) : KEYS;
        const int nk8 = (nk + KG - 1) / KG * KG;
        int64_t b = k0 / block_size, slot = k0 % block_size; /* walked, not divided, per key */
        for (int n = 0; n < nk; n++) {
            vp[n] = v_pool + table[b] * block_stride + slot * token_stride + head * DIM;
            if (++slot == block_size) {
                slot = 0;
                b++;
            }
        }
        for (int n = nk; n < nk8; n++) vp[n] = zero_row;
        const float *kt = kpack + (k0 - kpack_first / KEYS * KEYS) / KEYS * DIM * KEYS;
        /* keys past the first query, or at or before last query - window, are hidden somewhere */
        const struct mask m = {k0 + nk8 - 1 > p_first || (window > 0 && k0 <= p_last - window), k0 - p_first,
                               window, qpos};
        vf tmax[VECS];
        for (int v = 0; v < VECS; v++) tmax[v] = splat(-__builtin_inff());
        for (int n0 = 0; n0 < nk8; n0 += KG) {
            int v = 0;
            for (; v + RV <= VECS; v += RV) scores_tile(qt, kt, n0, v, RV, m, st, tmax);
            for (; v < VECS; v++) scores_tile(qt, kt, n0, v, 1, m, st, tmax);
        }
        for (int v = 0; v < VECS; v++) {
            const vf tile_max = tmax[v];
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

/* Query tokens per tile, and keys per packed key tile, for callers sizing the work and
 * the scratch. */
int64_t kvd_prefill_tile_tokens(void) { return MT; }
int64_t kvd_prefill_key_tile(void) { return KEYS; }
/* Floats of a share's scratch before its packed keys: the query, output and score tiles. */
int64_t kvd_prefill_tile_floats(void) { return 2 * DIM * ROWS + KEYS * ROWS + 3 * TILE_PAD; }

/* Returns 0, or -1 for a bad range. The chunk's q_len new tokens sit at positions
 * start_pos .. start_pos + q_len - 1 and their K/V are in the pool already; token i sees
 * keys max(0, pos - window + 1) .. pos (window 0: from 0). The work is kv_heads x tiles
 * units (unit = head * tiles + tile, a tile being kvd_prefill_tile_tokens() tokens); only
 * units [unit_lo, unit_hi) are computed and written, so callers may split one chunk over
 * threads. scratch is this call's own, 64-byte aligned: kvd_prefill_tile_floats() floats for
 * the tiles, then DIM * (start_pos + q_len + KEYS) for the packed keys. */
int kvd_prefill_f32(
    const float *q,          /* (q_len, kv_heads * GROUP, DIM), token stride q_stride floats */
    int64_t q_stride,
    const float *k_pool,     /* (num_blocks, block_size, kv_heads, DIM) */
    const float *v_pool,
    const int64_t *table,    /* block ids of the sequence */
    int64_t start_pos, int64_t q_len, int64_t kv_heads, int64_t block_size, int64_t window,
    float scale, int64_t unit_lo, int64_t unit_hi,
    float *out,              /* (q_len, kv_heads * GROUP, DIM), token stride out_stride floats */
    int64_t out_stride, float *scratch)
{
    const int64_t tiles = (q_len + MT - 1) / MT;
    if (unit_lo < 0 || unit_hi > kv_heads * tiles || unit_lo > unit_hi || start_pos < 0 || window < 0
        || block_size <= 0)
        return -1;
    float *tile_scratch = scratch, *kpack = scratch + kvd_prefill_tile_floats();
    int64_t packed_head = -1, kpack_first = 0;
    for (int64_t unit = unit_lo; unit < unit_hi; unit++) {
        const int64_t head = unit / tiles, tile = unit % tiles;
        const int64_t t0 = tile * MT, nt = q_len - t0 < MT ? q_len - t0 : MT;
        if (head != packed_head) { /* this head's keys for its tiles in this call */
            const int64_t last_unit = (head + 1) * tiles < unit_hi ? (head + 1) * tiles : unit_hi;
            const int64_t last_tile = (last_unit - 1) % tiles;
            const int64_t end = start_pos + (last_tile * MT + MT < q_len ? last_tile * MT + MT : q_len);
            kpack_first = first_key(start_pos + t0, window);
            pack_keys(k_pool, table, kpack_first, end, kv_heads, head, block_size, kpack);
            packed_head = head;
        }
        attend_tile(q, q_stride, k_pool, v_pool, table, start_pos, t0, nt, kv_heads, head, block_size,
                    window, scale, kpack, kpack_first, tile_scratch, out, out_stride);
    }
    return 0;
}
