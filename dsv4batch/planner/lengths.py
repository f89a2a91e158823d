"""Per-request attention lengths and the per-chunk workspace budget (vllm#45061).

All arrays are 1-D of shape ``[num_requests]`` (prefill-local order). A ratio ``r <= 1``
means an SWA-only layer (no compressed KV); any int ``r >= 0`` is accepted (DSv4 uses
0/1, 4 and 128).
"""

from __future__ import annotations

import numpy as np

Chunk = tuple[int, int, int, int]  # (start, end exclusive, N, M)


def max_compressed_len(compress_ratio: int, max_model_len: int) -> int:
    """``ceil(max_model_len / r)``, or 0 for SWA-only layers (``r <= 1``)."""
    return 0 if compress_ratio <= 1 else -(-max_model_len // compress_ratio)


def chunk_budget(compress_ratio, window_size, max_model_len, max_num_batched_tokens, prefill_chunk_size) -> int:
    """Workspace rows reserved at warm-up: ``chunk * (ceil(L/r) + W + mnbt)``."""
    if prefill_chunk_size < 1:
        raise ValueError(f"prefill_chunk_size must be >= 1, got {prefill_chunk_size}")
    return prefill_chunk_size * (
        max_compressed_len(compress_ratio, max_model_len) + window_size + max_num_batched_tokens)


def request_lengths(seq_lens, query_lens, *, compress_ratio, window_size, max_model_len,
                    max_num_batched_tokens, check_fit=True) -> tuple[np.ndarray, np.ndarray]:
    """Validate inputs and return ``(compressed, gather)``, each int64 ``[num_requests]``.

    ``compressed_i = seq_i // r`` (0 when ``r <= 1``);
    ``gather_i = q_i + clamp(seq_i - q_i, 0, W - 1)``.
    With ``check_fit`` raise if one request alone exceeds ``ceil(L/r) + W + mnbt`` rows.
    """
    seq = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    qry = np.asarray(query_lens, dtype=np.int64).reshape(-1)
    if seq.shape != qry.shape:
        raise ValueError(f"seq_lens has {seq.size} entries but query_lens has {qry.size}")
    if int(compress_ratio) != compress_ratio or compress_ratio < 0:
        raise ValueError(f"compress_ratio must be an int >= 0, got {compress_ratio!r}")
    if window_size < 1 or max_model_len < 1 or max_num_batched_tokens < 1:
        raise ValueError("window_size, max_model_len and max_num_batched_tokens must be >= 1")
    if seq.size:
        if (bad := np.flatnonzero(qry < 1)).size:
            raise ValueError(f"query_len < 1 at request {bad[0]}: {qry[bad[0]]}")
        if (bad := np.flatnonzero(qry > seq)).size:
            raise ValueError(f"query_len > seq_len at request {bad[0]}: {qry[bad[0]]} > {seq[bad[0]]}")
        if (bad := np.flatnonzero(seq > max_model_len)).size:
            raise ValueError(f"seq_len > max_model_len at request {bad[0]}: {seq[bad[0]]} > {max_model_len}")
    compressed = seq // compress_ratio if compress_ratio > 1 else np.zeros_like(seq)
    gather = qry + np.clip(seq - qry, 0, window_size - 1)
    if check_fit and seq.size:
        limit = max_compressed_len(compress_ratio, max_model_len) + window_size + max_num_batched_tokens
        if (bad := np.flatnonzero(compressed + gather > limit)).size:
            i = bad[0]
            raise ValueError(
                f"request {i} does not fit one workspace row: compressed {compressed[i]} + gather "
                f"{gather[i]} > ceil(L/r) + W + mnbt = {limit} (query_len {qry[i]} > "
                f"max_num_batched_tokens {max_num_batched_tokens}?)")
    return compressed, gather
