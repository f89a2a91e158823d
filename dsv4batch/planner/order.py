"""Length-aware request order for an offline engine (outputs are restored by the caller)."""

from __future__ import annotations

import numpy as np

from .lengths import request_lengths


def length_order(seq_lens, query_lens, compress_ratio, window_size) -> np.ndarray:
    """Stable permutation ``[num_requests]`` sorting by ``compressed + gather``, then ``seq_len``.

    ``seq_lens[perm]`` puts requests with similar workspace rows next to each other, so chunks
    pad less. No budget checks here (the planner does those on the permuted batch).
    """
    seq = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    compressed, gather = request_lengths(
        seq, query_lens, compress_ratio=compress_ratio, window_size=window_size,
        max_model_len=max(int(seq.max(initial=1)), 1), max_num_batched_tokens=1, check_fit=False)
    return np.lexsort((seq, compressed + gather))  # lexsort is stable; last key is primary


def inverse_permutation(perm) -> np.ndarray:
    """``inv`` with ``inv[perm[i]] == i``: ``permuted_outputs[inv]`` restores input order."""
    perm = np.asarray(perm, dtype=np.int64).reshape(-1)
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size, dtype=np.int64)
    return inv
