"""dsv4batch.kernels.sparse_mla_prefill, every backend, against the definition.

The definition, `dsv4batch.kernels.ref.sparse_mla_prefill_ref`, shares no code with the backends:
it builds a [s_q, s_kv] boolean mask from indices (FlashMLA validity rules), runs a full float64
softmax over all kv rows with the sink as an extra column in the denominator, and special-cases
lonely queries.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsv4batch.kernels import KernelConfig, available_backends, sparse_mla_prefill, use_kernels
from dsv4batch.kernels import cpu as cpu_mod
from dsv4batch.kernels import flashmla as flashmla_mod
from dsv4batch.kernels.ref import sparse_mla_prefill_ref
from dsv4batch.kernels.sparse_mla_torch import sparse_mla_prefill_torch
from dsv4batch.kernels.select import chosen
from tests.kernels.isas import RUNNABLE, fail_build

INF = math.inf
# FlashMLA test generator's invalid values (tests/lib.py::generate_testcase), minus those
# that would be valid for a large s_kv; s_kv itself is added per case.
INVALID = [-(2**31), -123456, -1, 114514, 1919810, 2147480000, 2**31 - 1]


def make_case(s_q, h_q, d_qk, s_kv, topk, *, seed=0, dtype=torch.float32, p_invalid=0.25,
              lonely_rows=(), with_topk_length=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s_q, h_q, d_qk, generator=g).to(dtype)
    kv = torch.randn(s_kv, 1, d_qk, generator=g).to(dtype)
    idx = torch.empty(s_q, 1, topk, dtype=torch.int32)
    bad = torch.tensor(INVALID + [s_kv], dtype=torch.int64)
    for i in range(s_q):  # unique valid indices per row, then sprinkle invalid ones
        row = torch.randperm(s_kv, generator=g)[:topk]
        row = torch.cat([row, bad[torch.randint(len(bad), (topk - len(row),), generator=g)]])
        drop = torch.rand(topk, generator=g) < p_invalid
        row[drop] = bad[torch.randint(len(bad), (int(drop.sum()),), generator=g)]
        if i in lonely_rows:
            row = bad[torch.randint(len(bad), (topk,), generator=g)]
        idx[i, 0] = row.to(torch.int32)
    tl = None
    if with_topk_length:
        tl = torch.randint(0, topk + 4, (s_q,), generator=g, dtype=torch.int32)
        tl[0] = topk  # at least one full row
    return q, kv, idx, tl


def check(got, want, out_tol):
    out, ml, lse = got
    r_out, r_ml, r_lse = want
    assert not torch.isnan(out).any() and not torch.isnan(ml).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.double(), r_out, **out_tol)
    torch.testing.assert_close(ml, r_ml, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, r_lse, atol=1e-5, rtol=1e-5)


FP32_TOL = dict(atol=2e-6, rtol=2e-5)
BF16_TOL = dict(atol=1e-2, rtol=1.6e-2)
# The CPU backends: the torch reference and the fused cpu kernel (built here: CI has a compiler,
# so a kernel that does not build fails these tests instead of skipping them).


@pytest.fixture(params=[("torch", "native")] + [("cpu", isa) for isa in RUNNABLE], ids=lambda p: "-".join(p))
def backend(request):
    """The torch reference, and the cpu kernel of every ISA's build this CPU runs."""
    name, isa = request.param
    if name == "torch":
        yield name
        return
    before = cpu_mod.isa()
    cpu_mod.use_isa(isa)
    try:
        assert cpu_mod.available(), cpu_mod.build_error()
        yield name
    finally:
        cpu_mod.use_isa(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sink_kind", ["none", "finite", "neg_inf", "mixed"])
@pytest.mark.parametrize("with_tl", [False, True])
def test_matches_the_definition(dtype, sink_kind, with_tl, backend):
    s_q, h_q, d_qk, s_kv, topk = 40, 4, 32, 57, 24
    q, kv, idx, tl = make_case(s_q, h_q, d_qk, s_kv, topk, dtype=dtype, lonely_rows=(3, 17),
                               with_topk_length=with_tl, seed=hash((sink_kind, with_tl)) % 1000)
    sink = {"none": None, "finite": torch.randn(h_q) * 2,
            "neg_inf": torch.full((h_q,), -INF),
            "mixed": torch.tensor([-INF, 0.5, INF, 4.0])}[sink_kind]
    got = sparse_mla_prefill(q, kv, idx, 0.3, sink, tl, backend=backend)
    assert got[0].dtype == dtype and got[0].shape == (s_q, h_q, d_qk)
    assert got[1].dtype == torch.float32 and got[2].dtype == torch.float32
    assert got[1].shape == got[2].shape == (s_q, h_q)
    check(got, sparse_mla_prefill_ref(q, kv, idx, 0.3, sink, tl), FP32_TOL if dtype == torch.float32 else BF16_TOL)
    # lonely queries: out 0 whatever the sink, max_logits -inf, lse +inf
    for i in (3, 17):
        assert torch.equal(got[0][i], torch.zeros_like(got[0][i]))
        assert (got[1][i] == -INF).all() and (got[2][i] == INF).all()
    # a real sink must actually shrink the output (guards against sink being ignored)
    if sink_kind == "finite":
        plain = sparse_mla_prefill(q, kv, idx, 0.3, None, tl, backend=backend)[0]
        assert (got[0].float().norm() < plain.float().norm() * 0.999).item()


def test_hand_computed():
    q = torch.tensor([[[1.0]], [[2.0]]])          # s_q 2, h_q 1, d_qk 1
    kv = torch.tensor([[[0.0]], [[5.0]], [[2.0]]])
    idx = torch.tensor([[[0, 2, -1]], [[7, -1, 1]]], dtype=torch.int32)
    out, ml, lse = sparse_mla_prefill(q, kv, idx, 1.0, torch.tensor([1.0]), torch.tensor([3, 2]))
    # query 0: P = [0, 2]; query 1: slot 2 is past topk_length -> lonely
    e2 = math.exp(2.0)
    assert ml[0, 0].item() == pytest.approx(2.0)
    assert lse[0, 0].item() == pytest.approx(math.log(1 + e2), rel=1e-6)
    assert out[0, 0, 0].item() == pytest.approx(2 * e2 / (1 + e2 + math.e), rel=1e-6)
    assert out[1, 0, 0].item() == 0.0 and ml[1, 0].item() == -INF and lse[1, 0].item() == INF


def test_neg_inf_sink_is_bitwise_no_sink(backend):
    q, kv, idx, tl = make_case(33, 3, 16, 40, 20, seed=5, lonely_rows=(4,))
    a = sparse_mla_prefill(q, kv, idx, 0.25, None, tl, backend=backend)
    b = sparse_mla_prefill(q, kv, idx, 0.25, torch.full((3,), -INF), tl, backend=backend)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_nan_rows_behind_invalid_slots_do_not_leak(backend):
    s_q, h_q, d_qk, s_kv, topk, n_live = 30, 2, 16, 200, 16, 10
    q, kv, idx, _ = make_case(s_q, h_q, d_qk, s_kv, topk, seed=7, lonely_rows=(2,), with_topk_length=False)
    tl = torch.full((s_q,), n_live, dtype=torch.int32)
    idx[idx == 0] = -1  # row 0 is what a naive "gather 0 for invalid slots" would read
    live = idx[:, 0, :n_live]
    used = set(live[(live >= 0) & (live < s_kv)].tolist())
    poisoned = sorted(set(range(s_kv)) - used)
    assert 0 in poisoned and len(poisoned) > 10
    tail = idx[:, 0, n_live:]  # valid-looking indices past topk_length -> poisoned rows
    n_tail = int((tail >= 0).sum())
    assert n_tail > 0
    tail[tail >= 0] = torch.tensor(poisoned, dtype=torch.int32)[torch.arange(n_tail) % len(poisoned)]
    kv[poisoned] = float("nan")
    sink = torch.randn(h_q)
    got = sparse_mla_prefill(q, kv, idx, 0.25, sink, tl, backend=backend)
    check(got, sparse_mla_prefill_ref(q, kv, idx, 0.25, sink, tl), FP32_TOL)
    assert (got[2][2] == INF).all() and not torch.isnan(got[0]).any()


def test_d_v_smaller_than_d_qk(backend):
    q, kv, idx, tl = make_case(25, 4, 48, 60, 20, seed=11)
    sink = torch.randn(4)
    got = sparse_mla_prefill(q, kv, idx, 0.2, sink, tl, d_v=16, backend=backend)
    assert got[0].shape == (25, 4, 16)
    check(got, sparse_mla_prefill_ref(q, kv, idx, 0.2, sink, tl, d_v=16), FP32_TOL)


def test_s_kv_smaller_than_topk_and_all_out_of_range_values(backend):
    q, kv, idx, tl = make_case(20, 2, 16, 9, 32, seed=13, lonely_rows=(0,))
    sink = torch.randn(2)
    check(sparse_mla_prefill(q, kv, idx, 0.5, sink, tl, backend=backend),
          sparse_mla_prefill_ref(q, kv, idx, 0.5, sink, tl), FP32_TOL)


@pytest.mark.parametrize("slice_elems", [1, 3000, 20000])
def test_slicing_matches_single_slice(slice_elems):
    q, kv, idx, tl = make_case(50, 4, 32, 80, 24, seed=17, lonely_rows=(10, 11, 12))
    sink = torch.randn(4)
    one = sparse_mla_prefill_torch(q, kv, idx, 0.3, sink, tl, slice_elems=1 << 30)
    many = sparse_mla_prefill_torch(q, kv, idx, 0.3, sink, tl, slice_elems=slice_elems)
    for x, y in zip(one, many):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)
    check(many, sparse_mla_prefill_ref(q, kv, idx, 0.3, sink, tl), FP32_TOL)


def test_empty_topk_and_empty_queries(backend):
    q = torch.randn(3, 2, 16)
    kv = torch.randn(5, 1, 16)
    out, ml, lse = sparse_mla_prefill(q, kv, torch.empty(3, 1, 0, dtype=torch.int32), 1.0, backend=backend)
    assert torch.equal(out, torch.zeros(3, 2, 16)) and (ml == -INF).all() and (lse == INF).all()
    out, ml, lse = sparse_mla_prefill(q[:0], kv, torch.empty(0, 1, 4, dtype=torch.int32), 1.0, backend=backend)
    assert out.shape == (0, 2, 16) and ml.shape == lse.shape == (0, 2)
    out, ml, lse = sparse_mla_prefill(q, kv[:0], torch.zeros(3, 1, 4, dtype=torch.int32), 1.0, backend=backend)
    assert torch.equal(out, torch.zeros(3, 2, 16)) and (ml == -INF).all() and (lse == INF).all()


def test_bad_shapes_raise():
    q = torch.randn(3, 2, 8)
    idx = torch.zeros(3, 1, 4, dtype=torch.int32)
    with pytest.raises(ValueError):
        sparse_mla_prefill(q, torch.randn(5, 2, 8), idx, 1.0)
    with pytest.raises(ValueError):
        sparse_mla_prefill(q, torch.randn(5, 1, 8), idx[:2], 1.0)
    with pytest.raises(ValueError):
        sparse_mla_prefill(q, torch.randn(5, 1, 8), idx, 1.0, d_v=9)
    with pytest.raises(ValueError):
        sparse_mla_prefill(q, torch.randn(5, 1, 8), idx, 1.0, attn_sink=torch.zeros(3))


def test_backend_selection_on_cpu():
    assert "torch" in available_backends()
    q, kv, idx, tl = make_case(8, 2, 16, 20, 8, seed=3)
    ref = sparse_mla_prefill(q, kv, idx, 0.5, None, tl, backend="torch")
    fused = sparse_mla_prefill(q, kv, idx, 0.5, None, tl, backend="cpu")
    # auto on CPU -> the cpu kernel where this ISA's table chooses it (avx2, avx512), else torch
    for x, y in zip(fused if chosen("sparse_mla") else ref, sparse_mla_prefill(q, kv, idx, 0.5, None, tl)):
        assert torch.equal(x, y)
    assert "cpu" in available_backends()
    for x, y in zip(ref[:1], fused[:1]):
        torch.testing.assert_close(x, y, atol=2e-6, rtol=2e-5)
    # calls the kernel does not take run on torch under auto, and refuse it when forced
    q8 = q[..., :8]
    for x, y in zip(sparse_mla_prefill(q8, kv[..., :8], idx, 0.5), sparse_mla_prefill(q8, kv[..., :8], idx, 0.5,
                                                                                    backend="torch")):
        assert torch.equal(x, y)
    with pytest.raises(RuntimeError, match="multiples of 16"):
        sparse_mla_prefill(q8, kv[..., :8], idx, 0.5, backend="cpu")
    with pytest.raises(RuntimeError, match="float64"):
        sparse_mla_prefill(q.double(), kv.double(), idx, 0.5, backend="cpu")
    with pytest.raises(RuntimeError, match="flashmla"):
        sparse_mla_prefill(q, kv, idx, 0.5, backend="flashmla")
    with pytest.raises(ValueError):
        sparse_mla_prefill(q, kv, idx, 0.5, backend="bogus")
    # auto takes the active KernelConfig's attention backend
    with use_kernels(attention="flashmla"):
        with pytest.raises(RuntimeError, match="flashmla"):
            sparse_mla_prefill(q, kv, idx, 0.5)
        sparse_mla_prefill(q, kv, idx, 0.5, backend="torch")  # an explicit backend beats the config
    with pytest.raises(ValueError, match="KernelConfig.attention"):
        KernelConfig(attention="bogus")
    with use_kernels(attention="torch"):
        assert torch.equal(sparse_mla_prefill(q, kv, idx, 0.5, None, tl)[0], ref[0])
    with use_kernels(KernelConfig(attention="cpu")):
        assert torch.equal(sparse_mla_prefill(q, kv, idx, 0.5, None, tl)[0], fused[0])


def test_cpu_kernel_that_cannot_build_leaves_auto_on_torch(monkeypatch):
    """No compiler: auto runs the torch reference (same bits), a forced "cpu" says why."""
    q, kv, idx, tl = make_case(8, 2, 16, 20, 8, seed=3)
    fail_build(monkeypatch)
    assert available_backends() == ["torch"]
    ref = sparse_mla_prefill(q, kv, idx, 0.5, None, tl, backend="torch")
    for x, y in zip(ref, sparse_mla_prefill(q, kv, idx, 0.5, None, tl)):
        assert torch.equal(x, y)
    with pytest.raises(RuntimeError, match="could not be built.*no C\\+\\+ compiler"):
        sparse_mla_prefill(q, kv, idx, 0.5, backend="cpu")


# ---------------------------------------------------------------- GPU: FlashMLA vs torch


def _flashmla_close(got, want, atol, rtol):
    """FlashMLA's check_is_allclose: inf/NaN positions match; each element within abs OR rel."""
    got, want = got.float(), want.float()
    assert torch.equal(torch.isinf(got) & (got > 0), torch.isinf(want) & (want > 0))
    assert torch.equal(torch.isinf(got) & (got < 0), torch.isinf(want) & (want < 0))
    assert not torch.isnan(got).any() and not torch.isnan(want).any()
    fin = torch.isfinite(want)
    diff = (got[fin] - want[fin]).abs()
    ok = (diff <= atol) | (diff <= rtol * want[fin].abs())
    assert ok.all(), f"{int((~ok).sum())} elements off, max abs diff {diff.max().item():.3g}"


def _cos_diff(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return (1 - 2 * (a * b).sum() / (a * a + b * b).sum().clamp_min(1e-30)).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or flashmla_mod.flash_mla_sparse_fwd_fn is None,
                    reason="needs CUDA and the flash_mla module (sgl-flash-mla)")
def test_flashmla_matches_torch_backend():
    if "flashmla" not in available_backends():
        pytest.skip("FlashMLA needs sm90/sm100")
    s_q, h_q, d_qk, s_kv, topk = 300, 16, 512, 1000, 200  # h_q padded to 64, topk to 256
    q, kv, idx, tl = make_case(s_q, h_q, d_qk, s_kv, topk, seed=23, dtype=torch.bfloat16,
                               lonely_rows=(5, 6))
    dev = torch.device("cuda")
    q, kv, idx, tl = q.to(dev), kv.to(dev), idx.to(dev), tl.to(dev)
    sink = torch.randn(h_q, device=dev)
    sink[0], sink[1] = -INF, INF
    scale = d_qk ** -0.5
    want = sparse_mla_prefill(q, kv, idx, scale, sink, tl, backend="torch")
    got = sparse_mla_prefill(q, kv, idx, scale, sink, tl, backend="flashmla")
    assert got[0].dtype == torch.bfloat16 and got[0].shape == (s_q, h_q, 512)
    _flashmla_close(got[0], want[0], 8e-4, 3.01 / 128)
    assert _cos_diff(got[0], want[0]) < 1e-5
    _flashmla_close(got[1], want[1], 1e-6, 2.01 / 65536)
    _flashmla_close(got[2], want[2], 1e-6, 2.01 / 65536)
    auto = sparse_mla_prefill(q, kv, idx, scale, sink, tl)
    assert torch.equal(auto[0], got[0])


# ------------------------------------- FlashMLA adapter logic on CPU, against a fake kernel


@pytest.mark.parametrize("major", [9, 10])
@pytest.mark.parametrize("h_q", [5, 130])
def test_flashmla_adapter_with_fake_kernel(monkeypatch, major, h_q):
    """Padding, -1 clamping, head groups, use_legacy and base-2 lse conversion, without a GPU:
    the fake kernel asserts FlashMLA's input rules and answers with the torch reference."""
    calls = []

    def fake_kernel(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None,
                    use_legacy=False, return_log2_lse=False):
        assert q.dtype == kv.dtype == torch.bfloat16 and indices.dtype == torch.int32
        assert q.shape[1] in (64, 128) and q.shape[2] == 512 and d_v == 512
        assert kv.shape[1] == 1 and indices.shape[1] == 1
        assert indices.shape[2] % 128 == 0 and indices.shape[2] > 0
        assert ((indices == -1) | ((indices >= 0) & (indices < kv.shape[0]))).all()
        assert attn_sink.dtype == torch.float32 and attn_sink.shape == (q.shape[1],)
        assert topk_length.dtype == torch.int32 and topk_length.shape == (q.shape[0],)
        assert use_legacy == (major == 9)
        calls.append(q.shape[1])
        out, ml, lse = sparse_mla_prefill_torch(q, kv, indices, sm_scale, attn_sink, topk_length)
        if return_log2_lse:
            ml, lse = ml * math.log2(math.e), lse * math.log2(math.e)
        return out, ml, lse

    monkeypatch.setattr(flashmla_mod, "flash_mla_sparse_fwd_fn", fake_kernel)
    monkeypatch.setattr(flashmla_mod, "_PARAMS", frozenset(
        {"attn_sink", "topk_length", "use_legacy", "return_log2_lse"}))
    monkeypatch.setattr(flashmla_mod, "unsupported_reason", lambda q, d_v=None: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))

    q, kv, idx, tl = make_case(12, h_q, 512, 300, 200, seed=29, dtype=torch.bfloat16, lonely_rows=(1,))
    sink = torch.randn(h_q)
    sink[0] = INF
    scale = 512 ** -0.5
    got = sparse_mla_prefill(q, kv, idx, scale, sink, tl, backend="flashmla")
    want = sparse_mla_prefill(q, kv, idx, scale, sink, tl, backend="torch")
    assert calls == ([64] if h_q == 5 else [128, 64])
    assert got[0].dtype == torch.bfloat16 and got[0].shape == (12, h_q, 512)
    torch.testing.assert_close(got[0].float(), want[0].float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[2], want[2], atol=1e-5, rtol=1e-5)
    assert (got[2][1] == INF).all() and (got[1][1] == -INF).all() and (got[0][1] == 0).all()
    assert (got[0][:, 0] == 0).all()  # sink +inf zeroes head 0


def test_cpu_backends_are_batch_invariant(backend):
    """A query's result is bit-identical whether it runs alone or with others of other lengths."""
    gen = torch.Generator().manual_seed(3)
    s_q, h_q, d, s_kv, topk = 40, 4, 32, 300, 150
    q = torch.randn(s_q, h_q, d, generator=gen)
    kv = torch.randn(s_kv, 1, d, generator=gen)
    idx = torch.stack([torch.randperm(s_kv, generator=gen)[:topk] for _ in range(s_q)]).int()[:, None]
    lens = torch.randint(1, topk + 1, (s_q,), generator=gen).int()
    sink = torch.randn(h_q, generator=gen)
    together = sparse_mla_prefill(q, kv, idx, 0.2, sink, lens, backend=backend)
    for i in range(s_q):
        alone = sparse_mla_prefill(q[i:i + 1], kv, idx[i:i + 1], 0.2, sink, lens[i:i + 1], backend=backend)
        for a, b in zip(alone, together):
            assert torch.equal(a[0], b[i])


def window_case(s_q, h_q, d_qk, window, *, seed=0, num_requests=2):
    """Indices like one SWA chunk: request r's queries see their last `window` rows of r's
    own block of kv rows (valid first, -1 padded), plus a few garbage slots past topk_length."""
    g = torch.Generator().manual_seed(seed)
    per = s_q // num_requests
    s_kv = s_q + 7
    q = torch.randn(s_q, h_q, d_qk, generator=g)
    kv = torch.randn(s_kv, 1, d_qk, generator=g)
    kv[s_q:] = float("nan")  # rows no query may use
    idx = torch.full((s_q, 1, window + 4), -1, dtype=torch.int32)
    tl = torch.empty(s_q, dtype=torch.int32)
    for i in range(s_q):
        r0 = (i // per) * per
        rows = torch.arange(max(r0, i - window + 1), i + 1)
        idx[i, 0, :len(rows)] = rows.to(torch.int32)
        idx[i, 0, len(rows):] = s_q + 3  # a NaN row, but past topk_length
        tl[i] = len(rows)
    bounds = sorted({0, s_q} | {r for r in range(0, s_q, per)} | set(range(0, s_q, 16)))
    return q, kv, idx, tl, bounds


@pytest.mark.parametrize("sink_kind", ["none", "finite", "mixed"])
def test_dense_blocks_match_the_definition(sink_kind):
    from dsv4batch.kernels.sparse_mla_torch import CPU_SLICE_ELEMS, _dense_blocks

    q, kv, idx, tl, bounds = window_case(64, 4, 32, 24, seed=3)
    idx[5, 0, :] = -1  # a lonely query inside a dense block
    tl[5] = 0
    sink = {"none": None, "finite": torch.randn(4), "mixed": torch.tensor([-INF, 0.5, INF, 4.0])}[sink_kind]
    want = sparse_mla_prefill_ref(q, kv, idx, 0.3, sink, tl)
    got = sparse_mla_prefill(q, kv, idx, 0.3, sink, tl, backend="torch", query_blocks=bounds)
    check(got, want, FP32_TOL)
    assert torch.equal(got[0][5], torch.zeros_like(got[0][5])) and got[2][5].eq(INF).all()
    # the same as the gathered slices alone (up to rounding), and the dense path was taken
    alone = sparse_mla_prefill(q, kv, idx, 0.3, sink, tl, backend="torch")
    for x, y in zip(got, alone):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)
    outs = tuple(torch.zeros(65, *t.shape[1:]) for t in got)  # a spare row for the padding queries
    valid = (torch.arange(idx.shape[-1]) < tl[:, None]) & (idx[:, 0] >= 0)
    gidx = torch.where(valid, idx[:, 0].long(), kv.shape[0])
    kvz = torch.cat([kv[:, 0], torch.zeros(1, 32)])
    kcq = torch.full((64,), 32)
    kcq[40:48] = 1  # block [40, 48) holds too few slots for its union: not dense, split instead
    done = _dense_blocks(q, kvz, gidx, ~valid, kcq, [16, 32, 40, 48], 0.3, sink, 32, outs, CPU_SLICE_ELEMS)
    assert done.tolist() == [False] * 16 + [True] * 32 + [False] * 16  # only the given blocks
    for x, y in zip(outs, got):  # what the block path wrote is what the call returned
        torch.testing.assert_close(x[16:48], y[16:48], atol=1e-6, rtol=1e-6)


def test_runs_of_full_blocks_run_in_place_beside_a_short_last_block(monkeypatch):
    import dsv4batch.kernels.sparse_mla_torch as ref

    assert ref.RUN_MIN == 4
    # runs of >= 4 consecutive full blocks (8 queries each) stay together; the rest follows its group's runs
    assert ref._runs_first([0, 8, 16, 24, 40, 48, 56, 64, 72, 80], [True] * 9 + [False], [10], 8) == \
        (list(range(10)), [(0, 4, 0), (4, 9, 0), (9, 10, 0)])
    assert ref._runs_first([0, 50, 58, 66, 74, 0, 8, 16], [True] * 8, [5, 3], 8) == \
        ([1, 2, 3, 4, 0, 5, 6, 7], [(0, 4, 0), (4, 5, 0), (5, 8, 1)])
    # one request of 9 full blocks and a short last one of the same width: the full ones run in
    # place, the short one is gathered, and the results are the definition's
    q, kv, idx, tl, _ = window_case(156, 4, 32, 24, seed=4, num_requests=1)
    bounds = list(range(0, 156, 16)) + [156]  # unions 16, then 39 (width 48), the last 12 + 23 (48)
    seen = []
    real = ref._runs_first
    monkeypatch.setattr(ref, "_runs_first", lambda *a: seen.append(real(*a)) or seen[-1])
    got = sparse_mla_prefill(q, kv, idx, 0.3, None, tl, backend="torch", query_blocks=bounds)
    check(got, want := sparse_mla_prefill_ref(q, kv, idx, 0.3, None, tl), FP32_TOL)
    runs = {g for _, segments in seen for s, e, g in segments if e - s >= 4}
    assert any(e - s == 1 and g in runs for _, segments in seen for s, e, g in segments)
    for x, y in zip(got, sparse_mla_prefill(q, kv, idx, 0.3, None, tl, backend="torch")):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)
    assert want[0].isfinite().all()


def csa_case(s_q, h_q, d_qk, window, topk, s_comp, *, seed=0):
    """Indices like one long CSA chunk: each query's `topk` compressed rows (random, per query,
    from [0, s_comp)) first, then its window of raw rows (kv rows s_comp + position)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s_q, h_q, d_qk, generator=g)
    kv = torch.randn(s_comp + s_q, 1, d_qk, generator=g)
    idx = torch.full((s_q, 1, topk + window), -1, dtype=torch.int32)
    for i in range(s_q):
        win = torch.arange(max(0, i - window + 1), i + 1) + s_comp
        comp = torch.randperm(s_comp, generator=g)[:topk]
        row = torch.cat([comp, win]).to(torch.int32)
        idx[i, 0, :len(row)] = row
    return q, kv, idx, list(range(0, s_q, 32)) + [s_q]


@pytest.mark.parametrize("sink_kind", ["none", "finite"])
def test_split_blocks_share_the_window_and_gather_the_rest(sink_kind, monkeypatch):
    import dsv4batch.kernels.sparse_mla_torch as ref

    q, kv, idx, bounds = csa_case(96, 4, 32, 40, 12, 500, seed=5)
    sink = None if sink_kind == "none" else torch.randn(4)
    want = sparse_mla_prefill_ref(q, kv, idx, 0.25, sink)
    taken = []
    real = ref._dense_blocks
    monkeypatch.setattr(ref, "_dense_blocks", lambda *a: taken.append(real(*a)) or taken[-1])
    got = sparse_mla_prefill(q, kv, idx, 0.25, sink, backend="torch", query_blocks=bounds)
    check(got, want, FP32_TOL)
    assert bool(torch.cat(taken).all())  # every block split: window common, compressed private
    monkeypatch.setattr(ref, "COMMON_SHARE", 10 ** 6)  # rows two queries share are common: too wide, gathered
    taken.clear()
    check(sparse_mla_prefill(q, kv, idx, 0.25, sink, backend="torch", query_blocks=bounds), want, FP32_TOL)
    assert not bool(torch.cat(taken).any())


def test_wide_blocks_fall_back_and_bad_blocks_are_refused():
    q, kv, idx, tl = make_case(40, 2, 16, 300, 24, seed=21)  # random slots: unions too wide
    want = sparse_mla_prefill_ref(q, kv, idx, 0.5, None, tl)
    check(sparse_mla_prefill(q, kv, idx, 0.5, None, tl, backend="torch", query_blocks=[0, 7, 40]), want, FP32_TOL)
    for bad in ([0, 20], [1, 40], [0, 20, 20, 40]):  # the hint is the torch backend's: it checks it
        with pytest.raises(ValueError, match="query_blocks"):
            sparse_mla_prefill(q, kv, idx, 0.5, None, tl, backend="torch", query_blocks=bad)
