"""Triton sparse MLA attention under ``dsv4batch.kernels.sparse_mla_prefill``'s contract.

Imported on first use (``dsv4batch.kernels.triton``): ``@triton.jit`` reads ``TRITON_INTERPRET``
when a kernel is *defined*, so defining the kernels lazily lets a test (or a CPU user) set it any
time before the first call.

One program = one query x one block of ``BLOCK_H`` heads x one split of the query's slots. All
heads of a query share its slots (one latent kv head), so the heads are the M side of both GEMMs:

* ``S [BLOCK_H, BLOCK_N] = Q [BLOCK_H, D] @ K^T`` over ``BLOCK_N`` gathered kv rows (invalid slots
  are masked at the load, so a NaN row behind one never enters the math, and get -inf logits);
* an online base-2 softmax (``sm_scale * log2 e`` folded into the logits), fp32;
* ``acc [BLOCK_H, D] += P @ V`` with ``V = K[:, :d_v]`` the same tile (DSv4: K = V): one gather
  feeds both GEMMs. bf16 inputs: bf16 GEMMs with fp32 accumulation, P rounded to bf16 before
  the second one (as FlashMLA does); fp32 inputs: IEEE fp32 GEMMs (no TF32).

Split-k (``splits > 1``): each split covers a fixed run of slots and writes its normalised
partial output, base-2 lse and max to fp32 scratch; :func:`_combine` merges them with the sink.
Prefill calls fill the GPU with queries and run unsplit; decode calls (one query per running
request) split when ``s_q * head blocks`` is below twice the SM count (:func:`num_splits`). A
query's bits therefore depend on how many queries share its call when that crosses the split
threshold (not batch-invariant at the bit level; fp32 rounding only).

Under the interpreter (``TRITON_INTERPRET=1``) bf16 ``tl.dot`` is wrong and fp32 -> bf16 casts
truncate, so every operand is upcast to fp32 before ``tl.dot`` and bf16/fp16 outputs are written
to an fp32 buffer that torch rounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
MIN_SPLIT_SLOTS = 128  # a split reads at least this many slots (fewer: the merge costs more than it gains)


@triton.jit
def _attend(q, kv_ptr, idx_row, lo, hi, s_kv, scale_log2, stride_kv,
            D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """Online softmax over slots [lo, hi): (acc [BLOCK_H, BLOCK_D] unnormalised, l [BLOCK_H]
    sum of 2^(s - m), m [BLOCK_H] max base-2 logit; -inf when no valid slot)."""
    d = tl.arange(0, BLOCK_D)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_row + j, mask=j < hi, other=-1)
        valid = (idx >= 0) & (idx < s_kv) & (j < hi)
        rows = tl.where(valid, idx, 0).to(tl.int64)
        # masked load: an invalid slot reads nothing (its row may be NaN or out of bounds)
        k = tl.load(kv_ptr + rows[:, None] * stride_kv + d[None, :],
                    mask=valid[:, None] & (d < D_QK)[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid slot yet: keep 0s
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = k
        if D_V < D_QK:  # the value is the first d_v dims
            v = tl.where((d < D_V)[None, :], k, 0.0)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _finish(acc, l_i, m_i, sink_ptr, h, h_q, HAS_SINK: tl.constexpr):
    """(out, max_logits, lse) of the contract from one softmax state (base-2 m): lonely rows
    (l == 0) get out 0, max_logits -inf, lse +inf; the sink only enlarges out's denominator."""
    lonely = l_i == 0.0
    m_safe = tl.where(lonely, 0.0, m_i)
    denom = l_i
    if HAS_SINK:
        sink = tl.load(sink_ptr + h, mask=h < h_q, other=float("-inf"))
        # sink -inf adds exactly 0 (no sink, bit for bit); +inf makes out 0
        denom = l_i + tl.exp2(sink * 1.4426950408889634 - m_safe)
    out = tl.where(lonely[:, None], 0.0, acc / tl.where(lonely, 1.0, denom)[:, None])
    max_logits = m_i * 0.6931471805599453
    lse = tl.where(lonely, float("inf"), (m_safe + tl.log2(tl.where(lonely, 1.0, l_i))) * 0.6931471805599453)
    return out, max_logits, lse


@triton.jit
def _sparse_mla_kernel(
    q_ptr, kv_ptr, idx_ptr, tl_ptr, sink_ptr, out_ptr, ml_ptr, lse_ptr,
    s_q, s_kv, topk, h_q, split_len, scale_log2,
    stride_qs, stride_qh, stride_kv, stride_is, stride_os, stride_oh, stride_op, stride_ms, stride_mp,
    D_QK: tl.constexpr, D_V: tl.constexpr, HAS_TL: tl.constexpr, HAS_SINK: tl.constexpr, PARTIAL: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """Grid (s_q * head blocks, splits); head blocks vary fastest, so a query's head blocks run
    side by side and share its gathered rows in L2. PARTIAL: write this split's normalised out,
    base-2 lse and max (fp32 scratch, split-major) for :func:`_combine`; else the final results."""
    n_hb = tl.cdiv(h_q, BLOCK_H)
    i = tl.program_id(0) // n_hb
    hb = tl.program_id(0) % n_hb
    split = tl.program_id(1)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hmask = h < h_q
    q = tl.load(q_ptr + i.to(tl.int64) * stride_qs + h[:, None] * stride_qh + d[None, :],
                mask=hmask[:, None] & (d < D_QK)[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    n = topk  # this split's slots: [lo, hi), cut at topk_length
    if HAS_TL:
        n = tl.minimum(tl.maximum(tl.load(tl_ptr + i), 0), topk)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, n)
    acc, l_i, m_i = _attend(q, kv_ptr, idx_ptr + i.to(tl.int64) * stride_is, lo, hi, s_kv, scale_log2, stride_kv,
                            D_QK, D_V, BLOCK_H, BLOCK_N, BLOCK_D, UPCAST, IEEE)
    row = split * stride_mp + i.to(tl.int64) * stride_ms + h
    o_ptr = out_ptr + split * stride_op + i.to(tl.int64) * stride_os + h[:, None] * stride_oh + d[None, :]
    omask = hmask[:, None] & (d < D_V)[None, :]
    if PARTIAL:
        empty = l_i == 0.0
        out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i)[:, None])
        tl.store(o_ptr, out, mask=omask)
        tl.store(ml_ptr + row, m_i, mask=hmask)
        tl.store(lse_ptr + row, tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i))), mask=hmask)
    else:
        out, max_logits, lse = _finish(acc, l_i, m_i, sink_ptr, h, h_q, HAS_SINK)
        tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=omask)
        tl.store(ml_ptr + row, max_logits, mask=hmask)
        tl.store(lse_ptr + row, lse, mask=hmask)


@triton.jit
def _combine(
    part_out, part_max, part_lse, sink_ptr, out_ptr, ml_ptr, lse_ptr,
    h_q, splits, stride_pp, stride_ps, stride_ph, stride_mp, stride_ms, stride_os, stride_oh,
    D_V: tl.constexpr, HAS_SINK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Merge the splits of one query x head block: weights 2^(lse_s - M), M = max lse_s (empty
    splits: lse -inf, weight 0, out 0), then the sink and the lonely rule as :func:`_finish`."""
    n_hb = tl.cdiv(h_q, BLOCK_H)
    i = tl.program_id(0) // n_hb
    h = (tl.program_id(0) % n_hb) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hmask = h < h_q
    omask = hmask[:, None] & (d < D_V)[None, :]
    stat = i.to(tl.int64) * stride_ms + h  # [s_q, h_q] offsets of this query's heads
    big = tl.full([BLOCK_H], float("-inf"), tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for sp in range(0, splits):
        big = tl.maximum(big, tl.load(part_lse + sp * stride_mp + stat, mask=hmask, other=float("-inf")))
        m_i = tl.maximum(m_i, tl.load(part_max + sp * stride_mp + stat, mask=hmask, other=float("-inf")))
    big_safe = tl.where(big == float("-inf"), 0.0, big)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    o_row = part_out + i.to(tl.int64) * stride_ps + h[:, None] * stride_ph + d[None, :]
    for sp in range(0, splits):
        w = tl.exp2(tl.load(part_lse + sp * stride_mp + stat, mask=hmask, other=float("-inf")) - big_safe)
        acc += w[:, None] * tl.load(o_row + sp * stride_pp, mask=omask, other=0.0)
        l_i += w
    # acc / l_i is the softmax output in units of 2^big: _finish's m is big here
    out, _, lse = _finish(acc, l_i, big, sink_ptr, h, h_q, HAS_SINK)
    tl.store(out_ptr + i.to(tl.int64) * stride_os + h[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=omask)
    tl.store(ml_ptr + stat, m_i * 0.6931471805599453, mask=hmask)
    tl.store(lse_ptr + stat, lse, mask=hmask)


# The kernels were defined under the interpreter (TRITON_INTERPRET=1 at import): CPU tensors.
INTERPRET = type(_sparse_mla_kernel).__name__ == "InterpretedFunction"


@dataclass(frozen=True)
class Config:
    """Tile sizes of one launch: heads per program (>= 16, the GEMMs' M), slots per step (>= 16),
    warps and software-pipeline stages."""

    block_h: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


def default_config(h_q: int, d_qk: int, dtype: torch.dtype) -> Config:
    """Tiles by head count, head dim and dtype. d 512 bf16: Q [64, 512] and acc [64, 512] fp32 live
    in 8 warps' registers, K tiles of 32 rows (32 KiB) double-buffered; fp32 inputs halve the
    tiles (the test path, not the model's). The interpreter takes bigger steps: fewer programs
    and iterations, each ~ms of numpy. Not yet tuned on a GPU (`bench/gpu.py` sweeps these)."""
    block_d = _block_d(d_qk)
    block_h = min(64, max(16, triton.next_power_of_2(h_q)))
    if INTERPRET:
        return Config(block_h, 64 if block_d <= 128 else 32, 1, 1)
    if dtype == torch.float32:
        block_h = min(block_h, 32)
        block_n = 16 if block_d >= 512 else 32
    else:
        block_n = 32 if block_d >= 256 else 64
    return Config(block_h, block_n, 8 if block_h * block_d >= 64 * 256 else 4, 2)


def _block_d(d_qk: int) -> int:
    return max(16, triton.next_power_of_2(d_qk))


def num_splits(s_q: int, head_blocks: int, topk: int, device: torch.device) -> int:
    """Splits per query: 1 when the queries alone give two programs per SM (prefill), else as
    many as bring it there, each split reading at least MIN_SPLIT_SLOTS slots (decode)."""
    if INTERPRET or device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = s_q * head_blocks
    if programs >= 2 * sms:
        return 1
    return max(1, min(-(-2 * sms // programs), topk // MIN_SPLIT_SLOTS))


def _inputs(q, kv, indices, attn_sink, topk_length):
    """The kernel's operands: q with unit last stride, kv [s_kv, d_qk] in q's dtype, indices
    [s_q, topk] int32 (wider ints: out-of-range values set to -1 first, so none wraps into range),
    topk_length int32 or None, sink fp32 or None."""
    s_q, _, d_qk = q.shape
    s_kv, topk = kv.shape[0], indices.shape[-1]
    q = q if q.stride(-1) == 1 else q.contiguous()
    kv2 = kv.reshape(s_kv, d_qk)
    if kv2.dtype != q.dtype or kv2.stride(-1) != 1:
        kv2 = kv2.to(q.dtype).contiguous()
    idx = indices.reshape(s_q, topk).to(q.device)
    if idx.dtype != torch.int32:
        idx = torch.where((idx < 0) | (idx >= s_kv), -1, idx).to(torch.int32)
    idx = idx if idx.stride(-1) == 1 else idx.contiguous()
    tl_ = None if topk_length is None else topk_length.to(q.device).reshape(s_q).clamp(0, topk).to(torch.int32)
    sink = None if attn_sink is None else attn_sink.to(q.device, torch.float32).reshape(-1).contiguous()
    return q, kv2, idx, tl_, sink


@torch.no_grad()
def sparse_mla_triton(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    d_v: Optional[int] = None,
    *,
    splits: Optional[int] = None,
    config: Optional[Config] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse MLA (the contract of ``dsv4batch.kernels.sparse_mla_prefill``): q [s_q, h_q, d_qk]
    fp32/bf16/fp16, kv [s_kv, 1, d_qk] (rows read in place: a decode step passes the whole cache
    pool), indices [s_q, 1, topk] int, attn_sink [h_q] fp32 or None, topk_length [s_q] int or
    None -> (out [s_q, h_q, d_v] q.dtype, max_logits [s_q, h_q] fp32, lse [s_q, h_q] fp32).

    splits: slot splits per query (None: :func:`num_splits`); config: tiles (None:
    :func:`default_config`). Both change rounding only. The caller checked shapes and support."""
    s_q, h_q, d_qk = q.shape
    s_kv, topk = kv.shape[0], indices.shape[-1]
    d_v = d_qk if d_v is None else int(d_v)
    dev = q.device
    max_logits = torch.full((s_q, h_q), -math.inf, dtype=torch.float32, device=dev)
    lse = torch.full((s_q, h_q), math.inf, dtype=torch.float32, device=dev)
    if s_q == 0 or topk == 0 or s_kv == 0 or h_q == 0:
        return torch.zeros(s_q, h_q, d_v, dtype=q.dtype, device=dev), max_logits, lse
    q, kv2, idx, tl_, sink = _inputs(q, kv, indices, attn_sink, topk_length)
    cfg = config or default_config(h_q, d_qk, q.dtype)
    hb = triton.cdiv(h_q, cfg.block_h)
    n_split = max(1, min(splits or num_splits(s_q, hb, topk, dev), triton.cdiv(topk, cfg.block_n)))
    # each split a whole number of slot blocks; splits past a query's topk_length are empty
    split_len = triton.cdiv(triton.cdiv(topk, n_split), cfg.block_n) * cfg.block_n
    n_split = triton.cdiv(topk, split_len)
    # interpreter: fp32 -> bf16 casts truncate there, so torch rounds the output
    out_dtype = torch.float32 if INTERPRET else q.dtype
    out = torch.empty(s_q, h_q, d_v, dtype=out_dtype, device=dev)
    args = (q, kv2, idx, tl_, sink, cfg, d_v, sm_scale)
    if n_split == 1:
        _launch(*args, 1, topk, out, max_logits, lse, partial=False)
    else:
        part = torch.empty(n_split, s_q, h_q, d_v, dtype=torch.float32, device=dev)
        p_max = torch.empty(n_split, s_q, h_q, dtype=torch.float32, device=dev)
        p_lse = torch.empty_like(p_max)
        _launch(*args, n_split, split_len, part, p_max, p_lse, partial=True)
        _merge(part, p_max, p_lse, sink, out, max_logits, lse, cfg)
    return out.to(q.dtype), max_logits, lse


def _launch(q, kv2, idx, tl_, sink, cfg: Config, d_v: int, sm_scale: float, n_split: int, split_len: int,
            out, ml, lse, *, partial: bool) -> None:
    """One main-kernel launch over (s_q * head blocks, n_split) programs."""
    s_q, h_q, d_qk = q.shape
    grid = (s_q * triton.cdiv(h_q, cfg.block_h), n_split)
    is_fp32 = q.dtype == torch.float32
    _sparse_mla_kernel[grid](
        q, kv2, idx, idx if tl_ is None else tl_, idx if sink is None else sink, out, ml, lse,
        s_q, kv2.shape[0], idx.shape[1], h_q, split_len, float(sm_scale) * LOG2E,
        q.stride(0), q.stride(1), kv2.stride(0), idx.stride(0),
        out.stride(-3), out.stride(-2), out.stride(0) if partial else 0,
        h_q, s_q * h_q if partial else 0,
        D_QK=d_qk, D_V=d_v, HAS_TL=tl_ is not None, HAS_SINK=sink is not None, PARTIAL=partial,
        BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, BLOCK_D=_block_d(d_qk),
        UPCAST=INTERPRET, IEEE=is_fp32 or INTERPRET,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _merge(part, p_max, p_lse, sink, out, ml, lse, cfg: Config) -> None:
    """The split-k merge: one program per query x head block."""
    n_split, s_q, h_q, d_v = part.shape
    block_h = min(cfg.block_h, 32)
    _combine[(s_q * triton.cdiv(h_q, block_h),)](
        part, p_max, p_lse, p_max if sink is None else sink, out, ml, lse,
        h_q, n_split, part.stride(0), part.stride(1), part.stride(2), s_q * h_q, h_q,
        out.stride(0), out.stride(1),
        D_V=d_v, HAS_SINK=sink is not None, BLOCK_H=block_h, BLOCK_D=_block_d(d_v), num_warps=4,
    )
