// Token-wise fp32 passes of the DSv4 block for the CPU, each one pass over its tensors where the
// torch path takes several (strided pairs, broadcasts, one op per stream). Definitions: the torch
// paths in dsv4batch/model/layers.py (`Rope.apply`, `hc_collapse`, `hc_post`); these equal them
// up to fp32 rounding, and every element's arithmetic is fixed whatever the number of rows or
// threads (batch-invariant). Threads split the rows (static ranges). All tensors contiguous fp32.
#include "common.h"

// Interleaved RoPE in place on x [n, m, d]'s last rd dims: pair (a, b) at (2i, 2i + 1) becomes
// (a c - b s, b c + a s) with c = cos[t, 2i], s = sin[t, 2i] (cos, sin [n, rd], repeat-interleaved).
extern "C" int rope_inplace(float *x, const float *cos, const float *sin, int64_t n, int64_t m, int64_t d,
                            int64_t rd, int threads) {
    run_split(n, threads, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; t++) {
            const float *c = cos + t * rd, *s = sin + t * rd;
            for (int64_t h = 0; h < m; h++) {
                float *p = x + (t * m + h) * d + (d - rd);
                for (int64_t i = 0; i < rd; i += 2) {
                    const float a = p[i], b = p[i + 1];
                    p[i] = a * c[i] - b * s[i];
                    p[i + 1] = b * c[i] + a * s[i];
                }
            }
        }
    });
    return 0;
}

// out [n, H] = sum_i w[t, i] * x[t, i, :] over the hc streams, i in order (x [n, hc, H], w [n, hc]).
extern "C" int hc_collapse_fwd(const float *x, const float *w, float *out, int64_t n, int64_t hc, int64_t H,
                               int threads) {
    run_split(n, threads, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; t++) {
            float *o = out + t * H;
            const float *xt = x + t * hc * H;
            for (int64_t k = 0; k < H; k++) o[k] = w[t * hc] * xt[k];
            for (int64_t i = 1; i < hc; i++)
                for (int64_t k = 0; k < H; k++) o[k] += w[t * hc + i] * xt[i * H + k];
        }
    });
    return 0;
}

// new [n, hc, H]: stream j = post[t, j] * out[t] + sum_i comb[i, j, t] * x[t, i], i in order
// (x [n, hc, H], out [n, H], post [n, hc], comb [hc, hc, n]).
extern "C" int hc_post_fwd(const float *x, const float *out, const float *post, const float *comb, float *y,
                           int64_t n, int64_t hc, int64_t H, int threads) {
    run_split(n, threads, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; t++) {
            const float *xt = x + t * hc * H, *ot = out + t * H;
            for (int64_t j = 0; j < hc; j++) {
                float *yj = y + (t * hc + j) * H;
                const float pj = post[t * hc + j];
                for (int64_t k = 0; k < H; k++) yj[k] = pj * ot[k];
                for (int64_t i = 0; i < hc; i++) {
                    const float cij = comb[(i * hc + j) * n + t];
                    for (int64_t k = 0; k < H; k++) yj[k] += cij * xt[i * H + k];
                }
            }
        }
    });
    return 0;
}

// mHC weights from the mixes (`model.layers.hc_pre` after its GEMM), per token t, hc <= 8:
// mixes [n, (2 + hc) * hc] (pre | post | comb logits), scale [3], base [(2 + hc) * hc]; out:
// post [n, hc] = 2 sigmoid(post), comb [hc, hc, n] Sinkhorn-normalised (softmax over j, + eps,
// then `iters` column / row normalisations: additions and divisions in `sinkhorn_`'s order, so
// the same bits as its paths from the same input), collapsed [n, H] = sum_i (sigmoid(pre_i) +
// eps) x[t, i] (x [n, hc, H]). 16 tokens at a time, one per vector lane (the ~700 divisions of
// a token's Sinkhorn run 16-wide); a lane's arithmetic never looks at another lane.
extern "C" int hc_pre_fwd(const float *mixes, const float *x, const float *scale, const float *base, int64_t n,
                          int64_t hc, int64_t H, int64_t iters, float eps, float *post, float *comb, float *collapsed,
                          int threads) {
    if (hc > 8) return 1;
    const int64_t m = (2 + hc) * hc;
    const int64_t blocks = (n + 15) / 16;
    run_split(blocks, threads, [&](int64_t b0, int64_t b1) {
        float lanes[80][16], pre[8][16];
        v16 c[8][8];
        const v16 ve = splat(eps);
        for (int64_t b = b0; b < b1; b++) {
            const int64_t t0 = 16 * b, L = std::min<int64_t>(16, n - t0);
            for (int64_t k = 0; k < m; k++)
                for (int64_t l = 0; l < 16; l++) lanes[k][l] = l < L ? mixes[(t0 + l) * m + k] : 0.0f;
            for (int64_t i = 0; i < hc; i++)
                for (int64_t l = 0; l < L; l++) {
                    pre[i][l] = 1.0f / (1.0f + std::exp(-(lanes[i][l] * scale[0] + base[i]))) + eps;
                    const float z = lanes[hc + i][l] * scale[1] + base[hc + i];
                    post[(t0 + l) * hc + i] = 2.0f * (1.0f / (1.0f + std::exp(-z)));
                }
            for (int64_t i = 0; i < hc; i++) {
                v16 peak;
                for (int64_t j = 0; j < hc; j++) {
                    const int64_t k = 2 * hc + i * hc + j;
                    std::memcpy(&c[i][j], lanes[k], 64);
                    c[i][j] = c[i][j] * splat(scale[2]) + splat(base[k]);
                    peak = j ? (c[i][j] > peak ? c[i][j] : peak) : c[i][j];
                }
                for (int64_t j = 0; j < hc; j++) c[i][j] = vexp(c[i][j] - peak);
            }
            auto rows = [&](bool with_eps) {  // each row i over j, left to right
                for (int64_t i = 0; i < hc; i++) {
                    v16 r = c[i][0];
                    for (int64_t j = 1; j < hc; j++) r += c[i][j];
                    if (with_eps) r += ve;
                    for (int64_t j = 0; j < hc; j++) c[i][j] /= r;
                }
            };
            rows(false);
            for (int64_t i = 0; i < hc; i++)
                for (int64_t j = 0; j < hc; j++) c[i][j] += ve;
            for (int64_t it = 0; it < iters; it++) {
                if (it) rows(true);
                for (int64_t j = 0; j < hc; j++) {  // each column j over i, top to bottom
                    v16 col = c[0][j];
                    for (int64_t i = 1; i < hc; i++) col += c[i][j];
                    col += ve;
                    for (int64_t i = 0; i < hc; i++) c[i][j] /= col;
                }
            }
            for (int64_t i = 0; i < hc; i++)
                for (int64_t j = 0; j < hc; j++) std::memcpy(comb + (i * hc + j) * n + t0, &c[i][j], 4 * L);
            for (int64_t l = 0; l < L; l++) {
                float *o = collapsed + (t0 + l) * H;
                const float *xt = x + (t0 + l) * hc * H;
                for (int64_t k = 0; k < H; k++) o[k] = pre[0][l] * xt[k];
                for (int64_t i = 1; i < hc; i++)
                    for (int64_t k = 0; k < H; k++) o[k] += pre[i][l] * xt[i * H + k];
            }
        }
    });
    return 0;
}

// RMSNorm: y[t] = x[t] * (1 / sqrt(mean(x[t]^2) + eps)) * w, x, y [n, d], w [d]. The sum of
// squares runs in 16 lanes over d then a fixed tree (`hsum`): a row's bits are its own.
extern "C" int rms_norm_fwd(const float *x, const float *w, float *y, int64_t n, int64_t d, float eps, int threads) {
    run_split(n, threads, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; t++) {
            const float *xt = x + t * d;
            v16 acc = splat(0.0f);
            int64_t k = 0;
            for (; k + 16 <= d; k += 16) {
                v16 v = *(const v16 *)(xt + k);
                acc += v * v;
            }
            float ss = hsum(acc);
            for (; k < d; k++) ss += xt[k] * xt[k];
            const float r = 1.0f / std::sqrt(ss / (float)d + eps);
            float *yt = y + t * d;
            for (k = 0; k < d; k++) yt[k] = xt[k] * r * w[k];
        }
    });
    return 0;
}

// SwiGLU: y = silu(min(gate, limit)) * clamp(up, -limit, limit), silu(g) = g / (1 + e^-g)
// computed from z = e^-|g| (g z / (1 + z) below 0), 16 at a time; gate, up, y [n] (elementwise).
static inline v16 swiglu16(v16 g, v16 u, float limit) {
    const v16 lim = splat(limit), nlim = splat(-limit);
    g = g > lim ? lim : g;  // NaN stays (the compare is false)
    u = u > lim ? lim : u;
    u = u < nlim ? nlim : u;
    const v16 z = vexp(g < splat(0.0f) ? g : -g);
    const v16 s = (g < splat(0.0f) ? g * z : g) / (splat(1.0f) + z);
    return s * u;
}

extern "C" int swiglu_fwd(const float *gate, const float *up, float *y, int64_t n, float limit, int threads) {
    const int64_t blocks = (n + 4095) / 4096;
    run_split(blocks, threads, [&](int64_t b0, int64_t b1) {
        const int64_t end = std::min(n, b1 * 4096);
        int64_t k = b0 * 4096;
        for (; k + 16 <= end; k += 16) {
            v16 g, u;
            std::memcpy(&g, gate + k, 64), std::memcpy(&u, up + k, 64);
            v16 r = swiglu16(g, u, limit);
            std::memcpy(y + k, &r, 64);
        }
        if (k < end) {  // the tail through a padded vector: the same arithmetic per element
            float g[16] = {0}, u[16] = {0};
            std::memcpy(g, gate + k, 4 * (end - k)), std::memcpy(u, up + k, 4 * (end - k));
            v16 gv, uv;
            std::memcpy(&gv, g, 64), std::memcpy(&uv, u, 64);
            v16 r = swiglu16(gv, uv, limit);
            std::memcpy(y + k, &r, 4 * (end - k));
        }
    });
    return 0;
}
