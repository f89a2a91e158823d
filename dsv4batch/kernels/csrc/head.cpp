// Fused vocabulary head for the CPU: per row, the GEMM's logits never leave the registers.
//
// x [n, K] fp32: the rows, already scaled by log2(e), so that z = x . w is a base-2 logit
// (2^z = e^logit); panels [P, K, PW] fp32: the head weight [V, K] in PW-column panels
// (`cpu.pack_head`: panel p holds ids [PW p, PW p + PW), columns past V zero and ignored);
// targets int64 [n]. Per row: sums[r] = sum_v 2^z_v (fp32; overflows to inf above z = 127 and
// loses its small terms below z = -126: the caller redoes such rows exactly), peaks[r] = max_v
// z_v, picked[r] = z at targets[r] (left as it was when the target is not in [0, V)).
//
// An RB-row x PW-column block of z accumulates in RB * NV vector registers over K, then 2^z (a
// degree-7 polynomial) is added to the row's lane-wise running sum and max, panel after panel
// in id order. The block fills the ISA's registers without spilling: 6 x 64 = 24 of AVX-512's 32,
// 6 x 16 = 12 of AVX2's 16 (with 2 weight vectors and a broadcast). Rows go in chunks whose x
// stays in L2 while every panel passes (a panel is read once per chunk from memory).
// A row's arithmetic depends on its own x alone, never on how many rows share the call or which
// block or chunk it lands in (the 1-row block adds in the same order): batch-invariant.
// Threads split the rows (static ranges).
#include "kernels.h"

namespace DSV4_NS {
namespace {

constexpr int NV = VL == 16 ? 4 : 2, PW = NV * VL, RB = 6;  // vectors / columns per panel, rows per block
constexpr int64_t CHUNK_FLOATS = 48 * 1024;                // x floats per chunk (192 KB: in L2)

struct Row {
    vf sum, peak;
};

// folds a block's z [R][NV] (ids from c0) into its rows' running sums and maxima, and the
// targets' z into picked. Not inlined: its constants would otherwise take registers from the
// block's accumulators in `block` (AVX2 has none to spare).
template <int R>
__attribute__((noinline)) void fold(const vf (*z)[NV], int64_t c0, int64_t V, const int64_t *targets, Row *acc,
                                    float *picked) {
    for (int r = 0; r < R; r++) {
        const int64_t t = targets[r] - c0;
        for (int v = 0; v < NV; v++) {
            vf zz = z[r][v];
            if (t >= VL * v && t < VL * v + VL && targets[r] < V) picked[r] = zz[t - VL * v];
            if (c0 + VL * v + VL > V)  // the last panel's columns past V: no term, no max
                for (int l = 0; l < VL; l++)
                    if (c0 + VL * v + l >= V) zz[l] = -INFINITY;
            acc[r].sum += vexp2(zz);
            acc[r].peak = vmax(acc[r].peak, zz);
        }
    }
}

// rows [0, R) of x (stride K) against panel p: their z accumulate in registers over K, then `fold`
template <int R>
void block(const float *x, const float *panels, int64_t K, int64_t V, int64_t p, const int64_t *targets,
           Row *acc, float *picked) {
    vf z[R][NV];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++) z[r][v] = splat(0.0f);
    const float *w = panels + p * K * PW;
    for (int64_t k = 0; k < K; k++) {
        vf wv[NV];
        for (int v = 0; v < NV; v++) wv[v] = load(w + k * PW + VL * v);
        for (int r = 0; r < R; r++) {
            vf xb = splat(x[r * K + k]);
            for (int v = 0; v < NV; v++) z[r][v] += xb * wv[v];
        }
    }
    fold<R>(z, p * PW, V, targets, acc, picked);
}

// rows [r0, r1) against every panel, in id order
void rows(const float *x, const float *panels, int64_t K, int64_t V, const int64_t *targets, Row *acc,
          float *picked, int64_t r0, int64_t r1) {
    for (int64_t p = 0; p < (V + PW - 1) / PW; p++) {
        int64_t r = r0;
        for (; r + RB <= r1; r += RB) block<RB>(x + r * K, panels, K, V, p, targets + r, acc + r, picked + r);
        for (; r < r1; r++) block<1>(x + r * K, panels, K, V, p, targets + r, acc + r, picked + r);
    }
}

}  // namespace

int head_panel_width() { return PW; }

int head_stats(const float *x, const float *panels, int64_t n, int64_t K, int64_t V, const int64_t *targets,
               float *sums, float *peaks, float *picked, int threads) {
    const int64_t chunk = std::max<int64_t>(RB, CHUNK_FLOATS / std::max<int64_t>(K, 1) / RB * RB);
    run_split(n, threads, [&](int64_t r0, int64_t r1) {
        std::vector<Row> acc(r1 - r0 > 0 ? r1 - r0 : 1, Row{splat(0.0f), splat(-INFINITY)});
        for (int64_t c = r0; c < r1; c += chunk)
            rows(x + r0 * K, panels, K, V, targets + r0, acc.data(), picked + r0, c - r0, std::min(c + chunk, r1) - r0);
        for (int64_t r = r0; r < r1; r++) {
            sums[r] = hsum(acc[r - r0].sum);
            peaks[r] = hmax(acc[r - r0].peak);
        }
    });
    return 0;
}

}  // namespace DSV4_NS
