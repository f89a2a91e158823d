"""Index layouts of one packed prefill step, built once per layer type (compress ratio) per step.

A step holds segments: request b feeds positions `[start_b, end_b)`; its earlier positions live in
a per-request cache (multi-step prefill). For a layer of ratio r every tensor the attention needs
is a row of one flat *table* per layer:

    table = [old entries (sum E_b) | new entries (sum n_b) | carried window (sum prior_b) | step kv (T) | zero]

with E_b = start_b // r entries already compressed, n_b = end_b // r - E_b new ones, prior_b =
min(start_b, W - 1) raw rows kept from earlier steps. Every layer of one type shares these counts,
so the gather indices below (workspace rows, combined attention indices for SWA/HCA, compressor
windows, indexer key ranges) are computed once per type and reused by all its layers. Pure numpy
until `to_torch`, and vectorised over requests (`ranges`): a step of many short requests costs a
few numpy calls per layout, not a Python loop per request.
"""

from __future__ import annotations

import numpy as np
import torch

from ..kernels.sparse_mla_torch import QUERY_BLOCK


def ranges(starts, lengths) -> np.ndarray:
    """Concatenated aranges: [starts[0], starts[0] + lengths[0]) ++ [starts[1], ...) as int64."""
    starts, lengths = np.asarray(starts, np.int64).reshape(-1), np.asarray(lengths, np.int64).reshape(-1)
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


def interleave(a, b) -> np.ndarray:
    """[a0, b0, a1, b1, ...]: per-request (first part, second part) pairs for `ranges`."""
    return np.stack([np.atleast_1d(a).astype(np.int64), np.atleast_1d(b).astype(np.int64)], 1).reshape(-1)


class CompressorLayout:
    """Windows closed in this step for a ratio-r compressor (with 2r-token overlap if `overlap`).

    Source rows: src = [carried block of each segment (prev window r rows if overlap, then pending
    start_b % r rows) | step rows T | pad]. cur [n, r] / prev [n, r] index src (pad = -inf gate);
    slots [n, coff * r] the same as one gather (see below).
    positions [n]: absolute position k * r of each new entry (its RoPE position).
    `keep_rows(b)`: the src rows request b carries to its next step.
    """

    def __init__(self, starts, ends, cu, r: int, overlap: bool):
        self.r, self.overlap = r, overlap
        self.pend = starts % r
        self.has_prev = (starts // r >= 1) & overlap
        self.carry_len = self.pend + np.where(self.has_prev, r, 0)
        self.carry_off = np.cumsum(self.carry_len) - self.carry_len
        self.num_carried = int(self.carry_len.sum())
        self.pad = self.num_carried + int(cu[-1])
        # per request: its pending rows then its step rows, one segment of `seg_len` src rows
        self.seg_len = self.pend + np.diff(cu)
        self.seg_off = np.cumsum(self.seg_len) - self.seg_len
        self.rows = ranges(interleave(self.carry_off + np.where(self.has_prev, r, 0), self.num_carried + cu[:-1]),
                           interleave(self.pend, np.diff(cu)))
        self.n = self.seg_len // r  # windows closed per request
        self.cur = self.rows[ranges(self.seg_off, self.n * r)].reshape(-1, r)
        self.prev = self.cur
        if overlap:
            first = np.cumsum(self.n) - self.n  # window index of each request's first new window
            self.prev = np.concatenate([np.full((1, r), self.pad, np.int64), self.cur[:-1]])[:len(self.cur)]
            has = self.n > 0
            self.prev[first[has]] = self.prev_rows(np.flatnonzero(has))
        self.positions = ranges(starts // r, self.n) * r
        self.num_new = (ends // r) - (starts // r)
        # slots [n, coff * r]: rows of src viewed [2 * rows, dim] (overlap: the previous window's
        # first halves, then this window's second halves) or of src itself: one gather per entry
        self.slots = np.concatenate([self.prev * 2, self.cur * 2 + 1], 1) if overlap else self.cur

    def prev_rows(self, bs) -> np.ndarray:
        """[len(bs), r] src rows of each request's previous (carried) window, pad rows if none."""
        bs = np.asarray(bs, np.int64)
        rows = self.carry_off[bs, None] + np.arange(self.r)
        return np.where(self.has_prev[bs, None], rows, self.pad)

    def keep_rows(self, b: int) -> np.ndarray:
        """src rows request b carries on: its last full window (overlap only, once one exists),
        then the `seg_len % r` pending rows after it (int64)."""
        seg = self.rows[self.seg_off[b]: self.seg_off[b] + self.seg_len[b]]
        n = int(self.n[b])
        keep = seg[n * self.r:]
        if self.overlap and (n or self.has_prev[b]):
            last = seg[(n - 1) * self.r: n * self.r] if n else self.prev_rows([b])[0]
            keep = np.concatenate([last, keep])
        return keep

    def to_torch(self, device):
        for name in ("cur", "prev", "positions", "slots"):
            setattr(self, name, torch.from_numpy(np.ascontiguousarray(getattr(self, name))).to(device))
        return self


class ChunkLayout:
    """One planned chunk `(s, e, N, M)`: its workspace gather and per-query index parts.

    ws_index [(e-s)*M]: table row for every workspace row (pad -> zero row).
    row_base/win_base/win_len/comp_len [s_q]: pieces of the combined indices (see `combine`).
    query_blocks: boundaries [0, ..., s_q] (list of ints) of the kernel's candidate dense blocks:
    one request's queries cut at absolute positions that are multiples of `QUERY_BLOCK` (a
    request's blocks, hence its arithmetic, do not depend on its chunk-mates).
    For the indexer (ratio 4): key_index [E_c] table rows of the chunk's entries, request after
    request (E_c = sum of the chunk's compressed counts); key_lo [s_q] where the query's request
    starts in it (its visible keys are key_lo + [0, comp_len)).
    """

    def __init__(self, lay: "RatioLayout", s: int, e: int, N: int, M: int):
        self.s, self.e, self.N, self.M = s, e, N, M
        self.q0, self.q1 = int(lay.cu[s]), int(lay.cu[e])
        bs = np.arange(s, e)
        base = (bs - s) * M
        comp, gather, q_len = lay.compressed[bs], lay.gather[bs], np.diff(lay.cu[s:e + 1])
        ws = np.full((e - s) * M, lay.zero_row, np.int64)
        self.key_index = lay.entry_rows(bs)
        ws[ranges(base, comp)] = self.key_index
        ws[ranges(base + N, gather)] = lay.window_rows(bs)
        p = ranges(lay.starts[bs], q_len)  # each query's absolute position
        per_query = np.repeat(np.arange(e - s), q_len)
        self.win_len = np.minimum(p + 1, lay.window)
        self.row_base = base[per_query]
        self.win_base = self.row_base + N + (p - self.win_len + 1) - (lay.ends[bs] - gather)[per_query]
        self.comp_len = (p + 1) // lay.r if lay.r > 1 else np.zeros(len(p), np.int64)
        key_end = np.cumsum(comp)
        self.key_lo = (key_end - comp)[per_query]
        # numpy copies for `query_slices`: the keys a query sees, [key_lo, key_lo + comp_len)
        self.key_bounds = (self.key_lo, self.key_lo + self.comp_len)
        first = np.zeros(len(p), bool)
        first[(lay.cu[s:e] - lay.cu[s])[q_len > 0]] = True  # each request's first query
        self.query_blocks = np.append(np.flatnonzero(first | (p % QUERY_BLOCK == 0)), len(p)).tolist()
        self.ws_index = ws
        self.slices = {}

    def query_slices(self, max_elems: int):
        """Query blocks [(a, b, k_lo, k_hi)] (chunk-local) whose keys are [k_lo, k_hi) of key_index.

        Blocks are contiguous queries of `rows` each, rows chosen so that rows * (the chunk's
        largest key range) stays near `max_elems` (a cache-sized score block); k_hi is the end of
        the last query's visible keys (queries run in position order, so no query of the block
        sees past it: a long request's early blocks score only the keys they can see), and short
        requests share one block and one GEMM.
        """
        if max_elems not in self.slices:
            rows = int(np.clip(max_elems // max(self.N, 1), 16, 512))
            lo, hi = self.key_bounds
            n = len(lo)
            self.slices[max_elems] = [(a, min(a + rows, n), int(lo[a]), int(hi[min(a + rows, n) - 1]))
                                      for a in range(0, n, rows)]
        return self.slices[max_elems]

    def to_torch(self, device):
        for name in ("ws_index", "row_base", "win_base", "win_len", "comp_len", "key_index", "key_lo"):
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
        self.old_off = np.cumsum(self.old) - self.old
        self.new_off = num_old + np.cumsum(self.compressed - self.old) - (self.compressed - self.old)
        self.win_off = num_old + num_new + np.cumsum(self.prior) - self.prior
        self.step_off = num_old + num_new + int(self.prior.sum())
        self.zero_row = self.step_off + int(cu[-1])
        self.entries_end = num_old + num_new
        self.comp = None
        if r > 1:
            self.comp = CompressorLayout(starts, ends, cu, r, overlap=(r == 4)).to_torch(device)
        self.chunks = [ChunkLayout(self, *c).to_torch(device) for c in chunks]
        self.static = {}  # combined indices for SWA/HCA, filled lazily, shared by all layers

    def entry_rows(self, b) -> np.ndarray:
        """Table rows of request b's compressed entries 0 .. end_b // r - 1 (b an int or an
        array of requests: their rows concatenated in that order)."""
        b = np.asarray(b)
        return ranges(interleave(self.old_off[b], self.new_off[b]),
                      interleave(self.old[b], self.compressed[b] - self.old[b]))

    def window_rows(self, b) -> np.ndarray:
        """Table rows of request b's raw tokens [end_b - gather_b, end_b) (b an int or an array)."""
        b = np.asarray(b)
        return ranges(interleave(self.win_off[b], self.step_off + self.cu[:-1][b]),
                      interleave(self.prior[b], self.cu[1:][b] - self.cu[:-1][b]))

    def static_indices(self, ci: int, chunk: ChunkLayout):
        """Combined indices of a SWA (r = 1) or HCA chunk: all visible entries, then the window."""
        if ci not in self.static:
            comp = None
            if self.r > 1:
                comp = torch.arange(max(chunk.N, 1), device=chunk.win_len.device).expand(len(chunk.win_len), -1)
            self.static[ci] = combine(comp, chunk.comp_len, chunk.row_base, chunk.win_base, chunk.win_len,
                                      self.window)
        return self.static[ci]
