"""The block's token-wise fp32 passes on the CPU, one C++ pass each (``csrc/elementwise.cpp``,
built with the other CPU kernels by ``cpu.py``): RoPE, mHC's weights / collapse / stream update,
RMSNorm and SwiGLU. Definitions: the torch paths in ``model/layers.py``, which call these where
:func:`elementwise_supported` and keep their own code as the fallback. Each equals its definition
up to fp32 rounding, and a row's bits never depend on the rows beside it (tests:
``tests/kernels/test_elementwise.py``). The active `KernelConfig.elementwise` = ``torch`` keeps the torch paths
(``auto``, the default: these kernels wherever they can run).
"""

from __future__ import annotations

import torch

from .cpu import op
from .config import current
from .select import chosen


def _ew_threads(work: int) -> int:
    """Threads for a token-wise pass touching `work` elements: one per 16M (at least one). These
    passes are memory-bound and short (~1 ms): a second thread mostly contends with torch's
    OpenMP workers, still spinning from the op before, for the same cores."""
    return max(1, min(torch.get_num_threads(), work >> 24))


def elementwise_supported(*tensors: torch.Tensor) -> bool:
    """Whether the token-wise kernels run for these tensors: all fp32, contiguous, on the CPU, no
    grad, the active ``KernelConfig.elementwise`` not ``torch``, and the kernels built and chosen for this
    ISA (``select.py``)."""
    if current().elementwise == "torch":
        return False
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
               and not (t.requires_grad and torch.is_grad_enabled()) for t in tensors) and chosen("elementwise")


def rope_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`model.layers.Rope.apply` in place: x [n, ..., d], cos/sin [n, rd] (`elementwise_supported`
    for all three) -> x."""
    op("rope_")(x, cos, sin, _ew_threads(x.numel() // max(x.shape[-1], 1) * cos.shape[-1]))
    return x


def hc_collapse_cpu(weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`model.layers.hc_collapse`: weights [T, hc], x [T, hc, H] -> [T, H]."""
    return op("hc_collapse")(weights, x, _ew_threads(x.numel()))


def hc_post_cpu(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """`model.layers.hc_post`: x [T, hc, H], out [T, H], post [T, hc], comb [hc, hc, T] -> [T, hc, H]."""
    return op("hc_post")(x, out, post, comb, _ew_threads(x.numel() * (x.shape[1] + 1)))


HC_MAX = 8  # streams csrc/elementwise.cpp's hc_pre_fwd holds per token


def hc_pre_cpu(mixes: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int,
               eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`model.layers.hc_pre` after its GEMM: mixes [T, (2 + hc) * hc], x [T, hc, H] (hc <= HC_MAX),
    scale [3], base [(2 + hc) * hc] -> (post [T, hc], comb [hc, hc, T], collapsed [T, H])."""
    return op("hc_pre")(mixes, x, scale, base, int(iters), float(eps), _ew_threads(x.numel()))


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`model.layers.RMSNorm`: x [..., d], weight [d] -> [..., d]."""
    return op("rms_norm")(x, weight, float(eps), _ew_threads(2 * x.numel()))


def swiglu_cpu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """`model.layers.swiglu`: gate, up [...] (same shape) -> silu(min(gate, limit)) * clamp(up)."""
    return op("swiglu")(gate, up, float(limit), _ew_threads(3 * gate.numel()))
