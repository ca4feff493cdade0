/* distzo's fused per-chunk kernels for CPU (float32), called through ctypes.
 *
 * One pass over a chunk of the master applies the pending update and writes every working copy
 * master +- eps * z, so z never travels through memory and the master is read once. Each
 * element goes through exactly the floating-point operations of the torch path
 * (engine/chunkpass.py, the optimizers' `update`), one rounding per operation, so the two agree bitwise.
 * Build with -ffp-contract=off: a fused multiply-add would round `x * decay - z` once instead
 * of twice. (-fno-math-errno only lets sqrtf vectorise: it changes no value.)
 *
 * A noise source is either a buffer of pre-drawn, pre-scaled values (a low-rank rule's z, drawn by
 * torch) or a counter stream of the chunk's seed (distzo/zo/streams.py defines both, in torch ops),
 * generated inside the pass: word j = splitmix64 output j for the chunk's seed;
 *   Rademacher: element i is +scale when bit (i % 64) of word (i / 64) is set, -scale otherwise;
 *   Gaussian: elements 2j and 2j + 1 are r cos t and r sin t of word j's Box-Muller transform,
 *   times scale, with ln, cos and sin computed from float32 arithmetic alone (`gaussian_pairs`).
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
    int32_t gaussian;    /* the stream's distribution: Gaussian (1) or Rademacher (0) */
} distzo_source;

static inline __attribute__((always_inline)) uint64_t stream_word(uint64_t seed, uint64_t j) {
    uint64_t x = seed + (j + 1) * GAMMA;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

/* float32 constants of the Gaussian stream, the same bits as zo/streams.py's: atanh's series 1/9 .. 1/3,
 * sin's -1/3! .. 1/9! and cos's 1/4! .. -1/10! (highest power first), ln 2 in two parts (the high one
 * exact in a product with an exponent), and (pi / 2) / 2^22, one step of the angle's 22-bit remainder. */
#define LN_C9 0x1.c71c72p-4f
#define LN_C7 0x1.24924ap-3f
#define LN_C5 0x1.99999ap-3f
#define LN_C3 0x1.555556p-2f
#define SIN_C9 0x1.71de3ap-19f
#define SIN_C7 -0x1.a01a02p-13f
#define SIN_C5 0x1.111112p-7f
#define SIN_C3 -0x1.555556p-3f
#define COS_C10 -0x1.27e4fcp-22f
#define COS_C8 0x1.a01a02p-16f
#define COS_C6 -0x1.6c16c2p-10f
#define COS_C4 0x1.555556p-5f
#define LN2_HI 0x1.62e4p-1f
#define LN2_LO 0x1.7f7d1cp-20f
#define ANGLE_STEP 0x1.921fb6p-22f
#define PAIRS (TILE / 2 + 1) /* the words a tile of elements from any offset needs */
/* The Gaussian tile is compiled for AVX-512, for AVX2 and for the baseline, and the loader picks the
 * widest one the CPU runs (GCC's function multiversioning; x86-64 Linux). The clones give the same bits:
 * every operation is an IEEE one, rounded once (no contraction into FMAs at any width), whatever the
 * vector length. -DDISTZO_NO_CLONES compiles the baseline alone (tests/unit/test_native.py compares
 * the widths). */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && \
    !defined(DISTZO_NO_CLONES) /* GCC 11 named the x86-64-v3 and v4 levels */
#define WIDEST_VECTORS __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define WIDEST_VECTORS
#endif

static inline float bits_float(int32_t b) { float f; memcpy(&f, &b, sizeof f); return f; }
static inline int32_t float_bits(float f) { int32_t b; memcpy(&b, &f, sizeof b); return b; }

/* Box-Muller of n words, in the operations of zo/streams.py's `gaussian_pairs` and in its order:
 * z[2t] = r cos t, z[2t + 1] = r sin t for word w[t]. Branch-free on 32-bit lanes, so it vectorises. */
static inline __attribute__((always_inline)) void gaussian_pairs(const uint64_t *__restrict__ w, int n,
                                                                 float *__restrict__ z) {
    int32_t k[PAIRS], angle[PAIRS];
    float cos_t[PAIRS], sin_t[PAIRS];
    for (int t = 0; t < n; t++) {
        k[t] = (int32_t)(w[t] >> 40) + 1;               /* u1 2^24 in [1, 2^24] */
        angle[t] = (int32_t)((w[t] >> 16) & 0xFFFFFF);  /* t = pi (angle / 2^23 - 1) */
    }
    for (int t = 0; t < n; t++) {
        const int32_t bits = float_bits((float)k[t]);
        const int32_t mantissa = (bits & 0x007FFFFF) | 0x3F800000;
        const int32_t big = mantissa > 0x3FB504F3; /* m above sqrt(2): halved */
        const float m = bits_float(mantissa - (big << 23));
        const float e = (float)((bits >> 23) - 127 + big - 24);
        const float s = (m - 1.0f) / (m + 1.0f);
        const float s2 = s * s;
        float p = LN_C9;
        p = p * s2 + LN_C7;
        p = p * s2 + LN_C5;
        p = p * s2 + LN_C3;
        const float ln_m = (s + s) * (p * s2 + 1.0f);
        const float r = sqrtf((e * LN2_HI + (e * LN2_LO + ln_m)) * -2.0f);
        const int32_t quadrant = (angle[t] + (1 << 21)) >> 22;
        const float x = (float)(angle[t] - (quadrant << 22)) * ANGLE_STEP;
        const float x2 = x * x;
        float sp = SIN_C9;
        sp = sp * x2 + SIN_C7;
        sp = sp * x2 + SIN_C5;
        sp = sp * x2 + SIN_C3;
        const float sin_x = x + x * (x2 * sp);
        float cp = COS_C10;
        cp = cp * x2 + COS_C8;
        cp = cp * x2 + COS_C6;
        cp = cp * x2 + COS_C4;
        const float cos_x = (cp * x2 - 0.5f) * x2 + 1.0f;
        /* cos and sin of t by quadrant mod 4: 0 (-cos x, -sin x), 1 (sin x, -cos x), 2 (cos x, sin x),
         * 3 (-sin x, cos x); a sign flip of the bits is the negation torch performs */
        const int32_t odd = -(quadrant & 1);
        const int32_t c = (float_bits(sin_x) & odd) | (float_bits(cos_x) & ~odd);
        const int32_t sn = (float_bits(cos_x) & odd) | (float_bits(sin_x) & ~odd);
        cos_t[t] = r * bits_float(c ^ (int32_t)((uint32_t)(~(quadrant + 1) & 2) << 30));
        sin_t[t] = r * bits_float(sn ^ (int32_t)((uint32_t)(~quadrant & 2) << 30));
    }
    for (int t = 0; t < n; t++) {
        z[2 * t] = cos_t[t];
        z[2 * t + 1] = sin_t[t];
    }
}

/* Elements [start, start + n) of a Gaussian stream times its scale, n <= TILE. */
WIDEST_VECTORS static void gaussian_tile(const distzo_source *s, int64_t start, int64_t n, float *buf) {
    uint64_t w[PAIRS];
    float z[2 * PAIRS];
    const int64_t first = start >> 1;
    const int words = (int)(((start + n + 1) >> 1) - first);
    for (int t = 0; t < words; t++) w[t] = stream_word(s->seed, (uint64_t)(first + t));
    gaussian_pairs(w, words, z);
    const float *from = z + (start & 1);
    const float scale = s->scale;
    for (int64_t i = 0; i < n; i++) buf[i] = from[i] * scale;
}

/* +-1 for each bit of a byte, bit 0 first: the byte b of a stream word gives eight elements. */
static float unit_signs[256][8];

__attribute__((constructor)) static void init_unit_signs(void) {
    for (int b = 0; b < 256; b++)
        for (int k = 0; k < 8; k++) unit_signs[b][k] = ((b >> k) & 1) ? 1.0f : -1.0f;
}

static inline float sign_element(const distzo_source *s, int64_t e) {
    return ((stream_word(s->seed, (uint64_t)e >> 6) >> (e & 63)) & 1) ? s->scale : -s->scale;
}

/* z of a source for chunk elements [start, start + n), n <= TILE: the pre-drawn values in place,
 * or the stream's values written to buf (Rademacher: +-1 times the scale, exact). */
static const float *source_tile(const distzo_source *s, int64_t start, int64_t n, float *buf) {
    if (s->values) return s->values + start;
    if (s->gaussian) {
        gaussian_tile(s, start, n, buf);
        return buf;
    }
    const float scale = s->scale;
    int64_t i = 0;
    for (; i < n && ((start + i) & 7); i++) buf[i] = sign_element(s, start + i); /* to a byte boundary */
    while (n - i >= 8) {
        const int64_t e = start + i;
        const uint64_t w = stream_word(s->seed, (uint64_t)e >> 6);
        for (int b = (int)((e & 63) >> 3); b < 8 && n - i >= 8; b++, i += 8) {
            const float *u = unit_signs[(w >> (8 * b)) & 255];
            for (int k = 0; k < 8; k++) buf[i + k] = u[k] * scale;
        }
    }
    for (; i < n; i++) buf[i] = sign_element(s, start + i);
    return buf;
}

/* out[i] = z of a stream (Gaussian or Rademacher) at chunk element offset + i, for i < n. */
void distzo_stream_fill(float *out, int64_t n, uint64_t seed, int64_t offset, float scale, int gaussian) {
    distzo_source s = {0, seed, scale, gaussian};
    for (int64_t i = 0; i < n; i += TILE) {
        int64_t m = n - i < TILE ? n - i : TILE;
        source_tile(&s, offset + i, m, out + i);  /* writes into out directly */
    }
}

/* Rows of a parameter's z: row r (row_numel elements) starts at element offsets[r] of the chunk
 * whose seed is seeds[r]; out holds n_rows * row_numel floats. */
void distzo_stream_rows(float *out, int64_t n_rows, int64_t row_numel, const uint64_t *seeds,
                        const int64_t *offsets, float scale, int gaussian) {
    for (int64_t r = 0; r < n_rows; r++)
        distzo_stream_fill(out + r * row_numel, row_numel, seeds[r], offsets[r], scale, gaussian);
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

/* A quantized base's weights decoded for the forward (models/decode.py, on a CPU), in the operations
 * of torchao's own dequantization, so the result is its bitwise:
 *   int8 (dequantize_affine, symmetric): out[r, c] = (float)q[r, c] * scale[r];
 *   NF4 (get_original_weight): block b of `group` weights has the scaler
 *   qscaler[b] / factor[b / scaler_group] + mean (dequantize_scalers), and element 2j of the block is
 *   lut[high nibble of byte j] * scaler, element 2j + 1 lut[low nibble] * scaler.
 * Written as float32, or (out_bf16) rounded once more to bfloat16 as torch converts (what autocast's
 * cast of the float32 weight gives). One pass, reading the quantized bytes and writing the weight
 * once, where torchao's NF4 takes about fifteen elementwise passes. */

/* float32 -> bfloat16 bits, to nearest, ties to even, as torch's conversion; a NaN as torch's vectorised
 * (AVX2, AVX-512) conversion writes it, 0xFFFF (its scalar one writes 0x7FC0: a NaN either way). */
static inline uint16_t bf16_bits(float f) {
    const uint32_t b = (uint32_t)float_bits(f);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFF;
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

WIDEST_VECTORS void distzo_decode_int8(const int8_t *__restrict__ q, const float *__restrict__ scale, int64_t rows,
                                       int64_t cols, void *__restrict__ out, int32_t out_bf16) {
    for (int64_t r = 0; r < rows; r++) {
        const float s = scale[r];
        const int8_t *qr = q + r * cols;
        if (out_bf16) {
            uint16_t *o = (uint16_t *)out + r * cols;
            for (int64_t c = 0; c < cols; c++) o[c] = bf16_bits((float)qr[c] * s);
        } else {
            float *o = (float *)out + r * cols;
            for (int64_t c = 0; c < cols; c++) o[c] = (float)qr[c] * s;
        }
    }
}

WIDEST_VECTORS void distzo_decode_nf4(const uint8_t *__restrict__ packed, const float *__restrict__ lut,
                                      const int8_t *__restrict__ qscaler, const float *__restrict__ factor, float mean,
                                      int64_t n, int64_t group, int64_t scaler_group, void *__restrict__ out,
                                      int32_t out_bf16) {
    for (int64_t b = 0; b < n / group; b++) {
        const float scaler = (float)qscaler[b] / factor[b / scaler_group] + mean;
        const uint8_t *bytes = packed + b * (group / 2);
        if (out_bf16) {
            uint16_t *o = (uint16_t *)out + b * group;
            for (int64_t j = 0; j < group / 2; j++) {
                o[2 * j] = bf16_bits(lut[bytes[j] >> 4] * scaler);
                o[2 * j + 1] = bf16_bits(lut[bytes[j] & 15] * scaler);
            }
        } else {
            float *o = (float *)out + b * group;
            for (int64_t j = 0; j < group / 2; j++) {
                o[2 * j] = lut[bytes[j] >> 4] * scaler;
                o[2 * j + 1] = lut[bytes[j] & 15] * scaler;
            }
        }
    }
}

#ifdef __cplusplus
}
#endif
