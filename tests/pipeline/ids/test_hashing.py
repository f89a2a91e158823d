"""Ray Data's row hash, inverted (checked against Ray's own function)."""

import numpy as np

from dsv4batch.pipeline.ids.hashing import mix64, path_seed, row_index


def test_row_hash_inversion_matches_ray():
    from ray.data._internal.datasource_v2.common.synthesized_columns import (
        _compute_row_hashes,
    )

    path = "/data/in/part-00001.parquet"
    hashes = _compute_row_hashes(path, 1000, 50)
    assert row_index(path, hashes).tolist() == list(range(1000, 1050))
    seeds = np.uint64(path_seed(path)) + np.arange(3, dtype=np.uint64)
    assert np.array_equal(mix64(seeds), _compute_row_hashes(path, 0, 3))
    assert (row_index("/another/file.parquet", hashes) == -1).all()
