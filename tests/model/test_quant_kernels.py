"""`kernels.quant_linear`: the reference backend against a dense GEMM on independently dequantized
weights and against the definition (`kernels/ref.py`), its slice-at-a-time property, its errors,
and the CUDA backend (marked `gpu`)."""

import pytest
import torch
import torch.nn.functional as F

from dsv4batch.kernels import KernelConfig, quant_backends, quant_cuda, quant_linear, quant_reference, use_kernels
from dsv4batch.kernels.ref import dequantize_ref, quant_linear_ref
from dsv4batch.kernels.rows import MIN_ROWS
from dsv4batch.model.layers import QuantLinear
from tests.model.test_quant_layout import quantize_fp4, quantize_fp8

GEN = torch.Generator().manual_seed(7)
# (fmt, out, in): partial FP8 blocks in both dims; FP4 rows not a multiple of 128
CASES = [("fp8", 200, 300), ("fp8", 128, 256), ("fp4", 130, 96), ("fp4", 256, 512)]


def stored(fmt, out, inp, scale_dtype=torch.float8_e8m0fnu):
    w = torch.randn(out, inp, generator=GEN) / inp ** 0.5
    q, scale, dense = (quantize_fp8 if fmt == "fp8" else quantize_fp4)(w)
    return q, scale.float().to(scale_dtype), dense


@pytest.mark.parametrize("fmt,out,inp", CASES)
@pytest.mark.parametrize("rows", [0, 1, 17, 300])
def test_reference_is_a_gemm_on_the_dequantized_weight(fmt, out, inp, rows):
    q, scale, dense = stored(fmt, out, inp)
    x = torch.randn(rows, inp, generator=GEN)
    y = quant_linear(x, q, scale, fmt, backend="reference")
    assert y.shape == (rows, out) and y.dtype == torch.float32
    torch.testing.assert_close(y, F.linear(x, dense), atol=1e-5, rtol=1e-5)
    # fp32 scales give the same weight as ue8m0 ones (they hold the same powers of two)
    torch.testing.assert_close(quant_linear(x, q, scale.float(), fmt), y, atol=0, rtol=0)
    # bf16 activations: the weight is dequantized to bf16 per slice, output bf16
    yb = quant_linear(x.bfloat16(), q, scale, fmt)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), F.linear(x.bfloat16(), dense.bfloat16()).float(), atol=2e-2, rtol=2e-2)


def test_reference_never_dequantizes_more_than_one_block_row(monkeypatch):
    q, scale, dense = stored("fp8", 1000, 256)
    seen = []
    original = quant_reference.dequantize_rows

    def spy(qweight, s, fmt, start, stop, dtype=torch.float32):
        seen.append(stop - start)
        return original(qweight, s, fmt, start, stop, dtype)

    monkeypatch.setattr(quant_reference, "dequantize_rows", spy)
    x = torch.randn(20, 256, generator=GEN)
    torch.testing.assert_close(quant_linear(x, q, scale, "fp8", backend="reference"), F.linear(x, dense),
                               atol=1e-5, rtol=1e-5)
    assert seen == [128] * 7 + [1000 - 7 * 128]


def test_rows_do_not_depend_on_their_batch_mates():
    """Through `QuantLinear` (>= MIN_ROWS rows per GEMM) a row's output is bit-identical alone or batched."""
    for fmt, out, inp in CASES:
        q, scale, _ = stored(fmt, out, inp)
        layer = QuantLinear(inp, out, fmt, qdtype=q.dtype, scale_dtype=scale.dtype)
        layer.qweight.copy_(q)
        layer.scale.copy_(scale)
        x = torch.randn(70, inp, generator=GEN)
        full = layer(x)
        for n in (1, 3, MIN_ROWS, 40):
            assert torch.equal(layer(x[:n]), full[:n])
        torch.testing.assert_close(layer.weight, stored_dense(fmt, q, scale))


def stored_dense(fmt, q, scale):
    return quant_reference.dequantize_into(torch.empty(q.shape[0], quant_reference.in_features_of(q, fmt)), q, scale, fmt)


def test_bad_calls_are_refused():
    q, scale, _ = stored("fp8", 128, 256)
    x = torch.randn(4, 256)
    with pytest.raises(ValueError, match="fmt must be one of"):
        quant_linear(x, q, scale, "int4")
    with pytest.raises(ValueError, match=r"needs scale \(1, 2\), got \(2, 2\)"):
        quant_linear(x, q, torch.ones(2, 2), "fp8")
    with pytest.raises(ValueError, match=r"x must be \[n, 256\]"):
        quant_linear(torch.randn(4, 255), q, scale, "fp8")
    with pytest.raises(ValueError, match="fp4 qweight must be 2-D"):
        quant_linear(x, q, scale, "fp4")
    with pytest.raises(ValueError, match="backend must be one of"):
        quant_linear(x, q, scale, "fp8", backend="bogus")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="cuda quant backend requested but unavailable: x on cpu"):
            quant_linear(x, q, scale, "fp8", backend="cuda")


def test_kernel_config_chooses_the_backend():
    q, scale, dense = stored("fp8", 128, 256)
    x = torch.randn(16, 256, generator=GEN)
    with use_kernels(quant="reference"):
        torch.testing.assert_close(quant_linear(x, q, scale, "fp8"), F.linear(x, dense), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="KernelConfig.quant must be one of .* got 'bogus'"):
        KernelConfig(quant="bogus")


@pytest.mark.parametrize("fmt,out,inp", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_backend_matches_the_definition(fmt, out, inp, dtype):
    """`ref.quant_linear_ref` (the whole weight dequantized, one fp64 GEMM) against the reference
    backend (slice by slice in x's dtype) and auto (the reference here), up to x's rounding."""
    q, scale, dense = stored(fmt, out, inp)
    x = torch.randn(37, inp, generator=GEN).to(dtype)
    want = quant_linear_ref(x, q, scale, fmt)
    assert want.dtype == dtype and torch.equal(dequantize_ref(q, scale, fmt), dense)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for backend in quant_backends(x, q, fmt) + ["auto"]:
        torch.testing.assert_close(quant_linear(x, q, scale, fmt, backend=backend).float(), want.float(), **tol)


@pytest.mark.parametrize("m,k,n", [(20, 256, 384), (16, 640, 128), (1, 128, 128), (33, 4096, 1024)])
def test_cuda_arguments_meet_torch_block_scaled_layout_rules(m, k, n):
    """On the meta device torch runs `scaled_mm`'s shape/stride/dtype checks without a GPU."""
    if quant_cuda.scaled_mm is None:
        pytest.skip(quant_cuda.IMPORT_ERROR)
    x = torch.empty(m, k, dtype=torch.bfloat16, device="meta")
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn, device="meta")
    scale = torch.empty(n // 128, k // 128, dtype=torch.float8_e8m0fnu, device="meta")
    y = quant_cuda.scaled_mm(*quant_cuda.scaled_mm_args(x, q, scale), output_dtype=torch.bfloat16)
    assert tuple(y.shape) == (-(-m // 16) * 16, n)


def test_activation_quantization_round_trips():
    x = torch.randn(5, 384, generator=GEN) * 3
    q, s = quant_cuda.act_quant(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 3)
    assert torch.equal(s, torch.exp2(torch.round(torch.log2(s))))  # powers of two (ue8m0)
    back = (q.float().view(5, 3, 128) * s[..., None]).view(5, 384)
    torch.testing.assert_close(back, x, atol=0, rtol=2 ** -3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m,k,n", [(16, 256, 256), (40, 1024, 512), (300, 4096, 2048)])
def test_cuda_backend_matches_the_reference(m, k, n):
    """FP8 activations: within a few percent of the reference, and rows independent of batch-mates."""
    q, scale, _ = stored("fp8", n, k)
    q, scale = q.cuda(), scale.cuda()
    x = torch.randn(m, k, generator=GEN).cuda().bfloat16()
    assert quant_backends(x, q, "fp8")[:2] == ["reference", "cuda"]
    y = quant_linear(x, q, scale, "fp8", backend="cuda")
    ref = quant_linear(x.float(), q, scale, "fp8", backend="reference")
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert float((y.float() - ref).norm() / ref.norm()) < 0.05
    assert torch.equal(quant_linear(x[:16], q, scale, "fp8", backend="cuda"), y[:16])
