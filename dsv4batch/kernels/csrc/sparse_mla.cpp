// Fused sparse MLA prefill for the CPU: the `"cpu"` backend of dsv4batch.kernels.sparse_mla_prefill.
//
// Contract: the same as dsv4batch/kernels/__init__.py (FlashMLA's flash_mla_sparse_fwd); the
// definition is the fp32 torch reference, dsv4batch/kernels/reference.py, and this code equals it
// up to fp32 rounding. One query at a time over its own valid slots only: its K = V rows are read
// straight from kv (no gathered copy, no union of a block's slots, no padding), the logits of
// all its heads stay in a [h, slots] scratch (4 heads x 4 slots per register tile, reduced
// together), the softmax runs on 16-float vectors, and out = weights @ V is accumulated in
// registers, 8 heads x 32 columns at a time. A query's arithmetic
// depends on its own q and slots alone (fixed order), so results are batch-invariant.
// Threads split the queries (static ranges); the caller passes how many.
//
// Tensors (all contiguous, fp32 unless said): q [s_q, h, d]; kv [s_kv, d] (K = kv, V = kv[:, :d_v]);
// idx int32 [s_q, topk]; len int32 [s_q] or NULL (slots j >= len[i] are invalid); sink [h] or
// NULL; out [s_q, h, d_v]; maxl, lse [s_q, h]. d and d_v are multiples of 16 (the caller checks).
// A slot is invalid when idx < 0, idx >= s_kv or j >= len: its row is never read. A query with
// no valid slot gets out 0, maxl -inf, lse +inf. sink -inf is exactly no sink, +inf gives out 0.
#include "common.h"

struct Args {
    const float *q, *kv, *sink; const int32_t *idx, *len;
    float *out, *maxl, *lse;
    int64_t s_q, h, d, d_v, s_kv, topk; float scale;
};

// lane k of the result = the sum of a[k]'s 16 lanes (a fixed tree: every call rounds alike)
static inline v16 reduce16(const v16 *a) {
    static const v16i lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    static const v16i hi1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    static const v16i lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    static const v16i hi2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    static const v16i lo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    static const v16i hi3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    static const v16i lo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    static const v16i hi4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    v16 b[8], c[4], d[2];
    for (int m = 0; m < 8; m++) b[m] = __builtin_shuffle(a[2 * m], a[2 * m + 1], lo1) + __builtin_shuffle(a[2 * m], a[2 * m + 1], hi1);
    for (int m = 0; m < 4; m++) c[m] = __builtin_shuffle(b[2 * m], b[2 * m + 1], lo2) + __builtin_shuffle(b[2 * m], b[2 * m + 1], hi2);
    for (int m = 0; m < 2; m++) d[m] = __builtin_shuffle(c[2 * m], c[2 * m + 1], lo3) + __builtin_shuffle(c[2 * m], c[2 * m + 1], hi3);
    return __builtin_shuffle(d[0], d[1], lo4) + __builtin_shuffle(d[0], d[1], hi4);
}

// logits p[hh * c + j] for heads [h0, h0 + HB) and slots [j0, j0 + SB) (HB * SB == 16)
template <int HB, int SB>
static void qk_tile(const Args &a, const float *q, const int64_t *rows, int64_t c, int64_t h0, int64_t j0, float *p) {
    const int64_t d = a.d, nv = d / 16;
    const v16 *k[SB];
    for (int y = 0; y < SB; y++) k[y] = (const v16 *)(a.kv + rows[j0 + y] * d);
    v16 acc[16];
    for (int z = 0; z < 16; z++) acc[z] = (v16){0};
    for (int64_t t = 0; t < nv; t++) {
        v16 kk[SB];
        for (int y = 0; y < SB; y++) kk[y] = k[y][t];
        for (int x = 0; x < HB; x++) {
            v16 qq = ((const v16 *)(q + (h0 + x) * d))[t];
            for (int y = 0; y < SB; y++) acc[x * SB + y] += qq * kk[y];
        }
    }
    v16 r = reduce16(acc) * splat(a.scale);
    for (int x = 0; x < HB; x++)
        for (int y = 0; y < SB; y++) p[(h0 + x) * c + j0 + y] = r[x * SB + y];
}

// logits for heads [h0, h0 + HB), any slots, one at a time
template <int HB>
static void qk_rest(const Args &a, const float *q, const int64_t *rows, int64_t c, int64_t h0, int64_t j0, float *p) {
    const int64_t d = a.d, nv = d / 16;
    for (int64_t j = j0; j < c; j++) {
        const v16 *k0 = (const v16 *)(a.kv + rows[j] * d);
        v16 acc0[HB];
        for (int x = 0; x < HB; x++) acc0[x] = (v16){0};
        for (int64_t t = 0; t < nv; t++)
            for (int x = 0; x < HB; x++) acc0[x] += ((const v16 *)(q + (h0 + x) * d))[t] * k0[t];
        for (int x = 0; x < HB; x++) p[(h0 + x) * c + j] = hsum(acc0[x]) * a.scale;
    }
}

static void qk_all(const Args &a, const float *q, const int64_t *rows, int64_t c, float *p) {
    const int64_t h = a.h;
    int64_t h0 = 0;
    for (; h0 + 4 <= h; h0 += 4) {
        int64_t j = 0;
        for (; j + 4 <= c; j += 4) qk_tile<4, 4>(a, q, rows, c, h0, j, p);
        qk_rest<4>(a, q, rows, c, h0, j, p);
    }
    for (; h0 < h; h0++) qk_rest<1>(a, q, rows, c, h0, 0, p);
}

// out[hh, :d_v] = sum_j p[hh, j] v_j for heads [h0, h0 + HB), 32 columns at a time
template <int HB>
static void pv(const Args &a, const float *p, const int64_t *rows, int64_t c, int64_t h0, float *out) {
    const int64_t d = a.d, dv = a.d_v;
    int64_t b = 0;
    for (; b + 32 <= dv; b += 32) {
        v16 o0[HB], o1[HB];
        for (int x = 0; x < HB; x++) { o0[x] = (v16){0}; o1[x] = (v16){0}; }
        for (int64_t j = 0; j < c; j++) {
            const v16 *v = (const v16 *)(a.kv + rows[j] * d + b);
            v16 va = v[0], vb = v[1];
            for (int x = 0; x < HB; x++) {
                float w = p[(h0 + x) * c + j];
                o0[x] += w * va; o1[x] += w * vb;
            }
        }
        for (int x = 0; x < HB; x++) {
            v16 *o = (v16 *)(out + (h0 + x) * dv + b);
            o[0] = o0[x]; o[1] = o1[x];
        }
    }
    for (; b < dv; b += 16) {
        v16 o0[HB];
        for (int x = 0; x < HB; x++) o0[x] = (v16){0};
        for (int64_t j = 0; j < c; j++) {
            v16 va = *(const v16 *)(a.kv + rows[j] * d + b);
            for (int x = 0; x < HB; x++) o0[x] += p[(h0 + x) * c + j] * va;
        }
        for (int x = 0; x < HB; x++) *(v16 *)(out + (h0 + x) * dv + b) = o0[x];
    }
}

// In place on the logits p [h, c]: the weights exp(P - lse'), lse' = logaddexp(lse, sink) (the
// sink rescales, as in the reference); writes maxl and lse (natural log) for query i.
static void softmax(const Args &a, int64_t i, int64_t c, float *p) {
    const int64_t h = a.h, cp = (c + 15) / 16 * 16;
    float tail[16];  // the last partial vector, padded with -inf (weight 0)
    for (int64_t x = 0; x < h; x++) {
        float *ph = p + x * c;
        v16 vm = splat(-INFINITY);
        for (int64_t j = 0; j < cp; j += 16) {
            v16 v;
            if (j + 16 <= c) std::memcpy(&v, ph + j, 64);
            else { for (int t = 0; t < 16; t++) tail[t] = j + t < c ? ph[j + t] : -INFINITY; std::memcpy(&v, tail, 64); }
            vm = vm > v ? vm : v;
        }
        float m = vm[0];
        for (int t = 1; t < 16; t++) m = vm[t] > m ? vm[t] : m;
        v16 vs = splat(0.0f), mm = splat(m);
        for (int64_t j = 0; j < cp; j += 16) {
            v16 v;
            if (j + 16 <= c) { std::memcpy(&v, ph + j, 64); v = vexp(v - mm); std::memcpy(ph + j, &v, 64); }
            else {
                for (int t = 0; t < 16; t++) tail[t] = j + t < c ? ph[j + t] : -INFINITY;
                std::memcpy(&v, tail, 64); v = vexp(v - mm);
                for (int t = 0; t < 16 && j + t < c; t++) ph[j + t] = v[t];
            }
            vs += v;
        }
        float l = m + std::log(hsum(vs)), lo = l;
        if (a.sink && a.sink[x] != -INFINITY) {  // logaddexp(l, sink) as max + log1p(exp(-|gap|))
            float sk = a.sink[x], gap = std::fabs(l - sk);
            if (gap != gap) gap = INFINITY;  // inf - inf: the sink's weight is 0
            lo = (l > sk ? l : sk) + std::log1p(std::exp(-gap));
        }
        float f = std::exp(m - lo);
        for (int64_t j = 0; j < c; j++) ph[j] *= f;
        a.maxl[i * h + x] = m;
        a.lse[i * h + x] = l;
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
    for (; h0 + 8 <= h; h0 += 8) pv<8>(a, p, rows, c, h0, out);
    for (; h0 + 4 <= h; h0 += 4) pv<4>(a, p, rows, c, h0, out);
    for (; h0 < h; h0++) pv<1>(a, p, rows, c, h0, out);
}

extern "C" int sparse_mla_fwd(const float *q, const float *kv, const int32_t *idx, const int32_t *len,
                              const float *sink, float *out, float *maxl, float *lse, int64_t s_q, int64_t h,
                              int64_t d, int64_t d_v, int64_t s_kv, int64_t topk, float scale, int threads) {
    Args a{q, kv, sink, idx, len, out, maxl, lse, s_q, h, d, d_v, s_kv, topk, scale};
    run_split(s_q, threads, [&](int64_t i0, int64_t i1) {
        std::vector<int64_t> rows(topk > 0 ? topk : 1);
        std::vector<float> p((topk > 0 ? topk : 1) * h);
        for (int64_t i = i0; i < i1; i++) one_query(a, i, rows.data(), p.data());
    });
    return 0;
}
