"""The Lightning Indexer's top-k over packed queries: the contract and its torch backend (the
definition, one query at a time in fp64, is ``ref.indexer_topk_ref``).

For query i (one token of a request) and the keys it sees, ``keys[key_lo[i] + e]`` for ``e`` in
``[0, visible[i])`` (its request's compressed indexer keys, request after request in ``keys``):

    score[i, e] = sum_h w[i, h] * relu(q[i, h] . keys[key_lo[i] + e])        (heads in order)

and ``picks[i, :k_i]``, ``k_i = min(width, visible[i])``, are its k_i best ``e`` (request-local),
best first; equal scores go to the lower ``e`` (the order of :func:`tie_free_keys`; -0.0 equals
+0.0; a NaN score, from a NaN query or key, has no specified rank). Later slots carry no meaning (callers mask them with
``k_i``): the torch path leaves garbage >= 0 there, the cpu kernel 0.

========== ============ ==================================================================
q          [s, h, d]    fp32: the queries (RoPE'd)
w          [s, h]       fp32: head weights, every scale folded in (DSv4: h**-0.5 * d**-0.5)
keys       [E, d]       fp32
key_lo     [s]          int64: where query i's request starts in ``keys``
visible    [s]          int64 >= 0: keys it sees, key_lo + visible <= E
width      int          columns of ``picks``
picks      [s, width]   int64
========== ============ ==================================================================

Backends (chosen by ``dsv4batch.kernels.indexer_topk``): ``"torch"``, :func:`indexer_topk_torch`
below: per block of queries one GEMM over the block's keys, masks, one
top-k; ``"cpu"``, ``csrc/indexer.cpp``: one query at a time over its own keys, the head sum in
registers and a running top-k, equal to the torch path up to fp32 rounding of the scores (so a
near-tie can pick differently). Both are batch-invariant: a query's picks depend on its own
q, w and keys alone, never on its block- or batch-mates.
"""

from __future__ import annotations

import torch

from .rows import MIN_ROWS, pad_rows


def indexer_topk_torch(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, key_lo: torch.Tensor,
                       visible: torch.Tensor, width: int, blocks) -> torch.Tensor:
    """The torch backend (contract: the module docstring). blocks [(a, b, k_lo, k_hi)]: query rows [a, b) whose
    requests' keys are keys[k_lo:k_hi] (`ChunkLayout.query_slices`: sized to bound the [h, b - a,
    k_hi - k_lo] scores). Valid picks first, sorted by score, min(width, visible) of them.

    Batch invariance: a block's key count depends on its block-mates, so every step here must
    give a query the same bits whatever that count: GEMMs on >= MIN_ROWS rows and columns
    (BLAS rounds a dot product the same way then), the head sum as elementwise multiply-adds
    (reductions and [1, h] x [h, E] products change strategy with E), and a top-k whose ties
    are broken by column (`canonical_topk`: torch.topk's own order depends on the width).
    """
    out = torch.zeros(q.shape[0], width, dtype=torch.long, device=q.device)
    keys_t = torch.cat([keys, keys.new_zeros(MIN_ROWS, keys.shape[1])]).t()
    for a, b, k_lo, k_hi in blocks:
        k = min(width, k_hi - k_lo)
        if k == 0:
            continue
        n, cols = b - a, max(k_hi - k_lo, MIN_ROWS)  # columns past k_hi are masked below
        per_head = torch.matmul(pad_rows(q[a:b]).transpose(0, 1), keys_t[:, k_lo:k_lo + cols])
        per_head = per_head[:, :n].relu_()                                        # [h, n, E]
        scores = per_head[0] * w[a:b, :1]
        for head in range(1, per_head.shape[0]):
            scores.addcmul_(per_head[head], w[a:b, head:head + 1])
        lo = key_lo[a:b, None] - k_lo  # the query's request's first key, block-local
        col = torch.arange(cols, device=q.device)
        scores.masked_fill_((col < lo) | (col >= lo + visible[a:b, None]), float("-inf"))
        out[a:b, :k] = (canonical_topk(scores, k) - lo).clamp_(min=0)
    return out


def canonical_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k column ids [n, k] of scores [n, E], best first, equal scores by lower column.

    torch.topk orders equal values by a width-dependent algorithm; its answer is canonical only
    when the k + 1 best values of a row are distinct. Rows where they are not (rare: an exact
    tie, e.g. every head's ReLU 0) are redone over `tie_free_keys`.
    """
    vals, picks = scores.topk(min(k + 1, scores.shape[1]), dim=-1)
    tied = ((vals[:, :-1] == vals[:, 1:]) & torch.isfinite(vals[:, :-1])).any(1).nonzero().squeeze(1)
    if tied.numel():
        picks[tied] = tie_free_keys(scores[tied]).topk(picks.shape[1], dim=-1).indices
    return picks[:, :k]


def tie_free_keys(scores: torch.Tensor) -> torch.Tensor:
    """fp32 scores [n, E] -> int64 keys [n, E] in the same order, ties broken by lower column.

    The float's bits as int32 (negative values mirrored so that integer order = float order;
    + 0.0 folds -0.0 into +0.0), times 2**32, minus the column: unique, so torch.topk's result
    does not depend on E or on where equal scores sit.
    """
    bits = (scores + 0.0).view(torch.int32)
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    return bits * (1 << 32) - torch.arange(scores.shape[1], device=scores.device)
