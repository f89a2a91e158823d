"""The bitmap of written rows and the read-side filter (against Ray's own row hash)."""

import numpy as np
import pyarrow as pa

from dsv4batch.pipeline.ids.rowset import KEY_SHIFT, RowBitmap, keep_pending


def test_row_bitmap_and_keep_pending_against_rays_row_hash():
    from ray.data._internal.datasource_v2.common.synthesized_columns import (
        _compute_row_hashes,
    )

    files = ["/in/a.parquet", "/in/b.parquet", "/in/c.parquet"]
    written = RowBitmap(files, [10, 3, 5])
    written.add(np.array([2, 3, 9]) + (0 << KEY_SHIFT))
    written.add(np.array([0, 1, 2]) + (1 << KEY_SHIFT))  # all of b
    written.add(np.array([3, 3]))  # the same row twice sets one bit
    pending = written.pending()
    assert pending.skipped == 6 and pending.files == ["/in/a.parquet", "/in/c.parquet"]
    assert set(pending.done) == {"/in/a.parquet"}
    a, c = files[0], files[2]
    batch = pa.table({"prompt": [f"a{i}" for i in range(10)] + [f"c{i}" for i in range(5)],
                      "path": [a] * 10 + [c] * 5,
                      "row_hash": pa.array(np.concatenate([_compute_row_hashes(a, 0, 10),
                                                           _compute_row_hashes(c, 0, 5)]))})
    kept = keep_pending(batch, pending.done)["prompt"].to_pylist()
    assert kept == ["a0", "a1", "a4", "a5", "a6", "a7", "a8", "c0", "c1", "c2", "c3", "c4"]
    grown = RowBitmap(files, None)  # row counts unknown (more files than footers read)
    grown.add(np.array([1, 20]))
    assert grown.pending().skipped == 2 and grown.pending().files == files
