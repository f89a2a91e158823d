"""Parquet sink: each write task streams its blocks to a hidden temporary file, then renames it.

A part file therefore either exists complete under its final name or not at all; readers skip
the temporary names (they start with `_` and do not end in `.parquet`). The final name depends
only on the run id and the write task index, so a retried task replaces its own file instead of
adding a second copy. Each task returns the counts it wrote; the driver sums them.
"""

from __future__ import annotations

import uuid
from typing import Any

from ray.data.datasource import Datasink

from dsv4batch.pipeline import schema as S

TMP_PREFIX = "_tmp-"
PART_PREFIX = "part-"


def open_fs(path: str):
    """(pyarrow filesystem, path inside it) for a local path or any URI pyarrow understands."""
    import os

    import pyarrow.fs as pafs

    if "://" in path:
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), os.path.abspath(path)


def _counts(table) -> dict[str, int]:
    import pyarrow.compute as pc

    def total(col: str) -> int:
        return int(pc.sum(table[col]).as_py() or 0)

    return {"rows": table.num_rows, "rows_errored": table.num_rows - table[S.ERROR].null_count,
            "input_tokens": total("num_tokens"), "scored_tokens": total("num_scored_tokens")}


class ParquetPartSink(Datasink):
    """Writes `part-<run>-<task>.parquet` files through temporary names; see module doc."""

    def __init__(self, path: str, run_id: str | None = None, compression: str = "zstd",
                 rows_per_file: int | None = None):
        self.path, self.compression, self.rows_per_file = path, compression, rows_per_file
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self.result: dict[str, Any] | None = None

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

    def write(self, blocks, ctx) -> dict[str, Any]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        fs, root = open_fs(self.path)
        name = f"{PART_PREFIX}{self.run_id}-{ctx.task_idx:06d}.parquet"
        tmp = f"{root}/{TMP_PREFIX}{uuid.uuid4().hex}.{name}.inprogress"
        writer, counts = None, {"rows": 0, "rows_errored": 0, "input_tokens": 0,
                                "scored_tokens": 0}
        try:
            for block in blocks:
                table = block if isinstance(block, pa.Table) else pa.Table.from_pandas(block)
                if table.num_rows == 0:
                    continue
                if writer is None:
                    writer = pq.ParquetWriter(fs.open_output_stream(tmp), table.schema,
                                              compression=self.compression)
                writer.write_table(table.cast(writer.schema))
                for k, v in _counts(table).items():
                    counts[k] += v
            if writer is None:
                return {"file": None, **counts}
            writer.close()
            writer = None
            fs.move(tmp, f"{root}/{name}")
        except BaseException:
            if writer is not None:
                writer.close()
            _delete_quietly(fs, tmp)
            raise
        return {"file": name, **counts}

    def on_write_complete(self, write_result) -> None:
        returns = [r for r in write_result.write_returns if r]
        totals = {k: sum(r[k] for r in returns) for k in
                  ("rows", "rows_errored", "input_tokens", "scored_tokens")}
        self.result = {**totals, "files": sorted(r["file"] for r in returns if r["file"])}


def _delete_quietly(fs, path: str) -> None:
    try:
        fs.delete_file(path)
    except Exception:
        pass
