"""`ParquetPartSink`: the Ray Data sink that writes OUTPUT's part files.

Ray Data hands each write task at least `rows_per_file` rows (`min_rows_per_write`); the task
streams them into part files of exactly `rows_per_file` rows (its last one may hold fewer),
each through `output.staged` (a temporary name, renamed when complete; see `output` for the
layout), and returns what it wrote; the driver adds them up.
"""

from __future__ import annotations

import uuid

from ray.data.datasource import Datasink

from dsv4batch.jobspec.stats import Written
from dsv4batch.pipeline import output as O
from dsv4batch.pipeline.fs import open_fs


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
        """Stream the task's rows into part files of at most `rows_per_file` rows each."""
        import pyarrow as pa

        tables = (b if isinstance(b, pa.Table) else pa.Table.from_pandas(b) for b in blocks)
        rows = (t for t in self._cut(tables) if t.num_rows)
        head = next(rows, None)
        counts, k = Written(), 0
        fs, root = open_fs(self.path)
        while head is not None:  # one file per round: its first table is `head`
            name = O.part_name(self.run_id, ctx.task_idx, k)
            head, written = self._write_file(fs, root, name, head, rows)
            counts, k = counts + written, k + 1
        return counts

    def _cut(self, tables):
        """Tables sliced so that none crosses a multiple of `rows_per_file` (None: no cut)."""
        n, done = self.rows_per_file, 0
        for t in tables:
            start = 0
            while n and start < t.num_rows:
                take = min(t.num_rows - start, n - done % n)
                yield t.slice(start, take)
                start, done = start + take, done + take
            if not n:
                yield t

    def _write_file(self, fs, root: str, name: str, head, rows):
        """Write `head` and following tables up to `rows_per_file` rows into `name`; returns
        (the first table of the next file or None, what was written)."""
        import pyarrow.parquet as pq

        counts, limit = Written(files=[name]), self.rows_per_file
        with O.staged(fs, root, name) as stream, \
                pq.ParquetWriter(stream, head.schema, compression=self.compression) as writer:
            table = head
            while table is not None:
                writer.write_table(table.cast(writer.schema))
                counts += Written.of_table(table)
                if limit and counts.rows >= limit:
                    return next(rows, None), counts
                table = next(rows, None)
        return None, counts

    def on_write_complete(self, write_result) -> None:
        total = sum((r for r in write_result.write_returns if r), Written())
        total.files = sorted(total.files)
        self.result = total
