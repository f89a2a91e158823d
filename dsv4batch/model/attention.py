"""DSv4 attention over a packed step: per planned chunk, gather a workspace and run the sparse kernel.

Per chunk `(s, e, N, M)` of requests (from `dsv4batch.planner`, computed once per layer type):
workspace [e - s, M, head_dim] from the engine's `WorkspacePool`; rows [0, compressed_b) hold
request b's compressed entries, rows [N, N + gather_b) its raw window tokens; combined indices (compressed
top-k / all visible entries first, then the window, offset by M * b, -1 padded) feed one
`sparse_mla_prefill` call. No `[T, T]` matrix, no padding of queries.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels import sparse_mla_prefill
from .compressor import Compressor, Indexer
from .layers import Linear, RMSNorm, Rope, grouped_linear, inv_rms
from .layout import combine
from .parallel import SINGLE


class WorkspacePool:
    """One flat buffer reused by every chunk of every layer and step (one per `Engine`).

    `peak_bytes`: the largest workspace taken since the engine last reset it (once per score call).
    """

    def __init__(self):
        self.buffer = None
        self.peak_bytes = 0

    def take(self, n: int, rows: int, dim: int, dtype, device) -> torch.Tensor:
        """A [n, rows, dim] view of the buffer's front in `dtype`, uninitialised.

        Every take reuses the same memory (a larger size or another dtype replaces the buffer), so
        the view is only valid until the next `take`, which overwrites it. `peak_bytes` keeps the
        largest view's size in bytes.
        """
        numel = n * rows * dim
        if self.buffer is None or self.buffer.numel() < numel or self.buffer.dtype != dtype:
            self.buffer = torch.empty(numel, dtype=dtype, device=device)
        self.peak_bytes = max(self.peak_bytes, numel * self.buffer.element_size())
        return self.buffer[:numel].view(n, rows, dim)


class Attention(nn.Module):
    """Native names: wq_a, q_norm, wq_b, wkv, norm (kv), wo_a, wo_b, attn_sink, compressor, indexer.

    Split by `tp` (`model/parallel.py`): wq_b / attn_sink by heads, wo_a by groups, wo_b by its
    input columns (the layer's output is all-reduced); everything before the heads is replicated."""

    def __init__(self, config, ratio: int, tp=SINGLE):
        super().__init__()
        # with `tp`: this rank's query heads and output groups (a group's heads stay together)
        hidden, self.head_dim = config.hidden_size, config.head_dim
        self.num_heads, self.groups = config.num_attention_heads // tp.size, config.o_groups // tp.size
        self.ratio, self.window, self.eps, self.tp = ratio, config.sliding_window, config.rms_norm_eps, tp
        eps = config.rms_norm_eps
        self.wq_a = Linear(hidden, config.q_lora_rank)
        self.q_norm = RMSNorm(config.q_lora_rank, eps)
        self.wq_b = Linear(config.q_lora_rank, self.num_heads * self.head_dim)
        self.wkv = Linear(hidden, self.head_dim)
        self.norm = RMSNorm(self.head_dim, eps)
        self.wo_a = Linear(self.num_heads * self.head_dim // self.groups, self.groups * config.o_lora_rank)
        self.wo_b = Linear(self.groups * config.o_lora_rank, hidden)
        self.attn_sink = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32))
        self.compressor = Compressor(hidden, self.head_dim, ratio, eps) if ratio > 1 else None
        self.indexer = Indexer(config) if ratio == 4 else None

    def forward(self, x: torch.Tensor, ctx, layer: int, backend: str) -> torch.Tensor:
        """x [T, hidden] (normed) -> [T, hidden]. ctx: the step (`StepContext`: its first
        `num_decode` tokens decode, one per request; the rest are prefill segments); layer: this
        layer's index (its tensors in the step's `CachePool`)."""
        cos, sin = ctx.rope_for(self.ratio)
        T, D = x.shape[0], ctx.num_decode
        q_res = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_res).view(T, self.num_heads, self.head_dim)
        q = Rope.apply(q.mul_(inv_rms(q, self.eps).to(q.dtype)), cos, sin)  # in place: q is fresh
        kv = Rope.apply(self.norm(self.wkv(x)), cos, sin)
        parts = []
        if D:
            parts.append(self.decode(x[:D], q_res[:D], q[:D], kv[:D], ctx, layer, backend))
        if T > D:
            parts.append(self.prefill(x[D:], q_res[D:], q[D:], kv[D:], ctx, layer, backend))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        # K = V carried RoPE: undo it on the output's rope slice at the query position.
        out = Rope.apply(out, cos, -sin)
        grouped = out.view(T, self.groups, -1)
        w = self.wo_a.weight.view(self.groups, -1, grouped.shape[-1])
        return self.tp.all_reduce(self.wo_b(grouped_linear(grouped, w).flatten(1)))  # row-parallel wo_b

    def prefill(self, x, q_res, q, kv, ctx, layer: int, backend: str) -> torch.Tensor:
        """The step's prefill tokens (x [T, hidden], q [T, heads, head_dim], kv [T, head_dim])
        -> attention output [T, heads, head_dim], chunk by planned chunk over the step's table."""
        lay, io = ctx.layouts[self.ratio], ctx.prefill_io[self.ratio]
        D = ctx.num_decode
        positions = ctx.positions[D:]
        cos, sin = (t[D:] for t in ctx.rope_for(self.ratio))
        cache_in = io.read(ctx.cache, layer)
        parts = [cache_in.get("entries"), None, cache_in.get("window"), kv, kv.new_zeros(1, self.head_dim)]
        idx_table, src, isrc = None, None, None
        if self.compressor is not None:
            parts[1], *src = self.compressor(x, positions, lay.comp, cache_in.get("comp"), ctx.comp_rope)
        if self.indexer is not None:
            new_idx, *isrc = self.indexer.compressor(x, positions, lay.comp, cache_in.get("idx"), ctx.comp_rope)
            old_idx = cache_in.get("idx_entries")
            idx_table = new_idx if old_idx is None else torch.cat([old_idx, new_idx])
            iq, iw = self.indexer.queries(x, q_res, cos, sin)
        table = torch.cat([p for p in parts if p is not None])
        io.write(ctx.cache, layer, table, idx_table, src, isrc)

        T = x.shape[0]
        single = len(lay.chunks) == 1  # then the kernel's output is the layer's: no [T, heads, dim] copy
        out = None if single else torch.empty(T, self.num_heads, self.head_dim, dtype=x.dtype, device=x.device)
        for ci, chunk in enumerate(lay.chunks):
            ws = ctx.pool.take(chunk.e - chunk.s, chunk.M, self.head_dim, table.dtype, table.device)
            torch.index_select(table, 0, chunk.ws_index, out=ws.view(-1, self.head_dim))
            if self.indexer is not None:
                indices, lens = self.sparse_indices(chunk, lay, idx_table, iq, iw, backend)
            else:
                indices, lens = lay.static_indices(ci, chunk)
            o, _, _ = sparse_mla_prefill(q[chunk.q0:chunk.q1], ws.view(-1, 1, self.head_dim), indices.unsqueeze(1),
                                         self.head_dim ** -0.5, attn_sink=self.attn_sink, topk_length=lens,
                                         backend=backend, query_blocks=chunk.query_blocks)
            if single:
                out = o
            else:
                out[chunk.q0:chunk.q1] = o
            ctx.count_chunk(ws)
        return out

    def decode(self, x, q_res, q, kv, ctx, layer: int, backend: str) -> torch.Tensor:
        """One token per running request (x [D, hidden], q [D, heads, head_dim], kv [D, head_dim])
        -> [D, heads, head_dim]: its rows appended to the request's cache in place, then one
        sparse-attention call over rows of the pool itself (entries, then the window)."""
        io, pool = ctx.decode_io[self.ratio], ctx.cache
        store = pool.kv[layer]
        store.index_copy_(0, io.ring_write, kv)
        if self.compressor is not None:
            self.compressor.decode(x, io, pool.comp[layer], store[pool.entry_base:], ctx.comp_rope)
        if self.indexer is not None:
            self.indexer.compressor.decode(x, io, pool.idx_comp[layer], pool.idx[layer], ctx.comp_rope)
            cos, sin = (t[:x.shape[0]] for t in ctx.rope_for(self.ratio))
            iq, iw = self.indexer.queries(x, q_res, cos, sin)
            keys = pool.idx[layer].index_select(0, io.key_rows).float()
            width = min(self.indexer.topk, max(int(io.visible.max()), 1))
            picks = self.indexer.select(iq, iw, keys, io.key_lo, io.visible, io.blocks, width, backend)
            indices, lens = io.sparse(picks, self.indexer.topk)
        else:
            indices, lens = io.static
        kv_rows = store
        if not ctx.is_in_place:  # a backend that copies all of kv: hand it only the rows used
            kv_rows = store.index_select(0, indices.clamp(min=0).flatten().long())
            used = torch.arange(indices.numel(), device=indices.device, dtype=torch.int32).view_as(indices)
            indices = torch.where(indices >= 0, used, -1)
        o, _, _ = sparse_mla_prefill(q, kv_rows.unsqueeze(1), indices.unsqueeze(1), self.head_dim ** -0.5,
                                     attn_sink=self.attn_sink, topk_length=lens, backend=backend)
        return o

    def sparse_indices(self, chunk, lay, idx_table, iq, iw, backend: str = "auto"):
        """CSA combined indices for one chunk: each query's indexer top-k, then its window.

        chunk: `ChunkLayout` of requests [s, e), queries [q0, q1) (s_q = q1 - q0 rows);
        lay: the step's ratio-4 `RatioLayout`; idx_table [lay.entries_end, index_head_dim]: indexer
        keys, rows aligned with the table's entry rows; iq [T, index_n_heads, index_head_dim] fp32
        and iw [T, index_n_heads] fp32 from `Indexer.queries`; backend: the attention backend asked for.
        Returns indices [s_q, K + window] int32 into the flattened workspace [(e - s) * M] (valid
        slots first, -1 padded), K = min(index_topk, max(N, 1)), and topk_length [s_q] int32.
        """
        width = min(self.indexer.topk, max(chunk.N, 1))
        keys = idx_table.index_select(0, chunk.key_index).float()  # the chunk's keys, request by request
        blocks = chunk.query_slices(INDEXER_BLOCK_ELEMS // self.indexer.num_heads)
        comp = self.indexer.select(iq[chunk.q0:chunk.q1], iw[chunk.q0:chunk.q1], keys, chunk.key_lo,
                                   chunk.comp_len, blocks, width, backend)
        comp_len = chunk.comp_len.clamp(max=self.indexer.topk)
        return combine(comp, comp_len, chunk.row_base, chunk.win_base, chunk.win_len, self.window)


# fp32 indexer scores [queries, heads, keys] per block: 4 MiB, cache-sized, whatever the context
INDEXER_BLOCK_ELEMS = 1 << 20
