"""KV compressors and the Lightning Indexer over packed, multi-step requests.

Maths as transformers' `DeepseekV4{HCA,CSA}Compressor` / `DeepseekV4Indexer`: entry k of a ratio-r
compressor is `norm(sum_t softmax_t(gate_t + ape[t % r]) * kv_t)` over its window (ratio 4 adds the
previous window's first-half channels: 2r slots), RoPE'd at position k * r. Window geometry comes
from `layout.CompressorLayout`; this module only does the arithmetic.
"""

from __future__ import annotations

import torch
from torch import nn

from .layers import Linear, RMSNorm, Rope, pad_rows


class Compressor(nn.Module):
    """wkv, wgate: hidden -> coff*dim (coff = 2 with overlap); ape [r, coff*dim]; norm over dim."""

    def __init__(self, hidden: int, dim: int, ratio: int, eps: float):
        super().__init__()
        self.dim, self.ratio, self.overlap = dim, ratio, ratio == 4
        coff = 2 if self.overlap else 1
        self.wkv = Linear(hidden, coff * dim)
        self.wgate = Linear(hidden, coff * dim)
        self.ape = nn.Parameter(torch.zeros(ratio, coff * dim, dtype=torch.float32))
        self.norm = RMSNorm(dim, eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, lay, carried, rope: Rope):
        """x [T, hidden], positions [T]; carried: (kv, gate) rows [num_carried, coff*dim] or None.

        Returns (new entries [num_new, dim] in segment order, src_kv, src_gate) where src_* are
        the source tables [num_carried + T + 1, coff*dim] (the caller slices carry-over from them).
        """
        kv = self.wkv(x)
        gate = self.wgate(x).float() + self.ape[positions % self.ratio]
        pad_kv = kv.new_zeros(1, kv.shape[1])
        pad_gate = gate.new_full((1, gate.shape[1]), float("-inf"))
        src_kv = torch.cat([carried[0], kv, pad_kv]) if carried is not None else torch.cat([kv, pad_kv])
        src_gate = torch.cat([carried[1], gate, pad_gate]) if carried is not None else torch.cat([gate, pad_gate])
        if lay.cur.shape[0] == 0:
            return kv.new_zeros(0, self.dim), src_kv, src_gate
        d = self.dim
        if self.overlap:
            win_kv = torch.cat([src_kv[lay.prev][..., :d], src_kv[lay.cur][..., d:]], dim=1)
            win_gate = torch.cat([src_gate[lay.prev][..., :d], src_gate[lay.cur][..., d:]], dim=1)
        else:
            win_kv, win_gate = src_kv[lay.cur], src_gate[lay.cur]
        weights = win_gate.softmax(dim=1, dtype=torch.float32).to(win_kv.dtype)
        entries = self.norm((win_kv * weights).sum(dim=1))
        cos, sin = rope.cos_sin(lay.positions)
        return Rope.apply(entries, cos, sin), src_kv, src_gate


class Indexer(nn.Module):
    """Lightning Indexer: score[t, e] = sum_h w[t, h] * relu(q[t, h] . k[e]) / sqrt(dim_i), then top-k.

    Native names: `wq_b` [heads_i * dim_i, q_lora], `weights_proj` [heads_i, hidden],
    `compressor.*` (ratio-4 compressor at dim_i).
    """

    def __init__(self, config, max_query_slice: int = 1024):
        super().__init__()
        self.num_heads, self.dim, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk
        self.wq_b = Linear(config.q_lora_rank, self.num_heads * self.dim)
        self.weights_proj = Linear(config.hidden_size, self.num_heads)
        ratio = config.compress_rates["compressed_sparse_attention"]
        self.compressor = Compressor(config.hidden_size, self.dim, ratio, config.rms_norm_eps)
        self.ratio = ratio
        self.max_query_slice = max_query_slice

    def queries(self, x, q_res, cos, sin):
        """-> q [T, heads_i, dim_i] fp32 (RoPE'd) and head weights [T, heads_i] fp32 (* heads_i ** -0.5)."""
        q = Rope.apply(self.wq_b(q_res).view(x.shape[0], self.num_heads, self.dim), cos, sin).float()
        return q, self.weights_proj(x).float() * self.num_heads ** -0.5

    def topk_for(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, width: int):
        """One request's queries q [s, h, d], w [s, h] vs its entries keys [E, d] -> [s, width] int64.

        Valid picks first (sorted by score); a query at position p sees entries e < (p+1) // r and
        gets min(topk, (p+1) // r) valid picks; later slots are garbage, masked by topk_length.
        Exact score ties are broken by torch.topk (as in transformers).
        """
        s, num_entries = q.shape[0], keys.shape[0]
        out = torch.zeros(s, width, dtype=torch.long, device=q.device)
        k = min(self.topk, num_entries, width)
        if k == 0:
            return out
        keys_t = keys.float().t()
        ent = torch.arange(num_entries, device=q.device)
        for a in range(0, s, self.max_query_slice):
            b = min(a + self.max_query_slice, s)
            scores = torch.matmul(pad_rows(q[a:b]), keys_t)[: b - a].relu_()            # [s, h, E]
            # sum_h w[t, h] * relu(.) as one batched [1, h] x [h, E] product: one pass over scores
            scores = torch.bmm((w[a:b] * self.dim ** -0.5).unsqueeze(1), scores).squeeze(1)
            visible = (positions[a:b] + 1) // self.ratio
            scores.masked_fill_(ent[None, :] >= visible[:, None], float("-inf"))
            out[a:b, :k] = scores.topk(k, dim=-1).indices
        return out
