"""Adaptive (vllm#45061), fixed (pre-PR baseline) and single-request chunk plans.

Inputs: ``seq_lens``/``query_lens`` of shape ``[num_requests]``. Output: a list of
``(start, end, N, M)``, ``end`` exclusive; the chunk's workspace is ``[end - start, M, head_dim]``
with compressed entries in rows ``[0, N)`` and window tokens in ``[N, M)``.
"""

from __future__ import annotations

from .lengths import Chunk, chunk_budget, max_compressed_len, request_lengths


def plan_prefill_chunks(seq_lens, query_lens, *, compress_ratio, window_size, max_model_len,
                        max_num_batched_tokens, prefill_chunk_size=4) -> list[Chunk]:
    """Greedy contiguous plan: extend while ``count * (max compr + max gather) <= budget``."""
    compressed, gather = request_lengths(
        seq_lens, query_lens, compress_ratio=compress_ratio, window_size=window_size,
        max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens)
    max_area = chunk_budget(compress_ratio, window_size, max_model_len, max_num_batched_tokens,
                            prefill_chunk_size)
    c, g = compressed.tolist(), gather.tolist()
    plan, num_requests, start = [], len(c), 0
    while start < num_requests:
        n, m, end = c[start], g[start], start + 1  # first request always admitted
        while end < num_requests:
            ce, ge = c[end], g[end]
            n2, m2 = (n if n > ce else ce), (m if m > ge else ge)
            if (end + 1 - start) * (n2 + m2) > max_area:
                break
            n, m, end = n2, m2, end + 1
        plan.append((start, end, n, n + m))
        start = end
    return plan


def fixed_prefill_chunks(seq_lens, query_lens, *, compress_ratio, window_size, max_model_len,
                         max_num_batched_tokens, prefill_chunk_size=4) -> list[Chunk]:
    """Pre-PR plan: ``prefill_chunk_size`` requests per chunk, ``N = ceil(L/r)``, ``M = N + W + mnbt``."""
    compressed, _ = request_lengths(
        seq_lens, query_lens, compress_ratio=compress_ratio, window_size=window_size,
        max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens)
    chunk_budget(compress_ratio, window_size, max_model_len, max_num_batched_tokens, prefill_chunk_size)
    n = max_compressed_len(compress_ratio, max_model_len)
    m = n + window_size + max_num_batched_tokens
    num_requests = compressed.size
    return [(s, min(s + prefill_chunk_size, num_requests), n, m)
            for s in range(0, num_requests, prefill_chunk_size)]


def single_prefill_chunks(seq_lens, query_lens, *, compress_ratio, window_size, max_model_len,
                          max_num_batched_tokens, prefill_chunk_size=4) -> list[Chunk]:
    """Batch-invariant plan: one request per chunk, N/M from that request alone."""
    compressed, gather = request_lengths(
        seq_lens, query_lens, compress_ratio=compress_ratio, window_size=window_size,
        max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens)
    return [(i, i + 1, n, n + m) for i, (n, m) in enumerate(zip(compressed.tolist(), gather.tolist()))]
