"""`kernels.dense_linear`: x @ weight.T through oneDNN or BLAS, the same maths and the same
batch-invariance either way, and the `KernelConfig.gemm` switch."""

import pytest
import torch
import torch.nn.functional as F

from dsv4batch.kernels import dense
from dsv4batch.kernels.dense import bf16_linear, dense_linear, onednn_available, pack_weight


@pytest.fixture(params=["auto", "blas"])
def gemm(request, kernels):
    kernels(gemm=request.param)
    return request.param


def test_equals_an_fp64_product_on_odd_shapes_strided_inputs_and_row_slices(gemm):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(1357, 70, generator=gen)
    x = torch.randn(70, 45, generator=gen).t()  # [45, 70], not contiguous
    for rows in (slice(0, 1357), slice(333, 1005)):  # a weight's row slice is what the head passes
        got = dense_linear(x, weight[rows])
        want = x.double() @ weight[rows].double().t()
        assert got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def test_a_rows_bits_do_not_depend_on_its_place_at_a_fixed_shape(gemm):
    # the engine's GEMMs keep one shape per call site (MIN_ROWS padding, fixed head slices)
    gen = torch.Generator().manual_seed(1)
    for rows, k, n in ((512, 256, 2048), (64, 128, 1005), (16, 2048, 128)):
        x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
        ref = dense_linear(x, w)
        for shift in (1, 7, rows // 2, rows - 1):
            assert torch.equal(dense_linear(x.roll(shift, 0), w).roll(-shift, 0), ref), (rows, k, n, shift)


def test_blas_is_f_linear_and_other_dtypes_or_grads_take_it(kernels):
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(20, 33, generator=gen), torch.randn(40, 33, generator=gen)
    kernels(gemm="blas")
    assert torch.equal(dense_linear(x, w), F.linear(x, w))
    kernels(gemm="auto")
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(dense_linear(xb, wb), F.linear(xb, wb))
    wg = w.clone().requires_grad_()
    y = dense_linear(x, wg)  # grad mode with a trainable weight: autograd needs F.linear
    y.sum().backward()
    torch.testing.assert_close(wg.grad, x.sum(0).expand(40, 33))


def test_the_switch_rejects_unknown_values_and_a_forced_onednn_that_cannot_run(monkeypatch, kernels):
    x, w = torch.ones(4, 8), torch.ones(3, 8)
    with pytest.raises(ValueError, match="KernelConfig.gemm"):
        kernels(gemm="cublas")
    kernels(gemm="onednn")
    monkeypatch.setattr(dense, "_onednn_ok", False)
    with pytest.raises(RuntimeError, match="oneDNN"):
        dense_linear(x, w)
    kernels(gemm="auto")  # auto falls back to BLAS instead
    assert torch.equal(dense_linear(x, w), torch.full((4, 3), 8.0))


def test_onednn_runs_on_this_build():
    # torch's CPU wheels ship oneDNN: if this fails the engine silently runs on BLAS
    assert onednn_available()


def test_a_packed_weight_gives_the_plain_weights_bits_and_is_ignored_off_onednn(kernels):
    from dsv4batch.kernels import pack_weight

    gen = torch.Generator().manual_seed(3)
    for rows, k, n in ((512, 128, 2048), (512, 256, 256), (40, 70, 1005)):
        x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
        packed = pack_weight(w, rows)
        assert packed is not None and packed.shape == w.shape
        assert torch.equal(dense_linear(x, w, packed), dense_linear(x, w)), (rows, k, n)
        assert torch.equal(dense_linear(x[:7], w, packed), dense_linear(x[:7], w))  # another row count
    kernels(gemm="blas")
    assert pack_weight(w, 40) is None
    assert torch.equal(dense_linear(x, w, packed), F.linear(x, w))  # BLAS multiplies by the weight itself
    kernels(gemm="auto")
    assert pack_weight(w.bfloat16(), 40) is None
    assert pack_weight(w.clone().requires_grad_(), 40) is None  # grad mode: F.linear's autograd


def test_bf16_products_stay_near_fp32_and_keep_a_rows_bits(kernels):
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(512, 256, generator=gen), torch.randn(2048, 256, generator=gen) * 0.05
    if not dense.bf16_available():
        assert pack_weight(w, 512, is_bf16=True) is None
        pytest.skip("no bf16 GEMM on this CPU (oneDNN needs AVX512-BF16 or AMX)")
    packed = pack_weight(w, 512, is_bf16=True)
    xb = x.bfloat16()
    got = bf16_linear(xb, packed)
    assert got.dtype == torch.bfloat16 and got.shape == (512, 2048)
    # the inputs' own rounding, summed exactly: what fp32 sums of bf16 products approach
    rounded = xb.double() @ w.bfloat16().double().t()
    torch.testing.assert_close(got.double(), rounded, rtol=2 ** -8, atol=1e-3)  # one bf16 rounding
    want = x.double() @ w.double().t()
    torch.testing.assert_close(got.double(), want, rtol=2 ** -7, atol=0.05)  # |x| w: sum |x w| ~ 10 here
    for shift in (1, 255):
        assert torch.equal(bf16_linear(xb.roll(shift, 0), packed).roll(-shift, 0), got)
    assert pack_weight(w.clone().requires_grad_(), 512, is_bf16=True) is None
    kernels(gemm="blas")  # a forced BLAS is fp32 only
    assert not dense.bf16_available() and pack_weight(w, 512, is_bf16=True) is None
