"""model/layout.py on two hand-checked requests: 0 continues an earlier step, 1 starts fresh.

Request 0 feeds positions [6, 10) (6 already cached), request 1 positions [0, 5): cu = [0, 4, 9].
Every expected value below was worked out by hand from the table layout in layout.py's docstring.
"""

import numpy as np
import torch

from dsv4batch.model.layout import ChunkLayout, CompressorLayout, RatioLayout, combine

STARTS, ENDS, CU = np.array([6, 0]), np.array([10, 5]), np.array([0, 4, 9])
W = 4


def rows(t):
    return t.tolist() if isinstance(t, torch.Tensor) else np.asarray(t).tolist()


def test_csa_table_rows():
    # r = 4: E = [1, 0] old entries, n = [1, 1] new, prior = min(start, W - 1) = [3, 0]
    # table = [old e0 of req 0 | new e1 of req 0 | new e0 of req 1 | req 0 window pos 3..5
    #          | step kv: req 0 pos 6..9, req 1 pos 0..4 | zero]
    lay = RatioLayout(STARTS, ENDS, CU, 4, W, [], "cpu")
    assert rows(lay.compressed) == [2, 1] and rows(lay.old) == [1, 0]
    assert rows(lay.prior) == [3, 0] and rows(lay.gather) == [7, 5]
    assert rows(lay.old_off) == [0, 1] and rows(lay.new_off) == [1, 2] and rows(lay.win_off) == [3, 6]
    assert lay.step_off == 6 and lay.zero_row == 15 and lay.entries_end == 3
    assert rows(lay.entry_rows(0)) == [0, 1] and rows(lay.entry_rows(1)) == [2]
    assert rows(lay.window_rows(0)) == [3, 4, 5, 6, 7, 8, 9]
    assert rows(lay.window_rows(1)) == [10, 11, 12, 13, 14]


def test_swa_table_rows():
    lay = RatioLayout(STARTS, ENDS, CU, 1, W, [], "cpu")
    assert rows(lay.compressed) == [0, 0] and lay.entries_end == 0 and lay.comp is None
    assert lay.step_off == 3 and lay.zero_row == 12
    assert rows(lay.window_rows(0)) == [0, 1, 2, 3, 4, 5, 6] and rows(lay.window_rows(1)) == [7, 8, 9, 10, 11]


def test_chunk_workspace_and_index_parts():
    lay = RatioLayout(STARTS, ENDS, CU, 4, W, [], "cpu")
    ch = ChunkLayout(lay, 0, 2, 2, 9)  # N = max compressed 2, M = N + max gather 7
    assert (ch.q0, ch.q1) == (0, 9)
    # request 0: entries 0, 1 then its 7 window rows; request 1: entry 0, pad, 5 rows, pad, pad
    assert rows(ch.ws_index) == [0, 1, 3, 4, 5, 6, 7, 8, 9,
                                 2, 15, 10, 11, 12, 13, 14, 15, 15]
    assert rows(ch.row_base) == [0] * 4 + [9] * 5
    assert rows(ch.win_len) == [4, 4, 4, 4, 1, 2, 3, 4, 4]
    # query at position p sees window positions [p - win_len + 1, p]; request 0's first gathered
    # position is 3 (workspace row 2), request 1's is 0 (row 9 + 2 = 11)
    assert rows(ch.win_base) == [2, 3, 4, 5, 11, 11, 11, 11, 12]
    assert rows(ch.comp_len) == [1, 2, 2, 2, 0, 0, 0, 1, 1]


def test_static_indices_visible_entries_then_window():
    chunks = [(0, 2, 2, 9)]
    lay = RatioLayout(STARTS, ENDS, CU, 4, W, chunks, "cpu")
    indices, lens = lay.static_indices(0, lay.chunks[0])
    assert indices.dtype == lens.dtype == torch.int32
    assert rows(indices) == [
        [0, 2, 3, 4, 5, -1],     # p = 6: entry 0, window pos 3..6
        [0, 1, 3, 4, 5, 6],      # p = 7: entries 0, 1, window pos 4..7
        [0, 1, 4, 5, 6, 7],
        [0, 1, 5, 6, 7, 8],
        [11, -1, -1, -1, -1, -1],  # request 1, p = 0: itself only
        [11, 12, -1, -1, -1, -1],
        [11, 12, 13, -1, -1, -1],
        [9, 11, 12, 13, 14, -1],   # p = 3: entry 0 (pos 0..3) just closed
        [9, 12, 13, 14, 15, -1],
    ]
    assert rows(lens) == [5, 6, 6, 6, 1, 2, 3, 5, 5]
    assert lay.static_indices(0, lay.chunks[0]) is lay.static_indices(0, lay.chunks[0])  # built once


def test_swa_static_indices_one_chunk_per_request():
    lay = RatioLayout(STARTS, ENDS, CU, 1, W, [(0, 1, 0, 7), (1, 2, 0, 5)], "cpu")
    first, second = lay.chunks
    assert rows(first.ws_index) == [0, 1, 2, 3, 4, 5, 6] and rows(second.ws_index) == [7, 8, 9, 10, 11]
    assert (second.q0, second.q1) == (4, 9)
    indices, lens = lay.static_indices(0, first)
    assert rows(indices) == [[0, 1, 2, 3], [1, 2, 3, 4], [2, 3, 4, 5], [3, 4, 5, 6]] and rows(lens) == [4] * 4
    indices, lens = lay.static_indices(1, second)
    assert rows(indices) == [[0, -1, -1, -1], [0, 1, -1, -1], [0, 1, 2, -1], [0, 1, 2, 3], [1, 2, 3, 4]]
    assert rows(lens) == [1, 2, 3, 4, 4]


def test_combine_topk_picks_then_window():
    comp = torch.tensor([[2, 0, 7], [1, 5, 5]])  # request-local picks, valid first
    comp_len = torch.tensor([2, 5])               # clamped to K = 3
    indices, lens = combine(comp, comp_len, row_base=torch.tensor([0, 10]), win_base=torch.tensor([4, 13]),
                            win_len=torch.tensor([2, 1]), window=3)
    assert rows(indices) == [[2, 0, 4, 5, -1, -1], [11, 15, 15, 13, -1, -1]]
    assert rows(lens) == [4, 4]


def test_combine_window_only():
    indices, lens = combine(None, torch.tensor([0, 0]), torch.tensor([0, 0]), torch.tensor([3, 0]),
                            torch.tensor([2, 3]), window=3)
    assert rows(indices) == [[3, 4, -1], [0, 1, 2]] and rows(lens) == [2, 3]


def test_compressor_overlap_windows_and_carry():
    # ratio 4 with overlap: request 0 carries its previous window (pos 0..3) and pending pos 4, 5
    lay = CompressorLayout(STARTS, ENDS, CU, 4, overlap=True)
    assert rows(lay.carry_len) == [6, 0] and lay.num_carried == 6 and lay.pad == 15
    # src = [carried: pos 0..3, 4, 5 | step: req 0 pos 6..9 (rows 6..9), req 1 pos 0..4 (10..14) | pad]
    assert rows(lay.cur) == [[4, 5, 6, 7], [10, 11, 12, 13]]
    assert rows(lay.prev) == [[0, 1, 2, 3], [15, 15, 15, 15]]  # request 1 has no previous window
    assert rows(lay.positions) == [4, 0] and rows(lay.num_new) == [1, 1]
    # to carry on: the last full window and the tail after it
    assert [rows(lay.keep_rows(b)) for b in range(2)] == [[4, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]


def test_compressor_without_overlap():
    starts, ends, cu = np.array([3, 0]), np.array([6, 3]), np.array([0, 3, 6])
    lay = CompressorLayout(starts, ends, cu, 2, overlap=False)
    assert lay.num_carried == 1 and lay.pad == 7  # request 0's pending pos 2
    assert rows(lay.cur) == [[0, 1], [2, 3], [4, 5]] and rows(lay.prev) == rows(lay.cur)
    assert rows(lay.positions) == [2, 4, 0] and rows(lay.num_new) == [2, 1]
    assert [rows(lay.keep_rows(b)) for b in range(2)] == [[], [6]]  # request 1 pends pos 2 (step row 6)
    torch_lay = CompressorLayout(starts, ends, cu, 2, overlap=False).to_torch("cpu")
    assert torch_lay.cur.dtype == torch.int64 and rows(torch_lay.keep_rows(1)) == [6]
