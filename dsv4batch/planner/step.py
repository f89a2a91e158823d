"""One plan per layer type (distinct compress ratio) per micro-batch, shared by its layers."""

from __future__ import annotations

from .dp import dp_prefill_chunks
from .greedy import fixed_prefill_chunks, plan_prefill_chunks, single_prefill_chunks
from .lengths import Chunk, chunk_budget

LayerPlans = dict[int, list[Chunk]]  # compress ratio -> [(start, end, N, M), ...]

PLANNERS = {"adaptive": plan_prefill_chunks, "fixed": fixed_prefill_chunks,
            "dp": dp_prefill_chunks, "single": single_prefill_chunks}
PLANNER_NAMES = tuple(PLANNERS)  # the one list of planner names (EngineConfig and the CLI check against it)


def plan_step(seq_lens, query_lens, *, compress_ratios, window_size, max_model_len,
              max_num_batched_tokens, prefill_chunk_size=4, planner="adaptive") -> LayerPlans:
    """Plan each distinct ratio in ``compress_ratios`` once; requests in the given order."""
    if planner not in PLANNERS:
        raise ValueError(f"planner must be one of {sorted(PLANNERS)}, got {planner!r}")
    fn = PLANNERS[planner]
    plans = {}
    for r in dict.fromkeys(int(r) for r in compress_ratios):
        kw = dict(compress_ratio=r, window_size=window_size, max_model_len=max_model_len,
                  max_num_batched_tokens=max_num_batched_tokens, prefill_chunk_size=prefill_chunk_size)
        if planner == "dp":
            # Price a chunk (one kernel launch + its workspace setup) like one request of maximal
            # length: without a price the area optimum is one request per chunk.
            kw["chunk_overhead_rows"] = chunk_budget(r, window_size, max_model_len, max_num_batched_tokens, 1)
        plans[r] = fn(seq_lens, query_lens, **kw)
    return plans
