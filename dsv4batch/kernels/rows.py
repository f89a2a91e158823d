"""The rows rule of every GEMM: BLAS takes other code paths (GEMV, split-K) for a handful of rows,
and their rounding differs, so a token's result would depend on how many tokens share its step.
Padding every GEMM to at least MIN_ROWS rows keeps each row's arithmetic identical whatever the
batch (batch invariance). The model's linears and the indexer's torch path both use it."""

from __future__ import annotations

import torch

MIN_ROWS = 16


def pad_rows(x: torch.Tensor, rows: int = MIN_ROWS) -> torch.Tensor:
    """x [n, ...] -> [max(n, rows), ...] (zero rows appended when n < rows)."""
    if x.shape[0] >= rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))])
