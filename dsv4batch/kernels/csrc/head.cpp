// Fused vocabulary head for the CPU: per row, the GEMM's logits never leave the registers.
//
// x [n, K] fp32: the rows, already scaled by log2(e), so that z = x . w is a base-2 logit
// (2^z = e^logit); panels [P, K, 64] fp32: the head weight [V, K] in 64-column panels
// (`cpu.pack_head`: panel p holds ids [64p, 64p + 64), columns past V zero and ignored);
// targets int64 [n]. Per row: sums[r] = sum_v 2^z_v (fp32; overflows to inf above z = 127 and
// loses its small terms below z = -126: the caller redoes such rows exactly), peaks[r] = max_v
// z_v, picked[r] = z at targets[r] (left as it was when the target is not in [0, V)).
//
// A 6-row x 64-column block of z accumulates in 24 vector registers over K (the panel, 64 KB
// at K = 256, is reused by every row block from L1/L2); then 2^z (a degree-7 polynomial on
// 16 lanes) is added to the row's lane-wise running sum and max, panel after panel in id
// order. A row's arithmetic depends on its own x alone, never on how many rows share the call
// or which block it lands in (the 1-row block adds in the same order): batch-invariant.
// Threads split the rows (static ranges).
#include "common.h"

namespace {

constexpr int NV = 4, PW = 16 * NV, RB = 6;  // vectors and columns per panel, rows per block

struct Row {
    v16 sum, peak;
};

// rows [0, R) of x (stride K) against panel p; folds their 2^z into acc[r], their max into it too
template <int R>
void block(const float *x, const float *panels, int64_t K, int64_t V, int64_t p, const int64_t *targets,
           Row *acc, float *picked) {
    v16 z[R][NV];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++) z[r][v] = splat(0.0f);
    const float *w = panels + p * K * PW;
    for (int64_t k = 0; k < K; k++) {
        v16 wv[NV];
        for (int v = 0; v < NV; v++) std::memcpy(&wv[v], w + k * PW + 16 * v, 64);
        for (int r = 0; r < R; r++) {
            v16 xb = splat(x[r * K + k]);
            for (int v = 0; v < NV; v++) z[r][v] += xb * wv[v];
        }
    }
    const int64_t c0 = p * PW;
    for (int r = 0; r < R; r++) {
        int64_t t = targets[r] - c0;
        if (t >= 0 && t < PW && targets[r] < V) picked[r] = z[r][t / 16][t % 16];
        for (int v = 0; v < NV; v++) {
            v16 zz = z[r][v];
            if (c0 + 16 * v + 16 > V)  // the last panel's columns past V: no term, no max
                for (int l = 0; l < 16; l++)
                    if (c0 + 16 * v + l >= V) zz[l] = -INFINITY;
            acc[r].sum += vexp2(zz);
            acc[r].peak = acc[r].peak > zz ? acc[r].peak : zz;
        }
    }
}

}  // namespace

extern "C" int head_stats(const float *x, const float *panels, int64_t n, int64_t K, int64_t V,
                          const int64_t *targets, float *sums, float *peaks, float *picked, int threads) {
    const int64_t P = (V + PW - 1) / PW;
    run_split(n, threads, [&](int64_t r0, int64_t r1) {
        std::vector<Row> acc(r1 - r0 > 0 ? r1 - r0 : 1, Row{splat(0.0f), splat(-INFINITY)});
        for (int64_t p = 0; p < P; p++) {  // a panel stays in cache for all of this range's rows
            int64_t r = r0;
            for (; r + RB <= r1; r += RB) block<RB>(x + r * K, panels, K, V, p, targets + r, &acc[r - r0], picked + r);
            for (; r < r1; r++) block<1>(x + r * K, panels, K, V, p, targets + r, &acc[r - r0], picked + r);
        }
        for (int64_t r = r0; r < r1; r++) {
            float m = -INFINITY;
            for (int l = 0; l < 16; l++) m = acc[r - r0].peak[l] > m ? acc[r - r0].peak[l] : m;
            sums[r] = hsum(acc[r - r0].sum);
            peaks[r] = m;
        }
    });
    return 0;
}
