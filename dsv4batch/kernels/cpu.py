"""The CPU's C++ kernels, built on first use: sparse attention, the fused vocabulary head and the
Lightning Indexer's top-k (the token-wise passes: ``elementwise.py``).

``csrc/sparse_mla.cpp`` is the ``"cpu"`` backend of :func:`dsv4batch.kernels.sparse_mla_prefill`.
The torch backend (``sparse_mla_torch.py``; the definition is ``ref.py``) runs each block of
queries as batched GEMMs over the *union* of the block's slots: a gathered copy of those K rows, logits for slots a
query does not use, masks and padding. At DSv4's long-context shapes that is 2-5x the useful
work (a ratio-4 layer's 32-query block attends over ~360 rows where each query has 192 slots).
This kernel runs one query at a time over its own valid slots, reading K = V rows straight from
``kv``, with its heads' logits in a small scratch and the output accumulated in registers
(module docstring of the source). Results equal the reference up to fp32 rounding (tests:
``tests/kernels/test_sparse_mla.py``), and a query's bits depend on its own inputs alone.

``csrc/head.cpp`` (:func:`head_stats`) is the fused head: per row, sum 2^z, max z and the
target's z over the whole vocabulary, the GEMM's logits kept in registers (no [n, tile] block
written, read back, exp'd and summed as `model/head.vocab_tiles` does); the weight is kept in
panels as wide as the ISA's register block (:func:`pack_head`, a second copy of it).

``csrc/indexer.cpp`` (:func:`indexer_topk_cpu`) is the Lightning Indexer's top-k (contract and
torch path: ``indexer.py``; definition: ``ref.py``): one query at a time over its own keys, a
tile of keys x heads of dot products in registers, the weighted ReLU sum over heads folded in there, and a running top-k:
no [heads, queries, keys] block, no mask, no full sort.

``csrc/elementwise.cpp`` holds the block's token-wise fp32 passes (their wrappers:
``elementwise.py``).

Build and dispatch: ``build.py`` builds ``csrc/`` with torch's extension JIT, once per node and
instruction set (avx512 / avx2 / generic, register blocks sized to each), into ops
``torch.ops.dsv4batch.<op>.<isa>``; this module calls the ISA in use (:func:`isa`: the best this
CPU runs, or the one :func:`use_isa` set). Where no build works the first try warns, and
:func:`build_error` says why; callers then run the torch paths. Which kernels run by default on
each ISA: ``select.py``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import build

VECTOR = 16  # d_qk and d_v must be multiples of it (whole vectors of every ISA)

_active: dict = {}  # "isa": the ISA whose ops run in this process (resolved on first use)
_layouts: dict = {}  # isa -> (floats per vector, head panel width, indexer key tile)


def use_isa(name: str) -> str:
    """Run the kernels built for `name` (``native``, ``avx512``, ``avx2`` or ``generic``) in this
    process from now on; returns the ISA. ValueError where this CPU cannot run it."""
    _active["isa"] = build.resolve(name)
    return _active["isa"]


def isa() -> str:
    """The ISA whose kernels run in this process (`build.native_isa` unless `use_isa` said)."""
    if "isa" not in _active:
        _active["isa"] = build.native_isa()
    return _active["isa"]


def available() -> bool:
    """Whether this ISA's kernels are built and loaded (building them on the first call)."""
    return build.load(isa())


def build_error() -> Optional[str]:
    """Why this ISA's kernels could not be had in this process (None: loaded or not tried)."""
    return build.build_error(isa())


def op(name: str):
    """``torch.ops.dsv4batch.<name>.<isa>``, building the library on first use; RuntimeError
    saying why where it cannot be built."""
    if not available():
        raise RuntimeError(f"the {isa()} CPU kernels could not be built ({build_error()})")
    return getattr(getattr(torch.ops.dsv4batch, name), isa())


def layout() -> tuple[int, int, int]:
    """This ISA's build: (floats per vector, `pack_head` panel width, indexer key tile)."""
    if isa() not in _layouts:
        _layouts[isa()] = tuple(op("layout")())
    return _layouts[isa()]


def unsupported_reason(q: torch.Tensor, d_v: Optional[int] = None) -> Optional[str]:
    """Why this backend cannot run a call with q [s_q, h_q, d_qk] (and d_v), or None if it can.
    Builds the library on the first call that could use it."""
    if q.device.type != "cpu":
        return f"q is on {q.device}; the cpu kernel runs on the CPU"
    if q.dtype == torch.float64:
        return "q is float64: the torch reference computes in float64, the cpu kernel in float32"
    d_qk = q.shape[-1]
    d_v = d_qk if d_v is None else int(d_v)
    if d_qk % VECTOR or d_v % VECTOR:
        return f"d_qk={d_qk}, d_v={d_v}: the cpu kernel needs multiples of {VECTOR}"
    if not available():
        return f"the cpu kernel could not be built ({build_error()})"
    return None


@torch.no_grad()
def sparse_mla_prefill_cpu(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                           attn_sink: Optional[torch.Tensor] = None, topk_length: Optional[torch.Tensor] = None,
                           d_v: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shapes, dtypes and edge cases: ``dsv4batch.kernels.sparse_mla_prefill`` (checked by the
    caller, with `unsupported_reason` None). fp32 math whatever q's dtype; out in q's dtype."""
    s_q, h_q, d_qk = q.shape
    s_kv, topk = kv.shape[0], indices.shape[-1]
    d_v = d_qk if d_v is None else int(d_v)
    if not (s_q and topk and s_kv):  # every query lonely
        return (q.new_zeros(s_q, h_q, d_v), torch.full((s_q, h_q), -math.inf), torch.full((s_q, h_q), math.inf))
    qf = q.contiguous().float()
    kvf = kv.reshape(s_kv, d_qk).contiguous().float()
    # int32 for the kernel; wider values clamped first so that no invalid index wraps into range
    idx = indices.reshape(s_q, topk)
    idx = (idx if idx.dtype == torch.int32 else idx.clamp(-1, s_kv).to(torch.int32)).contiguous()
    lens = None if topk_length is None else topk_length.reshape(s_q).clamp(-1, topk).to(torch.int32).contiguous()
    sink = None if attn_sink is None else attn_sink.reshape(h_q).float().contiguous()
    out, max_logits, lse = op("sparse_mla")(qf, kvf, idx, lens, sink, float(sm_scale), d_v, torch.get_num_threads())
    return out.to(q.dtype), max_logits, lse


def head_supported(weight: torch.Tensor) -> bool:
    """Whether `head_stats` can run a head of this weight [V, K]: fp32 on the CPU, no grad, and
    the kernels built (building them on the first call)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and not (weight.requires_grad and torch.is_grad_enabled()) and available())


@torch.no_grad()
def pack_head(weight: torch.Tensor) -> torch.Tensor:
    """weight [V, K] fp32 -> panels [ceil(V / W), K, W] fp32, W = this ISA's panel width
    (`layout()[1]`: 64 avx512, 16 avx2, 8 generic): panel p, row k holds weight[W p:W p + W, k]
    (ids past V zero; `head_stats` ignores them)."""
    width = layout()[1]
    num, k = -(-weight.shape[0] // width), weight.shape[1]
    padded = torch.zeros(num * width, k, dtype=torch.float32)
    padded[:weight.shape[0]] = weight
    return padded.view(num, width, k).transpose(1, 2).contiguous()


@torch.no_grad()
def head_stats(xs: torch.Tensor, panels: torch.Tensor, vocab: int, targets: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """xs [n, K] fp32 (rows times log2 e), panels = `pack_head(weight)` with weight [vocab, K],
    targets [n] int -> (sums [n]: sum over ids of 2^z, z = xs . weight[id]; peaks [n]: max z;
    picked [n]: z at the target, 0 where it is not in [0, vocab)), all fp32. sums is inf when a
    z passes 127 and misses terms below z = -126 (callers redo rows outside [2^-100, inf)).
    ValueError for panels that are not this build's `pack_head` of such a weight."""
    xs, tg = xs.contiguous().float(), targets.reshape(xs.shape[0]).to(torch.int64).contiguous()
    return op("head_stats")(xs, panels, int(vocab), tg, torch.get_num_threads())


def indexer_supported(q: torch.Tensor) -> bool:
    """Whether `indexer_topk_cpu` can run for queries q: on the CPU, and the kernels built."""
    return q.device.type == "cpu" and available()


@torch.no_grad()
def indexer_topk_cpu(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, key_lo: torch.Tensor,
                     visible: torch.Tensor, width: int) -> torch.Tensor:
    """The indexer's top-k (shapes and meaning: ``dsv4batch/kernels/indexer.py``) -> picks
    [s, width] int64. ValueError where a query's keys run past ``keys``."""
    s, h, d = q.shape
    e = keys.shape[0]
    lo = key_lo.reshape(s).to(torch.int64).contiguous()
    n = visible.reshape(s).to(torch.int64).clamp(min=0).contiguous()
    if s and (int(lo.min()) < 0 or int((lo + n).max()) > e):
        raise ValueError(f"indexer queries see keys outside keys [{e}, {d}]")
    if not (s and width):
        return torch.zeros(s, width, dtype=torch.int64)
    # the keys transposed ([d, e] rows of key vectors), with a zero tile past the last key
    kt = torch.zeros(d, e + layout()[2], dtype=torch.float32)
    kt[:, :e] = keys.t()
    qf, wf = q.contiguous().float(), w.reshape(s, h).contiguous().float()
    return op("indexer_topk")(qf, wf, kt, lo, n, int(width), torch.get_num_threads())
