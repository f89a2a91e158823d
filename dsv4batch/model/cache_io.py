"""Where one step reads and writes the `CachePool`, per layer type (ratio): row indices only.

Every layer of one ratio has the same geometry, so the rows are computed once per step and ratio
(numpy, then torch) and every layer of that ratio reads and writes its own tensors with them:

- `PrefillIO`: prefill segments that continue an earlier step read their carried state (window
  rows, entries, indexer keys, open windows) in the order the step's table expects (`layout`);
  segments whose request goes on afterwards write what the next step needs: their newest raw rows
  into the ring, their new entries, their open windows.
- `DecodeIO`: one token per request: its kv row into the ring, its compressor row into the open
  window (and, where that closes a window, the new entry into the entry rows and the window slid
  on), then the attention indices of the query: entries (all of them, or the indexer's top-k on
  ratio 4) and its window, read in place from the pool.
"""

from __future__ import annotations

import numpy as np
import torch

from .cache import CachePool
from .layout import RatioLayout, ranges


def _t(a, device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)


class PrefillIO:
    """The pool rows of one step's prefill segments at ratio `lay.r` (see the module docstring).

    Reads, for the segments in order: `win_in` (kv rows of the P_b raw rows before each segment),
    `ent_in` (entry rows of its E_b entries), `state_in` (flattened open-window rows). Writes,
    for the continuing segments `keep`: `win_out` (table rows, kv rows) of their last
    min(len, W) positions, `ent_out` (table rows, entry rows) of their new entries and
    `state_out` (compressor source rows, flattened open-window rows).
    """

    def __init__(self, pool: CachePool | None, segs, lay: RatioLayout, keep: list[int], device):
        self.r, self.device = lay.r, device
        self.is_reading = bool(lay.prior.sum()) or bool(lay.old.sum())
        self.keep = keep
        if pool is None:
            return
        caches = [st.cache for st, _, _ in segs]
        slots = np.array([c.slot if c is not None else 0 for c in caches], np.int64)
        starts = lay.starts
        if self.is_reading:
            self.win_in = _t(pool.ring_rows(np.repeat(slots, lay.prior), ranges(starts - lay.prior, lay.prior)), device)
            if lay.r > 1:
                with_old = [b for b in range(len(segs)) if lay.old[b]]
                local = pool.entry_rows([caches[b] for b in with_old], np.zeros(len(with_old)), lay.old[with_old], lay.r)
                self.ent_in = _t(local, device)
                self.state_in = _t(pool.state_rows(slots, np.zeros_like(slots), lay.comp.carry_len, lay.r), device)
        if keep:
            self._writes(pool, caches, slots, lay, device)

    def _writes(self, pool: CachePool, caches, slots, lay: RatioLayout, device):
        keep = np.array(self.keep, np.int64)
        q_len = (lay.ends - lay.starts)[keep]
        n = np.minimum(q_len, pool.spec.window)
        last = lay.step_off + lay.cu[1:][keep]
        self.win_out = (_t(ranges(last - n, n), device),
                        _t(pool.ring_rows(np.repeat(slots[keep], n), ranges(lay.ends[keep] - n, n)), device))
        if lay.r == 1:
            return
        new = (lay.compressed - lay.old)[keep]
        self.ent_out = (_t(ranges(lay.new_off[keep], new), device),
                        _t(pool.entry_rows([caches[b] for b in keep], lay.old[keep], new, lay.r), device))
        src = [lay.comp.keep_rows(int(b)) for b in keep]
        lens = np.array([len(s) for s in src], np.int64)
        self.state_out = (_t(np.concatenate(src) if src else np.zeros(0), device),
                          _t(pool.state_rows(slots[keep], np.zeros_like(keep), lens, lay.r), device))

    def read(self, pool: CachePool, layer: int) -> dict:
        """What `layer`'s segments carried from earlier steps (keys as `layout` names them:
        window, entries, idx_entries, comp, idx); {} when none continues an earlier step."""
        if not self.is_reading:
            return {}
        kv = pool.kv[layer]
        out = {"window": kv.index_select(0, self.win_in)}
        if self.r > 1:
            out["entries"] = kv[pool.entry_base:].index_select(0, self.ent_in)
            out["comp"] = _gather_state(pool.comp[layer], self.state_in)
        if self.r == 4:
            out["idx_entries"] = pool.idx[layer].index_select(0, self.ent_in)
            out["idx"] = _gather_state(pool.idx_comp[layer], self.state_in)
        return out

    def write(self, pool: CachePool, layer: int, table, idx_table, comp_src, idx_src) -> None:
        """Keep the continuing segments' state: table [rows, head_dim] (the step's table),
        idx_table (indexer keys, same entry rows), comp_src / idx_src (kv, gate) source tables."""
        if not self.keep:
            return
        kv = pool.kv[layer]
        kv.index_copy_(0, self.win_out[1], table.index_select(0, self.win_out[0]))
        if self.r == 1:
            return
        kv[pool.entry_base:].index_copy_(0, self.ent_out[1], table.index_select(0, self.ent_out[0]))
        _scatter_state(pool.comp[layer], self.state_out, comp_src)
        if self.r == 4:
            pool.idx[layer].index_copy_(0, self.ent_out[1], idx_table.index_select(0, self.ent_out[0]))
            _scatter_state(pool.idx_comp[layer], self.state_out, idx_src)


def _gather_state(state, rows) -> tuple[torch.Tensor, torch.Tensor]:
    kv, gate = state
    return (kv.view(-1, kv.shape[-1]).index_select(0, rows), gate.view(-1, gate.shape[-1]).index_select(0, rows))


def _scatter_state(state, rows, src) -> None:
    (kv, gate), (src_rows, dst_rows) = state, rows
    kv.view(-1, kv.shape[-1]).index_copy_(0, dst_rows, src[0].index_select(0, src_rows))
    gate.view(-1, gate.shape[-1]).index_copy_(0, dst_rows, src[1].index_select(0, src_rows))


class DecodeIO:
    """The pool rows of one step's decode tokens at ratio `r`; request i feeds position p_i.

    ring_write [D]: kv row of p_i. Compressors (r > 1): `state_write` [D] (flattened open-window
    row of p_i); the requests whose token closes a window (`(p + 1) % r == 0`), `close` [n] of
    them: `close_halves` [n, coff * r] (half-rows, `[rows * 2, dim]` view with overlap, else rows,
    of the window's slots: the previous window's first halves, then this one's second halves),
    `close_first` [n] bool (no previous window: its slots weigh nothing), `close_rows` [n] (entry
    rows), `close_positions` [n] (RoPE position k * r), `slide` (src, dst) flattened rows that move
    the closed window to the front (overlap). Attention: `static` (indices [D, K + W] int32 and
    lengths [D] int32: every visible entry then the window) unless r == 4, where the indexer picks
    among `key_rows` (entry rows, request after request; `key_lo`, `visible` [D]) and `sparse`
    combines its picks with the window.
    """

    def __init__(self, pool: CachePool, states, r: int, device):
        self.r, self.device = r, device
        W = pool.spec.window
        caches = [st.cache for st in states]
        slots = np.array([c.slot for c in caches], np.int64)
        p = np.array([st.done for st in states], np.int64)
        D = len(p)
        self.positions = _t(p, device)
        self.ring_write = _t(pool.ring_rows(slots, p), device)
        win_len = np.minimum(p + 1, W)
        win = np.full((D, W), -1, np.int64)
        win[np.repeat(np.arange(D), win_len), ranges(np.zeros(D), win_len)] = \
            pool.ring_rows(np.repeat(slots, win_len), ranges(p - win_len + 1, win_len))
        self.win_rows, self.win_len = win, win_len
        visible = (p + 1) // r if r > 1 else np.zeros(D, np.int64)
        local = pool.entry_rows(caches, np.zeros(D), visible, r) if r > 1 else np.zeros(0, np.int64)
        if r > 1:
            self._compressor(pool, caches, slots, p, device)
        if r == 4:
            self.key_rows = _t(local, device)
            self.entry_rows = _t(local + pool.entry_base, device)
            lo = np.cumsum(visible) - visible
            self.key_lo, self.visible = _t(lo, device), _t(visible, device)
            self.blocks = [(i, i + 1, int(lo[i]), int(lo[i] + visible[i])) for i in range(D)]
            self.win_t, self.win_len_t = _t(win, device), _t(win_len, device)
        else:
            self.static = self._static(local + pool.entry_base, visible, device)

    def _compressor(self, pool: CachePool, caches, slots, p, device):
        r = self.r
        overlap = r == 4
        rows = pool.spec.state_shape(r, 1)[0]  # rows per slot (the width does not matter)
        has_prev = overlap & (p // r >= 1)
        self.state_write = _t(slots * rows + np.where(has_prev, r, 0) + p % r, device)
        close = np.flatnonzero((p + 1) % r == 0)
        k = (p[close] + 1) // r - 1
        first = k == 0
        base = slots[close, None] * rows + np.arange(r)
        if overlap:
            cur = base + np.where(first, 0, r)[:, None]
            halves = np.concatenate([base * 2, cur * 2 + 1], 1)  # prev first halves (garbage when first)
            later = ~first
            slide = (ranges(slots[close][later] * rows + r, np.full(later.sum(), r)),
                     ranges(slots[close][later] * rows, np.full(later.sum(), r)))
            self.slide = tuple(_t(s, device) for s in slide)
        else:
            halves = base
            self.slide = None
        self.close = _t(close, device)
        self.close_halves = _t(halves, device)
        self.close_first = torch.from_numpy(first & overlap).to(device)
        self.close_rows = _t(pool.entry_rows([caches[i] for i in close], k, np.ones(len(k)), r), device)
        self.close_positions = _t(k * r, device)

    def _static(self, entry_rows, visible, device):
        """[D, K + W] indices (entries first, then the window) and lengths, int32."""
        D, W = self.win_rows.shape
        K = int(visible.max()) if D else 0
        out = np.full((D, K + W), -1, np.int64)
        out[np.repeat(np.arange(D), visible), ranges(np.zeros(D), visible)] = entry_rows
        rows, cols = np.nonzero(self.win_rows >= 0)
        out[rows, visible[rows] + cols] = self.win_rows[rows, cols]
        lens = visible + self.win_len
        return (torch.from_numpy(out.astype(np.int32)).to(device), torch.from_numpy(lens.astype(np.int32)).to(device))

    def sparse(self, picks: torch.Tensor, topk: int):
        """Indices [D, width + W] int32 and lengths [D] int32 of ratio-4 queries: the indexer's
        picks [D, width] (request-local entry ids, valid first: min(topk, visible) of them) as
        kv rows, then the window."""
        D, width = picks.shape
        n = self.visible.clamp(max=topk).unsqueeze(1)
        col = torch.arange(width + self.win_t.shape[1], device=self.device)
        out = self.win_t.gather(1, (col - n).clamp(0, self.win_t.shape[1] - 1))
        out = torch.where(col < n + self.win_len_t.unsqueeze(1), out, -1)
        if self.entry_rows.numel():  # else no request has an entry yet (n == 0)
            local = (self.key_lo.unsqueeze(1) + picks).clamp(0, self.entry_rows.numel() - 1)
            comp = self.entry_rows[local.gather(1, col.clamp(max=width - 1).expand(D, -1))]
            out = torch.where(col < n, comp, out)
        return out.to(torch.int32), (n.squeeze(1) + self.win_len_t).to(torch.int32)
