"""Comparing token ids between two paths that round differently, up to near-ties.

Two computations of the same logits (a split head against the whole one, the fused kernel
against BLAS tiles, ours against transformers') agree to a tolerance, not to the bit. Where two
tokens' log-probabilities are closer than that, their order, and so a top-K list or an argmax,
may differ between the paths without either being wrong. These helpers compare exactly where
the reference's values leave a clear gap, and as sets only inside a near-tie: they still fail
on any swap across a clear gap, a missing or foreign id, or a greedy flag that differs where
the target is clearly (not) the argmax.

`atol`, `rtol` are the tolerance each value may be off by (what the caller's `assert_allclose`
of the values uses); two values are near-tied when they differ by at most twice that, the most
two such errors can reorder.
"""

from __future__ import annotations

import numpy as np


def near(a, b, atol: float, rtol: float = 0.0):
    """Elementwise: could rounding within (atol, rtol) on each side reorder values a and b?"""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.abs(a - b) <= 2 * (atol + rtol * np.maximum(np.abs(a), np.abs(b)))


def tie_groups(values, atol: float, rtol: float = 0.0) -> list[tuple[int, int]]:
    """[start, end) runs of a descending list whose neighbours are near-tied (a run ends at a
    clear gap)."""
    values = np.asarray(values, np.float64)
    starts = [0] + [i for i in range(1, len(values)) if not near(values[i - 1], values[i], atol, rtol)]
    return list(zip(starts, starts[1:] + [len(values)]))


def assert_top_ids_match(want_ids, want_lps, got_ids, got_lps, atol: float, rtol: float = 0.0):
    """Top-K ids [n, K] of two paths are the same up to near-ties, row by row.

    `want_*` (the reference) may list more columns than `got_*` (K' >= K): the extra ones show
    whether the K-th id is near-tied with ids below it. Inside a near-tie group the ids compare
    as sets; a group that runs past the reference's last column may hold, in `got`, an id the
    reference did not list, only where its value is near-tied with that last listed value."""
    want_ids, got_ids = np.asarray(want_ids), np.asarray(got_ids)
    want_lps, got_lps = np.asarray(want_lps), np.asarray(got_lps)
    assert want_ids.shape[0] == got_ids.shape[0] and want_ids.shape[1] >= got_ids.shape[1], \
        (want_ids.shape, got_ids.shape)
    for row in range(got_ids.shape[0]):
        _match_row(want_ids[row], want_lps[row], got_ids[row], got_lps[row], atol, rtol, row)


def _match_row(want_ids, want_lps, got_ids, got_lps, atol, rtol, row) -> None:
    k = len(got_ids)
    assert len(set(got_ids.tolist())) == k, f"row {row}: repeated ids {got_ids.tolist()}"
    for start, end in tie_groups(want_lps, atol, rtol):
        if start >= k:
            break
        want, got = set(want_ids[start:end].tolist()), got_ids[start:min(end, k)].tolist()
        where = f"row {row}, positions {start}..{min(end, k) - 1}"
        if end <= k and end < len(want_ids):  # a clear gap follows, inside both lists
            assert set(got) == want, f"{where}: ids {got} != {sorted(want)} (values {want_lps[start:end]})"
            continue
        open_end = end == len(want_ids)  # the group may go on below the reference's last column
        for pos, tid in enumerate(got, start):
            if tid in want:
                continue
            assert open_end and tid not in want_ids.tolist() and near(got_lps[pos], want_lps[-1], atol, rtol), \
                f"{where}: id {tid} is not near-tied with the reference's {want_ids[start:end].tolist()}"


def ambiguous_greedy(target_lps, top_lps, atol: float, rtol: float = 0.0) -> np.ndarray:
    """Positions [n] whose greedy flag rounding may flip: the target is near-tied with the largest
    log-probability and another token is too (top_lps [n, >= 2], descending)."""
    top_lps = np.asarray(top_lps)
    assert top_lps.ndim == 2 and top_lps.shape[1] >= 2, "need the two largest values"
    return near(top_lps[:, 0], top_lps[:, 1], atol, rtol) & near(top_lps[:, 0], target_lps, atol, rtol)


def assert_greedy_match(want, got, target_lps, top_lps, atol: float, rtol: float = 0.0) -> None:
    """is_greedy flags [n] of two paths agree wherever the target is not near-tied at the top."""
    want, got = np.asarray(want, bool), np.asarray(got, bool)
    assert want.shape == got.shape, (want.shape, got.shape)
    clear = ~ambiguous_greedy(target_lps, top_lps, atol, rtol)
    differ = np.flatnonzero(clear & (want != got))
    assert differ.size == 0, f"is_greedy differs at positions {differ.tolist()} without a near-tie"
