// What the CPU kernels share: 16-float vectors (GCC/Clang vector extensions: AVX-512 registers
// with -march=native on a CPU that has them, two or four narrower ones elsewhere), their exp
// and sums, and the static split of rows over threads.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

typedef float v16 __attribute__((vector_size(64), aligned(4)));  // aligned(4): any float pointer loads
typedef int v16i __attribute__((vector_size(64)));

static inline v16 splat(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

// the sum of a vector's 16 lanes (a fixed tree: every call rounds alike)
static inline float hsum(v16 v) {
    v16 t = v + __builtin_shuffle(v, (v16i){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    t = t + __builtin_shuffle(t, (v16i){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    t = t + __builtin_shuffle(t, (v16i){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    return t[0] + t[1];
}

// e^f * 2^n for |f| <= ln2 / 2 and integral n in [-126, 127]: e^f by its degree-7 Taylor
// polynomial (relative error below 1e-8), 2^n added to the exponent bits
static inline v16 exp_scaled(v16 f, v16 n) {
    v16 p = splat(1.0f / 5040);
    p = p * f + splat(1.0f / 720); p = p * f + splat(1.0f / 120); p = p * f + splat(1.0f / 24);
    p = p * f + splat(1.0f / 6); p = p * f + splat(0.5f); p = p * f + splat(1.0f); p = p * f + splat(1.0f);
    return (v16)((v16i)p + (__builtin_convertvector(n, v16i) << 23));
}

static inline v16 round_nearest(v16 x) {  // |x| < 2^22: adding 1.5 * 2^23 drops the fraction, rounding
    return (x + splat(12582912.0f)) - splat(12582912.0f);
}

// e^x for softmax inputs x <= 0 (-inf -> 0, below -87 -> 0): x = n ln2 + f (Cody-Waite: ln2 in two parts)
static inline v16 vexp(v16 x) {
    v16i under = x < splat(-87.0f);
    x = under ? splat(-87.0f) : x;
    v16 n = round_nearest(x * splat(1.44269504088896341f));
    v16 r = exp_scaled(x - n * splat(0.693359375f) + n * splat(2.12194440e-4f), n);
    return under ? splat(0.0f) : r;
}

// 2^z for any z: z < -126 -> 0, z > 127 -> inf; z = n + f, 2^f = e^(f ln2)
static inline v16 vexp2(v16 z) {
    v16i under = z < splat(-126.0f), over = z > splat(127.0f);
    z = under ? splat(-126.0f) : (over ? splat(127.0f) : z);
    v16 n = round_nearest(z);
    v16 r = exp_scaled((z - n) * splat(0.693147180559945f), n);
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
