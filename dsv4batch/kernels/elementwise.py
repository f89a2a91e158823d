"""The block's token-wise fp32 passes on the CPU, one C++ pass each (``csrc/elementwise.cpp``,
built with the other CPU kernels by ``cpu.py``): RoPE, mHC's weights / collapse / stream update,
RMSNorm and SwiGLU. Definitions: the torch paths in ``model/layers.py``, which call these where
:func:`elementwise_supported` and keep their own code as the fallback. Each equals its definition
up to fp32 rounding, and a row's bits never depend on the rows beside it (tests:
``tests/kernels/test_elementwise.py``). ``DSV4BATCH_CPU_ELEMENTWISE=torch`` keeps the torch paths
(``auto``, the default: these kernels wherever they can run).
"""

from __future__ import annotations

import torch

from .cpu import library
from .env import env_choice

ENV_ELEMENTWISE = "DSV4BATCH_CPU_ELEMENTWISE"


def _ew_threads(work: int) -> int:
    """Threads for a token-wise pass touching `work` elements: one per 16M (at least one). These
    passes are memory-bound and short (~1 ms): a second thread mostly contends with torch's
    OpenMP workers, still spinning from the op before, for the same cores."""
    return max(1, min(torch.get_num_threads(), work >> 24))


def elementwise_supported(*tensors: torch.Tensor) -> bool:
    """Whether the token-wise kernels can take these tensors as they are: all fp32, contiguous,
    on the CPU, no grad, the library built, and ``DSV4BATCH_CPU_ELEMENTWISE`` not ``torch``."""
    if env_choice(ENV_ELEMENTWISE, ("auto", "torch")) == "torch":
        return False
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
               and not (t.requires_grad and torch.is_grad_enabled()) for t in tensors) and library() is not None


def rope_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`model.layers.Rope.apply` in place: x [n, ..., d], cos/sin [n, rd] (`elementwise_supported`
    for all three) -> x."""
    n, d, rd = x.shape[0], x.shape[-1], cos.shape[-1]
    if x.numel():
        library().rope_inplace(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), n, x.numel() // max(n * d, 1), d, rd,
                               _ew_threads(x.numel() // d * rd))
    return x


def hc_collapse_cpu(weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`model.layers.hc_collapse`: weights [T, hc], x [T, hc, H] -> [T, H]."""
    n, hc, h = x.shape
    out = torch.empty(n, h, dtype=torch.float32)
    if out.numel():
        library().hc_collapse_fwd(x.data_ptr(), weights.data_ptr(), out.data_ptr(), n, hc, h, _ew_threads(x.numel()))
    return out


def hc_post_cpu(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """`model.layers.hc_post`: x [T, hc, H], out [T, H], post [T, hc], comb [hc, hc, T] -> [T, hc, H]."""
    n, hc, h = x.shape
    new = torch.empty(n, hc, h, dtype=torch.float32)
    if new.numel():
        library().hc_post_fwd(x.data_ptr(), out.data_ptr(), post.data_ptr(), comb.data_ptr(), new.data_ptr(), n, hc,
                              h, _ew_threads(x.numel() * (hc + 1)))
    return new


HC_MAX = 8  # streams csrc/elementwise.cpp's hc_pre_fwd holds per token


def hc_pre_cpu(mixes: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int,
               eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`model.layers.hc_pre` after its GEMM: mixes [T, (2 + hc) * hc], x [T, hc, H] (hc <= HC_MAX),
    scale [3], base [(2 + hc) * hc] -> (post [T, hc], comb [hc, hc, T], collapsed [T, H])."""
    n, hc, h = x.shape
    post, comb, collapsed = torch.empty(n, hc), torch.empty(hc, hc, n), torch.empty(n, h)
    if n:
        library().hc_pre_fwd(mixes.data_ptr(), x.data_ptr(), scale.data_ptr(), base.data_ptr(), n, hc, h, iters,
                             float(eps), post.data_ptr(), comb.data_ptr(), collapsed.data_ptr(),
                             _ew_threads(x.numel()))
    return post, comb, collapsed


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`model.layers.RMSNorm`: x [..., d], weight [d] -> [..., d]."""
    d = x.shape[-1]
    y = torch.empty_like(x)
    if y.numel():
        library().rms_norm_fwd(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // d, d, float(eps),
                               _ew_threads(2 * x.numel()))
    return y


def swiglu_cpu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """`model.layers.swiglu`: gate, up [...] (same shape) -> silu(min(gate, limit)) * clamp(up)."""
    y = torch.empty_like(gate)
    if y.numel():
        library().swiglu_fwd(gate.data_ptr(), up.data_ptr(), y.data_ptr(), y.numel(), float(limit),
                             _ew_threads(3 * y.numel()))
    return y
