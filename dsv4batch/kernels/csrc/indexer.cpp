// Lightning Indexer top-k for the CPU: the `"cpu"` path of dsv4batch.kernels.indexer_topk.
//
// Definition: the torch path, dsv4batch/kernels/indexer.py (`indexer_topk_torch`); this code
// equals it up to fp32 rounding of the scores. Per query i, over the keys it sees, keys[lo_i +
// e] for e in [0, n_i):
//   score[e] = sum_h w[i, h] * relu(q[i, h] . keys[lo_i + e])      (heads in order, fp32)
// then its k_i = min(width, n_i) best e, best first; equal scores go to the lower e (the order
// is that of the 64-bit key (float bits made monotone) * 2^32 - e, as `tie_free_keys`).
// Slots [k_i, width) of its row are 0.
//
// One query at a time: KW keys x HB heads of dot products accumulate in KV * HB vector registers
// over the dimension (a key column read from the transposed keys feeds HB heads; a query's
// last tile takes fewer vectors where that covers its rest), and the weighted ReLU sum over
// heads folds into KV more. AVX-512: 48 keys x 8 heads (24 of 32 registers); AVX2 and others:
// 3 vectors x 4 heads (12 of 16, with 3 key vectors and a broadcast). A head's dot products and
// its place in the sum are the same in any block. Each VL scores are then compared at once with
// the running k-th best; the few that beat it go to a buffer (up to 2k + 64 keys, cut back to k
// with nth_element when full), and the k survivors are sorted at the end: no [heads, keys]
// block, no mask, no sort of every key. Nothing is shared between queries, so a query's picks
// depend on its own q, w and keys alone (batch-invariant). Threads take 8 queries at a time
// from a shared counter (later queries see more keys, so static ranges would be uneven); the
// assignment does not change any result.
//
// Tensors (contiguous): q fp32 [s, H, D]; w fp32 [s, H]; kt fp32 [D, E] (the keys transposed,
// with >= KW (`indexer_tile()`) zero columns past the last key any query sees); lo, n int64 [s]
// (the caller checks lo >= 0 and lo + n + KW <= E); out int64 [s, width].
#include <atomic>
#include <functional>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "kernels.h"

namespace DSV4_NS {
namespace {

constexpr int KV = 3, KW = VL * KV, HB = VL == 16 ? 8 : 4;  // key vectors / keys per tile, heads per block
constexpr int64_t GRAIN = 8;                                // queries a thread takes at a time

// sc[v] += sum over heads r < R of w[r] * relu(q[r] . key), for the VL * NV keys at kt's columns
template <int R, int NV>
inline void head_block(const float *q, const float *w, const float *kt, int64_t E, int64_t D, vf *sc) {
    vf acc[R][NV];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = splat(0.0f);
    for (int64_t j = 0; j < D; j++) {
        vf k[NV];
        for (int v = 0; v < NV; v++) k[v] = load(kt + j * E + VL * v);
        for (int r = 0; r < R; r++) {
            vf qb = splat(q[r * D + j]);
            for (int v = 0; v < NV; v++) acc[r][v] += qb * k[v];
        }
    }
    for (int r = 0; r < R; r++) {
        vf wb = splat(w[r]);
        for (int v = 0; v < NV; v++) {
            vf a = acc[r][v];
            sc[v] += wb * (a < splat(0.0f) ? splat(0.0f) : a);  // relu; NaN stays NaN
        }
    }
}

// the scores of one query's keys [e0, e0 + VL * NV) into sc (every lane the same arithmetic:
// heads in order, whatever block they fall in)
template <int NV>
inline void tile(const float *q, const float *w, const float *kt, int64_t E, int64_t H, int64_t D, vf *sc) {
    for (int v = 0; v < NV; v++) sc[v] = splat(0.0f);
    int64_t h = 0;
    for (; h + HB <= H; h += HB) head_block<HB, NV>(q + h * D, w + h, kt, E, D, sc);
    for (; h < H; h++) head_block<1, NV>(q + h * D, w + h, kt, E, D, sc);
}

// the order of (score, e): larger is better; unique per e (`tie_free_keys` in indexer.py)
inline int64_t order_key(int32_t mapped, int64_t e) { return (int64_t)mapped * (INT64_C(1) << 32) - e; }

inline int64_t key_column(int64_t key) { return ((INT64_C(1) << 32) - (key & 0xFFFFFFFF)) & 0xFFFFFFFF; }

// a score's float bits made monotone: integer order = float order (-0.0 folded into +0.0)
inline vi monotone(vf s) {
    vi b = (vi)(s + 0.0f);
    return b ^ ((b >> 31) & 0x7FFFFFFF);
}

// bit l set where lane l of m is true (-1)
inline uint32_t lanes(vi m) {
#if DSV4_VL == 16
    return _mm512_cmplt_epi32_mask((__m512i)m, _mm512_setzero_si512());
#elif DSV4_VL == 8 && defined(__AVX2__)
    return (uint32_t)_mm256_movemask_ps((__m256)m);
#else
    uint32_t bits = 0;
    for (int l = 0; l < VL; l++) bits |= (uint32_t)(m[l] != 0) << l;
    return bits;
#endif
}

// The k best (score, e) seen so far: every key above the running k-th best is kept (up to
// 2k + 64 of them, then cut back to k by nth_element). Keys arrive in increasing e, so one
// equal in score to the k-th best loses to it: a key enters only when its score is greater.
struct Best {
    std::vector<int64_t> buf;
    int64_t k = 0, cap = 0;
    int32_t bar = INT32_MIN;  // monotone bits of the k-th best once cut; none enter at or below
    bool is_cut = false;

    void reset(int64_t k_) { buf.clear(), k = k_, cap = 2 * k_ + 64, bar = INT32_MIN, is_cut = false; }
    void cut() {
        std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), std::greater<int64_t>());
        buf.resize(k);
        bar = (int32_t)((buf[k - 1] >> 32) + (buf[k - 1] & 0xFFFFFFFF ? 1 : 0));  // the k-th's mapped score
        is_cut = true;
    }
    // VL scores of keys e0 + l, l < valid
    void add(vf s, int64_t e0, int valid) {
        constexpr uint32_t ALL = (1u << VL) - 1;
        vi m = monotone(s);
        uint32_t pass = is_cut ? lanes(m > (vi{} + bar)) : ALL;
        pass &= valid >= VL ? ALL : (1u << valid) - 1;
        while (pass) {
            int l = __builtin_ctz(pass);
            pass &= pass - 1;
            if (is_cut && m[l] <= bar) continue;  // the bar rose within this vector
            buf.push_back(order_key(m[l], e0 + l));
            if ((int64_t)buf.size() == cap) cut();
        }
    }
    // the k best keys' e, best first, into row[0, k)
    void emit(int64_t *row) {
        if ((int64_t)buf.size() > k) cut();
        std::sort(buf.begin(), buf.end(), std::greater<int64_t>());
        for (int64_t j = 0; j < k; j++) row[j] = key_column(buf[j]);
    }
};

}  // namespace

int indexer_tile() { return KW; }

int indexer_topk(const float *q, const float *w, const float *kt, const int64_t *lo, const int64_t *n, int64_t s,
                 int64_t H, int64_t D, int64_t E, int64_t width, int64_t *out, int threads) {
    std::atomic<int64_t> next{0};
    if (threads < 1) threads = 1;
    run_split(threads, threads, [&](int64_t, int64_t) {  // one range per thread: a worker
        Best best;
        for (;;) {
            const int64_t a = next.fetch_add(GRAIN);
            if (a >= s) break;
            for (int64_t i = a; i < std::min(a + GRAIN, s); i++) {
                const int64_t ni = n[i], k = std::min(width, ni);
                best.reset(k);
                for (int64_t e0 = 0; e0 < ni; e0 += KW) {  // the last tile only as wide as it needs
                    vf sc[KV];
                    const float *ktile = kt + lo[i] + e0;
                    const int64_t left = ni - e0;
                    const float *qi = q + i * H * D, *wi = w + i * H;
                    if (left > 2 * VL) tile<3>(qi, wi, ktile, E, H, D, sc);
                    else if (left > VL) tile<2>(qi, wi, ktile, E, H, D, sc);
                    else tile<1>(qi, wi, ktile, E, H, D, sc);
                    for (int v = 0; v < KV && e0 + VL * v < ni; v++)
                        best.add(sc[v], e0 + VL * v, (int)std::min<int64_t>(VL, ni - e0 - VL * v));
                }
                int64_t *row = out + i * width;
                if (k > 0) best.emit(row);
                for (int64_t j = k; j < width; j++) row[j] = 0;
            }
        }
    });
    return 0;
}

}  // namespace DSV4_NS
