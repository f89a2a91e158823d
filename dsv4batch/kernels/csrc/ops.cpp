// The CPU kernels as torch ops: `torch.ops.dsv4batch.<op>.<isa>`, one overload per instruction
// set this library was built for (DSV4_ISA: avx512, avx2 or generic; `build.py` builds one library
// per ISA, and each adds its overloads to the one `dsv4batch` namespace, so several can be loaded
// in one process). Each op checks its tensors (dtype, device, layout, shape) and the kernel's
// status, raising a ValueError (bad arguments) or a RuntimeError (a kernel that refused) that
// names the op; the kernels themselves are in kernels.h. Contracts: the Python wrappers in
// dsv4batch/kernels/cpu.py and elementwise.py.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "kernels.h"

#ifndef DSV4_ISA
#define DSV4_ISA generic
#endif
#define DSV4_STR2(x) #x
#define DSV4_STR(x) DSV4_STR2(x)
#define OVERLOAD(name) name "." DSV4_STR(DSV4_ISA)

namespace DSV4_NS {
namespace {

using at::Tensor;

// t is a contiguous CPU tensor of `dtype` with `dims` dimensions
void check(const Tensor &t, const char *op, const char *name, at::ScalarType dtype, int64_t dims) {
    TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() && t.dim() == dims,
                      "dsv4batch::", op, ": ", name, " must be a contiguous ", dims, "-d CPU ", c10::toString(dtype),
                      " tensor, got ", t.dim(), "-d ", t.scalar_type(), " on ", t.device(),
                      t.is_contiguous() ? "" : " (not contiguous)");
}

void check_status(int status, const char *op) {
    TORCH_CHECK(status == 0, "dsv4batch::", op, ": the kernel refused its arguments (status ", status, ")");
}

Tensor empty_f32(at::IntArrayRef sizes) { return at::empty(sizes, at::TensorOptions().dtype(at::kFloat)); }

const float *ptr(const Tensor &t) { return t.data_ptr<float>(); }

float *mut(Tensor &t) { return t.data_ptr<float>(); }

std::tuple<Tensor, Tensor, Tensor> sparse_mla(const Tensor &q, const Tensor &kv, const Tensor &idx,
                                              const std::optional<Tensor> &lens, const std::optional<Tensor> &sink,
                                              double scale, int64_t d_v, int64_t threads) {
    const char *op = "sparse_mla";
    check(q, op, "q", at::kFloat, 3), check(kv, op, "kv", at::kFloat, 2), check(idx, op, "indices", at::kInt, 2);
    const int64_t s_q = q.size(0), h = q.size(1), d = q.size(2), s_kv = kv.size(0), topk = idx.size(1);
    TORCH_CHECK_VALUE(kv.size(1) == d && idx.size(0) == s_q && d % 16 == 0 && d_v % 16 == 0 && d_v <= d,
                      "dsv4batch::sparse_mla: shapes q ", q.sizes(), ", kv ", kv.sizes(), ", indices ", idx.sizes(),
                      ", d_v ", d_v, " do not fit (d and d_v multiples of 16, d_v <= d)");
    if (lens) {
        check(*lens, op, "topk_length", at::kInt, 1);
        TORCH_CHECK_VALUE(lens->size(0) == s_q, "dsv4batch::sparse_mla: topk_length ", lens->sizes(), " for ", s_q,
                          " queries");
    }
    if (sink) {
        check(*sink, op, "attn_sink", at::kFloat, 1);
        TORCH_CHECK_VALUE(sink->size(0) == h, "dsv4batch::sparse_mla: attn_sink ", sink->sizes(), " for ", h, " heads");
    }
    Tensor out = empty_f32({s_q, h, d_v}), maxl = empty_f32({s_q, h}), lse = empty_f32({s_q, h});
    check_status(sparse_mla_fwd(ptr(q), ptr(kv), idx.data_ptr<int32_t>(), lens ? lens->data_ptr<int32_t>() : nullptr,
                                sink ? ptr(*sink) : nullptr, mut(out), mut(maxl), mut(lse), s_q, h, d, d_v, s_kv,
                                topk, (float)scale, (int)threads), op);
    return {out, maxl, lse};
}

std::tuple<Tensor, Tensor, Tensor> head(const Tensor &xs, const Tensor &panels, int64_t vocab, const Tensor &targets,
                                        int64_t threads) {
    const char *op = "head_stats";
    check(xs, op, "xs", at::kFloat, 2), check(panels, op, "panels", at::kFloat, 3);
    check(targets, op, "targets", at::kLong, 1);
    const int64_t n = xs.size(0), k = xs.size(1), pw = head_panel_width();
    TORCH_CHECK_VALUE(panels.size(0) == (vocab + pw - 1) / pw && panels.size(1) == k && panels.size(2) == pw,
                      "dsv4batch::head_stats: panels ", panels.sizes(), " are not this build's pack_head of a [",
                      vocab, ", ", k, "] weight (panel width ", pw, ")");
    TORCH_CHECK_VALUE(targets.size(0) == n, "dsv4batch::head_stats: targets ", targets.sizes(), " for xs ", xs.sizes());
    Tensor sums = empty_f32({n}), peaks = empty_f32({n}), picked = at::zeros({n}, xs.options());
    check_status(head_stats(ptr(xs), ptr(panels), n, k, vocab, targets.data_ptr<int64_t>(), mut(sums), mut(peaks),
                            mut(picked), (int)threads), op);
    return {sums, peaks, picked};
}

Tensor indexer(const Tensor &q, const Tensor &w, const Tensor &kt, const Tensor &lo, const Tensor &n, int64_t width,
               int64_t threads) {
    const char *op = "indexer_topk";
    check(q, op, "q", at::kFloat, 3), check(w, op, "w", at::kFloat, 2), check(kt, op, "keys_t", at::kFloat, 2);
    check(lo, op, "key_lo", at::kLong, 1), check(n, op, "visible", at::kLong, 1);
    const int64_t s = q.size(0), h = q.size(1), d = q.size(2), e = kt.size(1);
    TORCH_CHECK_VALUE(w.size(0) == s && w.size(1) == h && kt.size(0) == d && lo.size(0) == s && n.size(0) == s &&
                      width >= 0, "dsv4batch::indexer_topk: shapes q ", q.sizes(), ", w ", w.sizes(), ", keys_t ",
                      kt.sizes(), ", key_lo ", lo.sizes(), ", visible ", n.sizes(), ", width ", width, " do not fit");
    if (s) {  // every query's keys, and a tile's padding past them, inside keys_t
        const int64_t *l = lo.data_ptr<int64_t>(), *v = n.data_ptr<int64_t>();
        for (int64_t i = 0; i < s; i++)
            TORCH_CHECK_VALUE(l[i] >= 0 && v[i] >= 0 && l[i] + v[i] + indexer_tile() <= e,
                              "dsv4batch::indexer_topk: query ", i, " sees keys [", l[i], ", ", l[i] + v[i], ") of ",
                              e, " columns (", indexer_tile(), " zero columns must follow)");
    }
    Tensor out = at::empty({s, width}, lo.options());
    check_status(indexer_topk(ptr(q), ptr(w), ptr(kt), lo.data_ptr<int64_t>(), n.data_ptr<int64_t>(), s, h, d, e,
                              width, out.data_ptr<int64_t>(), (int)threads), op);
    return out;
}

void rope(Tensor &x, const Tensor &cos, const Tensor &sin, int64_t threads) {
    const char *op = "rope_";
    TORCH_CHECK_VALUE(x.dim() >= 2, "dsv4batch::rope_: x must be [n, ..., d]");
    check(x, op, "x", at::kFloat, x.dim()), check(cos, op, "cos", at::kFloat, 2), check(sin, op, "sin", at::kFloat, 2);
    const int64_t n = x.size(0), d = x.size(-1), rd = cos.size(1);
    TORCH_CHECK_VALUE(cos.sizes() == sin.sizes() && cos.size(0) == n && rd % 2 == 0 && rd <= d,
                      "dsv4batch::rope_: cos ", cos.sizes(), ", sin ", sin.sizes(), " do not fit x ", x.sizes());
    if (x.numel())
        check_status(rope_inplace(mut(x), ptr(cos), ptr(sin), n, x.numel() / (n * d), d, rd, (int)threads), op);
}

Tensor collapse(const Tensor &weights, const Tensor &x, int64_t threads) {
    const char *op = "hc_collapse";
    check(weights, op, "weights", at::kFloat, 2), check(x, op, "x", at::kFloat, 3);
    const int64_t n = x.size(0), hc = x.size(1), h = x.size(2);
    TORCH_CHECK_VALUE(weights.size(0) == n && weights.size(1) == hc, "dsv4batch::hc_collapse: weights ",
                      weights.sizes(), " do not fit x ", x.sizes());
    Tensor out = empty_f32({n, h});
    if (out.numel()) check_status(hc_collapse_fwd(ptr(x), ptr(weights), mut(out), n, hc, h, (int)threads), op);
    return out;
}

Tensor post(const Tensor &x, const Tensor &out, const Tensor &post, const Tensor &comb, int64_t threads) {
    const char *op = "hc_post";
    check(x, op, "x", at::kFloat, 3), check(out, op, "out", at::kFloat, 2), check(post, op, "post", at::kFloat, 2);
    check(comb, op, "comb", at::kFloat, 3);
    const int64_t n = x.size(0), hc = x.size(1), h = x.size(2);
    TORCH_CHECK_VALUE(out.size(0) == n && out.size(1) == h && post.size(0) == n && post.size(1) == hc &&
                      comb.size(0) == hc && comb.size(1) == hc && comb.size(2) == n, "dsv4batch::hc_post: out ",
                      out.sizes(), ", post ", post.sizes(), ", comb ", comb.sizes(), " do not fit x ", x.sizes());
    Tensor y = empty_f32({n, hc, h});
    if (y.numel())
        check_status(hc_post_fwd(ptr(x), ptr(out), ptr(post), ptr(comb), mut(y), n, hc, h, (int)threads), op);
    return y;
}

std::tuple<Tensor, Tensor, Tensor> pre(const Tensor &mixes, const Tensor &x, const Tensor &scale, const Tensor &base,
                                       int64_t iters, double eps, int64_t threads) {
    const char *op = "hc_pre";
    check(mixes, op, "mixes", at::kFloat, 2), check(x, op, "x", at::kFloat, 3);
    check(scale, op, "scale", at::kFloat, 1), check(base, op, "base", at::kFloat, 1);
    const int64_t n = x.size(0), hc = x.size(1), h = x.size(2), m = (2 + hc) * hc;
    TORCH_CHECK_VALUE(hc <= 8 && mixes.size(0) == n && mixes.size(1) == m && base.size(0) == m && scale.size(0) == 3,
                      "dsv4batch::hc_pre: mixes ", mixes.sizes(), ", scale ", scale.sizes(), ", base ", base.sizes(),
                      " do not fit x ", x.sizes(), " (at most 8 streams)");
    Tensor post = empty_f32({n, hc}), comb = empty_f32({hc, hc, n}), collapsed = empty_f32({n, h});
    if (n)
        check_status(hc_pre_fwd(ptr(mixes), ptr(x), ptr(scale), ptr(base), n, hc, h, iters, (float)eps, mut(post),
                                mut(comb), mut(collapsed), (int)threads), op);
    return {post, comb, collapsed};
}

Tensor rms_norm(const Tensor &x, const Tensor &weight, double eps, int64_t threads) {
    const char *op = "rms_norm";
    TORCH_CHECK_VALUE(x.dim() >= 1, "dsv4batch::rms_norm: x must be [..., d]");
    check(x, op, "x", at::kFloat, x.dim()), check(weight, op, "weight", at::kFloat, 1);
    const int64_t d = x.size(-1);
    TORCH_CHECK_VALUE(weight.size(0) == d, "dsv4batch::rms_norm: weight ", weight.sizes(), " does not fit x ",
                      x.sizes());
    Tensor y = at::empty_like(x);
    if (y.numel())
        check_status(rms_norm_fwd(ptr(x), ptr(weight), mut(y), x.numel() / d, d, (float)eps, (int)threads), op);
    return y;
}

Tensor swiglu(const Tensor &gate, const Tensor &up, double limit, int64_t threads) {
    const char *op = "swiglu";
    check(gate, op, "gate", at::kFloat, gate.dim()), check(up, op, "up", at::kFloat, up.dim());
    TORCH_CHECK_VALUE(gate.sizes() == up.sizes(), "dsv4batch::swiglu: gate ", gate.sizes(), " and up ", up.sizes(),
                      " differ");
    Tensor y = at::empty_like(gate);
    if (y.numel()) check_status(swiglu_fwd(ptr(gate), ptr(up), mut(y), y.numel(), (float)limit, (int)threads), op);
    return y;
}

// what the Python side must lay out to this build's register blocks: [floats per vector, head
// panel width (`pack_head`), indexer key tile (zero columns after the keys)]
std::vector<int64_t> layout() { return {VL, head_panel_width(), indexer_tile()}; }

}  // namespace
}  // namespace DSV4_NS

TORCH_LIBRARY_FRAGMENT(dsv4batch, m) {
    m.def(OVERLOAD("sparse_mla") "(Tensor q, Tensor kv, Tensor indices, Tensor? topk_length, Tensor? attn_sink, "
          "float sm_scale, int d_v, int threads) -> (Tensor out, Tensor max_logits, Tensor lse)");
    m.def(OVERLOAD("head_stats") "(Tensor xs, Tensor panels, int vocab, Tensor targets, int threads) -> "
          "(Tensor sums, Tensor peaks, Tensor picked)");
    m.def(OVERLOAD("indexer_topk") "(Tensor q, Tensor w, Tensor keys_t, Tensor key_lo, Tensor visible, int width, "
          "int threads) -> Tensor");
    m.def(OVERLOAD("rope_") "(Tensor(a!) x, Tensor cos, Tensor sin, int threads) -> ()");
    m.def(OVERLOAD("hc_collapse") "(Tensor weights, Tensor x, int threads) -> Tensor");
    m.def(OVERLOAD("hc_post") "(Tensor x, Tensor out, Tensor post, Tensor comb, int threads) -> Tensor");
    m.def(OVERLOAD("hc_pre") "(Tensor mixes, Tensor x, Tensor scale, Tensor base, int iters, float eps, int threads)"
          " -> (Tensor post, Tensor comb, Tensor collapsed)");
    m.def(OVERLOAD("rms_norm") "(Tensor x, Tensor weight, float eps, int threads) -> Tensor");
    m.def(OVERLOAD("swiglu") "(Tensor gate, Tensor up, float limit, int threads) -> Tensor");
    m.def(OVERLOAD("layout") "() -> int[]", &DSV4_NS::layout);
}

TORCH_LIBRARY_IMPL(dsv4batch, CPU, m) {
    m.impl(OVERLOAD("sparse_mla"), &DSV4_NS::sparse_mla);
    m.impl(OVERLOAD("head_stats"), &DSV4_NS::head);
    m.impl(OVERLOAD("indexer_topk"), &DSV4_NS::indexer);
    m.impl(OVERLOAD("rope_"), &DSV4_NS::rope);
    m.impl(OVERLOAD("hc_collapse"), &DSV4_NS::collapse);
    m.impl(OVERLOAD("hc_post"), &DSV4_NS::post);
    m.impl(OVERLOAD("hc_pre"), &DSV4_NS::pre);
    m.impl(OVERLOAD("rms_norm"), &DSV4_NS::rms_norm);
    m.impl(OVERLOAD("swiglu"), &DSV4_NS::swiglu);
}
