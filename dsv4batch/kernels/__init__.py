"""Sparse MLA prefill attention with FlashMLA ``flash_mla_sparse_fwd`` semantics.

This package is the one module family that imports ``flash_mla`` (the ``sgl-flash-mla`` wheel,
optional extra ``gpu``).  Everything else calls :func:`sparse_mla_prefill`, which runs either

* ``"torch"``: :func:`dsv4batch.kernels.sparse_mla_torch.sparse_mla_prefill_torch`, pure torch,
  CPU or CUDA, fp32 math (dense blocks over unions of slots, gathered slices).  **The definition
  of the contract below** is :func:`dsv4batch.kernels.ref.sparse_mla_prefill_ref` (``ref.py``,
  short dense fp64 code that every backend is tested against);
* ``"cpu"``: :func:`dsv4batch.kernels.cpu.sparse_mla_prefill_cpu`, a fused C++ kernel built on
  first use (``cpu.py``): one query at a time over its own slots, fp32 math, equal to the
  reference up to fp32 rounding; CPU tensors, not fp64, d_qk and d_v multiples of 16; or
* ``"flashmla"``: :func:`dsv4batch.kernels.flashmla.sparse_mla_prefill_flashmla`, the FlashMLA
  kernel (CUDA sm90/sm100, d_qk == d_v == 512, bf16 math, so results match only approximately:
  out within abs 8e-4 / rel 3/128, max_logits and lse within about 1e-6 relative); or
* ``"triton"``: :func:`dsv4batch.kernels.triton.sparse_mla_triton` (``kernels/triton/``, optional
  extra ``gpu``): CUDA sm80+, fp32/bf16/fp16, any head count, d_qk up to 512; prefill and decode
  (split-k over the slots when the queries alone do not fill the GPU). fp32 inputs: IEEE fp32
  math; bf16: bf16 GEMMs with fp32 softmax and sums. With ``TRITON_INTERPRET=1`` it runs on CPU
  tensors through Triton's interpreter (tests only; ``"auto"`` never picks that).

Backend choice: ``backend="auto"`` takes FlashMLA when it imported and the call fits it, else
Triton for CUDA tensors where it imports and a one-time probe on that GPU agreed with torch,
else the cpu kernel when the call fits it and it builds, else torch (the Lightning Indexer follows
the same request: :func:`indexer_topk`); ``"auto"`` first takes the active :class:`KernelConfig`'s
``attention`` (``config.py``: the engine makes its own config active around its steps, from
``EngineConfig.attn_backend``), whose own ``"auto"`` is the order above.  ``"torch"`` /
``"cpu"`` / ``"flashmla"`` / ``"triton"`` force a backend; forcing one where it cannot run raises
``RuntimeError`` with the reason.

The package's other entry points: :func:`quant_linear` (``quant_matmul.py``) multiplies by a
weight kept as the checkpoint stores it (FP8 block-scaled or FP4 e2m1; its contract is in
``quant_matmul.py``), and :func:`dense_linear` (``dense.py``) is the vocabulary head's dense
GEMM (fp32 on the CPU through oneDNN where it runs, else BLAS; :func:`pack_weight` keeps a
weight in oneDNN's layout; :func:`bf16_linear` is its opt-in bf16 GEMM where the CPU has bf16
units, :func:`bf16_available`), and :func:`head_stats` (``cpu.py``) is the fused fp32 head on
the CPU (per row: sum of 2^z, max z, the target's z over the vocabulary, on
:func:`pack_head` panels; :func:`head_supported`), and :func:`indexer_topk` is the Lightning
Indexer's top-k (contract and torch definition in ``indexer.py``; the cpu kernel where the
attention backend asked for allows it); :func:`rope_cpu`, :func:`hc_pre_cpu`,
:func:`hc_collapse_cpu`, :func:`hc_post_cpu`, :func:`rms_norm_cpu` and :func:`swiglu_cpu` are
the block's token-wise fp32 passes, one C++ pass each (``elementwise.py``, where
:func:`elementwise_supported`; definitions: the torch paths in ``model/layers.py``).

Tensors (no batch dim: concatenate tokens and offset indices into one concatenated kv):

========== ====================== ============================================================
q          [s_q, h_q, d_qk]       any float dtype (bf16 in the model)
kv         [s_kv, 1, d_qk]        any float dtype; K = kv, V = kv[..., :d_v] (DSv4: K = V)
indices    [s_q, 1, topk]         int32 (any int dtype accepted); row i lists kv rows for query i
sm_scale   float                  logits P = (q . K) * sm_scale (no default; DSv4: d_qk ** -0.5)
attn_sink  [h_q] or None          fp32 per-head sink logit
topk_length [s_q] or None         int; slots j >= topk_length[i] are invalid
d_v        int or None            value width, defaults to d_qk (FlashMLA itself needs 512)
out        [s_q, h_q, d_v]        q.dtype
max_logits [s_q, h_q]             fp32, max_j P_ij over valid slots (-inf if none)
lse        [s_q, h_q]             fp32, natural-log logsumexp_j P_ij over valid slots
========== ====================== ============================================================

Slot j of query i is *invalid* when ``indices[i,0,j] < 0``, ``>= s_kv``, or ``j >= topk_length[i]``.
Invalid slots never touch the math, even when they name NaN rows.  Indices in a row are assumed
unique (as in FlashMLA).  With a sink, ``out = sum_j exp(P_j - logaddexp(lse, sink_h)) V_j``:
the sink only rescales ``out`` (``lse``/``max_logits`` ignore it); sink ``-inf`` is exactly no
sink, ``+inf`` gives out 0.  A query with no valid slot ("lonely") gets out 0 (any sink),
max_logits -inf and lse **+inf**.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import cpu as _cpu
from . import flashmla as _flashmla
from . import triton as _triton
from .cpu import head_stats, head_supported, pack_head
from .dense import bf16_available, bf16_linear, dense_linear, pack_weight
from .elementwise import (HC_MAX, elementwise_supported, hc_collapse_cpu, hc_post_cpu, hc_pre_cpu, rms_norm_cpu,
                          rope_cpu, swiglu_cpu)
from .config import KernelConfig
from .config import current as current_kernels
from .config import use as use_kernels
from .indexer import indexer_topk_torch
from .quant_matmul import quant_backends, quant_linear
from .select import chosen, selection
from .sparse_mla_torch import check_shapes, sparse_mla_prefill_torch

__all__ = ["sparse_mla_prefill", "available_backends", "attention_backend", "requested_backend", "KernelConfig",
           "current_kernels", "use_kernels",
           "quant_linear", "quant_backends", "dense_linear", "pack_weight", "bf16_linear", "bf16_available",
           "head_stats", "head_supported", "pack_head", "indexer_topk", "elementwise_supported", "rope_cpu",
           "hc_collapse_cpu", "hc_post_cpu", "hc_pre_cpu", "HC_MAX", "rms_norm_cpu", "swiglu_cpu", "chosen",
           "selection"]

_BACKENDS = ("auto", "torch", "cpu", "flashmla", "triton")


def available_backends() -> list[str]:
    """Backends usable in this process: ``"torch"`` always; ``"cpu"`` when its kernel builds;
    ``"flashmla"`` when ``flash_mla`` imported and the current CUDA device is sm90/sm100 (shape
    limits are checked per call); ``"triton"`` when triton imported and the current CUDA device
    is sm80+ (the CPU interpreter is not listed)."""
    names = ["torch"] + (["cpu"] if _cpu.available() else [])
    if _flashmla.flash_mla_sparse_fwd_fn is not None and torch.cuda.is_available():
        probe = torch.empty(0, 1, _flashmla.D_QK, device="cuda")
        if _flashmla.unsupported_reason(probe) is None:
            names.append("flashmla")
    if torch.cuda.is_available() and _triton.unsupported_reason(torch.empty(0, 1, 512, device="cuda")) is None:
        names.append("triton")
    return names


def attention_backend(backend: str, device, dtype: torch.dtype, d_qk: int) -> str:
    """The backend ``sparse_mla_prefill(..., backend=backend)`` runs for q on ``device`` in
    ``dtype`` with head dim ``d_qk`` (d_v = d_qk): ``"torch"``, ``"cpu"``, ``"flashmla"`` or ``"triton"``.
    Raises as ``sparse_mla_prefill`` does when a forced backend cannot run there."""
    return _resolve(backend, torch.empty(0, 1, d_qk, device=device, dtype=dtype), None)


def requested_backend(backend: str) -> str:
    """What a call with ``backend`` asks for: the active `KernelConfig.attention` in place of
    ``"auto"`` (ValueError for a name that is not a backend)."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    return current_kernels().attention if backend == "auto" else backend


def _resolve(backend: str, q: torch.Tensor, d_v: Optional[int]) -> str:
    backend = requested_backend(backend)
    if backend == "auto":
        if _flashmla.unsupported_reason(q, d_v) is None:
            return "flashmla"
        if q.device.type == "cuda" and _triton.auto_reason(q, d_v) is None:
            return "triton"
        return "cpu" if _cpu.unsupported_reason(q, d_v) is None and chosen("sparse_mla") else "torch"
    if backend != "torch":
        reason = {"flashmla": _flashmla, "cpu": _cpu, "triton": _triton}[backend].unsupported_reason(q, d_v)
        if reason is not None:
            raise RuntimeError(f"{backend} backend requested but unavailable: {reason}")
    return backend


def sparse_mla_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    *,
    d_v: Optional[int] = None,
    backend: str = "auto",
    query_blocks=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse MLA prefill: returns ``(out [s_q,h_q,d_v] q.dtype, max_logits [s_q,h_q] fp32,
    lse [s_q,h_q] fp32)``.  Shapes, dtypes and edge cases: see the module docstring; the
    definition is :func:`dsv4batch.kernels.ref.sparse_mla_prefill_ref`.

    ``query_blocks``: optional increasing boundaries ``[0, ..., s_q]`` of consecutive queries
    that share most of their slots (one request's neighbouring positions). A hint, not part of
    the contract: the torch backend may attend over a block's union of slots at once (the same
    result up to fp32 rounding); the cpu kernel, FlashMLA and Triton ignore it."""
    check_shapes(q, kv, indices, d_v)
    if attn_sink is not None and attn_sink.numel() != q.shape[1]:
        raise ValueError(f"attn_sink must be [h_q={q.shape[1]}], got {tuple(attn_sink.shape)}")
    if topk_length is not None and topk_length.numel() != q.shape[0]:
        raise ValueError(f"topk_length must be [s_q={q.shape[0]}], got {tuple(topk_length.shape)}")
    chosen = _resolve(backend, q, d_v)
    if chosen == "flashmla":
        return _flashmla.sparse_mla_prefill_flashmla(q, kv, indices, sm_scale, attn_sink, topk_length, d_v)
    if chosen == "triton":
        return _triton.sparse_mla_triton(q, kv, indices, sm_scale, attn_sink, topk_length, d_v)
    if chosen == "cpu":
        return _cpu.sparse_mla_prefill_cpu(q, kv, indices, sm_scale, attn_sink, topk_length, d_v)
    return sparse_mla_prefill_torch(q, kv, indices, sm_scale, attn_sink, topk_length, d_v,
                                    query_blocks=query_blocks)


def indexer_topk(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, key_lo: torch.Tensor, visible: torch.Tensor,
                 width: int, blocks, *, backend: str = "auto") -> torch.Tensor:
    """The Lightning Indexer's picks [s, width] int64 (shapes, meaning and edge cases:
    ``dsv4batch/kernels/indexer.py``; blocks: the torch path's query blocks, see
    :func:`indexer_topk_torch`). ``backend`` is the attention backend asked for (as
    :func:`sparse_mla_prefill`'s): ``"cpu"``, or ``"auto"`` when q is on the CPU and the cpu
    kernels build, runs ``csrc/indexer.cpp``; anything else the torch definition. Forcing
    ``"cpu"`` where it cannot run raises ``RuntimeError``."""
    asked = requested_backend(backend)
    if _cpu.indexer_supported(q) and (asked == "cpu" or (asked == "auto" and chosen("indexer"))):
        return _cpu.indexer_topk_cpu(q, w, keys, key_lo, visible, width)
    if asked == "cpu":
        reason = f"q is on {q.device}" if q.device.type != "cpu" else f"it could not be built ({_cpu.build_error()})"
        raise RuntimeError(f"cpu backend requested but the cpu indexer kernel is unavailable: {reason}")
    return indexer_topk_torch(q, w, keys, key_lo, visible, width, blocks)
