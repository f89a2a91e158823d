"""Index layouts of one packed prefill step, built once per layer type (compress ratio) per step.

A step holds segments: request b feeds positions `[start_b, end_b)`; its earlier positions live in
a per-request cache (multi-step prefill). For a layer of ratio r every tensor the attention needs
is a row of one flat *table* per layer:

    table = [old entries (sum E_b) | new entries (sum n_b) | carried window (sum prior_b) | step kv (T) | zero]

with E_b = start_b // r entries already compressed, n_b = end_b // r - E_b new ones, prior_b =
min(start_b, W - 1) raw rows kept from earlier steps. Every layer of one type shares these counts,
so the gather indices below (workspace rows, combined attention indices for SWA/HCA, compressor
windows) are computed once per type and reused by all its layers. Pure numpy until `to_torch`.
"""

from __future__ import annotations

import numpy as np
import torch


class CompressorLayout:
    """Windows closed in this step for a ratio-r compressor (with 2r-token overlap if `overlap`).

    Source rows: src = [carried block of each segment (prev window r rows if overlap, then pending
    start_b % r rows) | step rows T | pad]. cur [n, r] / prev [n, r] index src (pad = -inf gate).
    positions [n]: absolute position k * r of each new entry (its RoPE position).
    """

    def __init__(self, starts, ends, cu, r: int, overlap: bool):
        num = len(starts)
        self.pend = starts % r
        self.has_prev = (starts // r >= 1) & overlap
        self.carry_len = self.pend + np.where(self.has_prev, r, 0)
        carry_off = np.concatenate([[0], np.cumsum(self.carry_len)])
        self.num_carried = int(carry_off[-1])
        step_off = self.num_carried
        self.pad = step_off + int(cu[-1])
        cur, prev, pos, keep = [], [], [], []
        for b in range(num):
            prev_rows = np.arange(r) + carry_off[b] if self.has_prev[b] else np.full(r, self.pad)
            rows = np.concatenate([carry_off[b] + np.where(self.has_prev[b], r, 0) + np.arange(self.pend[b]),
                                   step_off + np.arange(cu[b], cu[b + 1])])
            n = len(rows) // r
            win = rows[: n * r].reshape(n, r)
            cur.append(win)
            prev.append(np.concatenate([prev_rows[None], win[:-1]])[:n] if overlap else win)
            pos.append((starts[b] // r + np.arange(n)) * r)
            # rows to carry if the request continues: last full window (overlap) then the tail
            last = win[-1] if n else prev_rows
            tail = rows[n * r:]
            keep.append(np.concatenate([last, tail]) if overlap and (n or self.has_prev[b]) else tail)
        self.cur = np.concatenate(cur).astype(np.int64) if num else np.zeros((0, r), np.int64)
        self.prev = np.concatenate(prev).astype(np.int64) if num else np.zeros((0, r), np.int64)
        self.positions = np.concatenate(pos).astype(np.int64) if num else np.zeros(0, np.int64)
        self.num_new = (ends // r) - (starts // r)
        self.keep = keep

    def to_torch(self, device):
        for name in ("cur", "prev", "positions"):
            setattr(self, name, torch.from_numpy(getattr(self, name)).to(device))
        self.keep = [torch.from_numpy(k.astype(np.int64)).to(device) for k in self.keep]
        return self


class ChunkLayout:
    """One planned chunk `(s, e, N, M)`: its workspace gather and per-query index parts.

    ws_index [(e-s)*M]: table row for every workspace row (pad -> zero row).
    row_base/win_base/win_len/comp_len [s_q]: pieces of the combined indices (see `combine`).
    """

    def __init__(self, lay: "RatioLayout", s: int, e: int, N: int, M: int):
        self.s, self.e, self.N, self.M = s, e, N, M
        self.q0, self.q1 = int(lay.cu[s]), int(lay.cu[e])
        ws = np.full((e - s, M), lay.zero_row, np.int64)
        row_base, win_base, win_len, comp_len = [], [], [], []
        for i, b in enumerate(range(s, e)):
            ws[i, : lay.compressed[b]] = lay.entry_rows(b)
            g = lay.gather[b]
            ws[i, N: N + g] = lay.window_rows(b)
            p = np.arange(lay.starts[b], lay.ends[b])
            wl = np.minimum(p + 1, lay.window)
            row_base.append(np.full(len(p), i * M))
            win_len.append(wl)
            win_base.append(i * M + N + (p - wl + 1) - (lay.ends[b] - g))
            comp_len.append((p + 1) // lay.r if lay.r > 1 else np.zeros(len(p), np.int64))
        self.ws_index = ws.reshape(-1)
        self.row_base, self.win_base = np.concatenate(row_base), np.concatenate(win_base)
        self.win_len, self.comp_len = np.concatenate(win_len), np.concatenate(comp_len)

    def to_torch(self, device):
        for name in ("ws_index", "row_base", "win_base", "win_len", "comp_len"):
            setattr(self, name, torch.from_numpy(getattr(self, name).astype(np.int64)).to(device))
        return self


def combine(comp: torch.Tensor | None, comp_len, row_base, win_base, win_len, window: int):
    """Combined per-query indices into the flattened workspace, valid slots first.

    comp [s_q, K] request-local compressed entry ids (valid-first, or None for SWA-only);
    comp_len [s_q] valid compressed count; window part = win_base + arange(win_len).
    Returns indices [s_q, K + window] int32 (-1 padded) and topk_length [s_q] int32.
    """
    k = 0 if comp is None else comp.shape[1]
    col = torch.arange(k + window, device=win_len.device)
    cl = comp_len.clamp(max=k).unsqueeze(1)
    win = win_base.unsqueeze(1) + (col - cl)
    out = torch.where(col < cl + win_len.unsqueeze(1), win, -1)
    if comp is not None and k:
        gathered = comp.gather(1, col.clamp(max=k - 1).expand(comp.shape[0], -1)) + row_base.unsqueeze(1)
        out = torch.where(col < cl, gathered, out)
    return out.to(torch.int32), (cl.squeeze(1) + win_len).to(torch.int32)


class RatioLayout:
    """Everything a layer of compress ratio `r` needs for one step; see the module docstring."""

    def __init__(self, starts, ends, cu, r: int, window: int, chunks, device):
        self.starts, self.ends, self.cu, self.r, self.window = starts, ends, cu, r, window
        self.compressed = ends // r if r > 1 else np.zeros_like(ends)
        self.old = starts // r if r > 1 else np.zeros_like(starts)
        self.prior = np.minimum(starts, window - 1)
        self.gather = (ends - starts) + self.prior
        num_old, num_new = int(self.old.sum()), int((self.compressed - self.old).sum())
        self.old_off = np.concatenate([[0], np.cumsum(self.old)])[:-1]
        self.new_off = num_old + np.concatenate([[0], np.cumsum(self.compressed - self.old)])[:-1]
        self.win_off = num_old + num_new + np.concatenate([[0], np.cumsum(self.prior)])[:-1]
        self.step_off = num_old + num_new + int(self.prior.sum())
        self.zero_row = self.step_off + int(cu[-1])
        self.entries_end = num_old + num_new
        self.comp = None
        if r > 1:
            self.comp = CompressorLayout(starts, ends, cu, r, overlap=(r == 4)).to_torch(device)
        self.chunks = [ChunkLayout(self, *c).to_torch(device) for c in chunks]
        self.static = {}  # combined indices for SWA/HCA, filled lazily, shared by all layers

    def entry_rows(self, b: int) -> np.ndarray:
        """Table rows of request b's compressed entries 0 .. end_b // r - 1."""
        return np.concatenate([self.old_off[b] + np.arange(self.old[b]),
                               self.new_off[b] + np.arange(self.compressed[b] - self.old[b])])

    def window_rows(self, b: int) -> np.ndarray:
        """Table rows of request b's raw tokens [end_b - gather_b, end_b)."""
        return np.concatenate([self.win_off[b] + np.arange(self.prior[b]),
                               self.step_off + np.arange(self.cu[b], self.cu[b + 1])])

    def static_indices(self, ci: int, chunk: ChunkLayout):
        """Combined indices of a SWA (r = 1) or HCA chunk: all visible entries, then the window."""
        if ci not in self.static:
            comp = None
            if self.r > 1:
                comp = torch.arange(max(chunk.N, 1), device=chunk.win_len.device).expand(len(chunk.win_len), -1)
            self.static[ci] = combine(comp, chunk.comp_len, chunk.row_base, chunk.win_base, chunk.win_len,
                                      self.window)
        return self.static[ci]
