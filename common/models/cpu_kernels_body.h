/* The kernels for one element type T (see cpu_kernels.c, which includes this once per type
 * with T, SUFFIX, LOAD, STORE and ROUND defined). All arithmetic is float32. */

/* One key head's group of G query rows (qf [G, D], float32, already scaled) over its first
 * n positions: scores, softmax and the weighted sum of values into acc [G, D]; p holds G * n
 * floats. Inlined with G a constant at each call, so the loops over g unroll. */
static inline __attribute__((always_inline)) void NAME(group)(
    const float *qf, const T *k, int64_t k_st, const T *v, int64_t v_st, int n, int D,
    const int G, float *p, float *acc) {
    for (int t = 0; t < n; t++) {
        const T *kt = k + t * k_st;
        for (int g = 0; g < G; g++) {
            const float *qg = qf + g * D;
            float s = 0.0f;
            for (int d = 0; d < D; d++) s += qg[d] * LOAD(kt[d]);
            p[g * n + t] = s;
        }
    }
    for (int g = 0; g < G; g++) {
        float *pg = p + g * n, m = pg[0], sum = 0.0f;
        for (int t = 1; t < n; t++) m = pg[t] > m ? pg[t] : m;
        for (int t = 0; t < n; t++) {
            pg[t] = exp_nonpositive(pg[t] - m);
            sum += pg[t];
        }
        const float inv = 1.0f / sum;
        for (int t = 0; t < n; t++) pg[t] *= inv;
        for (int d = 0; d < D; d++) acc[g * D + d] = 0.0f;
    }
    for (int t = 0; t < n; t++) {
        const T *vt = v + t * v_st;
        for (int d = 0; d < D; d++) {
            const float vd = LOAD(vt[d]);
            for (int g = 0; g < G; g++) acc[g * D + d] += p[g * n + t] * vd;
        }
    }
}

/* out [B, H * D] (contiguous) = attention of q [B, H, D] over k, v [B, KV, T, D] (any
 * strides, last dimension contiguous) at positions below lens[b] (all T when lens is NULL).
 * Returns 0; -1 when the work buffer could not be allocated, -2 when H is not a multiple of
 * KV by at most 16. The caller checks the rest: 1 <= lens[b] <= T, the strides. */
int NAME(epd_decode_attention)(const T *q, int64_t q_sb, int64_t q_sh, const T *k, int64_t k_sb,
                               int64_t k_sh, int64_t k_st, const T *v, int64_t v_sb,
                               int64_t v_sh, int64_t v_st, const int64_t *lens, int B, int H,
                               int KV, int T_, int D, float scale, T *out) {
    if (KV <= 0 || H % KV != 0 || H / KV > 16) return -2;
    const int G = H / KV;
    float *p = malloc(sizeof(float) * ((size_t)G * (size_t)T_ + 2 * (size_t)G * (size_t)D));
    if (p == NULL) return -1;
    float *qf = p + (size_t)G * (size_t)T_, *acc = qf + (size_t)G * (size_t)D;
    for (int b = 0; b < B; b++) {
        const int n = lens ? (int)lens[b] : T_;
        for (int h = 0; h < KV; h++) {
            const T *qg = q + b * q_sb + (int64_t)h * G * q_sh;
            for (int g = 0; g < G; g++)
                for (int d = 0; d < D; d++) qf[g * D + d] = LOAD(qg[g * q_sh + d]) * scale;
            const T *kb = k + b * k_sb + h * k_sh, *vb = v + b * v_sb + h * v_sh;
            switch (G) {
            case 1: NAME(group)(qf, kb, k_st, vb, v_st, n, D, 1, p, acc); break;
            case 2: NAME(group)(qf, kb, k_st, vb, v_st, n, D, 2, p, acc); break;
            case 4: NAME(group)(qf, kb, k_st, vb, v_st, n, D, 4, p, acc); break;
            case 8: NAME(group)(qf, kb, k_st, vb, v_st, n, D, 8, p, acc); break;
            default: NAME(group)(qf, kb, k_st, vb, v_st, n, D, G, p, acc);
            }
            T *o = out + ((int64_t)b * H + (int64_t)h * G) * D;
            for (int i = 0; i < G * D; i++) o[i] = STORE(acc[i]);
        }
    }
    free(p);
    return 0;
}

/* RMSNorm's factor for one row: 1 / sqrt(mean(row^2) + eps), in float32. */
static inline float NAME(norm_scale)(const T *row, int64_t d, float eps) {
    float squares = 0.0f;
    for (int64_t k = 0; k < d; k++) squares += LOAD(row[k]) * LOAD(row[k]);
    return 1.0f / sqrtf(squares / (float)d + eps);
}

/* out [n, m, d] (contiguous) = RMSNorm of x [n, m, d] (strides xs0, xs1, 1) over d, scaled by
 * w [m, d] (row stride ws0; 0: one [d] row for all): the row normalized in float32 and cast
 * to T, then times the weight (as torch's ops round in T). */
void NAME(epd_rms_norm)(const T *x, int64_t n, int64_t m, int64_t d, int64_t xs0, int64_t xs1,
                        const T *w, int64_t ws0, float eps, T *out) {
    for (int64_t i = 0; i < n; i++) {
        for (int64_t j = 0; j < m; j++) {
            const T *row = x + i * xs0 + j * xs1, *wr = w + j * ws0;
            const float scale = NAME(norm_scale)(row, d, eps);
            T *o = out + (i * m + j) * d;
            for (int64_t k = 0; k < d; k++)
                o[k] = STORE(ROUND(LOAD(row[k]) * scale) * LOAD(wr[k]));
        }
    }
}

/* RMSNorm (as above) then rotate-half RoPE, in one pass per row: with y the normed row,
 * out[k] = y[k] * cos[k] + y[(k + d/2) % d] * ssin[k], where ssin is the sine with its first
 * half negated (text_ops.signed_sin). cos and ssin are [n, d] tables, row stride cs0 (the
 * same for both), one row per token for all of its m heads. d is even and at most 1024;
 * returns -2 if not. */
int NAME(epd_rms_norm_rotate)(const T *x, int64_t n, int64_t m, int64_t d, int64_t xs0,
                              int64_t xs1, const T *w, int64_t ws0, float eps, const T *cos,
                              const T *ssin, int64_t cs0, T *out) {
    if (d % 2 != 0 || d > 1024) return -2;
    const int64_t half = d / 2;
    float y[1024];
    for (int64_t i = 0; i < n; i++) {
        const T *c = cos + i * cs0, *s = ssin + i * cs0;
        for (int64_t j = 0; j < m; j++) {
            const T *row = x + i * xs0 + j * xs1, *wr = w + j * ws0;
            const float scale = NAME(norm_scale)(row, d, eps);
            for (int64_t k = 0; k < d; k++) y[k] = ROUND(ROUND(LOAD(row[k]) * scale) * LOAD(wr[k]));
            T *o = out + (i * m + j) * d;
            for (int64_t k = 0; k < d; k++) {
                const float turned = y[k < half ? k + half : k - half];
                o[k] = STORE(ROUND(y[k] * LOAD(c[k])) + ROUND(turned * LOAD(s[k])));
            }
        }
    }
    return 0;
}

/* out [n, f] (contiguous) = silu(gate) * up, where gate is x's first f columns and up its
 * last f (x [n, 2f], row stride xs0). */
void NAME(epd_silu_mul)(const T *x, int64_t n, int64_t f, int64_t xs0, T *out) {
    for (int64_t i = 0; i < n; i++) {
        const T *g = x + i * xs0, *u = g + f;
        T *o = out + i * f;
        for (int64_t k = 0; k < f; k++) o[k] = STORE(ROUND(silu(LOAD(g[k]))) * LOAD(u[k]));
    }
}
