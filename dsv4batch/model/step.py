"""One packed prefill step (`StepContext`) and the per-request state carried between steps.

The engine (`model/engine.py`) cuts requests into steps and builds one `StepContext` per step;
the model's layers read it (positions, ids, layouts, ropes, the workspace pool) and hand it the
tensors continuing requests carry to their next step. Counters go to the engine's `StepStats`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..planner import plan_step
from .layout import RatioLayout, ranges
from .stats import StepStats


@dataclass
class RequestState:
    """A request being prefilled over several steps: its ids and each layer's carried tensors."""

    ids: np.ndarray
    done: int = 0  # positions [0, done) already fed
    layers: dict = field(default_factory=dict)  # layer idx -> {"window", "entries", "comp", "idx", "idx_entries"}


def step_plans(segs, ratios, window: int, config, stats: StepStats) -> dict:
    """The step's chunk plans, once per layer type: compress ratio -> the planner's chunks.

    segs: [(state, start, end)] as `StepContext` takes them; config: the `EngineConfig`. The
    planner's time goes to `stats.planner_s`."""
    starts = np.array([s for _, s, _ in segs], np.int64)
    ends = np.array([e for _, _, e in segs], np.int64)
    t0 = time.perf_counter()
    plans = plan_step(ends, ends - starts, compress_ratios=ratios, window_size=window,
                      max_model_len=config.max_model_len, max_num_batched_tokens=config.max_num_batched_tokens,
                      prefill_chunk_size=config.prefill_chunk_size, planner=config.planner)
    stats.planner_s += time.perf_counter() - t0
    return plans


class StepContext:
    """Everything shared by the layers of one step.

    segs: [(state, start, end)]: request `state` feeds positions [start, end) in this step.
    cu [B + 1] int64 (numpy): segment b's tokens are rows [cu[b], cu[b + 1]) of the step.
    positions, input_ids [T] int64 on `device`: tokens concatenated in segment order.
    continuing: indices b of the segments whose request has more positions after this step.
    layouts: compress ratio -> `RatioLayout` (chunks planned once per ratio for this step: `plans`,
    `step_plans`' output, computed here when not given).
    Building a context counts one step, its tokens and the planner time in `stats`.
    """

    def __init__(self, segs, *, ratios, window, config, ropes, pool, stats: StepStats, device, plans=None):
        self.segs, self.window, self.ropes, self.pool, self.stats = segs, window, ropes, pool, stats
        starts = np.array([s for _, s, _ in segs], np.int64)
        ends = np.array([e for _, _, e in segs], np.int64)
        self.cu = np.concatenate([[0], np.cumsum(ends - starts)])
        self.positions = torch.from_numpy(ranges(starts, ends - starts)).to(device)
        self.input_ids = torch.from_numpy(np.concatenate([st.ids[s:e] for st, s, e in segs])).to(device)
        self.continuing = [b for b, (st, _, e) in enumerate(segs) if e < len(st.ids) - 1]
        if plans is None:
            plans = step_plans(segs, ratios, window, config, stats)
        stats.num_steps += 1
        stats.num_tokens += int(self.cu[-1])
        self.layouts = {r: RatioLayout(starts, ends, self.cu, r, window, plans[r], device) for r in plans}
        self.cos_sin = {name: rope.cos_sin(self.positions) for name, rope in ropes.items()}
        self.comp_rope = ropes["compress"]

    def rope_for(self, ratio: int):
        """Sliding-only layers use the main RoPE; compressed layers the compress (YaRN) one."""
        return self.cos_sin["main" if ratio == 1 else "compress"]

    def cache_in(self, layer: int) -> dict:
        """The tensors `layer` carried from earlier steps, concatenated over segments with start > 0.

        Segment order, as the layout's table and compressor source rows expect. Per segment b,
        with r the layer's ratio: P_b = min(start_b, W - 1), E_b = start_b // r and
        K_b = start_b % r pending compressor rows (+ r rows of the last window when r == 4 and
        E_b >= 1); coff = 2 for r == 4 (overlapping windows), else 1:
          "window"      [sum P_b, head_dim]          raw kv rows just before each segment (all layers);
          "entries"     [sum E_b, head_dim]          compressed entries (r > 1);
          "comp"        (kv [sum K_b, coff * head_dim], gate fp32 [sum K_b, coff * head_dim])
                        compressor source rows (r > 1);
          "idx"         (kv, gate) the same for the indexer's ratio-4 compressor at index_head_dim;
          "idx_entries" [sum E_b, index_head_dim]    indexer keys (CSA layers).
        `{}` when no segment continues an earlier step.
        """
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
        """Keep each continuing request's compressor rows (last full window + pending tail).

        src: (kv, gate) source tables [num_carried + T + 1, coff * dim] of one compressor (see
        `Compressor.forward`); comp_layout: the step's `CompressorLayout`. Sets
        cache_out[b][key] = (kv[keep_b], gate[keep_b]) for b in `continuing`, keep_b = r rows of
        the last closed window (ratio 4 only, once one exists) then the end_b % r pending rows.
        """
        for b in self.continuing:
            rows = torch.from_numpy(comp_layout.keep_rows(b)).to(src[0].device)
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
        """Hand `cache_out` (segment b -> tensors) to the requests: `cache_in` of their next step."""
        for b, tensors in cache_out.items():
            self.segs[b][0].layers[layer] = tensors

    def count_chunk(self, ws: torch.Tensor):
        """One sparse-attention kernel call over workspace `ws`."""
        self.stats.num_chunks += 1
        self.stats.workspace_elements += ws.numel()
