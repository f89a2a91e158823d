"""Filesystems and Parquet footers for INPUT and OUTPUT (pyarrow only: no ray, no torch).

A path is a local path or a URI pyarrow understands (`s3://`, `gs://`, `hdfs://`, ...).
"""

from __future__ import annotations

from typing import Any

from dsv4batch.pipeline.errors import UsageError


def open_fs(path: str):
    """(pyarrow filesystem, path inside it) for a local path or any URI pyarrow understands."""
    import os

    import pyarrow.fs as pafs

    if "://" in path:
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), os.path.abspath(path)


def read_footers(fs, files: list[str], what: str) -> list[tuple[int, Any]]:
    """(row count, Arrow schema) per file from its footer, 16 at a time; a file that cannot be
    read is a `UsageError` naming it (`what`: e.g. "Parquet file {!r}")."""
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow.parquet as pq

    def footer(f: str):
        try:
            with fs.open_input_file(f) as fh:
                pf = pq.ParquetFile(fh)
                return pf.metadata.num_rows, pf.schema_arrow
        except Exception as exc:
            raise UsageError(f"cannot read {what.format(f)}: {exc}") from exc

    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(footer, files))
