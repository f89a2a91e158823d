"""Prefill chunk planning for DSv4 sparse attention (pure Python + numpy, no torch).

A plan is ``[(start, end, N, M), ...]`` over prefill-local requests: each chunk gathers its
requests' KV into a ``[end - start, M, head_dim]`` workspace, compressed entries in rows
``[0, N)`` and sliding-window tokens in ``[N, M)``. See vllm-project/vllm#45061.
"""

from .cost import plan_cost, workspace_bytes
from .dp import dp_prefill_chunks
from .greedy import fixed_prefill_chunks, plan_prefill_chunks, single_prefill_chunks
from .lengths import Chunk, chunk_budget, max_compressed_len, request_lengths
from .order import inverse_permutation, length_order
from .step import PLANNER_NAMES, PLANNERS, LayerPlans, plan_step

__all__ = [
    "Chunk", "LayerPlans", "PLANNER_NAMES", "PLANNERS", "chunk_budget", "dp_prefill_chunks",
    "fixed_prefill_chunks", "inverse_permutation", "length_order", "max_compressed_len", "plan_cost",
    "plan_prefill_chunks", "plan_step", "request_lengths", "single_prefill_chunks", "workspace_bytes",
]
