"""KV compressors and the Lightning Indexer over packed, multi-step requests.

Maths as transformers' `DeepseekV4{HCA,CSA}Compressor` / `DeepseekV4Indexer`: entry k of a ratio-r
compressor is `norm(sum_t softmax_t(gate_t + ape[t % r]) * kv_t)` over its window (ratio 4 adds the
previous window's first-half channels: 2r slots), RoPE'd at position k * r. Window geometry comes
from `layout.CompressorLayout`; this module only does the arithmetic.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import indexer_topk
from .layers import Linear, RMSNorm, Rope


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
        d, n = self.dim, lay.slots.shape[0]
        # every slot of every window in one gather: overlapping windows read the halves they use
        # (src rows viewed as [2 * rows, d]) instead of gathering whole rows, slicing and concatenating
        win_kv = src_kv.view(-1, d).index_select(0, lay.slots.view(-1)).view(n, -1, d)
        win_gate = src_gate.view(-1, d).index_select(0, lay.slots.view(-1)).view(n, -1, d)
        return self.pool_windows(win_kv, win_gate, lay.positions, rope), src_kv, src_gate

    def pool_windows(self, win_kv: torch.Tensor, win_gate: torch.Tensor, positions: torch.Tensor, rope: Rope) -> torch.Tensor:
        """Entries [n, dim] of n closed windows: win_kv [n, slots, dim] (overwritten), win_gate
        fp32 [n, slots, dim], positions [n] (each window's first position, its RoPE position)."""
        weights = win_gate.softmax(dim=1, dtype=torch.float32).to(win_kv.dtype)
        entries = self.norm(win_kv.mul_(weights).sum(dim=1))
        cos, sin = rope.cos_sin(positions)
        return Rope.apply(entries, cos, sin)

    def decode(self, x: torch.Tensor, io, state, entries: torch.Tensor, rope: Rope) -> None:
        """One token per request (`cache_io.DecodeIO` io, positions io.positions): its row joins
        its open window in `state` ((kv, gate) [slots, coff * r, coff * dim]); a window it
        closes becomes an entry in `entries` [rows, dim] (its row io.close_rows) and, with
        overlap, moves to the front of the state as the next window's previous one."""
        kv_state, gate_state = (t.view(-1, t.shape[-1]) for t in state)
        kv_state.index_copy_(0, io.state_write, self.wkv(x).to(kv_state.dtype))
        gate_state.index_copy_(0, io.state_write, self.wgate(x).float() + self.ape[io.positions % self.ratio])
        n = io.close.numel()
        if n == 0:
            return
        d = self.dim
        win_kv = kv_state.view(-1, d).index_select(0, io.close_halves.view(-1)).view(n, -1, d)
        win_gate = gate_state.view(-1, d).index_select(0, io.close_halves.view(-1)).view(n, -1, d)
        if self.overlap:  # a first window has no previous one: its slots weigh nothing
            win_kv[:, :self.ratio].masked_fill_(io.close_first.view(n, 1, 1), 0.0)
            win_gate[:, :self.ratio].masked_fill_(io.close_first.view(n, 1, 1), float("-inf"))
        entries.index_copy_(0, io.close_rows, self.pool_windows(win_kv, win_gate, io.close_positions, rope))
        if io.slide is not None and io.slide[0].numel():
            kv_state.index_copy_(0, io.slide[1], kv_state.index_select(0, io.slide[0]))
            gate_state.index_copy_(0, io.slide[1], gate_state.index_select(0, io.slide[0]))


class Indexer(nn.Module):
    """Lightning Indexer: score[t, e] = sum_h w[t, h] * relu(q[t, h] . k[e]) / sqrt(dim_i), then top-k.

    Native names: `wq_b` [heads_i * dim_i, q_lora], `weights_proj` [heads_i, hidden],
    `compressor.*` (ratio-4 compressor at dim_i).
    """

    def __init__(self, config):
        super().__init__()
        self.num_heads, self.dim, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk
        self.wq_b = Linear(config.q_lora_rank, self.num_heads * self.dim)
        self.weights_proj = Linear(config.hidden_size, self.num_heads)
        ratio = config.compress_rates["compressed_sparse_attention"]
        self.compressor = Compressor(config.hidden_size, self.dim, ratio, config.rms_norm_eps)
        self.ratio = ratio

    def queries(self, x, q_res, cos, sin):
        """-> q [T, heads_i, dim_i] fp32 (RoPE'd) and head weights [T, heads_i] fp32 (* heads_i ** -0.5)."""
        q = Rope.apply(self.wq_b(q_res).view(x.shape[0], self.num_heads, self.dim), cos, sin).float()
        return q, self.weights_proj(x).float() * self.num_heads ** -0.5

    def select(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, key_lo: torch.Tensor,
               visible: torch.Tensor, blocks, width: int, backend: str = "auto") -> torch.Tensor:
        """One chunk's queries vs its keys -> [s, width] int64 request-local entry ids.

        q [s, h, d] and w [s, h] fp32: the chunk's queries (`queries`); keys [E, d] fp32: the
        chunk's entries, request after request; key_lo [s]: where a query's request starts in
        `keys`; visible [s]: entries it sees ((p + 1) // r, its request's first ones); blocks
        [(a, b, k_lo, k_hi)]: query rows [a, b) whose requests' keys are keys[k_lo:k_hi]
        (`ChunkLayout.query_slices`, for the torch path). Valid picks first (sorted by score),
        min(topk, visible) of them; later slots are garbage, masked by topk_length. Exact ties go
        to the lower entry id. The contract: `dsv4batch.kernels.indexer`; backend: the attention
        backend asked for (the cpu kernel or the torch definition)."""
        return indexer_topk(q, w * self.dim ** -0.5, keys, key_lo, visible, width, blocks, backend=backend)
