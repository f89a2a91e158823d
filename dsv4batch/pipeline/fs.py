"""Filesystems and Parquet footers for INPUT and OUTPUT (pyarrow only: no ray, no torch).

A path is a local path or a URI pyarrow understands (`s3://`, `gs://`, `hdfs://`, ...).
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

from dsv4batch.jobspec.errors import UsageError


def open_fs(path: str):
    """(pyarrow filesystem, path inside it) for a local path or any URI pyarrow understands."""
    import os

    import pyarrow.fs as pafs

    if "://" in path:
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), os.path.abspath(path)


class Footer(NamedTuple):
    rows: int
    schema: Any  # pyarrow.Schema
    size: int  # file bytes
    digest: str  # blake2b of the Parquet footer (row groups, statistics, writer): the content's mark


def read_footers(fs, files: list[str], what: str) -> list[Footer]:
    """Each file's `Footer`, 16 files at a time; a file that cannot be read is a `UsageError`
    naming it (`what`: e.g. "Parquet file {!r}")."""
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow.parquet as pq

    def footer(f: str) -> Footer:
        try:
            with fs.open_input_file(f) as fh:
                pf = pq.ParquetFile(fh)
                size = fh.size()
                fh.seek(size - 8)
                n = int.from_bytes(fh.read(4), "little")
                fh.seek(size - 8 - n)
                digest = hashlib.blake2b(fh.read(n), digest_size=16).hexdigest()
                return Footer(pf.metadata.num_rows, pf.schema_arrow, size, digest)
        except Exception as exc:
            raise UsageError(f"cannot read {what.format(f)}: {exc}") from exc

    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(footer, files))
