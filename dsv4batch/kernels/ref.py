"""The definitions every kernel backend is tested against (FlashMLA's ``tests/ref.py`` style):
short, dense, fp64 and obviously correct, never fast. Nothing in the engine calls them.

* :func:`sparse_mla_prefill_ref`: sparse MLA prefill under FlashMLA's ``flash_mla_sparse_fwd``
  contract (``dsv4batch/kernels/__init__.py``): a slot is invalid when its index is < 0 (FlashMLA
  pads with -1), >= s_kv, or at or past ``topk_length``; the sink only enlarges the denominator;
  a query with no valid slot gets out 0, max_logits -inf, lse +inf.
* :func:`indexer_topk_ref`: the Lightning Indexer's top-k (contract: ``indexer.py``).
* :func:`quant_linear_ref`: ``x @ W.T`` with W the block-scaled FP8 / FP4 weight dequantized
  whole (formats: ``quant_reference.py``), one fp64 matmul.
"""

from __future__ import annotations

import torch

from .quant_reference import BLOCK, FP4_GROUP, FP4_LUT, in_features_of

INF = float("inf")


def valid_slots(indices: torch.Tensor, s_kv: int, topk_length=None) -> torch.Tensor:
    """[s_q, s_kv] bool: kv row t is one of query i's valid slots."""
    idx = indices[:, 0].long()                                     # [s_q, topk]
    ok = (idx >= 0) & (idx < s_kv)
    if topk_length is not None:
        ok &= torch.arange(idx.shape[1]) < topk_length.reshape(-1, 1).long()
    mask = torch.zeros(idx.shape[0], s_kv + 1, dtype=torch.bool)
    mask.scatter_(1, torch.where(ok, idx, s_kv), True)             # invalid slots -> spare column
    return mask[:, :s_kv]


def sparse_mla_prefill_ref(q, kv, indices, sm_scale: float, attn_sink=None, topk_length=None, d_v=None):
    """(out [s_q, h_q, d_v] fp64, max_logits [s_q, h_q] fp32, lse [s_q, h_q] fp32): a full fp64
    softmax over every kv row, the invalid ones masked out, the sink as one more column. (out
    stays fp64, finer than any backend's q.dtype, so that tests measure the backend's error alone.)"""
    s_q, h_q, d_qk = q.shape
    s_kv, d_v = kv.shape[0], d_qk if d_v is None else d_v
    mask = valid_slots(indices, s_kv, topk_length)                 # [s_q, s_kv]
    k = torch.where(mask.any(0)[:, None], kv[:, 0].double(), 0.0)  # rows nobody uses may hold NaN
    logits = torch.einsum("qhd,kd->qhk", q.double(), k) * sm_scale
    logits = logits.masked_fill(~mask[:, None, :], -INF)
    lonely = ~mask.any(1)
    max_logits = logits.amax(-1)
    lse = torch.logsumexp(logits, -1).masked_fill(lonely[:, None], INF)
    sink = torch.full((h_q,), -INF, dtype=torch.float64) if attn_sink is None else attn_sink.double()
    with_sink = torch.cat([logits, sink.view(1, h_q, 1).expand(s_q, h_q, 1)], -1)
    weights = torch.softmax(with_sink, -1)[..., :s_kv]
    weights = weights.masked_fill(lonely[:, None, None] | (sink == INF).view(1, h_q, 1), 0.0)
    out = torch.einsum("qhk,kd->qhd", weights, k[:, :d_v])
    return out, max_logits.float(), lse.float()


def indexer_topk_ref(q, w, keys, key_lo, visible, width: int) -> list[torch.Tensor]:
    """Per query i, its picks [min(width, visible[i])] int64: the request-local key ids e of its
    best scores sum_h w[i, h] * relu(q[i, h] . keys[key_lo[i] + e]) (fp64), best first, equal
    scores by lower e. (Later columns of a backend's picks carry no meaning.)"""
    picks = []
    for i in range(q.shape[0]):
        own = keys[int(key_lo[i]):int(key_lo[i]) + int(visible[i])].double()     # [visible, d]
        scores = (torch.relu(q[i].double() @ own.t()) * w[i].double()[:, None]).sum(0)
        order = sorted(range(len(scores)), key=lambda e: (-float(scores[e]), e))
        picks.append(torch.tensor(order[:min(width, len(order))], dtype=torch.long))
    return picks


def dequantize_ref(qweight: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """The dense fp32 weight [out, in]: fp8 ``q[r, c] * scale[r // 128, c // 128]``; fp4
    ``FP4_LUT[code(r, c)] * scale[r, c // 32]``, the low nibble of a byte the even column."""
    out_f, in_f = qweight.shape[0], in_features_of(qweight, fmt)
    if fmt == "fp8":
        s = scale.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        return qweight.float() * s[:out_f, :in_f]
    codes = qweight.view(torch.uint8).long()
    values = torch.stack([FP4_LUT[codes & 0xF], FP4_LUT[codes >> 4]], -1).reshape(out_f, in_f)
    return values * scale.float().repeat_interleave(FP4_GROUP, 1)[:, :in_f]


def quant_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x [n, in] @ W.T -> [n, out]`` in x.dtype, W = `dequantize_ref`, the product in fp64."""
    return (x.double() @ dequantize_ref(qweight, scale, fmt).double().t()).to(x.dtype)
