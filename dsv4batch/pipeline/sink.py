"""`ParquetPartSink`: the Ray Data sink that writes OUTPUT's part files.

Each write task streams its blocks into one part file through `output.staged` (a temporary
name, renamed when complete; see `output` for the layout) and returns what it wrote; the
driver adds them up.
"""

from __future__ import annotations

import itertools
import uuid

from ray.data.datasource import Datasink

from dsv4batch.pipeline import output as O
from dsv4batch.pipeline.fs import open_fs
from dsv4batch.pipeline.stats import Written


class ParquetPartSink(Datasink):
    """Writes `part-<run>-<task>.parquet` files; `result` holds the run's `Written` totals."""

    def __init__(self, path: str, run_id: str | None = None, compression: str = "zstd",
                 rows_per_file: int | None = None):
        self.path, self.compression, self.rows_per_file = path, compression, rows_per_file
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self.result: Written | None = None

    def get_name(self) -> str:
        return "WriteScores"

    @property
    def min_rows_per_write(self) -> int | None:
        # Ray Data gathers blocks to this many rows per write task (else one small file per
        # scoring batch); the last file of a run may hold fewer
        return self.rows_per_file

    def on_write_start(self, schema=None) -> None:
        fs, root = open_fs(self.path)
        fs.create_dir(root, recursive=True)

    def write(self, blocks, ctx) -> Written:
        import pyarrow as pa
        import pyarrow.parquet as pq

        tables = (b if isinstance(b, pa.Table) else pa.Table.from_pandas(b) for b in blocks)
        tables = (t for t in tables if t.num_rows)
        head = next(tables, None)
        if head is None:
            return Written()
        fs, root = open_fs(self.path)
        name = O.part_name(self.run_id, ctx.task_idx)
        counts = Written(files=[name])
        with O.staged(fs, root, name) as stream, \
                pq.ParquetWriter(stream, head.schema, compression=self.compression) as writer:
            for table in itertools.chain([head], tables):
                writer.write_table(table.cast(writer.schema))
                counts += Written.of_table(table)
        return counts

    def on_write_complete(self, write_result) -> None:
        total = sum((r for r in write_result.write_returns if r), Written())
        total.files = sorted(total.files)
        self.result = total
