// Fused sparse MLA prefill for the CPU: the `"cpu"` backend of dsv4batch.kernels.sparse_mla_prefill.
//
// Contract: the same as dsv4batch/kernels/__init__.py (FlashMLA's flash_mla_sparse_fwd); the
// definition is dsv4batch/kernels/ref.py (tested against it, as every backend), and this code equals it
// up to fp32 rounding. One query at a time over its own valid slots only: its K = V rows are read
// straight from kv (no gathered copy, no union of a block's slots, no padding), the logits of
// all its heads stay in a [h, slots] scratch (heads x slots register tiles, reduced together),
// the softmax runs on vectors, and out = weights @ V is accumulated in registers, a block of
// heads x columns at a time (block sizes per instruction set: QH, QS, PH, PC below). A query's
// arithmetic depends on its own q and slots alone (fixed order), so results are batch-invariant.
// Threads split the queries (static ranges); the caller passes how many.
//
// Tensors (all contiguous, fp32 unless said): q [s_q, h, d]; kv [s_kv, d] (K = kv, V = kv[:, :d_v]);
// idx int32 [s_q, topk]; len int32 [s_q] or NULL (slots j >= len[i] are invalid); sink [h] or
// NULL; out [s_q, h, d_v]; maxl, lse [s_q, h]. d and d_v are multiples of 16 (the caller checks):
// whole vectors of every ISA.
// A slot is invalid when idx < 0, idx >= s_kv or j >= len: its row is never read. A query with
// no valid slot gets out 0, maxl -inf, lse +inf. sink -inf is exactly no sink, +inf gives out 0.
#include "kernels.h"

namespace DSV4_NS {

struct Args {
    const float *q, *kv, *sink; const int32_t *idx, *len;
    float *out, *maxl, *lse;
    int64_t s_q, h, d, d_v, s_kv, topk; float scale;
};

// lane k of the result = the sum of a[k]'s VL lanes: halves of pairs added, level after level (a
// fixed tree: every call rounds alike). Each level takes the low and the high half of every block
// of two vectors' lanes (SHUFFLE indexes the pair's 2 VL lanes) and adds them.
static inline vf reduce_lanes(const vf *a) {
#if DSV4_VL == 16
    vf b[8], c[4], d[2];
    for (int m = 0; m < 8; m++)
        b[m] = SHUFFLE(a[2 * m], a[2 * m + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + SHUFFLE(a[2 * m], a[2 * m + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int m = 0; m < 4; m++)
        c[m] = SHUFFLE(b[2 * m], b[2 * m + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + SHUFFLE(b[2 * m], b[2 * m + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int m = 0; m < 2; m++)
        d[m] = SHUFFLE(c[2 * m], c[2 * m + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + SHUFFLE(c[2 * m], c[2 * m + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SHUFFLE(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + SHUFFLE(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#elif DSV4_VL == 8
    vf b[4], c[2];
    for (int m = 0; m < 4; m++)
        b[m] = SHUFFLE(a[2 * m], a[2 * m + 1], 0, 1, 2, 3, 8, 9, 10, 11)
             + SHUFFLE(a[2 * m], a[2 * m + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int m = 0; m < 2; m++)
        c[m] = SHUFFLE(b[2 * m], b[2 * m + 1], 0, 1, 4, 5, 8, 9, 12, 13)
             + SHUFFLE(b[2 * m], b[2 * m + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return SHUFFLE(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14) + SHUFFLE(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15);
#else
    vf b[2];
    for (int m = 0; m < 2; m++)
        b[m] = SHUFFLE(a[2 * m], a[2 * m + 1], 0, 1, 4, 5) + SHUFFLE(a[2 * m], a[2 * m + 1], 2, 3, 6, 7);
    return SHUFFLE(b[0], b[1], 0, 2, 4, 6) + SHUFFLE(b[0], b[1], 1, 3, 5, 7);
#endif
}

// Register blocks: QK tiles of QH heads x QS slots (QH * QS == VL accumulators, reduced together by
// reduce_lanes), PV blocks of PH heads x PC vectors of columns. AVX-512: 4 x 4 and 8 x 2 (16 of
// 32 registers); AVX2: 4 x 2 and 6 x 2 (8 and 12 of 16); 4 lanes: 2 x 2 and 6 x 2.
constexpr int QH = VL == 4 ? 2 : 4, QS = VL / QH, PH = VL == 16 ? 8 : 6, PC = 2;

// logits p[hh * c + j] for heads [h0, h0 + QH) and slots [j0, j0 + QS)
static void qk_tile(const Args &a, const float *q, const int64_t *rows, int64_t c, int64_t h0, int64_t j0, float *p) {
    const int64_t d = a.d;
    const float *k[QS];
    for (int y = 0; y < QS; y++) k[y] = a.kv + rows[j0 + y] * d;
    vf acc[VL];
    for (int z = 0; z < VL; z++) acc[z] = splat(0.0f);
    for (int64_t t = 0; t < d; t += VL) {
        vf kk[QS];
        for (int y = 0; y < QS; y++) kk[y] = load(k[y] + t);
        for (int x = 0; x < QH; x++) {
            vf qq = load(q + (h0 + x) * d + t);
            for (int y = 0; y < QS; y++) acc[x * QS + y] += qq * kk[y];
        }
    }
    vf r = reduce_lanes(acc) * a.scale;
    for (int x = 0; x < QH; x++)
        for (int y = 0; y < QS; y++) p[(h0 + x) * c + j0 + y] = r[x * QS + y];
}

// logits for heads [h0, h0 + HB), slots [j0, c), one at a time
template <int HB>
static void qk_rest(const Args &a, const float *q, const int64_t *rows, int64_t c, int64_t h0, int64_t j0, float *p) {
    const int64_t d = a.d;
    for (int64_t j = j0; j < c; j++) {
        const float *k0 = a.kv + rows[j] * d;
        vf acc0[HB];
        for (int x = 0; x < HB; x++) acc0[x] = splat(0.0f);
        for (int64_t t = 0; t < d; t += VL)
            for (int x = 0; x < HB; x++) acc0[x] += load(q + (h0 + x) * d + t) * load(k0 + t);
        for (int x = 0; x < HB; x++) p[(h0 + x) * c + j] = hsum(acc0[x]) * a.scale;
    }
}

static void qk_all(const Args &a, const float *q, const int64_t *rows, int64_t c, float *p) {
    const int64_t h = a.h;
    int64_t h0 = 0;
    for (; h0 + QH <= h; h0 += QH) {
        int64_t j = 0;
        for (; j + QS <= c; j += QS) qk_tile(a, q, rows, c, h0, j, p);
        qk_rest<QH>(a, q, rows, c, h0, j, p);
    }
    for (; h0 < h; h0++) qk_rest<1>(a, q, rows, c, h0, 0, p);
}

// out[hh, b:b + CV * VL] = sum_j p[hh, j] v_j[b:...] for heads [h0, h0 + HB)
template <int HB, int CV>
static void pv_cols(const Args &a, const float *p, const int64_t *rows, int64_t c, int64_t h0, int64_t b, float *out) {
    vf o[HB][CV];
    for (int x = 0; x < HB; x++)
        for (int u = 0; u < CV; u++) o[x][u] = splat(0.0f);
    for (int64_t j = 0; j < c; j++) {
        const float *v = a.kv + rows[j] * a.d + b;
        vf vv[CV];
        for (int u = 0; u < CV; u++) vv[u] = load(v + u * VL);
        for (int x = 0; x < HB; x++) {
            vf w = splat(p[(h0 + x) * c + j]);
            for (int u = 0; u < CV; u++) o[x][u] += w * vv[u];
        }
    }
    for (int x = 0; x < HB; x++)
        for (int u = 0; u < CV; u++) store(out + (h0 + x) * a.d_v + b + u * VL, o[x][u]);
}

// out[hh, :d_v] = sum_j p[hh, j] v_j for heads [h0, h0 + HB), PC vectors of columns at a time
template <int HB>
static void pv(const Args &a, const float *p, const int64_t *rows, int64_t c, int64_t h0, float *out) {
    int64_t b = 0;
    for (; b + PC * VL <= a.d_v; b += PC * VL) pv_cols<HB, PC>(a, p, rows, c, h0, b, out);
    for (; b < a.d_v; b += VL) pv_cols<HB, 1>(a, p, rows, c, h0, b, out);
}

// the max of row ph [c] and, with its padding to whole vectors at -inf, sum of exp(ph - max)
// (written back in place)
static float exp_row(float *ph, int64_t c, float *sum) {
    float tail[VL];  // the last partial vector, padded with -inf (weight 0)
    const int64_t cp = (c + VL - 1) / VL * VL;
    auto at = [&](int64_t j) {
        if (j + VL <= c) return load(ph + j);
        for (int t = 0; t < VL; t++) tail[t] = j + t < c ? ph[j + t] : -INFINITY;
        return load(tail);
    };
    vf vm = splat(-INFINITY);
    for (int64_t j = 0; j < cp; j += VL) vm = vmax(vm, at(j));
    const float m = hmax(vm);
    vf vs = splat(0.0f);
    for (int64_t j = 0; j < cp; j += VL) {
        vf v = vexp(at(j) - m);
        if (j + VL <= c) store(ph + j, v);
        else for (int t = 0; j + t < c; t++) ph[j + t] = v[t];
        vs += v;
    }
    *sum = hsum(vs);
    return m;
}

// In place on the logits p [h, c]: the weights exp(P - lse'), lse' = logaddexp(lse, sink) (the
// sink rescales, as in the reference); writes maxl and lse (natural log) for query i.
static void softmax(const Args &a, int64_t i, int64_t c, float *p) {
    for (int64_t x = 0; x < a.h; x++) {
        float *ph = p + x * c, s;
        const float m = exp_row(ph, c, &s);
        float l = m + std::log(s), lo = l;
        if (a.sink && a.sink[x] != -INFINITY) {  // logaddexp(l, sink) as max + log1p(exp(-|gap|))
            float sk = a.sink[x], gap = std::fabs(l - sk);
            if (gap != gap) gap = INFINITY;  // inf - inf: the sink's weight is 0
            lo = (l > sk ? l : sk) + std::log1p(std::exp(-gap));
        }
        float f = std::exp(m - lo);
        for (int64_t j = 0; j < c; j++) ph[j] *= f;
        a.maxl[i * a.h + x] = m;
        a.lse[i * a.h + x] = l;
    }
}

static void one_query(const Args &a, int64_t i, int64_t *rows, float *p) {
    const int64_t h = a.h, dv = a.d_v, topk = a.topk;
    int64_t lim = a.len ? a.len[i] : topk;
    if (lim > topk) lim = topk;
    int64_t c = 0;
    for (int64_t j = 0; j < lim; j++) {
        int64_t r = a.idx[i * topk + j];
        if (r >= 0 && r < a.s_kv) rows[c++] = r;
    }
    float *out = a.out + i * h * dv;
    if (c == 0) {
        std::memset(out, 0, sizeof(float) * h * dv);
        for (int64_t x = 0; x < h; x++) { a.maxl[i * h + x] = -INFINITY; a.lse[i * h + x] = INFINITY; }
        return;
    }
    const float *q = a.q + i * h * a.d;
    qk_all(a, q, rows, c, p);
    softmax(a, i, c, p);
    int64_t h0 = 0;
    for (; h0 + PH <= h; h0 += PH) pv<PH>(a, p, rows, c, h0, out);
    for (; h0 + 4 <= h; h0 += 4) pv<4>(a, p, rows, c, h0, out);
    for (; h0 + 2 <= h; h0 += 2) pv<2>(a, p, rows, c, h0, out);
    for (; h0 < h; h0++) pv<1>(a, p, rows, c, h0, out);
}

int sparse_mla_fwd(const float *q, const float *kv, const int32_t *idx, const int32_t *len, const float *sink,
                   float *out, float *maxl, float *lse, int64_t s_q, int64_t h, int64_t d, int64_t d_v, int64_t s_kv,
                   int64_t topk, float scale, int threads) {
    Args a{q, kv, sink, idx, len, out, maxl, lse, s_q, h, d, d_v, s_kv, topk, scale};
    run_split(s_q, threads, [&](int64_t i0, int64_t i1) {
        std::vector<int64_t> rows(topk > 0 ? topk : 1);
        std::vector<float> p((topk > 0 ? topk : 1) * h);
        for (int64_t i = i0; i < i1; i++) one_query(a, i, rows.data(), p.data());
    });
    return 0;
}

}  // namespace DSV4_NS
