/* The text model's CPU kernels in float32 that torch runs as many small ops: decode attention
 * (one query row per sequence and query head over that sequence's K/V rows), RMSNorm, RMSNorm
 * with rotate-half RoPE, and the MLP's silu(gate) * up.
 * Built and called by common/models/native_kernels.py, which says why and how. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* e^x for x <= 0 (a score minus its row's maximum), to about 2 ulp: x = n ln2 + r with
 * |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial, 2^n put in the exponent bits.
 * Written so that the compiler vectorizes the loops calling it (no libm call). */
static inline float exp_nonpositive(float x) {
    if (x < -87.0f) x = -87.0f;                     /* e^-87 ~ 1.6e-38: vanishes in the sum */
    float n = __builtin_floorf(x * 1.44269504f + 0.5f);
    float r = x - n * 0.693145752f - n * 1.42860677e-6f;  /* ln 2 in two parts */
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (0.166666672f + r * (0.0416666679f
              + r * (0.00833333377f + r * 0.00138888892f)))));
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* One key head's group of G query rows over its first n positions: scores, softmax, and
 * the weighted sum of values, into out[g * D + d]. p holds G * n floats. */
#define GROUP(NAME, G_EXPR)                                                                  \
    static void NAME(const float *q, int64_t q_sh, const float *k, int64_t k_st,            \
                     const float *v, int64_t v_st, int n, int D, int Gdyn, float scale,      \
                     float *p, float *out, int64_t out_sh) {                                 \
        const int G = G_EXPR;                                                                \
        (void)Gdyn;                                                                          \
        for (int t = 0; t < n; t++) {                                                        \
            const float *kt = k + t * k_st;                                                  \
            float s[16];                                                                     \
            for (int g = 0; g < G; g++) s[g] = 0.0f;                                         \
            for (int d = 0; d < D; d++)                                                      \
                for (int g = 0; g < G; g++) s[g] += q[g * q_sh + d] * kt[d];                 \
            for (int g = 0; g < G; g++) p[g * n + t] = s[g] * scale;                         \
        }                                                                                    \
        for (int g = 0; g < G; g++) {                                                        \
            float *pg = p + g * n, m = pg[0], sum = 0.0f;                                    \
            for (int t = 1; t < n; t++) m = pg[t] > m ? pg[t] : m;                           \
            for (int t = 0; t < n; t++) { pg[t] = exp_nonpositive(pg[t] - m); sum += pg[t]; }\
            float inv = 1.0f / sum;                                                          \
            for (int t = 0; t < n; t++) pg[t] *= inv;                                        \
            float *o = out + g * out_sh;                                                     \
            for (int d = 0; d < D; d++) o[d] = 0.0f;                                         \
        }                                                                                    \
        for (int t = 0; t < n; t++) {                                                        \
            const float *vt = v + t * v_st;                                                  \
            for (int g = 0; g < G; g++) {                                                    \
                float w = p[g * n + t], *o = out + g * out_sh;                               \
                for (int d = 0; d < D; d++) o[d] += w * vt[d];                               \
            }                                                                                \
        }                                                                                    \
    }

GROUP(group1, 1)
GROUP(group2, 2)
GROUP(group4, 4)
GROUP(group8, 8)
GROUP(group_any, Gdyn)

/* out [B, H * D] (contiguous) = attention of q [B, H, D] over k, v [B, KV, T, D] (any
 * strides, last dimension contiguous) at positions below lens[b] (all T when lens is NULL).
 * Returns 0; -1 when the work buffer could not be allocated, -2 when H is not a multiple of
 * KV by at most 16. The caller checks the rest: 1 <= lens[b] <= T, the strides. */
int epd_decode_attention(const float *q, int64_t q_sb, int64_t q_sh, const float *k,
                         int64_t k_sb, int64_t k_sh, int64_t k_st, const float *v,
                         int64_t v_sb, int64_t v_sh, int64_t v_st, const int64_t *lens, int B,
                         int H, int KV, int T, int D, float scale, float *out) {
    if (KV <= 0 || H % KV != 0 || H / KV > 16) return -2;
    const int G = H / KV;
    float *p = malloc(sizeof(float) * (size_t)G * (size_t)T);
    if (p == NULL) return -1;
    for (int b = 0; b < B; b++) {
        const int n = lens ? (int)lens[b] : T;
        for (int h = 0; h < KV; h++) {
            const float *qg = q + b * q_sb + (int64_t)h * G * q_sh;
            const float *kb = k + b * k_sb + h * k_sh, *vb = v + b * v_sb + h * v_sh;
            float *o = out + ((int64_t)b * H + (int64_t)h * G) * D;
            switch (G) {
            case 1: group1(qg, q_sh, kb, k_st, vb, v_st, n, D, G, scale, p, o, D); break;
            case 2: group2(qg, q_sh, kb, k_st, vb, v_st, n, D, G, scale, p, o, D); break;
            case 4: group4(qg, q_sh, kb, k_st, vb, v_st, n, D, G, scale, p, o, D); break;
            case 8: group8(qg, q_sh, kb, k_st, vb, v_st, n, D, G, scale, p, o, D); break;
            default: group_any(qg, q_sh, kb, k_st, vb, v_st, n, D, G, scale, p, o, D);
            }
        }
    }
    free(p);
    return 0;
}

/* out [n, m, d] (contiguous) = RMSNorm of x [n, m, d] (strides xs0, xs1, 1) over d, scaled by
 * w [m, d] (row stride ws0; 0: one [d] row for all): x * (1 / sqrt(mean(x^2) + eps)) * w. */
void epd_rms_norm(const float *x, int64_t n, int64_t m, int64_t d, int64_t xs0, int64_t xs1,
                  const float *w, int64_t ws0, float eps, float *out) {
    for (int64_t i = 0; i < n; i++) {
        for (int64_t j = 0; j < m; j++) {
            const float *row = x + i * xs0 + j * xs1, *wr = w + j * ws0;
            float *o = out + (i * m + j) * d, squares = 0.0f;
            for (int64_t k = 0; k < d; k++) squares += row[k] * row[k];
            const float scale = 1.0f / sqrtf(squares / (float)d + eps);
            for (int64_t k = 0; k < d; k++) o[k] = row[k] * scale * wr[k];
        }
    }
}

/* RMSNorm (as epd_rms_norm) then rotate-half RoPE, in one pass per row: with y the normed
 * row, out[k] = y[k] * cos[k] + y[(k + d/2) % d] * ssin[k], where ssin is the sine with its
 * first half negated (text_ops.signed_sin). cos and ssin are [n, d] tables, row stride cs0
 * (the same for both), one row per token for all of its m heads. d is even and at most 1024. */
int epd_rms_norm_rotate(const float *x, int64_t n, int64_t m, int64_t d, int64_t xs0,
                        int64_t xs1, const float *w, int64_t ws0, float eps, const float *cos,
                        const float *ssin, int64_t cs0, float *out) {
    if (d % 2 != 0 || d > 1024) return -2;
    const int64_t half = d / 2;
    float y[1024];
    for (int64_t i = 0; i < n; i++) {
        const float *c = cos + i * cs0, *s = ssin + i * cs0;
        for (int64_t j = 0; j < m; j++) {
            const float *row = x + i * xs0 + j * xs1, *wr = w + j * ws0;
            float *o = out + (i * m + j) * d, squares = 0.0f;
            for (int64_t k = 0; k < d; k++) squares += row[k] * row[k];
            const float scale = 1.0f / sqrtf(squares / (float)d + eps);
            for (int64_t k = 0; k < d; k++) y[k] = row[k] * scale * wr[k];
            for (int64_t k = 0; k < half; k++) o[k] = y[k] * c[k] + y[k + half] * s[k];
            for (int64_t k = half; k < d; k++) o[k] = y[k] * c[k] + y[k - half] * s[k];
        }
    }
    return 0;
}

/* out [n, f] (contiguous) = silu(gate) * up, where gate is x's first f columns and up its
 * last f (x [n, 2f], row stride xs0): silu(g) = g / (1 + e^-g), computed from e^-|g| so
 * that the exponential never overflows. */
void epd_silu_mul(const float *x, int64_t n, int64_t f, int64_t xs0, float *out) {
    for (int64_t i = 0; i < n; i++) {
        const float *g = x + i * xs0, *u = g + f;
        float *o = out + i * f;
        for (int64_t k = 0; k < f; k++) {
            const float e = exp_nonpositive(g[k] > 0.0f ? -g[k] : g[k]); /* e^-|g| */
            const float sig = g[k] > 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
            o[k] = g[k] * sig * u[k];
        }
    }
}
