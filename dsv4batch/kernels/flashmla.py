"""FlashMLA backend: adapter for ``flash_mla.flash_mla_sparse_fwd`` from the ``sgl-flash-mla`` wheel.

The import is guarded: a CPU torch build or missing CUDA libraries (``OSError``) just leave
``flash_mla_sparse_fwd_fn`` as ``None`` and ``IMPORT_ERROR`` set.  :func:`unsupported_reason`
says why a given call cannot use this backend (``None`` when it can).  :func:`sparse_mla_prefill_flashmla`
bridges this package's contract to the kernel's tile rules: bf16 inputs, h_q padded to 64 or 128
(zero q heads, sink -inf, sliced back off; more than 128 heads run in groups of 128), topk padded
with -1 to a multiple of 128, every invalid slot (negative, >= s_kv, beyond topk_length) set to -1,
topk_length int32, ``use_legacy`` (sm90) and base-2 lse handled, lonely queries forced to
out 0 / max_logits -inf / lse +inf.
"""

from __future__ import annotations

import inspect
import math
from typing import Optional

import torch

IMPORT_ERROR: Optional[str] = None
try:  # the one place (with __init__) that touches flash_mla
    from flash_mla import flash_mla_sparse_fwd as flash_mla_sparse_fwd_fn
except (ImportError, OSError) as e:  # CPU torch, no CUDA libs, wheel absent
    flash_mla_sparse_fwd_fn = None
    IMPORT_ERROR = f"{type(e).__name__}: {e}"

_PARAMS: frozenset = frozenset()
if flash_mla_sparse_fwd_fn is not None:
    try:
        _PARAMS = frozenset(inspect.signature(flash_mla_sparse_fwd_fn).parameters)
    except (TypeError, ValueError):  # builtin without a signature: assume the upstream one
        _PARAMS = frozenset({"attn_sink", "topk_length"})

D_QK = 512
D_V = 512
HEAD_GROUP = 128
TOPK_ALIGN = 128


def unsupported_reason(q: torch.Tensor, d_v: Optional[int] = None) -> Optional[str]:
    """Why FlashMLA cannot run this call, or ``None`` if it can."""
    if flash_mla_sparse_fwd_fn is None:
        return f"flash_mla import failed ({IMPORT_ERROR})"
    if not {"attn_sink", "topk_length"} <= _PARAMS:
        return "installed flash_mla.flash_mla_sparse_fwd lacks attn_sink/topk_length (too old)"
    if q.device.type != "cuda":
        return f"q is on {q.device}, FlashMLA needs CUDA"
    major = torch.cuda.get_device_capability(q.device)[0]
    if major not in (9, 10):
        return f"device capability major {major}; FlashMLA sparse prefill needs sm90 or sm100"
    d_qk = q.shape[-1]
    d_v = d_qk if d_v is None else d_v
    if d_qk != D_QK or d_v != D_V:
        return f"d_qk={d_qk}, d_v={d_v}; FlashMLA path needs d_qk == d_v == 512"
    return None


def _extra_kwargs(device: torch.device) -> tuple[dict, bool]:
    """(kwargs for the wheel's extra parameters, whether lse/max_logits come back base-2)."""
    kwargs: dict = {}
    legacy = torch.cuda.get_device_capability(device)[0] == 9
    if "use_legacy" in _PARAMS:
        kwargs["use_legacy"] = legacy
    log2 = False
    if "return_log2_lse" in _PARAMS:  # legacy kernels keep base 2; convert ourselves
        log2 = legacy
        kwargs["return_log2_lse"] = log2
    return kwargs, log2


@torch.no_grad()
def sparse_mla_prefill_flashmla(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    d_v: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as ``sparse_mla_prefill``; caller checked :func:`unsupported_reason`."""
    reason = unsupported_reason(q, d_v)
    if reason is not None:
        raise RuntimeError(f"flashmla backend unavailable: {reason}")
    s_q, h_q, d_qk = q.shape
    s_kv, topk = kv.shape[0], indices.shape[-1]
    dev = q.device
    out = torch.zeros(s_q, h_q, D_V, dtype=q.dtype, device=dev)
    max_logits = torch.full((s_q, h_q), -math.inf, dtype=torch.float32, device=dev)
    lse = torch.full((s_q, h_q), math.inf, dtype=torch.float32, device=dev)
    if s_q == 0 or topk == 0 or s_kv == 0:
        return out, max_logits, lse

    idx = indices.reshape(s_q, topk).to(dev)
    valid = (idx >= 0) & (idx < s_kv)
    tl32 = None
    if topk_length is not None:
        tl = topk_length.to(dev).reshape(s_q)
        valid &= torch.arange(topk, device=dev) < tl.unsqueeze(1)
        tl32 = tl.clamp(0, topk).to(torch.int32).contiguous()
    topk_p = -(-topk // TOPK_ALIGN) * TOPK_ALIGN
    idx_p = torch.full((s_q, 1, topk_p), -1, dtype=torch.int32, device=dev)
    idx_p[:, 0, :topk] = torch.where(valid, idx, -1).to(torch.int32)
    kv_b = kv.to(dev, torch.bfloat16).reshape(s_kv, 1, d_qk).contiguous()
    sink = None if attn_sink is None else attn_sink.to(dev, torch.float32).reshape(h_q)
    kwargs, log2 = _extra_kwargs(dev)

    for h0 in range(0, h_q, HEAD_GROUP):
        h1 = min(h0 + HEAD_GROUP, h_q)
        hp = 64 if h1 - h0 <= 64 else 128
        q_p = torch.zeros(s_q, hp, d_qk, dtype=torch.bfloat16, device=dev)
        q_p[:, : h1 - h0] = q[:, h0:h1]
        sink_p = None
        if sink is not None:
            sink_p = torch.full((hp,), -math.inf, dtype=torch.float32, device=dev)
            sink_p[: h1 - h0] = sink[h0:h1]
        o, ml, ls = flash_mla_sparse_fwd_fn(
            q_p, kv_b, idx_p, float(sm_scale), D_V, attn_sink=sink_p, topk_length=tl32, **kwargs
        )
        out[:, h0:h1] = o[:, : h1 - h0].to(q.dtype)
        max_logits[:, h0:h1] = ml[:, : h1 - h0].float()
        lse[:, h0:h1] = ls[:, : h1 - h0].float()
    if log2:
        max_logits.mul_(math.log(2.0))
        lse.mul_(math.log(2.0))
    lonely = ~valid.any(1)  # enforce the edge-case contract whatever the kernel version does
    out[lonely] = 0
    max_logits[lonely] = -math.inf
    lse[lonely] = math.inf
    return out, max_logits, lse
