"""One packed prefill step: segments, planned chunks per layer type, carried per-request state."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..planner import plan_step
from .layout import RatioLayout


@dataclass
class RequestState:
    """A request being prefilled over several steps: its ids and each layer's carried tensors."""

    ids: np.ndarray
    done: int = 0  # positions [0, done) already fed
    layers: dict = field(default_factory=dict)  # layer idx -> {"window", "entries", "comp", "idx", "idx_entries"}


class StepContext:
    """Everything shared by the layers of one step.

    segs: [(state, start, end)]; tokens are concatenated in segment order, positions [T] int64.
    layouts: compress ratio -> `RatioLayout` (chunks planned once per ratio for this step).
    """

    def __init__(self, segs, *, ratios, window, engine, ropes, pool, stats, device):
        self.segs, self.window, self.ropes, self.pool, self.stats = segs, window, ropes, pool, stats
        starts = np.array([s for _, s, _ in segs], np.int64)
        ends = np.array([e for _, _, e in segs], np.int64)
        self.cu = np.concatenate([[0], np.cumsum(ends - starts)])
        self.positions = torch.from_numpy(np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)])).to(device)
        self.input_ids = torch.from_numpy(np.concatenate([st.ids[s:e] for st, s, e in segs])).to(device)
        self.continuing = [b for b, (st, _, e) in enumerate(segs) if e < len(st.ids) - 1]
        t0 = time.perf_counter()
        plans = plan_step(ends, ends - starts, compress_ratios=ratios, window_size=window,
                          max_model_len=engine.max_model_len, max_num_batched_tokens=engine.max_num_batched_tokens,
                          prefill_chunk_size=engine.prefill_chunk_size, planner=engine.planner)
        stats["planner_s"] += time.perf_counter() - t0
        self.layouts = {r: RatioLayout(starts, ends, self.cu, r, window, plans[r], device) for r in plans}
        self.cos_sin = {name: rope.cos_sin(self.positions) for name, rope in ropes.items()}
        self.comp_rope = ropes["compress"]

    def rope_for(self, ratio: int):
        """Sliding-only layers use the main RoPE; compressed layers the compress (YaRN) one."""
        return self.cos_sin["main" if ratio == 1 else "compress"]

    def cache_in(self, layer: int) -> dict:
        """Concatenate the continuing requests' carried tensors for `layer`, in segment order."""
        per_seg = [st.layers.get(layer) for st, s, _ in self.segs if s > 0]
        if not per_seg:
            return {}
        out = {}
        for key in ("window", "entries", "idx_entries"):
            if key in per_seg[0]:
                out[key] = torch.cat([c[key] for c in per_seg])
        for key in ("comp", "idx"):
            if key in per_seg[0]:
                out[key] = (torch.cat([c[key][0] for c in per_seg]), torch.cat([c[key][1] for c in per_seg]))
        return out

    def carry(self, cache_out: dict, key: str, src, comp_layout):
        """Keep each continuing request's compressor rows (last full window + pending tail)."""
        for b in self.continuing:
            rows = comp_layout.keep[b]
            cache_out.setdefault(b, {})[key] = (src[0][rows], src[1][rows])

    def carry_entries(self, cache_out: dict, table, lay: RatioLayout, idx_table):
        """Keep each continuing request's compressed entries and its last W - 1 raw rows."""
        for b in self.continuing:
            out = cache_out.setdefault(b, {})
            win = torch.from_numpy(lay.window_rows(b)[-(self.window - 1):]).to(table.device)
            out["window"] = table[win]
            if lay.r > 1:
                rows = torch.from_numpy(lay.entry_rows(b)).to(table.device)
                out["entries"] = table[rows]
                if idx_table is not None:
                    out["idx_entries"] = idx_table[rows]

    def store(self, layer: int, cache_out: dict):
        for b, tensors in cache_out.items():
            self.segs[b][0].layers[layer] = tensors

    def count_chunk(self, ws: torch.Tensor):
        self.stats["num_chunks"] += 1
        self.stats["workspace_elements"] += ws.numel()
