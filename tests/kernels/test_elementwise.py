"""The token-wise C++ passes (`kernels/csrc/elementwise.cpp`) against their torch definitions in
`model/layers.py`: RoPE, mHC's weights (Sinkhorn included) and collapse, and the stream update;
each up to fp32 rounding, and a token's bits independent of the tokens beside it."""

import pytest
import torch

import dsv4batch.model.layers as layers
from dsv4batch.kernels import cpu as cpu_mod
from dsv4batch.kernels import elementwise as ew_mod
from tests.kernels.isas import isa  # noqa: F401 - the fixture the tests below use


@pytest.fixture(autouse=True)
def built():
    assert cpu_mod.available(), cpu_mod.build_error()  # CI has a compiler: a failed build fails


@pytest.fixture
def torch_paths(monkeypatch):
    """Runs a call on the torch definitions (the layers' fallback when no kernel is built)."""
    def run(fn, *args):
        with monkeypatch.context() as m:
            m.setattr(layers, "elementwise_supported", lambda *a: False)
            return fn(*args)
    return run


@pytest.mark.usefixtures("isa")
def test_rope_equals_the_torch_path_and_touches_only_the_rope_dims(torch_paths):
    gen = torch.Generator().manual_seed(0)
    rope = layers.Rope(1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16)), 1.3)
    cos, sin = rope.cos_sin(torch.randint(0, 5000, (37,), generator=gen))
    for shape in ((37, 3, 40), (37, 16)):
        x = torch.randn(shape, generator=gen)
        got, ref = layers.Rope.apply(x.clone(), cos, sin), torch_paths(layers.Rope.apply, x.clone(), cos, sin)
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)
        assert torch.equal(got[..., :-16], x[..., :-16])
        # undoing with -sin gives the input back (as attention does with its output)
        torch.testing.assert_close(layers.Rope.apply(got, cos / 1.3 ** 2, -sin / 1.3 ** 2), x, atol=1e-5, rtol=1e-5)
    alone = layers.Rope.apply(x[5:6].clone(), cos[5:6], sin[5:6])
    assert torch.equal(alone[0], layers.Rope.apply(x.clone(), cos, sin)[5])


@pytest.mark.parametrize("hc", [4, 2])
@pytest.mark.usefixtures("isa")
def test_hc_pre_and_post_equal_the_torch_paths(torch_paths, hc):
    gen = torch.Generator().manual_seed(hc)
    T, H = 29, 48
    x = torch.randn(T, hc, H, generator=gen)
    fn = torch.randn((2 + hc) * hc, hc * H, generator=gen) / (hc * H) ** 0.5
    base, scale = torch.randn((2 + hc) * hc, generator=gen), torch.rand(3, generator=gen) + 0.5
    args = (x, fn, base, scale, hc, 20, 1e-6, 1e-6)
    got, ref = layers.hc_pre(*args), torch_paths(layers.hc_pre, *args)
    for g, r in zip(got, ref):
        assert g.shape == r.shape
        torch.testing.assert_close(g, r, atol=2e-6, rtol=2e-5)
    post, comb, _ = got
    torch.testing.assert_close(comb.sum(0), torch.ones(hc, T), atol=1e-5, rtol=0)  # doubly stochastic
    out = torch.randn(T, H, generator=gen)
    new, new_ref = layers.hc_post(x, out, post, comb), torch_paths(layers.hc_post, x, out, post, comb)
    torch.testing.assert_close(new, new_ref, atol=2e-6, rtol=2e-5)
    # a token alone: the same bits as among the others
    alone = layers.hc_pre(x[7:8].contiguous(), *args[1:])
    assert all(torch.equal(a, b) for a, b in zip((alone[0][0], alone[1][..., 0], alone[2][0]),
                                                 (got[0][7], got[1][..., 7], got[2][7])))
    w = torch.rand(T, hc, generator=gen)
    torch.testing.assert_close(layers.hc_collapse(w, x), torch_paths(layers.hc_collapse, w, x), atol=1e-6, rtol=1e-6)


def test_other_dtypes_and_views_take_the_torch_paths():
    x = torch.randn(8, 4, 16)
    assert not ew_mod.elementwise_supported(x.double())
    assert not ew_mod.elementwise_supported(x.transpose(0, 1))
    assert not ew_mod.elementwise_supported(x.bfloat16())
    assert ew_mod.elementwise_supported(x, x[0].contiguous())


@pytest.mark.usefixtures("isa")
def test_rms_norm_and_swiglu_equal_the_torch_paths(torch_paths):
    gen = torch.Generator().manual_seed(4)
    for shape in ((33, 64), (5, 3, 40)):  # 40: a vector tail
        x, w = 3 * torch.randn(shape, generator=gen), torch.rand(shape[-1], generator=gen) + 0.5
        norm = layers.RMSNorm(shape[-1], 1e-6)
        norm.weight.data.copy_(w)
        with torch.no_grad():
            got, ref = norm(x), torch_paths(norm, x)
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
            assert torch.equal(norm(x.view(-1, shape[-1])[4:5].clone())[0], got.view(-1, shape[-1])[4])
    gate, up = 8 * torch.randn(50, 24, generator=gen), 8 * torch.randn(50, 24, generator=gen)
    gate[0, :3] = torch.tensor([float("nan"), 30.0, -30.0])
    up[1, :2] = torch.tensor([float("nan"), -30.0])
    got, ref = layers.swiglu(gate, up, 7.0), torch_paths(layers.swiglu, gate, up, 7.0)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert got[0, 0].isnan() and got[1, 0].isnan()


def test_the_switch_keeps_the_torch_paths(kernels):
    x = torch.randn(8, 4, 16)
    assert ew_mod.elementwise_supported(x)
    kernels(elementwise="torch")
    assert not ew_mod.elementwise_supported(x)
    with pytest.raises(ValueError, match="KernelConfig.elementwise"):
        kernels(elementwise="fast")
