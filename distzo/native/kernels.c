/* distzo's fused per-chunk kernels for CPU (float32), called through ctypes.
 *
 * One pass over a chunk of the master applies the pending update and writes every working copy
 * master +- eps * z, so z never travels through memory and the master is read once. Each
 * element goes through exactly the floating-point operations of the torch path
 * (engine/chunkpass.py, the optimizers' `update`), one rounding per operation, so the two agree bitwise.
 * Build with -ffp-contract=off: a fused multiply-add would round `x * decay - z` once instead
 * of twice.
 *
 * A noise source is either a buffer of pre-drawn, pre-scaled values (Gaussian z, drawn by torch)
 * or a Rademacher stream: element i of a chunk is +scale when bit (i % 64) of word (i / 64) of
 * the chunk's SplitMix64 stream is set, -scale otherwise, where word j = splitmix64 output j for
 * the chunk's seed (zo/directions.py implements the same stream with torch ops).
 */
#include <stdint.h>
#include <math.h>
#include <string.h>

/* torch.utils.cpp_extension compiles this file with the C++ compiler: keep C linkage (unmangled
 * names) for ctypes. */
#ifdef __cplusplus
extern "C" {
#endif

#define GAMMA 0x9E3779B97F4A7C15ULL
#define TILE 256 /* elements per tile: a multiple of 64, small enough that tiles stay in L1 */

typedef struct {
    const float *values; /* pre-drawn values of the chunk, indexed like the master; NULL: a stream */
    uint64_t seed;       /* the stream's chunk seed */
    float scale;         /* the stream's magnitude (|lr c_k| or eps) */
} distzo_source;

static inline uint64_t stream_word(uint64_t seed, uint64_t j) {
    uint64_t x = seed + (j + 1) * GAMMA;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

/* +-1 for each bit of a byte, bit 0 first: the byte b of a stream word gives eight elements. */
static float unit_signs[256][8];

__attribute__((constructor)) static void init_unit_signs(void) {
    for (int b = 0; b < 256; b++)
        for (int k = 0; k < 8; k++) unit_signs[b][k] = ((b >> k) & 1) ? 1.0f : -1.0f;
}

static inline float stream_element(const distzo_source *s, int64_t e) {
    return ((stream_word(s->seed, (uint64_t)e >> 6) >> (e & 63)) & 1) ? s->scale : -s->scale;
}

/* z of a source for chunk elements [start, start + n), n <= TILE: the pre-drawn values in place,
 * or the stream's values written to buf (+-1 times the scale: exact). */
static const float *source_tile(const distzo_source *s, int64_t start, int64_t n, float *buf) {
    if (s->values) return s->values + start;
    const float scale = s->scale;
    int64_t i = 0;
    for (; i < n && ((start + i) & 7); i++) buf[i] = stream_element(s, start + i); /* to a byte boundary */
    while (n - i >= 8) {
        const int64_t e = start + i;
        const uint64_t w = stream_word(s->seed, (uint64_t)e >> 6);
        for (int b = (int)((e & 63) >> 3); b < 8 && n - i >= 8; b++, i += 8) {
            const float *u = unit_signs[(w >> (8 * b)) & 255];
            for (int k = 0; k < 8; k++) buf[i + k] = u[k] * scale;
        }
    }
    for (; i < n; i++) buf[i] = stream_element(s, start + i);
    return buf;
}

/* out[i] = z of a Rademacher stream at chunk element offset + i, for i < n. */
void distzo_rademacher_fill(float *out, int64_t n, uint64_t seed, int64_t offset, float scale) {
    distzo_source s = {0, seed, scale};
    for (int64_t i = 0; i < n; i += TILE) {
        int64_t m = n - i < TILE ? n - i : TILE;
        source_tile(&s, offset + i, m, out + i);  /* writes into out directly */
    }
}

/* Rows of a parameter's Rademacher z: row r (row_numel elements) starts at element offsets[r] of
 * the chunk whose seed is seeds[r]; out holds n_rows * row_numel floats. */
void distzo_rademacher_rows(float *out, int64_t n_rows, int64_t row_numel, const uint64_t *seeds,
                            const int64_t *offsets, float scale) {
    for (int64_t r = 0; r < n_rows; r++)
        distzo_rademacher_fill(out + r * row_numel, row_numel, seeds[r], offsets[r], scale);
}

/* A magnitude mask (Sparse MeZO): z reaches element i only where |x[i]| <= h; elsewhere it is +0,
 * as torch.where(x.abs() <= h, z, 0) gives it. Returns z itself when there is no mask. */
static const float *masked(const float *__restrict__ z, const float *__restrict__ x, int64_t m, int has_mask, float h,
                          float *__restrict__ out) {
    if (!has_mask) return z;
    /* Branch-free on the bits (so it vectorises): z's bits where kept, all zero bits (+0) elsewhere. */
    for (int64_t i = 0; i < m; i++) {
        uint32_t bits;
        memcpy(&bits, &z[i], sizeof bits);
        bits &= (uint32_t)0 - (uint32_t)(fabsf(x[i]) <= h);
        memcpy(&out[i], &bits, sizeof bits);
    }
    return out;
}

/* Copies of one tile: for each output o, outs[o][i] = x + z_q or x - z_q (shared by both entry points),
 * z_q masked by the updated x where there is a mask, and divided by root[i] where `root` is given
 * (sqrt of HiZOO's Hessian after the update: its perturbation (eps z) / sqrt(H)). */
static void write_copies(const float *x, int64_t i0, int64_t m, int64_t offset, int n_queries,
                         const distzo_source *queries, int n_outs, float *const *outs, const int *out_query,
                         const int *out_sign, float *buf, int has_mask, float mask_h, float *mbuf,
                         const float *root, float *sbuf) {
    for (int q = 0; q < n_queries; q++) {
        const float *z = 0;
        for (int o = 0; o < n_outs; o++) {
            if (out_query[o] != q) continue;
            if (!z) {
                z = masked(source_tile(&queries[q], offset + i0, m, buf), x, m, has_mask, mask_h, mbuf);
                if (root) {
                    for (int64_t i = 0; i < m; i++) sbuf[i] = z[i] / root[i];
                    z = sbuf;
                }
            }
            float *dst = outs[o] + i0;
            if (out_sign[o] > 0)
                for (int64_t i = 0; i < m; i++) dst[i] = x[i] + z[i];
            else
                for (int64_t i = 0; i < m; i++) dst[i] = x[i] - z[i];
        }
    }
}

/* One chunk range of a float32 master: master[0 .. n) holds chunk elements [offset, offset + n).
 * An optimizer's update (distzo/zo/optimizers.py: the same float32 operations in the same order as
 * its `update`), then the copies, in one pass over the range.
 *
 * Terms t are (z_t, term_add[t]): z_t = |a_t| z, term_add when a_t < 0, so a_t z = add ? -z_t : z_t.
 *   rule 0 (sgd; no consts, no state): x = x * decay (if has_decay); per term: x = x -+ z_t. With no
 *     decay and no terms the master is left untouched (a pass that only writes copies).
 *   rule 1 (momentum; consts mu; state0 d):
 *     x = x * decay; if mu != 0: x = x - mu * d; d = d * mu; per term: x = x -+ z_t, d = d +- z_t
 *   rule 2 (adam; consts b1, 1-b1, b2, 1-b2, alpha, 1/sqrt(1-b2^t), eps; state0 m, state1 v):
 *     g = sum_t a_t z; m = m * b1 + g * (1-b1); v = v * b2 + (g * g) * (1-b2); x = x * decay;
 *     x = x - (m * alpha) / (sqrt(v) * inv_bc2s + eps)
 *   rule 3 (sign; consts lr): g as above; x = x * decay; x = g > 0 ? x - lr : g < 0 ? x + lr : x
 *   rule 4 (hizoo; consts 1-alpha, alpha*d, lr*c; state0 h; at most one term, z itself):
 *     with the term: h = h * (1-alpha) + ((z * z) * h) * (alpha*d); x = x * decay; with the term:
 *     x = x - (z * (lr*c)) / sqrt(h). Its copies divide z_q by sqrt(h) (h after the update), also in a
 *     call with no term and no decay, which leaves x and h as they are (a pass that only writes copies).
 * Copies: for each output o, outs[o][i] = x + z_q (out_sign[o] > 0) or x - z_q, with q = out_query[o]
 * indexing `queries`.
 * With has_mask, every z is masked by magnitude (Sparse MeZO): a term's z where |x| <= mask_h for x as
 * the master held it before the update, a copy's z where |x| <= mask_h for the updated x. */
void distzo_chunk_rule(float *master, int64_t n, int64_t offset, int rule, const float *consts,
                       float *state0, float *state1, int has_decay, float decay,
                       int n_terms, const distzo_source *terms, const int *term_add,
                       int n_queries, const distzo_source *queries,
                       int n_outs, float *const *outs, const int *out_query, const int *out_sign,
                       int has_mask, float mask_h) {
    float x[TILE], x0[TILE], buf[TILE], g[TILE], mbuf[TILE], sbuf[TILE], root[TILE];
    for (int64_t i0 = 0; i0 < n; i0 += TILE) {
        const int64_t m = n - i0 < TILE ? n - i0 : TILE;
        memcpy(x, master + i0, (size_t)m * sizeof(float));
        if (has_mask) memcpy(x0, x, (size_t)m * sizeof(float));
        if (rule == 0) {
            if (has_decay)
                for (int64_t i = 0; i < m; i++) x[i] = x[i] * decay;
            for (int t = 0; t < n_terms; t++) {
                const float *z = masked(source_tile(&terms[t], offset + i0, m, buf), x0, m, has_mask, mask_h, mbuf);
                if (term_add[t])
                    for (int64_t i = 0; i < m; i++) x[i] = x[i] + z[i];
                else
                    for (int64_t i = 0; i < m; i++) x[i] = x[i] - z[i];
            }
        } else if (rule == 1) {
            float *d = state0 + i0;
            const float mu = consts[0];
            if (has_decay)
                for (int64_t i = 0; i < m; i++) x[i] = x[i] * decay;
            if (mu != 0.0f)
                for (int64_t i = 0; i < m; i++) x[i] = x[i] - mu * d[i];
            for (int64_t i = 0; i < m; i++) d[i] = d[i] * mu;
            for (int t = 0; t < n_terms; t++) {
                const float *z = masked(source_tile(&terms[t], offset + i0, m, buf), x0, m, has_mask, mask_h, mbuf);
                if (term_add[t])
                    for (int64_t i = 0; i < m; i++) { x[i] = x[i] + z[i]; d[i] = d[i] - z[i]; }
                else
                    for (int64_t i = 0; i < m; i++) { x[i] = x[i] - z[i]; d[i] = d[i] + z[i]; }
            }
        } else if (rule == 4) {
            float *h = state0 + i0;
            const float keep = consts[0], alpha_d = consts[1], lr_c = consts[2];
            const float *z = n_terms ? masked(source_tile(&terms[0], offset + i0, m, buf), x0, m, has_mask, mask_h,
                                              mbuf) : 0;
            if (z)
                for (int64_t i = 0; i < m; i++) {
                    const float curved = ((z[i] * z[i]) * h[i]) * alpha_d;
                    h[i] = h[i] * keep + curved;
                }
            for (int64_t i = 0; i < m; i++) root[i] = sqrtf(h[i]);  /* the update's and the copies' */
            if (has_decay)
                for (int64_t i = 0; i < m; i++) x[i] = x[i] * decay;
            if (z)
                for (int64_t i = 0; i < m; i++) x[i] = x[i] - (z[i] * lr_c) / root[i];
        } else {
            for (int64_t i = 0; i < m; i++) g[i] = 0.0f;
            for (int t = 0; t < n_terms; t++) {
                const float *z = masked(source_tile(&terms[t], offset + i0, m, buf), x0, m, has_mask, mask_h, mbuf);
                if (term_add[t])
                    for (int64_t i = 0; i < m; i++) g[i] = g[i] - z[i];
                else
                    for (int64_t i = 0; i < m; i++) g[i] = g[i] + z[i];
            }
            if (rule == 2) {
                float *mm = state0 + i0, *vv = state1 + i0;
                const float b1 = consts[0], omb1 = consts[1], b2 = consts[2], omb2 = consts[3];
                const float alpha = consts[4], inv_bc2s = consts[5], eps = consts[6];
                for (int64_t i = 0; i < m; i++) {
                    mm[i] = mm[i] * b1 + g[i] * omb1;
                    vv[i] = vv[i] * b2 + (g[i] * g[i]) * omb2;
                }
                if (has_decay)
                    for (int64_t i = 0; i < m; i++) x[i] = x[i] * decay;
                for (int64_t i = 0; i < m; i++) x[i] = x[i] - (mm[i] * alpha) / (sqrtf(vv[i]) * inv_bc2s + eps);
            } else { /* rule 3 */
                const float lr = consts[0];
                if (has_decay)
                    for (int64_t i = 0; i < m; i++) x[i] = x[i] * decay;
                for (int64_t i = 0; i < m; i++) x[i] = g[i] > 0.0f ? x[i] - lr : (g[i] < 0.0f ? x[i] + lr : x[i]);
            }
        }
        if (rule != 0 || has_decay || n_terms > 0) memcpy(master + i0, x, (size_t)m * sizeof(float));
        write_copies(x, i0, m, offset, n_queries, queries, n_outs, outs, out_query, out_sign, buf, has_mask, mask_h,
                     mbuf, rule == 4 ? root : 0, sbuf);
    }
}

#ifdef __cplusplus
}
#endif
