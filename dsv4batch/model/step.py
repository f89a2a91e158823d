"""One packed step (`StepContext`): decode tokens and prefill segments, and the request state.

The engine (`model/engine.py`) cuts requests into steps and builds one `StepContext` per step;
the model's layers read it (positions, ids, layouts, ropes, the workspace pool) and keep what a
request's later tokens need in the step's `CachePool` (`cache_io`). Counters go to the engine's
`StepStats`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ..planner import plan_step
from .cache import CachePool, SeqCache
from .cache_io import DecodeIO, PrefillIO
from .layout import RatioLayout, ranges
from .stats import StepStats


@dataclass
class RequestState:
    """A request fed over one or more steps: its ids, the positions fed so far and, when it
    outlives a step, its place in the step's `CachePool` (the state its later tokens read)."""

    ids: np.ndarray
    done: int = 0  # positions [0, done) already fed
    cache: SeqCache | None = None

    def keeps_cache(self, end: int) -> bool:
        """Whether, after feeding positions up to `end`, a later step still reads this request's
        cache (scoring: positions are left; the last id is only a target)."""
        return self.cache is not None and end < len(self.ids) - 1


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

    decodes: requests that feed one token each (position `state.done`, id `state.ids[done]`),
    first in the step; num_decode = len(decodes). segs: [(state, start, end)] prefill segments:
    request `state` feeds positions [start, end). cu [B + 1] int64 (numpy): segment b's tokens
    are prefill rows [cu[b], cu[b + 1]) (step rows num_decode + those). positions, input_ids [T]
    int64 on `device`: decode tokens, then the segments' tokens in order. continuing: indices b of
    the segments whose request keeps its cache after this step (`RequestState.keeps_cache`).
    layouts: compress ratio -> `RatioLayout` of the prefill segments (chunks planned once per
    ratio: `plans`, `step_plans`' output, computed here when not given). cache: the `CachePool`
    the requests' `SeqCache`s point into (None when no request has one); prefill_io / decode_io:
    ratio -> where this step reads and writes it (`cache_io`). is_in_place: whether the attention
    backend reads kv rows in place (else decode hands it only the rows a query uses).
    Building a context counts one step, its tokens and the planner time in `stats`.
    """

    def __init__(self, segs, *, ratios, window, config, ropes, pool, stats: StepStats, device, plans=None,
                 decodes=(), cache: CachePool | None = None, is_in_place: bool = True):
        self.segs, self.window, self.ropes, self.pool, self.stats = segs, window, ropes, pool, stats
        self.cache, self.is_in_place, self.num_decode = cache, is_in_place, len(decodes)
        starts = np.array([s for _, s, _ in segs], np.int64)
        ends = np.array([e for _, _, e in segs], np.int64)
        self.cu = np.concatenate([[0], np.cumsum(ends - starts)])
        dec_pos = np.array([st.done for st in decodes], np.int64)
        self.positions = torch.from_numpy(np.concatenate([dec_pos, ranges(starts, ends - starts)])).to(device)
        ids = [np.asarray([st.ids[st.done] for st in decodes], np.int64)]
        self.input_ids = torch.from_numpy(np.concatenate(ids + [np.asarray(st.ids[s:e], np.int64)
                                                                for st, s, e in segs])).to(device)
        self.continuing = [b for b, (st, _, e) in enumerate(segs) if st.keeps_cache(e)]
        if plans is None and segs:
            plans = step_plans(segs, ratios, window, config, stats)
        stats.num_steps += 1
        stats.num_tokens += int(self.cu[-1]) + self.num_decode
        self.layouts, self.prefill_io, self.decode_io = {}, {}, {}
        for r in ratios:
            if segs:
                lay = self.layouts[r] = RatioLayout(starts, ends, self.cu, r, window, plans[r], device)
                self.prefill_io[r] = PrefillIO(cache, segs, lay, self.continuing, device)
            if decodes:
                self.decode_io[r] = DecodeIO(cache, decodes, r, device)
        self.cos_sin = {name: rope.cos_sin(self.positions) for name, rope in ropes.items()}
        self.comp_rope = ropes["compress"]

    def rope_for(self, ratio: int):
        """Sliding-only layers use the main RoPE; compressed layers the compress (YaRN) one."""
        return self.cos_sin["main" if ratio == 1 else "compress"]

    def count_chunk(self, ws: torch.Tensor):
        """One sparse-attention kernel call over workspace `ws`."""
        self.stats.num_chunks += 1
        self.stats.workspace_elements += ws.numel()
