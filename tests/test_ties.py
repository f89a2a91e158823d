"""The near-tie comparisons of tests/ties.py fail where they must: they only forgive orders that
rounding within the tolerance can produce."""

import numpy as np
import pytest

from tests.ties import assert_greedy_match, assert_top_ids_match, tie_groups

TOL = 1e-5


def test_groups_split_at_clear_gaps():
    assert tie_groups([-1.0, -1.0 - 1e-6, -1.5, -2.0, -2.0 - 1.5e-5, -2.0 - 3e-5], TOL) == [(0, 2), (2, 3), (3, 6)]
    assert tie_groups([-1.0, -1.0 - 3e-5], TOL) == [(0, 1), (1, 2)]  # 3e-5 > 2 x 1e-5: clear


def test_a_swap_inside_a_near_tie_passes_and_across_a_gap_fails():
    ids, lps = [[7, 3, 9]], [[-1.0, -1.2, -1.2 - 1e-6]]
    assert_top_ids_match(ids, lps, [[7, 9, 3]], lps, TOL)  # positions 1 and 2 are near-tied
    with pytest.raises(AssertionError, match="positions 0..0"):
        assert_top_ids_match(ids, lps, [[3, 7, 9]], lps, TOL)  # 0.2 apart: not rounding
    wide_ids, wide_lps = [[7, 3, 9, 5]], [[-1.0, -1.2, -1.3, -1.5]]
    with pytest.raises(AssertionError, match="positions 2..2"):  # a foreign id after a clear gap
        assert_top_ids_match(wide_ids, wide_lps, [[7, 3, 4]], [[-1.0, -1.2, -1.3]], TOL)
    with pytest.raises(AssertionError, match="repeated"):
        assert_top_ids_match(ids, lps, [[7, 7, 9]], lps, TOL)


def test_the_last_id_may_change_only_with_a_near_tie_below_it():
    ids, lps = [[7, 3, 9]], [[-1.0, -1.2, -1.4]]
    # the reference lists 3 ids: an unlisted 4th near-tied with the 3rd may take its place...
    assert_top_ids_match(ids, lps, [[7, 3, 4]], [[-1.0, -1.2, -1.4 - 1e-6]], TOL)
    # ...but not one whose value is clearly below it
    with pytest.raises(AssertionError, match="id 4"):
        assert_top_ids_match(ids, lps, [[7, 3, 4]], [[-1.0, -1.2, -1.5]], TOL)
    # a reference one column wider knows the 4th id: 4 is it, near-tied, so it may come in
    assert_top_ids_match([[7, 3, 9, 4]], [[-1.0, -1.2, -1.4, -1.4 - 1e-6]], [[7, 3, 4]],
                         [[-1.0, -1.2, -1.4]], TOL)


def test_greedy_flags_may_differ_only_at_a_near_tie_for_the_max():
    top = np.array([[-1.0, -1.0 - 1e-6], [-1.0, -2.0], [-1.0, -1.0 - 1e-6]])
    target = np.array([-1.0, -1.0, -3.0])  # tied at the top; clearly the max; clearly not
    assert_greedy_match([True, True, False], [False, True, False], target, top, TOL)
    with pytest.raises(AssertionError, match=r"positions \[1\]"):
        assert_greedy_match([True, True, False], [True, False, False], target, top, TOL)
    with pytest.raises(AssertionError, match=r"positions \[2\]"):
        assert_greedy_match([True, True, False], [True, True, True], target, top, TOL)
