"""The vocabulary head's details: log p(target), whether the target is the argmax, and top-K.

`tiled_details` walks the vocabulary with `model.tiled_logprobs`'s own parts (`vocab_tiles`,
`OnlineLogSumExp`: its logprobs are bit-identical to `Engine.score`'s) and also keeps, per row,
the running top-K (value, id) pairs; the row max says whether the target is the argmax.
Nothing larger than one [n, tile] block and [n, 2K] candidates exists at a time, and every step
is row-wise: a row's result does not depend on its batch-mates.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch


class TokenScores(NamedTuple):
    """One request's scored positions (n = len(request) - 1)."""

    logprobs: np.ndarray  # float32 [n]: log p(ids[t] | ids[:t]), as `Engine.score` returns
    is_greedy: np.ndarray  # bool [n]: ids[t] has the largest logit at its position
    top_ids: np.ndarray  # int32 [n, K]: the K most likely token ids, most likely first
    top_logprobs: np.ndarray  # float32 [n, K]: their log-probabilities, descending


def sliced_details(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                   slice_rows: int, top_k: int):
    """`tiled_details` over fixed `slice_rows`-row slices (the last zero-padded), exactly as
    `DSv4Model.token_logprobs` slices: one GEMM shape whatever the step's size."""
    from .model import VOCAB_TILE

    n, k = hidden.shape[0], min(top_k, weight.shape[0])
    outs = (torch.empty(n, dtype=torch.float32, device=hidden.device),
            torch.empty(n, dtype=torch.bool, device=hidden.device),
            torch.empty(n, k, dtype=torch.int64, device=hidden.device),
            torch.empty(n, k, dtype=torch.float32, device=hidden.device))
    padded = hidden.new_zeros(slice_rows, hidden.shape[1])
    padded_targets = targets.new_zeros(slice_rows)
    for a in range(0, n, slice_rows):
        rows = min(slice_rows, n - a)
        padded[:rows], padded_targets[:rows] = hidden[a:a + rows], targets[a:a + rows]
        for out, part in zip(outs, tiled_details(padded, weight, padded_targets, k, VOCAB_TILE)):
            out[a:a + rows] = part[:rows]
    return outs


def tiled_details(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, top_k: int,
                  tile: int):
    """x [n, hidden], weight [vocab, hidden], targets [n] int64 ->
    (logprob [n] fp32, is_max [n] bool, top_ids [n, K] int64, top_logprobs [n, K] fp32).

    is_max: the target's logit equals the row's largest (ties count as greedy). K = top_k may be
    0 (empty [n, 0] outputs); ties in the top-K keep the lower token id first, like a stable
    sort of the whole row."""
    from .model import OnlineLogSumExp, vocab_tiles

    n, k = x.shape[0], min(top_k, weight.shape[0])
    acc = OnlineLogSumExp(targets, tile)
    top_v = torch.full((n, k), float("-inf"), dtype=torch.float32, device=x.device)
    top_i = torch.zeros((n, k), dtype=torch.int64, device=x.device)
    for i, v0, logits in vocab_tiles(x, weight, tile):
        if k:  # merge this tile's best K with the best so far (before `add` shifts the tile)
            v, j = logits.topk(min(k, logits.shape[1]), dim=1)
            cand_v, cand_i = torch.cat([top_v, v], 1), torch.cat([top_i, j + v0], 1)
            order = _stable_desc(cand_v, cand_i)
            top_v, top_i = cand_v.gather(1, order[:, :k]), cand_i.gather(1, order[:, :k])
        acc.add(i, logits)
    lse = acc.logsumexp()
    # run_max is the row's largest logit; the target's logit was picked unshifted
    return acc.picked - lse, acc.picked >= acc.run_max, top_i, top_v - lse.unsqueeze(1)


def _stable_desc(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Column order [n, m] sorting each row by value descending, then id ascending."""
    by_id = ids.argsort(dim=1, stable=True)
    by_value = values.gather(1, by_id).argsort(dim=1, descending=True, stable=True)
    return by_id.gather(1, by_value)
