// Token-wise fp32 passes of the DSv4 block for the CPU, each one pass over its tensors where the
// torch path takes several (strided pairs, broadcasts, one op per stream). Definitions: the torch
// paths in dsv4batch/model/layers.py (`Rope.apply`, `hc_collapse`, `hc_post`); these equal them
// up to fp32 rounding, and every element's arithmetic is fixed whatever the number of rows or
// threads (batch-invariant). Threads split the rows (static ranges). All tensors contiguous fp32.
#include "kernels.h"

namespace DSV4_NS {

// Interleaved RoPE in place on x [n, m, d]'s last rd dims: pair (a, b) at (2i, 2i + 1) becomes
// (a c - b s, b c + a s) with c = cos[t, 2i], s = sin[t, 2i] (cos, sin [n, rd], repeat-interleaved).
int rope_inplace(float *x, const float *cos, const float *sin, int64_t n, int64_t m, int64_t d,
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
int hc_collapse_fwd(const float *x, const float *w, float *out, int64_t n, int64_t hc, int64_t H,
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
int hc_post_fwd(const float *x, const float *out, const float *post, const float *comb, float *y,
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
// eps) x[t, i] (x [n, hc, H]). VL tokens at a time, one per vector lane (the ~700 divisions of
// a token's Sinkhorn run VL-wide); a lane's arithmetic never looks at another lane.
int hc_pre_fwd(const float *mixes, const float *x, const float *scale, const float *base, int64_t n,
                          int64_t hc, int64_t H, int64_t iters, float eps, float *post, float *comb, float *collapsed,
                          int threads) {
    if (hc > 8) return 1;
    const int64_t m = (2 + hc) * hc;
    const int64_t blocks = (n + VL - 1) / VL;
    run_split(blocks, threads, [&](int64_t b0, int64_t b1) {
        float lanes[80][VL], pre[8][VL];
        vf c[8][8];
        const vf ve = splat(eps);
        for (int64_t b = b0; b < b1; b++) {
            const int64_t t0 = VL * b, L = std::min<int64_t>(VL, n - t0);
            for (int64_t k = 0; k < m; k++)
                for (int64_t l = 0; l < VL; l++) lanes[k][l] = l < L ? mixes[(t0 + l) * m + k] : 0.0f;
            for (int64_t i = 0; i < hc; i++)
                for (int64_t l = 0; l < L; l++) {
                    pre[i][l] = 1.0f / (1.0f + std::exp(-(lanes[i][l] * scale[0] + base[i]))) + eps;
                    const float z = lanes[hc + i][l] * scale[1] + base[hc + i];
                    post[(t0 + l) * hc + i] = 2.0f * (1.0f / (1.0f + std::exp(-z)));
                }
            for (int64_t i = 0; i < hc; i++) {
                vf peak;
                for (int64_t j = 0; j < hc; j++) {
                    const int64_t k = 2 * hc + i * hc + j;
                    c[i][j] = load(lanes[k]) * scale[2] + base[k];
                    peak = j ? (c[i][j] > peak ? c[i][j] : peak) : c[i][j];
                }
                for (int64_t j = 0; j < hc; j++) c[i][j] = vexp(c[i][j] - peak);
            }
            auto rows = [&](bool with_eps) {  // each row i over j, left to right
                for (int64_t i = 0; i < hc; i++) {
                    vf r = c[i][0];
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
                    vf col = c[0][j];
                    for (int64_t i = 1; i < hc; i++) col += c[i][j];
                    col += ve;
                    for (int64_t i = 0; i < hc; i++) c[i][j] /= col;
                }
            }
            for (int64_t i = 0; i < hc; i++)
                for (int64_t j = 0; j < hc; j++) std::memcpy(comb + (i * hc + j) * n + t0, &c[i][j], sizeof(float) * L);
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
// squares runs in VL lanes over d then a fixed tree (`hsum`): a row's bits are its own.
int rms_norm_fwd(const float *x, const float *w, float *y, int64_t n, int64_t d, float eps, int threads) {
    run_split(n, threads, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; t++) {
            const float *xt = x + t * d;
            vf acc = splat(0.0f);
            int64_t k = 0;
            for (; k + VL <= d; k += VL) {
                vf v = load(xt + k);
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
// computed from z = e^-|g| (g z / (1 + z) below 0), VL at a time; gate, up, y [n] (elementwise).
static inline vf swiglu_v(vf g, vf u, float limit) {
    const vf lim = splat(limit), nlim = splat(-limit);
    g = g > lim ? lim : g;  // NaN stays (the compare is false)
    u = u > lim ? lim : u;
    u = u < nlim ? nlim : u;
    const vf z = vexp(g < 0.0f ? g : -g);
    const vf s = (g < 0.0f ? g * z : g) / (1.0f + z);
    return s * u;
}

int swiglu_fwd(const float *gate, const float *up, float *y, int64_t n, float limit, int threads) {
    const int64_t blocks = (n + 4095) / 4096;
    run_split(blocks, threads, [&](int64_t b0, int64_t b1) {
        const int64_t end = std::min(n, b1 * 4096);
        int64_t k = b0 * 4096;
        for (; k + VL <= end; k += VL) store(y + k, swiglu_v(load(gate + k), load(up + k), limit));
        if (k < end) {  // the tail through a padded vector: the same arithmetic per element
            float g[VL] = {0}, u[VL] = {0};
            std::memcpy(g, gate + k, 4 * (end - k)), std::memcpy(u, up + k, 4 * (end - k));
            vf r = swiglu_v(load(g), load(u), limit);
            std::memcpy(y + k, &r, 4 * (end - k));
        }
    });
    return 0;
}

}  // namespace DSV4_NS
