"""One-time checks that the Triton kernels agree with the torch definitions on a device.

``"auto"`` takes the Triton backends on a GPU only after this passed there (a GPU this code was
never run on must not silently corrupt scores): the attention kernel on a small bf16 DSv4-width
problem (d 512, sink, invalid slots, both the unsplit and the split-k path), the linears on an
FP8 and an FP4 weight with bf16 activations.
"""

from __future__ import annotations

from typing import Optional

import torch

ATTN_TOL = 2e-2  # relative error of bf16 outputs (P rounded to bf16 for the second GEMM)
QUANT_TOL = 0.1  # fp8 activations: ~2^-4 per element, ~1e-2 on a row's sums


def probe(kind: str, device: torch.device) -> Optional[str]:
    """None when kernel ``kind`` ("attention" / "quant") agrees with torch on ``device``, else why."""
    try:
        err = _attention_error(device) if kind == "attention" else _quant_error(device)
    except Exception as exc:  # a compile or launch failure: report it, take another backend
        return f"probe raised {type(exc).__name__}: {exc}"
    tol = ATTN_TOL if kind == "attention" else QUANT_TOL
    return None if err < tol else f"probe relative error {err:.3g} vs the torch definition (tolerance {tol})"


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative error over want's finite entries (NaN if got is not finite there; +-inf must match)."""
    got, want = got.float(), want.float()
    fin = want.isfinite()
    if not torch.equal(got[~fin], want[~fin]):
        return float("inf")
    return float((got[fin] - want[fin]).norm() / want[fin].norm().clamp(min=1e-30))


def _attention_error(device: torch.device) -> float:
    from ..sparse_mla_torch import sparse_mla_prefill_torch
    from .attention import sparse_mla_triton

    gen = torch.Generator().manual_seed(0)
    s_q, h_q, d, s_kv, topk = 4, 16, 512, 300, 256
    q = torch.randn(s_q, h_q, d, generator=gen).to(device, torch.bfloat16)
    kv = torch.randn(s_kv, 1, d, generator=gen).to(device, torch.bfloat16)
    idx = torch.randint(-1, s_kv + 5, (s_q, 1, topk), generator=gen, dtype=torch.int32).to(device)
    sink = torch.randn(h_q, generator=gen).to(device)
    want = sparse_mla_prefill_torch(q, kv, idx, d ** -0.5, sink)
    errs = []
    for splits in (1, 2):
        got = sparse_mla_triton(q, kv, idx, d ** -0.5, sink, splits=splits)
        errs += [_rel(got[0], want[0]), _rel(got[2], want[2]) * 100]  # lse: far tighter than out
    return max(errs)


def _quant_error(device: torch.device) -> float:
    from ..quant_reference import quant_linear_reference
    from .quant import quant_linear_triton

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 256, generator=gen).to(device, torch.bfloat16)
    errs = []
    for fmt, cols in (("fp8", 256), ("fp4", 128)):
        w = torch.randint(0, 256, (192, cols), generator=gen, dtype=torch.uint8)
        if fmt == "fp8":
            w = w.view(torch.float8_e4m3fn)
            w = torch.where(w.float().isnan(), 0.0, w.float()).to(torch.float8_e4m3fn)
            scale = torch.full((2, 2), 2.0 ** -7)
        else:
            scale = torch.full((192, 8), 2.0 ** -3)
        w, scale = w.to(device), scale.to(device)
        want = quant_linear_reference(x.float(), w, scale, fmt)
        errs.append(_rel(quant_linear_triton(x, w, scale, fmt), want))
    return max(errs)
