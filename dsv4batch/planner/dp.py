"""Fixed-order partition minimising total padded workspace rows (length-aware packing).

Chunk cost is its area ``(end - start) * M`` with ``M = max compressed + max gather`` (the
quantity the adaptive planner bounds by the budget), plus ``chunk_overhead_rows`` per chunk
to price a kernel launch. With the default 0 the optimum is (nearly) one request per chunk,
since a singleton has no padding. ``O(num_requests * max_chunk_len)`` with padding pruning.
"""

from __future__ import annotations

from itertools import accumulate

from .lengths import Chunk, chunk_budget, request_lengths


def dp_prefill_chunks(seq_lens, query_lens, *, compress_ratio, window_size, max_model_len,
                      max_num_batched_tokens, prefill_chunk_size=4, chunk_overhead_rows=0) -> list[Chunk]:
    """Contiguous plan minimising ``sum (end - start) * M + chunk_overhead_rows * num_chunks``.

    Ties go to fewer chunks. Every chunk satisfies ``(end - start) * M <= budget`` or holds one
    request, so its total area never exceeds :func:`plan_prefill_chunks`' on the same order
    when ``chunk_overhead_rows == 0``.
    """
    compressed, gather = request_lengths(
        seq_lens, query_lens, compress_ratio=compress_ratio, window_size=window_size,
        max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens)
    max_area = chunk_budget(compress_ratio, window_size, max_model_len, max_num_batched_tokens,
                            prefill_chunk_size)
    c, g = compressed.tolist(), gather.tolist()
    num_requests = len(c)
    rows = [0, *accumulate(a + b for a, b in zip(c, g))]  # rows[e] <= any cost of [0, e)
    # best[e] = (cost, num chunks) of requests [0, e); prev[e] = start of its last chunk
    best, prev = [(0, 0)] * (num_requests + 1), [0] * (num_requests + 1)
    for end in range(1, num_requests + 1):
        n = m = 0
        choice = None
        for start in range(end - 1, -1, -1):
            cs, gs = c[start], g[start]
            n, m = (n if n > cs else cs), (m if m > gs else gs)
            area = (end - start) * (n + m)
            if start < end - 1 and (area > max_area or  # both only grow as start moves left
                                    rows[start] + area + chunk_overhead_rows > choice[0]):
                break
            total, chunks = best[start]
            key = (total + area + chunk_overhead_rows, chunks + 1)
            if choice is None or key < choice:
                choice, prev[end] = key, start
        best[end] = choice
    plan, end = [], num_requests
    while end > 0:
        start = prev[end]
        n, m = max(c[start:end]), max(g[start:end])
        plan.append((start, end, n, n + m))
        end = start
    return plan[::-1]
