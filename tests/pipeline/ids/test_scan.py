"""The id scan's partitioning and its classification of one partition's id groups."""

import numpy as np
import pyarrow as pa
import pytest

from dsv4batch.pipeline.ids.scan import KINDS, classify, partition_of


def test_classify_one_partition_of_ids():
    # INPUT rows (in=1, their position as key) and OUTPUT ids (done=1, key -1)
    rows = [("a", 1, 0, 5), ("a", 1, 0, 6), (None, 1, 0, 7), (None, 1, 0, 8), ("b", 1, 0, 9),
            ("b", 0, 1, -1), ("c", 1, 0, 10), ("d", 0, 1, -1), ("e", 1, 0, 11), ("e", 0, 1, -1),
            ("e", 0, 1, -1)]
    ids, n_in, n_done, keys = zip(*rows)
    out = classify(pa.table({"id": list(ids), "__in": list(n_in), "__done": list(n_done),
                             "__key": list(keys), "__part": [0] * len(rows)}))
    got = sorted((KINDS[k], i, n, key) for k, i, n, key in zip(*(out[c].to_pylist() for c in
                                                                 ("kind", "id", "n", "key"))))
    assert got == [("done", None, 1, 9),  # b: written before, its position goes to the bitmap
                   ("dup_in", "'a'", 2, 6), ("dup_out", "'e'", 2, 11), ("null", "None", 2, 8),
                   ("orphan", "'d'", 1, -1)]  # c: still to score, not reported



@pytest.mark.parametrize("ids", [pa.array(["r1", "r22", "", None, "héllo"] * 40),
                                 pa.array(list(range(200)) + [None]),
                                 pa.array([b"\x00\xff", b"ab"] * 50, pa.binary())])
def test_partition_of_is_stable_and_spreads(ids):
    parts = partition_of(ids, 4)
    assert parts.min() >= 0 and parts.max() < 4
    assert np.array_equal(parts, partition_of(ids.slice(0), 4))
    values = ids.to_pylist()
    first = {}
    for v, p in zip(values, parts.tolist()):  # the same id: the same partition, always
        assert first.setdefault(v, p) == p
    if len(set(values)) > 50:
        assert len(set(parts.tolist())) == 4
    if pa.types.is_string(ids.type):  # string and large_string agree (ids cast on read)
        assert np.array_equal(parts, partition_of(ids.cast(pa.large_string()), 4))
