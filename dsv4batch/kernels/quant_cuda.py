"""CUDA backend of :func:`dsv4batch.kernels.quant_linear`: torch's block-scaled FP8 GEMM (cuBLASLt).

The one module that touches ``torch.nn.functional.scaled_mm`` and its ``ScalingType`` recipes
(torch >= 2.9); the import is guarded, so a torch without them leaves ``scaled_mm`` ``None`` and
``IMPORT_ERROR`` set. Only ``"fp8"`` weights run here: the activation is quantized per token and
128 columns to e4m3 with power-of-two (ue8m0) scales, as DeepSeek's own inference does
(``activation_scheme: dynamic``), and multiplied against the stored 128 x 128 block-scaled weight:
recipe ``(BlockWise1x128, BlockWise128x128)``. cuBLASLt's layout rules (torch's checks): ``a``
``[M, K]`` row-major, ``b`` ``[K, N]`` column-major (the stored ``[N, K]`` weight transposed),
``scale_a [M, K/128]`` fp32 with strides ``(1, M)``, ``scale_b [L4, N/128]`` fp32 with strides
``(1, L4)`` where ``L4 = round_up(K/128, 4)``; K and N multiples of 128; M is padded to 16.
FP4 (e2m1) weights need sm100 MX kernels with swizzled scales and are not handled here.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

IMPORT_ERROR: Optional[str] = None
try:  # the one place that touches torch's block-scaled GEMM
    from torch.nn.functional import ScalingType, scaled_mm
    _RECIPES = (ScalingType.BlockWise1x128, ScalingType.BlockWise128x128)
except (ImportError, AttributeError) as e:  # torch < 2.9
    scaled_mm, _RECIPES = None, None
    IMPORT_ERROR = f"{type(e).__name__}: {e}"

E4M3_MAX = 448.0
BLOCK = 128
ROW_ALIGN = 16
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def unsupported_reason(x: torch.Tensor, qweight: torch.Tensor, fmt: str) -> Optional[str]:
    """Why this backend cannot run ``x [M, K] @ qweight``, or ``None`` when it can."""
    if fmt != "fp8":
        return f"{fmt} weights have no CUDA GEMM here (only fp8; e2m1 needs sm100 MX kernels)"
    if scaled_mm is None:
        return f"torch.nn.functional.scaled_mm is unavailable ({IMPORT_ERROR})"
    if x.device.type != "cuda" or qweight.device != x.device:
        return f"x on {x.device}, qweight on {qweight.device}: the CUDA backend needs both on one GPU"
    major, minor = torch.cuda.get_device_capability(x.device)
    if (major, minor) < (9, 0):
        return f"device capability {major}.{minor}; cuBLASLt block-scaled FP8 needs sm90 or newer"
    n, k = qweight.shape
    if k % BLOCK or n % BLOCK:
        return f"weight [{n}, {k}]: cuBLASLt block scaling needs both dims multiples of {BLOCK}"
    if x.dtype not in OUT_DTYPES:
        return f"x dtype {x.dtype}; expected one of {OUT_DTYPES}"
    return None


def act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K % 128 == 0) -> (e4m3 [M, K], fp32 power-of-two scales [M, K/128]), per row and
    128 columns: ``x ~= q * scale`` with ``scale = 2**ceil(log2(amax / 448))``."""
    m, k = x.shape
    groups = x.float().view(m, k // BLOCK, BLOCK)
    amax = groups.abs().amax(-1).clamp(min=1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))
    q = (groups / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(m, k), scale


def scaled_mm_args(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> tuple:
    """The positional arguments of ``scaled_mm`` for ``x [M, K] @ qweight [N, K].T`` (M padded to 16)."""
    m, k = x.shape
    pad = -m % ROW_ALIGN
    if pad:
        x = torch.cat([x, x.new_zeros(pad, k)])
    a, scale_a = act_quant(x)
    kb = k // BLOCK
    l4 = -(-kb // 4) * 4
    scale_b = scale.float()
    if l4 != kb:
        scale_b = F.pad(scale_b, (0, l4 - kb))
    return (a, qweight.t(), scale_a.t().contiguous().t(), _RECIPES[0],
            scale_b.contiguous().t(), _RECIPES[1])


@torch.no_grad()
def quant_linear_cuda(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Same contract as ``quant_linear`` for ``fmt="fp8"``; the caller checked ``unsupported_reason``."""
    y = scaled_mm(*scaled_mm_args(x, qweight, scale), output_dtype=x.dtype)
    return y[: x.shape[0]]
