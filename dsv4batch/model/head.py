"""The vocabulary head's details: log p(target), whether the target is the argmax, and top-K.

`fused_scores` is the head `Engine.score` and `score_details` use on the CPU in fp32: the C++
kernel `kernels.head_stats` (logits kept in registers, never written) over `PackedHead.panels`,
with the same plain sum of 2 ** z and exact redo as below; a row's logprob and greedy flag.
Elsewhere (bf16 head, CUDA, `KernelConfig.gemm` onednn or blas, vocabulary-parallel ranks, top-K)
the tiles below run. `tiled_logprobs` is the tiled head; `tiled_details` walks the vocabulary with
its own parts (`vocab_tiles`, `OnlineLogSumExp`: its logprobs are bit-identical to `score`'s) and also keeps, per row,
the running top-K (value, id) pairs; the row max says whether the target is the argmax.
Nothing larger than two [n, tile] blocks (one reduced while the next is computed) and [n, 2K]
candidates exists at a time, and every step is row-wise: a row's result does not depend on its
batch-mates.

The tiles hold base-2 logits, z = logit * log2(e): the GEMM's input row is scaled once
([n, hidden]) instead of every logit ([n, vocab]), and 2 ** z is exp(logit). Sums and maxima run
on z; a logprob is (z_target - log2(sum 2 ** z)) * ln 2. `PackedHead` keeps the weight's tiles
in oneDNN's layout (`kernels.pack_weight`). Together: the head over 512 rows 1.10x faster
(hidden 128: 106 -> 95 ms; 256: 201 -> 180 ms; one 2-core EPYC).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ..kernels import (bf16_available, bf16_linear, chosen, dense_linear, head_stats, head_supported, pack_head,
                       pack_weight)
from .config import HEAD_PRECISIONS
from .parallel import SINGLE


def nonfinite_error(position: int) -> str:
    """The error of a request whose logits are not finite (NaN or +-inf: an overflowing model)
    at `position`, the first such scored or generated position (0-based)."""
    return f"non-finite logits at position {position}"


def first_nonfinite(*values: np.ndarray) -> int | None:
    """The first position (index along the first axis) where any of `values` ([n, ...] each)
    holds NaN or +-inf; None when every value is finite."""
    bad = None
    for v in values:
        if v.size:
            row = ~np.isfinite(v.reshape(len(v), -1)).all(axis=1)
            bad = row if bad is None else bad | row
    hits = np.flatnonzero(bad) if bad is not None else ()
    return int(hits[0]) if len(hits) else None


class TokenScores(NamedTuple):
    """One request's scored positions (n = len(request) - 1).

    Where the model's logits are not finite (a checkpoint whose values overflow), the logprobs
    at those positions are NaN or -inf, never silently a number: `error` names the first one."""

    logprobs: np.ndarray  # float32 [n]: log p(ids[t] | ids[:t]), as `Engine.score` returns
    is_greedy: np.ndarray  # bool [n]: ids[t] has the largest logit at its position
    top_ids: np.ndarray  # int32 [n, K]: the K most likely token ids, most likely first
    top_logprobs: np.ndarray  # float32 [n, K]: their log-probabilities, descending

    @property
    def error(self) -> str | None:
        """None when every position's logprob (and top-K logprob) is finite, else
        `nonfinite_error` of the first position that is not (an index into `logprobs`)."""
        at = first_nonfinite(self.logprobs, self.top_logprobs)
        return None if at is None else nonfinite_error(at)


# Vocabulary columns per head tile: a [256, 2048] fp32 logits tile (2 MiB) plus its weight rows
# stay in L2/L3 while it is reduced, instead of streaming [256, 129280] (132 MB) through memory.
VOCAB_TILE = 2048


def tiled_logprobs(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                   tile: int = VOCAB_TILE, packed=None) -> torch.Tensor:
    """Fused head: x [n, hidden], weight [vocab, hidden], targets [n] -> log p(target) [n] fp32.

    Per vocabulary tile (`vocab_tiles`; `packed`: `PackedHead.tiles` of this weight and tile):
    one GEMM [n, tile], then `OnlineLogSumExp.add` (the target's base-2 logit from its tile, the
    sum of 2 ** z); the logprob is (z_target - log2(sum)) * ln 2. At most two [n, tile] blocks
    exist at a time. Everything after the GEMM is row-wise and the tiles come in a fixed order,
    so a row's result depends only on its own values (and the fixed shape [n, tile] of every
    GEMM): batch-invariant.
    """
    acc = OnlineLogSumExp(targets, tile, is_exact=False)
    for i, _, logits in vocab_tiles(x, weight, tile, packed):
        acc.add(i, logits)
    return ((acc.picked - finite_logsumexp(acc, x, weight, targets, tile, packed)) * LN2).clamp_(max=0.0)


# A plain sum of 2 ** z = exp(logit) is exact to fp32 rounding while it stays in [SUM_MIN, inf):
# below, its terms were denormal or flushed (every logit under ~-69); inf: a logit above ~88.
SUM_MIN = 2.0 ** -100


def finite_logsumexp(acc: "OnlineLogSumExp", x, weight, targets, tile: int, packed=None) -> torch.Tensor:
    """acc's log2(sum 2 ** z) [n] after its last tile; rows whose plain sum left [SUM_MIN, inf)
    (a logit above ~88, or all of them below ~-69) are recomputed with a running max (exact, a
    second pass)."""
    lse = acc.logsumexp()
    bad = ~torch.isfinite(acc.run_sum) | (acc.run_sum < SUM_MIN)
    if not acc.is_exact and bool(bad.any()):
        exact = OnlineLogSumExp(targets, tile)
        for i, _, logits in vocab_tiles(x, weight, tile, packed):
            exact.add(i, logits)
        lse = torch.where(bad, exact.logsumexp(), lse)
    return lse


# Base 2 because torch.exp on x86 calls MKL's vector exp, which takes a slow generic path on
# non-Intel CPUs: on a 2-core AMD EPYC (AVX-512), [512, 2048] took 460-840 us against 166 us for
# exp2 (Sleef); the head spent 18% of a tiny 511-token call in exp. exp2's scalar tail (the last
# len % 32 elements of a loop) rounds differently from its vector body, so every exp'd row spans
# a multiple of EXP_COLS columns of its buffer (the spare columns are computed and ignored): an
# element's bits never depend on its row's position.
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
EXP_COLS = 32  # torch's CPU loops take 2 x 16-float AVX-512 vectors per iteration


def padded_cols(width: int) -> int:
    """Columns a tile row of `width` logits spans for `exp_`: width rounded up to EXP_COLS."""
    return -(-width // EXP_COLS) * EXP_COLS


def exp_(logits: torch.Tensor) -> torch.Tensor:
    """2 ** z of a `vocab_tiles` tile [n, width] of base-2 logits z in place (returned): exp of
    the logits, computed over its padded rows.
    Raises ValueError for a tensor whose rows have no such padding (the spare columns would be
    another row's)."""
    n, width = logits.shape
    if n == 0:
        return logits
    cols = padded_cols(width)
    end = logits.storage_offset() + (n - 1) * logits.stride(0) + cols
    if logits.stride(1) != 1 or (n > 1 and logits.stride(0) < cols) or \
            end > logits.untyped_storage().nbytes() // logits.element_size():
        raise ValueError(f"exp_ needs rows padded to {cols} columns (a vocab_tiles tile), got strides {logits.stride()}")
    logits.as_strided((n, cols), logits.stride()).exp2_()
    return logits


def vocab_tiles(x: torch.Tensor, weight: torch.Tensor, tile: int = VOCAB_TILE, packed=None):
    """Yield (tile index i, first id v0, base-2 logits z [n, width] fp32) over the vocabulary in
    order: z = (x @ weight[v0:v0 + width].T) * log2(e).

    Each tile is one `dense_linear` GEMM [n, hidden] x [hidden, width] on x * log2(e) (an fp32 x;
    a bf16/fp16 model's tile is scaled after its GEMM, in fp32); `packed`: `PackedHead.tiles`
    for this weight and tile, or None. With `packed.is_bf16` each tile is a `bf16_linear` of
    x * log2(e) rounded to bf16 (a bf16 tile: its z rounded to bf16, the reduction in fp32).
    Its rows span a multiple of EXP_COLS columns for `exp_` (a tile whose width is not one is
    copied into a padded buffer). Valid until the next tile is produced."""
    n, vocab = x.shape[0], weight.shape[0]
    cols, num_tiles = min(tile, vocab), -(-vocab // tile)
    if packed is not None and len(packed.weights) != num_tiles:
        raise ValueError(f"packed holds {len(packed.weights)} tiles, this weight and tile make {num_tiles}")
    is_bf16 = packed is not None and packed.is_bf16
    is_scaled = x.dtype == torch.float32
    xs = x * LOG2E if is_scaled else x
    xs = xs.bfloat16() if is_bf16 else xs
    buf = None
    for i, v0 in enumerate(range(0, vocab, tile)):
        width = min(tile, vocab - v0)
        if is_bf16:
            logits = bf16_linear(xs, packed.weights[i])
        else:
            logits = dense_linear(xs, weight[v0:v0 + width], None if packed is None else packed.weights[i])
        # into the padded fp32 buffer: rows `exp_` could not pad in place, or a bf16 tile (a bf16
        # model's or a bf16 head's: the GEMM sums in fp32 inside; the reduction runs in fp32)
        if width % EXP_COLS or logits.dtype != torch.float32:
            if buf is None:
                buf = torch.zeros(n, padded_cols(cols), dtype=torch.float32, device=x.device)
            logits = buf[:, :width].copy_(logits)
        yield i, v0, logits if is_scaled else logits.mul_(LOG2E)


# Rows per exact redo (`fused_scores`): fixed, so a redone row's GEMM shape never depends on how
# many of its batch-mates were redone with it.
REDO_ROWS = 64


def fused_scores(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, panels: torch.Tensor):
    """x [n, hidden] fp32, weight [vocab, hidden] fp32, targets [n] int64, panels =
    `PackedHead.panels(weight)` -> (log p(target) [n] fp32, is_max [n] bool: the target's logit
    is the row's largest, ties included). One `kernels.head_stats` call; rows whose sum of 2 ** z
    left [SUM_MIN, inf) are redone exactly (running max over `vocab_tiles`) in REDO_ROWS-row
    slices. Every step is per row: batch-invariant."""
    sums, peaks, picked = head_stats(x * LOG2E, panels, weight.shape[0], targets)
    lse = sums.log2()
    bad = (~torch.isfinite(sums) | (sums < SUM_MIN)).nonzero().flatten()
    for a in range(0, bad.numel(), REDO_ROWS):
        rows = bad[a:a + REDO_ROWS]
        m = rows.numel()
        padded, padded_targets = x.new_zeros(REDO_ROWS, x.shape[1]), targets.new_zeros(REDO_ROWS)
        padded[:m], padded_targets[:m] = x[rows], targets[rows]
        exact = OnlineLogSumExp(padded_targets, VOCAB_TILE)
        for i, _, logits in vocab_tiles(padded, weight, VOCAB_TILE):
            exact.add(i, logits)
        lse[rows], picked[rows], peaks[rows] = exact.logsumexp()[:m], exact.picked[:m], exact.run_max[:m]
    return ((picked - lse) * LN2).clamp_(max=0.0), picked >= peaks


class PackedTiles(NamedTuple):
    """`PackedHead.tiles`: what `vocab_tiles` multiplies by on oneDNN."""

    weights: list  # one `kernels.pack_weight` copy per vocabulary tile, in order
    is_bf16: bool  # bf16 copies for `kernels.bf16_linear` (head_precision "bf16" where it runs)


class PackedHead:
    """A head weight's packed copies, each built on first use and again when the weight changes
    (another tensor, an in-place write, another tile, GEMM or precision), kept while the model
    is: `panels`, the fused head's (`kernels.pack_head`), and `tiles`, the `vocab_tiles` tiles in
    oneDNN's layout (`kernels.pack_weight`; None where the head's GEMM is not oneDNN's: other
    dtypes, CUDA, `KernelConfig.gemm` blas). Each is a second copy of the weight; the tiles are
    built only where the tiled head runs (top-K, bf16, vocabulary-parallel ranks, onednn).
    Never pickled or copied: a copy starts empty."""

    def __init__(self):
        self._key, self._tiles = None, None
        self._panel_key, self._panels = None, None

    def panels(self, weight: torch.Tensor, precision: str = "fp32") -> torch.Tensor | None:
        """weight [vocab, hidden] -> `kernels.pack_head` panels for `fused_scores` (kept, rebuilt
        when the weight changes), or None where the tiles run instead: a bf16 head that runs
        (`precision` "bf16" with bf16 units), a weight `kernels.head_supported` refuses, or
        the active `KernelConfig.gemm` onednn or blas; RuntimeError when it is "fused" and the kernel
        cannot run."""
        from ..kernels.dense import cpu_gemm

        choice = cpu_gemm()
        if choice in ("onednn", "blas") or (precision == "bf16" and bf16_available()):
            return None
        if not head_supported(weight) or (choice == "auto" and not chosen("head")):
            if choice == "fused":
                raise RuntimeError("KernelConfig.gemm='fused', but the fused head cannot run this weight "
                                   f"({weight.dtype} on {weight.device}) or its kernel is not built")
            return None
        key = (weight.data_ptr(), weight._version, tuple(weight.shape), weight.dtype, weight.device)
        if key != self._panel_key:
            self._panel_key, self._panels = None, None  # the old copy goes before the new one is built
            self._panels, self._panel_key = pack_head(weight.detach()), key
        return self._panels

    def tiles(self, weight: torch.Tensor, tile: int, rows: int, precision: str = "fp32"):
        """weight [vocab, hidden] -> `PackedTiles`: one packed tile per `tile` rows (GEMMs of
        `rows` rows), or None. `precision` ("fp32" or "bf16", `EngineConfig.head_precision`):
        "bf16" packs bf16 copies where `kernels.bf16_available()` (else fp32 ones: the head
        computes fp32)."""
        if precision not in HEAD_PRECISIONS:
            raise ValueError(f"head precision must be one of {HEAD_PRECISIONS}, got {precision!r}")
        from ..kernels.dense import cpu_gemm

        is_bf16 = precision == "bf16" and bf16_available()  # (a bf16 weight packs nothing: None)
        key = (weight.data_ptr(), weight._version, tuple(weight.shape), weight.dtype, weight.device,
               tile, rows, cpu_gemm(), is_bf16)
        if key != self._key:
            self._key, self._tiles = None, None  # the old copy goes before the new one is built
            tiles = [pack_weight(weight[v0:v0 + tile].detach(), rows, is_bf16)
                     for v0 in range(0, weight.shape[0], tile)]
            if all(t is not None for t in tiles):  # None (e.g. grad mode) is not kept: asked again next time
                self._key, self._tiles = key, tiles
        return None if self._tiles is None else PackedTiles(self._tiles, is_bf16)

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.__init__()  # neither the tiles nor the panels travel

    def __deepcopy__(self, memo):
        return PackedHead()


class OnlineLogSumExp:
    """Running sum of 2 ** z per row over `vocab_tiles`' base-2 tiles, and the target's z.

    targets [n] int64. `add(i, logits)` folds tile i in (exp'ing the tile in place: read it
    before); after the last tile `logsumexp()` [n] = log2(sum 2 ** z) and `picked` [n] (the
    target's z). is_exact=False: a plain sum, one exp2 and one sum per tile (no max, no shift,
    no rescale); it overflows for a logit above ~88 and loses precision when every logit is
    below ~-69 (`finite_logsumexp` redoes those rows). is_exact=True: a running max (exact for
    any logits; what split vocabularies and the redo use)."""

    def __init__(self, targets: torch.Tensor, tile: int, is_exact: bool = True):
        n, dev = targets.shape[0], targets.device
        self.is_exact = is_exact
        self.run_max = torch.full((n,), float("-inf") if is_exact else 0.0, dtype=torch.float32, device=dev)
        self.run_sum = torch.zeros(n, dtype=torch.float32, device=dev)
        self.picked = torch.zeros(n, dtype=torch.float32, device=dev)
        self.tile_of, self.col = targets // tile, (targets % tile).unsqueeze(1)
        self.tile = tile

    def add(self, i: int, logits: torch.Tensor) -> None:
        col = self.col if logits.shape[1] == self.tile else self.col.clamp(max=logits.shape[1] - 1)
        self.picked = torch.where(self.tile_of == i, logits.gather(1, col).squeeze(1), self.picked)
        if not self.is_exact:
            self.run_sum += exp_(logits).sum(1)
            return
        new_max = torch.maximum(self.run_max, logits.amax(1))
        self.run_sum = (self.run_sum * torch.exp2(self.run_max - new_max)
                        + exp_(logits.sub_(new_max.unsqueeze(1))).sum(1))
        self.run_max = new_max

    def logsumexp(self) -> torch.Tensor:
        """log2(sum 2 ** z) [n]: the base-2 logsumexp."""
        return self.run_sum.log2() if not self.is_exact else self.run_max + self.run_sum.log2()


def sliced_details(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                   slice_rows: int, top_k: int, tp=SINGLE, vocab_start: int = 0, packed=None):
    """`tiled_details` over fixed `slice_rows`-row slices (the last zero-padded), exactly as
    `DSv4Model.token_logprobs` slices: one GEMM shape whatever the step's size (`packed`: the
    weight's `PackedHead.tiles` at VOCAB_TILE, or None).

    Vocabulary-parallel (`tp.size` > 1): `weight` is this rank's rows, token ids
    [vocab_start, vocab_start + len(weight)); every rank calls this with the same rows."""
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
        parts = tiled_details(padded, weight, padded_targets, k, VOCAB_TILE, tp, vocab_start, packed)
        for out, part in zip(outs, parts):
            out[a:a + rows] = part[:rows]
    return outs


def tiled_details(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, top_k: int,
                  tile: int, tp=SINGLE, vocab_start: int = 0, packed=None):
    """x [n, hidden], weight [vocab, hidden], targets [n] int64 ->
    (logprob [n] fp32, is_max [n] bool, top_ids [n, K] int64, top_logprobs [n, K] fp32).

    is_max: the target's logit equals the row's largest (ties count as greedy). K = top_k may be
    0 (empty [n, 0] outputs); ties in the top-K keep the lower token id first, like a stable
    sort of the whole row. With `tp`: `weight` holds ids from `vocab_start`, and the ranks'
    parts are combined exactly (`combine_ranks`)."""
    picked, lse, peak, top_i, top_v = vocab_parts(x, weight, targets - vocab_start, top_k, tile, tp.size == 1,
                                                  packed)
    if tp.size > 1:
        picked, lse, peak, top_i, top_v = combine_ranks(tp, picked, lse, peak, top_i + vocab_start, top_v)
    # base 2 (`vocab_tiles`); peak is the row's largest, the target's was picked before the tile's exp
    return ((picked - lse) * LN2).clamp_(max=0.0), picked >= peak, top_i, (top_v - lse.unsqueeze(1)) * LN2


def vocab_parts(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, top_k: int, tile: int,
                is_plain: bool = False, packed=None):
    """One pass over `weight`'s vocabulary tiles, all in base 2 (z = logit * log2 e): (target z
    [n] (0 where the target is not among these ids), log2(sum 2 ** z) [n], max z [n], top ids
    [n, K] local, their z [n, K]).
    is_plain: every target is among these ids; a plain sum of exp, as `tiled_logprobs` does
    (bit-identical logsumexp; rows it cannot hold are redone exactly)."""
    n, k = x.shape[0], min(top_k, weight.shape[0])
    acc = OnlineLogSumExp(targets, tile, is_exact=not is_plain)
    peak = torch.full((n,), float("-inf"), dtype=torch.float32, device=x.device)
    top_v = torch.full((n, k), float("-inf"), dtype=torch.float32, device=x.device)
    top_i = torch.zeros((n, k), dtype=torch.int64, device=x.device)
    for i, v0, logits in vocab_tiles(x, weight, tile, packed):
        if k:  # merge this tile's best K with the best so far (before `add` exps the tile)
            v, j = logits.topk(min(k, logits.shape[1]), dim=1)
            cand_v, cand_i = torch.cat([top_v, v], 1), torch.cat([top_i, j + v0], 1)
            order = _stable_desc(cand_v, cand_i)
            top_v, top_i = cand_v.gather(1, order[:, :k]), cand_i.gather(1, order[:, :k])
        peak = torch.maximum(peak, logits.amax(1)) if is_plain else peak
        acc.add(i, logits)
    owned = (targets >= 0) & (targets < weight.shape[0])
    picked = acc.picked if bool(owned.all()) else torch.where(owned, acc.picked, 0.0)
    lse = finite_logsumexp(acc, x, weight, targets, tile, packed)
    return picked, lse, peak if is_plain else acc.run_max, top_i, top_v


def combine_ranks(tp, picked, lse, peak, top_i, top_v):
    """The whole vocabulary's parts from each rank's (`vocab_parts` with global top ids, base 2):
    one all-gather of [n, 3 + 2K] fp32 (ids < 2^24 are exact in fp32). The target's z is the
    owner's (the others give 0), the base-2 logsumexp over the ranks' ones, the max of maxes,
    and the top-K of the ranks' top-Ks (ties by lower id)."""
    n, k = top_v.shape
    parts = tp.all_gather(torch.cat([picked[:, None], lse[:, None], peak[:, None], top_v,
                                     top_i.to(torch.float32)], 1))  # [T, n, 3 + 2K]
    lse = (parts[:, :, 1] * LN2).logsumexp(0) * LOG2E
    picked, peak = parts[:, :, 0].sum(0), parts[:, :, 2].amax(0)
    if k:
        cand_v = parts[:, :, 3:3 + k].transpose(0, 1).reshape(n, -1)
        cand_i = parts[:, :, 3 + k:].transpose(0, 1).reshape(n, -1).to(torch.int64)
        order = _stable_desc(cand_v, cand_i)[:, :k]
        top_v, top_i = cand_v.gather(1, order), cand_i.gather(1, order)
    return picked, lse, peak, top_i, top_v


def _stable_desc(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Column order [n, m] sorting each row by value descending, then id ascending."""
    by_id = ids.argsort(dim=1, stable=True)
    by_value = values.gather(1, by_id).argsort(dim=1, descending=True, stable=True)
    return by_id.gather(1, by_value)
