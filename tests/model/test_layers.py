"""`layers.Rope.apply` against a complex-number rotation in fp64 (interleaved pairs)."""

import torch

from dsv4batch.model.layers import Rope


def _reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(x0 + i x1) * (cos + i sin) on each (even, odd) pair of the last rd dims, in fp64."""
    rd = cos.shape[-1]
    out = x.double().clone()
    pairs = torch.view_as_complex(out[..., -rd:].unflatten(-1, (rd // 2, 2)).contiguous())
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (rd // 2,)
    turn = torch.complex(cos[:, 0::2].double(), sin[:, 0::2].double()).reshape(shape)
    out[..., -rd:] = torch.view_as_real(pairs * turn).flatten(-2)
    return out


def test_rotates_the_last_dims_in_place_like_a_complex_product_for_fp32_and_bf16():
    gen = torch.Generator().manual_seed(0)
    rope = Rope(1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16), 0.9)
    cos, sin = rope.cos_sin(torch.arange(37) * 5)
    for shape in ((37, 3, 40), (37, 24)):
        x = torch.randn(*shape, generator=gen)
        want = _reference(x, cos, sin)
        y = x.clone()
        assert Rope.apply(y, cos, sin) is y  # in place
        torch.testing.assert_close(y.double(), want, rtol=0, atol=1e-6)
        assert torch.equal(y[..., :-16], x[..., :-16])  # the other dims untouched
        back = Rope.apply(y.clone(), cos, -sin)  # the backward rotation (attention's output)
        torch.testing.assert_close(back.double(), _reference(y, cos, -sin), rtol=0, atol=1e-6)
        xb = x.bfloat16()
        torch.testing.assert_close(Rope.apply(xb.clone(), cos, sin).double(), _reference(xb, cos, sin),
                                   rtol=0, atol=2e-2)


def test_a_rows_bits_do_not_depend_on_how_many_rows_are_rotated():
    gen = torch.Generator().manual_seed(1)
    rope = Rope(1.0 / 10000 ** (torch.arange(0, 64, 2).float() / 64), 1.0)
    cos, sin = rope.cos_sin(torch.arange(300))
    x = torch.randn(300, 8, 512, generator=gen)
    whole = Rope.apply(x.clone(), cos, sin)
    for a, b in ((0, 1), (7, 40), (100, 300)):
        assert torch.equal(Rope.apply(x[a:b].clone(), cos[a:b], sin[a:b]), whole[a:b]), (a, b)
