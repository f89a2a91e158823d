"""Derived ids `<file>:<row>` from Ray Data's path and row hash."""

import numpy as np
import pyarrow as pa

from dsv4batch.pipeline.ids.derive import DeriveIds


def test_derive_ids_relative_to_root_with_fallback():
    from ray.data._internal.datasource_v2.common.synthesized_columns import (
        _compute_row_hashes,
    )

    a, b = "/data/in/x/a.parquet", "/data/in/b.parquet"
    hashes = np.concatenate([_compute_row_hashes(a, 0, 2), _compute_row_hashes(b, 7, 1),
                             np.array([123], np.uint64)])
    batch = pa.table({"prompt": list("pqrs"), "path": [a, a, b, b],
                      "row_hash": pa.array(hashes, pa.uint64())})
    out = DeriveIds("/data/in")(batch)
    assert out.column_names == ["prompt", "id"]
    assert out["id"].to_pylist() == ["x/a.parquet:0", "x/a.parquet:1", "b.parquet:7",
                                     "b.parquet#000000000000007b"]
