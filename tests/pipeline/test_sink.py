"""The part-file sink: temporary names, renames, counts, nothing left by a failed write."""

import os
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dsv4batch.jobspec import schema as S
from dsv4batch.jobspec.stats import Written
from dsv4batch.pipeline.sink import ParquetPartSink


def test_sink_writes_through_temp_names(tmp_path):
    schema = S.output_schema(pa.int64(), False)
    def block(ids, err=None):
        n = len(ids)
        return pa.table({"id": ids, "num_tokens": pa.array([3] * n, pa.int32()),
                         "num_scored_tokens": pa.array([2] * n, pa.int32()),
                         "logprob_sum": [-1.0] * n, "logprob_mean": [-0.5] * n,
                         "perplexity": [1.6] * n, "is_greedy": [False] * n,
                         "error": pa.array([err] * n, pa.string())},
                        schema=schema)
    sink = ParquetPartSink(str(tmp_path / "out"), run_id="r1")
    sink.on_write_start()
    r0 = sink.write([block([1, 2]), block([], None), block([3], "boom")], SimpleNamespace(task_idx=0))
    r1 = sink.write([block([])], SimpleNamespace(task_idx=1))
    assert r0 == Written(rows=3, rows_errored=1, input_tokens=9, scored_tokens=6,
                         files=["part-r1-000000.parquet"])
    assert r1 == Written()
    sink.on_write_complete(SimpleNamespace(write_returns=[r0, r1]))
    assert sink.result.rows == 3 and sink.result.files == ["part-r1-000000.parquet"]
    assert os.listdir(tmp_path / "out") == ["part-r1-000000.parquet"]
    assert pq.read_table(tmp_path / "out").schema.equals(schema)

    class Broken:  # a failing block stream leaves no file behind, temporary or final
        def __iter__(self):
            yield block([4])
            raise RuntimeError("actor died")
    with pytest.raises(RuntimeError):
        sink.write(Broken(), SimpleNamespace(task_idx=2))
    assert os.listdir(tmp_path / "out") == ["part-r1-000000.parquet"]
