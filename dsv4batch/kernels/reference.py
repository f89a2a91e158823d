"""Torch backend of :func:`dsv4batch.kernels.sparse_mla_prefill`; this code *is* the definition.

Same contract as FlashMLA ``flash_mla_sparse_fwd`` (see ``dsv4batch/kernels/__init__.py``).
It is the CPU hot path of the engine: queries are grouped by how many slots they use and
processed in slices, each slice does one gather of its K rows and two batched matmuls in fp32
(fp64 when q is fp64); no Python loop per query or head.  Memory per slice is bounded by
``slice_elems``.
"""

from __future__ import annotations

from typing import Optional

import torch

# Elements (K rows gathered + logits) per query slice. Small slices stay cache-resident on CPU,
# which measured faster than big ones; on CUDA bigger slices mean fewer launches.
CPU_SLICE_ELEMS = 1 << 22
CUDA_SLICE_ELEMS = 1 << 25
KC_ALIGN = 16  # slots are padded to whole 16-float vectors


def check_shapes(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: Optional[int]) -> None:
    """Raise ``ValueError`` unless q [s_q,h_q,d_qk], kv [s_kv,1,d_qk], indices [s_q,1,topk]."""
    if q.dim() != 3:
        raise ValueError(f"q must be [s_q, h_q, d_qk], got {tuple(q.shape)}")
    s_q, _, d_qk = q.shape
    if kv.dim() != 3 or kv.shape[1] != 1 or kv.shape[2] != d_qk:
        raise ValueError(f"kv must be [s_kv, 1, {d_qk}], got {tuple(kv.shape)}")
    if indices.dim() != 3 or indices.shape[:2] != (s_q, 1):
        raise ValueError(f"indices must be [{s_q}, 1, topk], got {tuple(indices.shape)}")
    if d_v is not None and not 0 < d_v <= d_qk:
        raise ValueError(f"d_v must be in (0, {d_qk}], got {d_v}")


@torch.no_grad()
def sparse_mla_prefill_torch(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    d_v: Optional[int] = None,
    slice_elems: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shapes/dtypes/edge cases: see ``sparse_mla_prefill``. ``slice_elems`` bounds one slice."""
    check_shapes(q, kv, indices, d_v)
    s_q, h_q, d_qk = q.shape
    s_kv, topk = kv.shape[0], indices.shape[-1]
    d_v = d_qk if d_v is None else int(d_v)
    dev = q.device
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    inf = float("inf")
    out = torch.empty(s_q, h_q, d_v, dtype=q.dtype, device=dev)  # lonely rows zeroed below
    max_logits = torch.full((s_q, h_q), -inf, dtype=torch.float32, device=dev)
    lse = torch.full((s_q, h_q), inf, dtype=torch.float32, device=dev)
    if s_q == 0 or topk == 0 or s_kv == 0:
        return out.zero_(), max_logits, lse

    # kv in compute dtype plus one zero row (index s_kv): every invalid slot gathers that row,
    # so whatever an invalid index names (NaN rows, garbage, out of range) never enters the math.
    kvz = torch.cat([kv.reshape(s_kv, d_qk).to(cdt), kv.new_zeros(1, d_qk, dtype=cdt)])
    idx = indices.reshape(s_q, topk).to(dev)
    valid = (idx >= 0) & (idx < s_kv)
    if topk_length is not None:
        valid &= torch.arange(topk, device=dev) < topk_length.to(dev).reshape(s_q, 1)
    gidx = torch.where(valid, idx.long(), s_kv)
    invalid = ~valid
    # Pad the slot axis to a multiple of KC_ALIGN with invalid slots (whole vector blocks).
    width = -(-topk // KC_ALIGN) * KC_ALIGN
    if width != topk:
        gidx = torch.cat([gidx, gidx.new_full((s_q, width - topk), s_kv)], 1)
        invalid = torch.cat([invalid, invalid.new_ones(s_q, width - topk)], 1)
        topk = width
    # Each query computes over kc = its own last valid slot rounded up to KC_ALIGN, and queries
    # run grouped by kc (a stable sort): a query's arithmetic (GEMM widths, reduction lengths)
    # is fixed by its own indices, whatever else the call holds (batch invariance), and a short
    # query no longer pays for the widest query of its slice.
    ncols = ((~invalid) * torch.arange(1, topk + 1, device=dev, dtype=torch.int32)).amax(1).cpu()
    kcq = (ncols + KC_ALIGN - 1) // KC_ALIGN * KC_ALIGN
    order = torch.argsort(kcq, stable=True)
    widths, counts = torch.unique_consecutive(kcq[order], return_counts=True)
    sink = None if attn_sink is None else attn_sink.to(dev, cdt).reshape(1, h_q)
    if slice_elems is None:
        slice_elems = CUDA_SLICE_ELEMS if dev.type == "cuda" else CPU_SLICE_ELEMS
    pieces, a = [], 0  # (first, end, kc) in sorted order; lonely queries (kc 0) keep 0 / -inf / +inf
    for kc, count in zip(widths.tolist(), counts.tolist()):
        step = max(1, int(slice_elems) // (kc * (d_qk + h_q))) if kc else count
        pieces += [(i, min(i + step, a + count), kc) for i in range(a, a + count, step) if kc]
        a += count
    if counts.numel() and int(widths[0]) == 0:  # lonely queries (no valid slot): out 0
        out[order[: int(counts[0])].to(dev)] = 0
    if not pieces:
        return out, max_logits, lse
    # Reused buffers: fresh big allocations per slice cost page faults on CPU.
    kbuf = torch.empty(max((b - a) * kc for a, b, kc in pieces) * d_qk, dtype=cdt, device=dev)
    pbuf = torch.empty(kbuf.numel() // d_qk * h_q, dtype=cdt, device=dev)
    obuf = torch.empty(max(b - a for a, b, _ in pieces) * h_q * d_v, dtype=cdt, device=dev)
    first, order_dev = order.tolist(), order.to(dev)

    for a, b, kc in pieces:
        n = b - a
        # the piece's queries: a plain slice when they are consecutive (a long request), else an index
        sel = slice(first[a], first[a] + n) if first[b - 1] - first[a] == n - 1 else order_dev[a:b]
        k = torch.index_select(kvz, 0, gidx[sel, :kc].reshape(-1), out=kbuf[: n * kc * d_qk].view(n * kc, d_qk))
        k = k.view(n, kc, d_qk)                                                # [n, kc, d_qk]
        p = pbuf[: n * h_q * kc].view(n, h_q, kc)
        torch.bmm(q[sel].to(cdt), k.transpose(1, 2), out=p).mul_(sm_scale)    # [n, h_q, kc]
        p.masked_fill_(invalid[sel, None, :kc], -inf)
        m = p.amax(-1)                                                         # [n, h_q]
        m_safe = torch.where(m == -inf, 0.0, m)                                # lonely rows: 0
        p.sub_(m_safe.unsqueeze(-1)).exp_()
        denom = p.sum(-1)
        lse_s = torch.where(denom > 0, m_safe + denom.log(), inf)              # lonely -> +inf
        lse_o = lse_s
        if sink is not None:                                                   # sink -inf: exact no-op
            # logaddexp as max + log1p(exp(-|d|)): torch.logaddexp rounds a tensor's last
            # (len % vector width) elements on a scalar path, tying a query's bits to its slice.
            gap = (lse_s - sink).abs().nan_to_num_(nan=inf)                    # inf - inf: 0 weight
            lse_o = torch.where(sink == -inf, lse_s, torch.maximum(lse_s, sink) + torch.log1p(torch.exp(-gap)))
        o = torch.bmm(p, k[..., :d_v], out=obuf[: n * h_q * d_v].view(n, h_q, d_v))
        out[sel] = o.mul_(torch.exp(m_safe - lse_o).unsqueeze(-1)).to(out.dtype)
        max_logits[sel] = m
        lse[sel] = lse_s
    return out, max_logits, lse
