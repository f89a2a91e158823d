"""The Triton kernels (`dsv4batch/kernels/triton/`) against the torch definitions.

Without CUDA they run under Triton's interpreter on the CPU: `TRITON_INTERPRET=1` must be set
before triton itself is imported (its own `triton.language` functions are @triton.jit too), and
other test modules import it (transformers' models do), so `tests/conftest.py` sets it for the
session; the line below covers running this file on its own. With CUDA the same tests run
compiled on the GPU (the `device` fixture's "cuda" case, marked `gpu`). References: the
definitions of `dsv4batch/kernels/ref.py` (float64, independent of every backend) and the torch
backend for attention; `ref.quant_linear_ref`, `quant_linear_reference` / a dense GEMM on the
dequantized weight for the linears (bit for bit where the data make every sum exact, so the comparison is order-free).
"""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit is defined (see above)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dsv4batch.kernels import quant_linear, sparse_mla_prefill  # noqa: E402
from dsv4batch.kernels import triton as ktriton  # noqa: E402
from dsv4batch.kernels.quant_cuda import act_quant  # noqa: E402
from dsv4batch.kernels.quant_reference import dequantize_rows, quant_linear_reference  # noqa: E402
from dsv4batch.kernels.ref import dequantize_ref, quant_linear_ref, sparse_mla_prefill_ref  # noqa: E402
from dsv4batch.kernels.sparse_mla_torch import sparse_mla_prefill_torch  # noqa: E402
from tests.kernels.test_sparse_mla import BF16_TOL, make_case  # noqa: E402

if ktriton.triton_module is None:
    pytest.skip(f"triton is not installed ({ktriton.IMPORT_ERROR})", allow_module_level=True)
attn, quant = ktriton.kernels()  # defined now: interpreted without CUDA
INF = math.inf
FP32_TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(params=[pytest.param("cpu", marks=pytest.mark.skipif(not attn.INTERPRET, reason="compiled kernels")),
                        pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
                            attn.INTERPRET or not torch.cuda.is_available(), reason="needs CUDA")])])
def device(request):
    return torch.device(request.param)


def to(device, *tensors):
    return [None if t is None else t.to(device) for t in tensors]


def run_attention(device, q, kv, idx, scale, sink=None, tl=None, d_v=None, **kw):
    got = attn.sparse_mla_triton(*to(device, q, kv, idx), scale, *to(device, sink, tl), d_v, **kw)
    return [t.cpu() for t in got]


def check_attention(got, want, tol):
    """Values within tol (out) / 1e-5 (max_logits, lse), and every +-inf where the reference has it."""
    for a, b in zip(got[1:], want[1:]):
        assert torch.equal(a.isinf(), b.isinf()) and torch.equal(a == INF, b == INF)
    assert not any(t.isnan().any() for t in got)
    torch.testing.assert_close(got[0].double(), want[0].double(), **tol)
    torch.testing.assert_close(got[1], want[1], **FP32_TOL)
    torch.testing.assert_close(got[2], want[2], **FP32_TOL)


# ---------------------------------------------------------------------------------------- attention

SINKS = {"none": None, "mixed": torch.tensor([-INF, 0.5, INF, 4.0, -1.0])}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sink_kind", ["none", "mixed"])
@pytest.mark.parametrize("splits", [1, 3])
def test_matches_the_definition(device, dtype, sink_kind, splits):
    """5 heads (not a power of two), top-k 40 over 16-slot blocks (not a multiple), every invalid
    index kind, topk_length 0..topk+3, two lonely queries, sinks -inf / finite / +inf; unsplit and
    split-k (3 splits, merged)."""
    q, kv, idx, tl = make_case(8, 5, 64, 57, 40, dtype=dtype, lonely_rows=(3, 7), seed=11)
    tl[5] = 0
    sink = SINKS[sink_kind]
    got = run_attention(device, q, kv, idx, 0.3, sink, tl, splits=splits, config=attn.Config(16, 16))
    assert got[0].dtype == dtype and got[0].shape == (8, 5, 64)
    check_attention(got, sparse_mla_prefill_ref(q, kv, idx, 0.3, sink, tl),
                    FP32_TOL if dtype == torch.float32 else BF16_TOL)
    for i in (3, 5, 7):  # lonely: out 0 (any sink), max_logits -inf, lse +inf
        assert not got[0][i].any() and (got[1][i] == -INF).all() and (got[2][i] == INF).all()
    if sink is not None:  # sink +inf (head 2): out 0; -inf (head 0): no sink at all
        assert not got[0][:, 2].any()
        plain = run_attention(device, q, kv, idx, 0.3, None, tl, splits=splits, config=attn.Config(16, 16))
        assert torch.equal(got[0][:, 0], plain[0][:, 0])


def test_bf16_matches_the_torch_backend(device):
    """bf16 in, DSv4 widths (d 512, 16 heads): within bf16 rounding of the torch backend."""
    q, kv, idx, tl = make_case(3, 16, 512, 90, 48, dtype=torch.bfloat16, seed=2)
    sink = torch.randn(16)
    want = sparse_mla_prefill_torch(q, kv, idx, 512 ** -0.5, sink, tl)
    check_attention(run_attention(device, q, kv, idx, 512 ** -0.5, sink, tl), want, BF16_TOL)


def test_all_slots_invalid_and_topk_length_zero(device):
    q, kv, idx, _ = make_case(4, 3, 32, 20, 24, lonely_rows=(0, 1, 2, 3), seed=4)
    sink = torch.tensor([-INF, 0.0, INF])
    for lengths in (None, torch.zeros(4, dtype=torch.int32)):
        for splits in (1, 2):
            out, ml, lse = run_attention(device, q, kv, idx, 0.5, sink, lengths, splits=splits,
                                         config=attn.Config(16, 16))
            assert not out.any() and (ml == -INF).all() and (lse == INF).all()
    q, kv, idx, _ = make_case(4, 3, 32, 20, 24, seed=4)  # valid slots, but none within topk_length 0
    out, ml, lse = run_attention(device, q, kv, idx, 0.5, sink, torch.zeros(4, dtype=torch.int32))
    assert not out.any() and (ml == -INF).all() and (lse == INF).all()


def test_nan_rows_behind_invalid_slots_never_leak(device):
    """Rows named only by invalid slots (negative, >= s_kv, past topk_length) hold NaN / inf."""
    q, kv, idx, tl = make_case(6, 4, 32, 40, 20, seed=9)
    used = {int(idx[i, 0, j]) for i in range(6) for j in range(int(tl[i])) if 0 <= int(idx[i, 0, j]) < 40}
    poisoned = [r for r in range(40) if r not in used]
    assert poisoned
    bad = kv.clone()
    bad[poisoned] = float("nan")
    bad[poisoned[0]] = INF
    sink = torch.randn(4)
    want = sparse_mla_prefill_ref(q, kv, idx, 0.4, sink, tl)  # the clean kv: poisoned rows are never read
    for splits in (1, 2):
        check_attention(run_attention(device, q, bad, idx, 0.4, sink, tl, splits=splits, config=attn.Config(16, 16)),
                        want, FP32_TOL)


def test_neg_inf_sink_is_bitwise_no_sink(device):
    q, kv, idx, tl = make_case(7, 3, 64, 30, 20, seed=5, lonely_rows=(2,))
    for splits in (1, 2):
        a = run_attention(device, q, kv, idx, 0.25, None, tl, splits=splits, config=attn.Config(16, 16))
        b = run_attention(device, q, kv, idx, 0.25, torch.full((3,), -INF), tl, splits=splits,
                          config=attn.Config(16, 16))
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_d_v_below_d_qk_and_wide_index_dtypes(device):
    """d_v 48 of d_qk 64; int64 indices beyond int32 (2^32 + 3 must not wrap to row 3)."""
    q, kv, idx, tl = make_case(5, 2, 64, 33, 18, seed=6)
    wide = idx.long()
    wide[:, 0, ::3] = 2 ** 32 + 3
    wide[1, 0, 1] = -(2 ** 40)
    sink = torch.tensor([0.3, -0.7])
    got = run_attention(device, q, kv, wide, 0.5, sink, tl, d_v=48)
    assert got[0].shape == (5, 2, 48)
    check_attention(got, sparse_mla_prefill_ref(q, kv, wide, 0.5, sink, tl, d_v=48), FP32_TOL)


# ------------------------------------------------------------------------------------------- linears

GEN = torch.Generator().manual_seed(3)
E8M0 = torch.float8_e8m0fnu


def exact_weight(fmt, out, inp, scale_dtype=E8M0):
    """A stored weight whose products with `exact_x` rows sum exactly in fp32 (any order):
    fp8 codes are integers in [-8, 8], fp4 codes any e2m1 value, scales 2^-4 .. 1."""
    if fmt == "fp8":
        q = torch.randint(-8, 9, (out, inp), generator=GEN).float().to(torch.float8_e4m3fn)
        shape = (-(-out // 128), -(-inp // 128))
    else:
        q = torch.randint(-128, 128, (out, inp // 2), generator=GEN, dtype=torch.int8)
        shape = (out, -(-inp // 32))
    scale = 2.0 ** torch.randint(-4, 1, shape, generator=GEN).float()
    return q, scale.to(scale_dtype)


def exact_x(rows, inp):
    """Integers in [-8, 8], every 128-column group holding an 8: the fp8 path's per-group e4m3
    quantization (power-of-two scale 2^-5) is then exact too."""
    x = torch.randint(-8, 9, (rows, inp), generator=GEN).float()
    x[:, ::128] = 8.0
    return x


def dense(q, scale, fmt):
    want = dequantize_ref(q, scale, fmt)  # fp32, the definition's dequantization
    assert torch.equal(want, dequantize_rows(q, scale, fmt, 0, q.shape[0]))  # the reference backend's too
    return want


LINEARS = [("fp8", "dequant", 200, 300), ("fp8", "fp8", 200, 300), ("fp4", "dequant", 130, 96)]


@pytest.mark.parametrize("fmt,path,out,inp", LINEARS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 37])
def test_linears_bit_for_bit_on_exact_data(device, fmt, path, out, inp, dtype, rows):
    """Partial 128-blocks in both dims (fp8), rows not a multiple of 16 and fp4 rows not of 128:
    equal bit for bit to a dense fp32 GEMM on the dequantized weight (rounded to x's dtype), for
    ue8m0, fp32 and bf16 scales."""
    for scale_dtype in (E8M0, torch.float32, torch.bfloat16)[: 3 if rows == 1 else 1]:
        q, scale = exact_weight(fmt, out, inp, scale_dtype)
        x = exact_x(rows, inp).to(dtype)
        want = F.linear(x.float(), dense(q, scale, fmt)).to(dtype)
        got = quant.quant_linear_triton(*to(device, x, q, scale), fmt, path=path).cpu()
        assert got.dtype == dtype and got.shape == (rows, out)
        assert torch.equal(got, want)


@pytest.mark.parametrize("fmt,inp", [("fp8", 300), ("fp4", 96)])
def test_dequant_path_matches_the_reference(device, fmt, inp):
    """Random data: the definition's (and the reference backend's) result up to fp32 summation
    order (bf16: the reference backend's rounding)."""
    q, scale = exact_weight(fmt, 150, inp)
    x = torch.randn(20, inp, generator=GEN)
    got = quant.quant_linear_triton(*to(device, x, q, scale), fmt, path="dequant").cpu()
    for want in (quant_linear_ref(x, q, scale, fmt), quant_linear_reference(x, q, scale, fmt)):
        torch.testing.assert_close(got, want, atol=1e-6 * float(want.abs().max()), rtol=1e-5)
    got = quant.quant_linear_triton(*to(device, x.bfloat16(), q, scale), fmt, path="dequant").cpu()
    torch.testing.assert_close(got.float(), quant_linear_reference(x.bfloat16(), q, scale, fmt).float(), **BF16_TOL)
    empty = quant.quant_linear_triton(*to(device, x[:0], q, scale), fmt)
    assert empty.shape == (0, 150)


def test_fp8_path_is_the_reference_on_quantized_activations(device):
    """The fp8 path multiplies e4m3(x) exactly: the reference on x's e4m3 round trip up to fp32
    summation order, and within a few percent of the reference on x itself."""
    q, scale = exact_weight("fp8", 160, 256)
    x = torch.randn(24, 256, generator=GEN).bfloat16()
    xq, sx = act_quant(x)
    x_back = (xq.float().view(24, 2, 128) * sx[..., None]).view(24, 256)
    got = quant.quant_linear_triton(*to(device, x, q, scale), "fp8", path="fp8").cpu().float()
    want = quant_linear_reference(x_back, q, scale, "fp8")
    torch.testing.assert_close(got, want.bfloat16().float(), atol=1e-2, rtol=1e-2)
    ref = quant_linear_reference(x.float(), q, scale, "fp8")
    assert float((got - ref).norm() / ref.norm()) < 0.05


# ------------------------------------------------------------------------------------ backend choice

def test_attention_backend_choice(monkeypatch):
    """Forced "triton" runs the kernel (the interpreter on CPU tensors); "auto" never takes the
    interpreter; forcing it where it cannot run raises with the reason."""
    from dsv4batch.kernels import attention_backend, use_kernels

    q, kv, idx, tl = make_case(4, 2, 32, 20, 16, seed=1)
    direct = attn.sparse_mla_triton(q, kv, idx, 0.5, None, tl)
    if attn.INTERPRET:
        for a, b in zip(sparse_mla_prefill(q, kv, idx, 0.5, None, tl, backend="triton"), direct):
            assert torch.equal(a, b)
        assert attention_backend("auto", "cpu", torch.float32, 32) != "triton"
        assert attention_backend("triton", "cpu", torch.float32, 32) == "triton"
        with use_kernels(attention="triton"):
            assert torch.equal(sparse_mla_prefill(q, kv, idx, 0.5, None, tl)[0], direct[0])
    with pytest.raises(RuntimeError, match="triton backend requested but unavailable: q dtype torch.float64"):
        sparse_mla_prefill(q.double(), kv.double(), idx, 0.5, backend="triton")
    with pytest.raises(RuntimeError, match="head dims up to 512"):
        sparse_mla_prefill(torch.zeros(1, 1, 576), torch.zeros(2, 1, 576), idx[:1], 0.5, backend="triton")
    monkeypatch.setattr(ktriton, "interpreting", lambda: False)
    with pytest.raises(RuntimeError, match="triton backend requested but unavailable: tensors on cpu; .* needs CUDA"):
        sparse_mla_prefill(q, kv, idx, 0.5, backend="triton")
    monkeypatch.setattr(ktriton, "triton_module", None)
    monkeypatch.setattr(ktriton, "IMPORT_ERROR", "ModuleNotFoundError: No module named 'triton'")
    with pytest.raises(RuntimeError, match="triton import failed"):
        sparse_mla_prefill(q, kv, idx, 0.5, backend="triton")
    assert attention_backend("auto", "cpu", torch.float32, 32) in ("cpu", "torch")


def test_quant_backend_choice(monkeypatch):
    from dsv4batch.kernels import quant_backends, use_kernels

    q, scale = exact_weight("fp4", 64, 64)
    x = torch.randn(16, 64, generator=GEN)
    reference = quant_linear_reference(x, q, scale, "fp4")
    assert torch.equal(quant_linear(x, q, scale, "fp4"), reference)  # auto on the CPU: the reference
    assert quant_backends(x, q, "fp4") == ["reference"]
    if attn.INTERPRET:
        direct = quant.quant_linear_triton(x, q, scale, "fp4")
        assert torch.equal(quant_linear(x, q, scale, "fp4", backend="triton"), direct)
        with use_kernels(quant="triton"):
            assert torch.equal(quant_linear(x, q, scale, "fp4"), direct)
    with pytest.raises(RuntimeError, match="triton quant backend requested but unavailable: x dtype torch.float64"):
        quant_linear(x.double(), q, scale, "fp4", backend="triton")
    monkeypatch.setattr(ktriton, "interpreting", lambda: False)
    with pytest.raises(RuntimeError, match="triton quant backend requested but unavailable: tensors on cpu"):
        quant_linear(x, q, scale, "fp4", backend="triton")


def test_probes_pass(device):
    """The one-time checks that gate "auto" on a GPU (`triton/probe.py`) pass here."""
    from dsv4batch.kernels.triton.probe import probe

    assert probe("attention", device) is None and probe("quant", device) is None


# ------------------------------------------------------------------------------------- whole model

def quantize_in_memory(model):
    """Hold the model's native FP8 linears and routed experts (FP4) as the checkpoint would store
    them (`QuantLinear`s filled from the seeded weights), in place; returns the model."""
    from dsv4batch.model.layers import Experts, Linear, QuantLinear
    from dsv4batch.model.quant import NATIVE_FP8, quantize_fp4, quantize_fp8

    for name, module in list(model.named_modules()):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(module, Linear) and NATIVE_FP8.search(name + ".weight"):
            qw, s = quantize_fp8(module.weight.detach())
            new = QuantLinear(module.in_features, module.out_features, "fp8")
            new.qweight, new.scale = qw, s
            setattr(parent, attr, new)
        elif isinstance(module, Experts):
            for w in ("w1", "w2", "w3"):
                stacked = getattr(module, w).detach()
                pairs = [quantize_fp4(e) for e in stacked]
                new = QuantLinear(stacked.shape[2], stacked.shape[1], "fp4", experts=stacked.shape[0])
                new.qweight, new.scale = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
                delattr(module, w)
                setattr(module, w, new)
    return model


@pytest.fixture(scope="module")
def tiny_stored():
    from dsv4batch.model import TINY
    from dsv4batch.model.loader import load_model

    return quantize_in_memory(load_model(TINY))


def test_tiny_model_on_the_triton_backends_equals_torch(device, tiny_stored):
    """`tiny` (all three layer types, FP8 linears, FP4 experts) with both Triton backends forced:
    scores (`Engine.score`) and greedy tokens with their logprobs (`Engine.generate`: prefill
    chunks, then decode steps over the cache pool) equal the torch path's to 1e-4."""
    from dsv4batch.kernels import use_kernels
    from dsv4batch.model import Engine, EngineConfig
    from dsv4batch.model.sampling import SamplingParams

    model = tiny_stored.to(device)
    # short: every kernel launch costs the interpreter ~0.1 s, and a step launches ~150 linears
    batch, prompts = [[0, 5, 17, 300, 4000, 12]], [[0, 77, 1000, 3]]
    params = SamplingParams(max_tokens=2, ignore_eos=True)  # a prefill step, then a decode step
    config = dict(max_num_batched_tokens=64, max_model_len=64, max_num_seqs=2)
    with use_kernels(quant="reference"):  # an engine keeps the kernels active when it was made
        torch_engine = Engine(model, EngineConfig(attn_backend="torch", **config))
    want, want_gen = torch_engine.score(batch)[0], torch_engine.generate(prompts, params)[0]
    with use_kernels(quant="triton"):
        engine = Engine(model, EngineConfig(attn_backend="triton", **config))
    assert engine.attn_kernel == "triton"
    got, got_gen = engine.score(batch)[0], engine.generate(prompts, params)[0]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
    for a, b in zip(got_gen, want_gen):
        assert np.array_equal(a.token_ids, b.token_ids)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------ compiled (GPU) only

@pytest.mark.gpu
@pytest.mark.skipif(attn.INTERPRET or not torch.cuda.is_available(), reason="needs CUDA (compiled kernels)")
def test_v4_flash_shapes_on_the_gpu():
    """V4-Flash widths, bf16: 64 heads, d 512, top-k 512 prefill (unsplit) and a 4-query decode
    batch (split-k chosen by `num_splits`) within bf16 rounding of the torch backend; 16-bit x
    takes the fp8 path on sm89+."""
    dev = torch.device("cuda")
    q, kv, idx, tl = make_case(64, 64, 512, 2048, 512, dtype=torch.bfloat16, lonely_rows=(5,), seed=21)
    q, kv, idx, tl = to(dev, q, kv, idx, tl)
    sink = torch.randn(64, device=dev)
    want = [t.cpu() for t in sparse_mla_prefill_torch(q, kv, idx, 512 ** -0.5, sink, tl)]
    check_attention([t.cpu() for t in attn.sparse_mla_triton(q, kv, idx, 512 ** -0.5, sink, tl)], want, BF16_TOL)
    assert attn.num_splits(4, 1, 512, dev) > 1
    got = [t.cpu() for t in attn.sparse_mla_triton(q[:4], kv, idx[:4], 512 ** -0.5, sink, tl[:4])]
    check_attention(got, [t[:4] for t in want], BF16_TOL)
    x = torch.randn(8, 256, device=dev, dtype=torch.bfloat16)
    want_path = "fp8" if torch.cuda.get_device_capability() >= (8, 9) else "dequant"
    assert quant.default_path(x, "fp8") == want_path and quant.default_path(x, "fp4") == "dequant"
    assert ktriton.probe_failure("attention", dev) is None and ktriton.probe_failure("quant", dev) is None
