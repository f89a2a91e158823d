"""Torch backend of :func:`dsv4batch.kernels.sparse_mla_prefill`; this code *is* the definition.

Same contract as FlashMLA ``flash_mla_sparse_fwd`` (see ``dsv4batch/kernels/__init__.py``).
It is the CPU hot path of the engine: queries are processed in slices, each slice does one
gather of its K rows and two batched matmuls in fp32 (fp64 when q is fp64); no Python loop
per query or head.  Memory per slice is bounded by ``slice_elems``.
"""

from __future__ import annotations

from typing import Optional

import torch

# Elements (K rows gathered + logits) per query slice. Small slices stay cache-resident on CPU,
# which measured faster than big ones; on CUDA bigger slices mean fewer launches.
CPU_SLICE_ELEMS = 1 << 22
CUDA_SLICE_ELEMS = 1 << 25
KC_ALIGN = 64


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
    out = torch.zeros(s_q, h_q, d_v, dtype=q.dtype, device=dev)
    max_logits = torch.full((s_q, h_q), -inf, dtype=torch.float32, device=dev)
    lse = torch.full((s_q, h_q), inf, dtype=torch.float32, device=dev)
    if s_q == 0 or topk == 0 or s_kv == 0:
        return out, max_logits, lse

    # kv in compute dtype plus one zero row (index s_kv): every invalid slot gathers that row,
    # so whatever an invalid index names (NaN rows, garbage, out of range) never enters the math.
    kvz = torch.zeros(s_kv + 1, d_qk, dtype=cdt, device=dev)
    kvz[:s_kv] = kv.reshape(s_kv, d_qk)
    idx = indices.reshape(s_q, topk).to(dev)
    valid = (idx >= 0) & (idx < s_kv)
    if topk_length is not None:
        valid &= torch.arange(topk, device=dev) < topk_length.to(dev).reshape(s_q, 1)
    gidx = torch.where(valid, idx.long(), s_kv)
    invalid = ~valid
    # Pad the slot axis to a multiple of KC_ALIGN with invalid slots: every slice then reduces over
    # a multiple of KC_ALIGN columns, and trailing zero blocks leave fp32 sums bit-identical, so a
    # query's result does not depend on which queries share its slice (batch invariance).
    width = -(-topk // KC_ALIGN) * KC_ALIGN
    if width != topk:
        gidx = torch.cat([gidx, gidx.new_full((s_q, width - topk), s_kv)], 1)
        invalid = torch.cat([invalid, invalid.new_ones(s_q, width - topk)], 1)
        topk = width
    # Columns a slice needs: up to its last valid slot (topk_length / -1 padding trims the work).
    ncols = ((~invalid) * torch.arange(1, topk + 1, device=dev, dtype=torch.int32)).amax(1).cpu()
    sink = None if attn_sink is None else attn_sink.to(dev, cdt).reshape(1, h_q)
    if slice_elems is None:
        slice_elems = CUDA_SLICE_ELEMS if dev.type == "cuda" else CPU_SLICE_ELEMS
    step = min(s_q, max(1, int(slice_elems) // (topk * (d_qk + h_q))))
    # Reused buffers: fresh big allocations per slice cost page faults on CPU.
    kbuf = torch.empty(step * topk * d_qk, dtype=cdt, device=dev)
    pbuf = torch.empty(step * h_q * topk, dtype=cdt, device=dev)
    obuf = torch.empty(step * h_q * d_v, dtype=cdt, device=dev)

    for a in range(0, s_q, step):
        b = min(a + step, s_q)
        n, kc = b - a, int(ncols[a:b].max())
        kc = -(-kc // KC_ALIGN) * KC_ALIGN
        if kc == 0:  # only lonely queries: outputs keep their initial 0 / -inf / +inf
            continue
        rows = gidx[a:b, :kc].reshape(-1)
        k = torch.index_select(kvz, 0, rows, out=kbuf[: n * kc * d_qk].view(n * kc, d_qk))
        k = k.view(n, kc, d_qk)                                                # [n, kc, d_qk]
        p = pbuf[: n * h_q * kc].view(n, h_q, kc)
        torch.bmm(q[a:b].to(cdt), k.transpose(1, 2), out=p).mul_(sm_scale)    # [n, h_q, kc]
        p.masked_fill_(invalid[a:b, None, :kc], -inf)
        m = p.amax(-1)                                                         # [n, h_q]
        m_safe = torch.where(m == -inf, 0.0, m)                                # lonely rows: 0
        p.sub_(m_safe.unsqueeze(-1)).exp_()
        denom = p.sum(-1)
        lse_s = torch.where(denom > 0, m_safe + denom.log(), inf)              # lonely -> +inf
        lse_o = lse_s
        if sink is not None:                                                   # sink -inf: exact no-op
            lse_o = torch.where(sink == -inf, lse_s, torch.logaddexp(lse_s, sink))
        o = torch.bmm(p, k[..., :d_v], out=obuf[: n * h_q * d_v].view(n, h_q, d_v))
        out[a:b] = o.mul_(torch.exp(m_safe - lse_o).unsqueeze(-1))
        max_logits[a:b] = m
        lse[a:b] = lse_s
    return out, max_logits, lse
