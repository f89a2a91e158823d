"""Triton backend: sparse MLA attention and FP8 / FP4 block-scaled linears (optional extra ``gpu``).

The import of ``triton`` is guarded: without it (or where it fails to import) ``triton_module``
is ``None`` and ``IMPORT_ERROR`` says why; nothing else here needs it. The kernels themselves
live in ``attention.py`` and ``quant.py`` and are *defined on first use* (:func:`kernels`):
Triton decides at definition time whether a ``@triton.jit`` function is compiled for a GPU or
run by its interpreter (``TRITON_INTERPRET=1``), so the interpreter can be switched on any time
before the first call (the CPU tests do it at the top of their module).

Where each runs:

* compiled: CUDA tensors on sm80 or newer (Ampere, Ada, Hopper, Blackwell);
* interpreted (``TRITON_INTERPRET=1`` when the kernels were defined): CPU tensors, slowly (the
  tests' small shapes); ``"auto"`` never picks the interpreter.

:func:`unsupported_reason` / :func:`quant_unsupported_reason` say why a call cannot run here
(``None`` when it can); :func:`sparse_mla_triton` / :func:`quant_linear_triton` run it.
:func:`probe_failure` runs both kernels once per device on a small problem against the torch
definitions, so that ``"auto"`` only takes a backend that agreed with them on this GPU.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

IMPORT_ERROR: Optional[str] = None
try:  # the one place (with attention.py / quant.py) that touches triton
    import triton as triton_module
except (ImportError, OSError, RuntimeError) as e:  # not installed, or a broken install
    triton_module = None
    IMPORT_ERROR = f"{type(e).__name__}: {e}"

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 512  # the attention kernel keeps a query's [heads, d] tile in registers
_PROBED: dict = {}  # (kind, device) -> None or why the probe failed


def kernels():
    """(attention module, quant module): imported, hence the kernels defined, on first call."""
    from . import attention, quant

    return attention, quant


def interpreting() -> bool:
    """Whether the kernels run (or, not yet defined, would run) under Triton's interpreter."""
    import sys

    mod = sys.modules.get(__name__ + ".attention")
    if mod is not None:
        return mod.INTERPRET
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def device_reason(t: torch.Tensor) -> Optional[str]:
    """Why Triton cannot run on ``t``'s device, or ``None``."""
    if triton_module is None:
        return f"triton import failed ({IMPORT_ERROR})"
    if interpreting():
        if t.device.type != "cpu":
            return f"tensors on {t.device}, but TRITON_INTERPRET=1 runs the kernels on the CPU"
        return None
    if t.device.type != "cuda":
        return f"tensors on {t.device}; the triton backend needs CUDA (or TRITON_INTERPRET=1 for the CPU)"
    major, minor = torch.cuda.get_device_capability(t.device)
    if major < 8:
        return f"device capability {major}.{minor}; the triton kernels need sm80 or newer"
    return None


def unsupported_reason(q: torch.Tensor, d_v: Optional[int] = None) -> Optional[str]:
    """Why :func:`sparse_mla_triton` cannot run a call with this q (and d_v), or ``None``."""
    reason = device_reason(q)
    if reason is not None:
        return reason
    if q.dtype not in DTYPES:
        return f"q dtype {q.dtype}; the triton kernel takes {DTYPES}"
    if not 0 < q.shape[-1] <= MAX_HEAD_DIM:
        return f"d_qk={q.shape[-1]}; the triton kernel takes head dims up to {MAX_HEAD_DIM}"
    return None


def auto_reason(q: torch.Tensor, d_v: Optional[int] = None) -> Optional[str]:
    """Why ``"auto"`` does not take the attention kernel for this q: never the interpreter (a
    test mode), else :func:`unsupported_reason` or a failed :func:`probe_failure` on q's GPU."""
    if q.device.type != "cuda":
        return f"q is on {q.device}; auto takes triton on CUDA only"
    return unsupported_reason(q, d_v) or probe_failure("attention", q.device)


def sparse_mla_triton(q, kv, indices, sm_scale, attn_sink=None, topk_length=None, d_v=None, **kwargs):
    """Sparse MLA under the package contract; see ``attention.sparse_mla_triton``."""
    return kernels()[0].sparse_mla_triton(q, kv, indices, sm_scale, attn_sink, topk_length, d_v, **kwargs)


def quant_unsupported_reason(x: torch.Tensor, qweight: torch.Tensor, fmt: str) -> Optional[str]:
    """Why :func:`quant_linear_triton` cannot run ``x @ W`` (W stored in ``fmt``), or ``None``."""
    reason = device_reason(x)
    if reason is not None:
        return reason
    if qweight.device != x.device:
        return f"x on {x.device}, qweight on {qweight.device}"
    if x.dtype not in DTYPES:
        return f"x dtype {x.dtype}; the triton kernels take {DTYPES}"
    return None


def quant_auto_reason(x: torch.Tensor, qweight: torch.Tensor, fmt: str) -> Optional[str]:
    """As :func:`auto_reason`, for :func:`quant_linear_triton`."""
    if x.device.type != "cuda":
        return f"x is on {x.device}; auto takes triton on CUDA only"
    return quant_unsupported_reason(x, qweight, fmt) or probe_failure("quant", x.device)


def quant_linear_triton(x, qweight, scale, fmt: str, **kwargs):
    """``quant_linear``'s contract on Triton; see ``quant.quant_linear_triton``."""
    return kernels()[1].quant_linear_triton(x, qweight, scale, fmt, **kwargs)


def probe_failure(kind: str, device: torch.device) -> Optional[str]:
    """Run kernel ``kind`` ("attention" or "quant") once on ``device`` against the torch
    definition (cached per device): ``None`` when it agreed, else why not."""
    key = (kind, torch.device(device))
    if key not in _PROBED:
        from .probe import probe

        _PROBED[key] = probe(kind, torch.device(device))
    return _PROBED[key]
