// What the CPU kernels share: the native float vector of the instruction set they are built for
// (`build.py` compiles this library once per ISA: -march=x86-64-v4, x86-64-v3 or the compiler's
// default), its exp and lane sums, and the static split of rows over threads.
//
// VL floats per vector: 16 (AVX-512, 32 registers), 8 (AVX2, 16 registers) or 4 (anything else:
// SSE2 / NEON). Each kernel sizes its register blocks from VL (and the register count that comes
// with it), so a block never spills. Written with the vector extensions GCC and clang share
// (vector_size, element access, __builtin_convertvector, lane-wise ?:); lane shuffles go through
// SHUFFLE, which is __builtin_shufflevector (clang, GCC >= 12) or GCC's older __builtin_shuffle.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#if defined(__AVX512F__)
#define DSV4_VL 16
#elif defined(__AVX2__) && defined(__FMA__)
#define DSV4_VL 8
#else
#define DSV4_VL 4
#endif
constexpr int VL = DSV4_VL;

typedef float vf __attribute__((vector_size(4 * DSV4_VL)));
typedef int32_t vi __attribute__((vector_size(4 * DSV4_VL)));
typedef float vf_unaligned __attribute__((vector_size(4 * DSV4_VL), aligned(4), may_alias));  // any float pointer

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif

static inline vf splat(float x) { return x - vf{}; }  // x - 0 is x (x + 0 would turn -0 into +0): a broadcast
static inline vf load(const float *p) { return *(const vf_unaligned *)p; }
static inline void store(float *p, vf v) { *(vf_unaligned *)p = v; }
static inline vf vmax(vf a, vf b) { return a > b ? a : b; }  // NaN in a: b

// the sum of a vector's lanes: halves added until one is left (a fixed tree: every call rounds alike)
static inline float hsum(vf v) {
    float a[VL];
    store(a, v);
    for (int w = VL / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) a[i] += a[i + w];
    return a[0];
}

static inline float hmax(vf v) {  // -inf for no lane above it; NaN lanes skipped
    float m = -INFINITY;
    for (int l = 0; l < VL; l++) m = v[l] > m ? v[l] : m;
    return m;
}

// e^f * 2^n for |f| <= ln2 / 2 and integral n in [-126, 127]: e^f by its degree-7 Taylor
// polynomial (relative error below 1e-8), 2^n added to the exponent bits
static inline vf exp_scaled(vf f, vf n) {
    vf p = splat(1.0f / 5040);
    p = p * f + 1.0f / 720; p = p * f + 1.0f / 120; p = p * f + 1.0f / 24;
    p = p * f + 1.0f / 6; p = p * f + 0.5f; p = p * f + 1.0f; p = p * f + 1.0f;
    return (vf)((vi)p + (__builtin_convertvector(n, vi) << 23));
}

static inline vf round_nearest(vf x) {  // |x| < 2^22: adding 1.5 * 2^23 drops the fraction, rounding
    return (x + 12582912.0f) - 12582912.0f;
}

// e^x for softmax inputs x <= 0 (-inf -> 0, below -87 -> 0): x = n ln2 + f (Cody-Waite: ln2 in two parts)
static inline vf vexp(vf x) {
    vi under = x < -87.0f;
    x = under ? splat(-87.0f) : x;
    vf n = round_nearest(x * 1.44269504088896341f);
    vf r = exp_scaled(x - n * 0.693359375f + n * 2.12194440e-4f, n);
    return under ? splat(0.0f) : r;
}

// 2^z for any z: z < -126 -> 0, z > 127 -> inf; z = n + f, 2^f = e^(f ln2)
static inline vf vexp2(vf z) {
    vi under = z < -126.0f, over = z > 127.0f;
    z = under ? splat(-126.0f) : (over ? splat(127.0f) : z);
    vf n = round_nearest(z);
    vf r = exp_scaled((z - n) * 0.693147180559945f, n);
    r = under ? splat(0.0f) : r;
    return over ? splat(INFINITY) : r;
}

// work(a, b) on `threads` static ranges [a, b) of [0, n), the first on this thread; a thread
// that cannot be started has its range done here. A row's result never depends on its range.
template <class F>
static void run_split(int64_t n, int threads, F work) {
    if (threads < 1) threads = 1;
    auto range = [&](int t) { work(n * t / threads, n * (t + 1) / threads); };
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; t++) {
        try {
            pool.emplace_back(range, t);
        } catch (...) {
            range(t);
        }
    }
    range(0);
    for (auto &th : pool) th.join();
}
