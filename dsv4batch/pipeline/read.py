"""Input discovery and the streaming Parquet read (only the columns the pipeline needs).

`inspect_input` resolves INPUT (file, folder or glob; local or any pyarrow filesystem URI) to
its Parquet files, schema and row count from the footers, and `check_input` validates the
configured columns against that schema, so a bad path or column is reported before Ray starts.
"""

from __future__ import annotations

import fnmatch
import posixpath
from dataclasses import dataclass
from typing import Any

from dsv4batch.pipeline import schema as S
from dsv4batch.pipeline.config import ScoreConfig, UsageError
from dsv4batch.pipeline.sink import open_fs

MAX_FOOTERS = 20_000  # count rows from footers up to this many files (else: unknown total)
_WILDCARDS = "*?["


@dataclass
class InputInfo:
    path: str  # as given
    filesystem: Any  # pyarrow.fs.FileSystem
    root: str  # folder that derived ids are relative to
    files: list[str]
    schema: Any  # pyarrow.Schema of the first file
    num_rows: int | None


def _list(fs, base: str, pattern: str | None) -> list[str]:
    import pyarrow.fs as pafs

    infos = fs.get_file_info(pafs.FileSelector(base, recursive=True))
    files = [i.path for i in infos if i.type == pafs.FileType.File]
    files = [f for f in files if not any(p.startswith(("_", "."))
                                         for p in posixpath.relpath(f, base).split("/"))]
    if pattern:
        return sorted(f for f in files if _match(f.split("/"), pattern.split("/")))
    return sorted(f for f in files if f.endswith((".parquet", ".pq", ".parq")))


def _match(parts: list[str], pats: list[str]) -> bool:
    """Glob match per path segment: `*` stays within a folder, `**` spans folders."""
    if not pats:
        return not parts
    if pats[0] == "**":
        return any(_match(parts[i:], pats[1:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pats[0]) and _match(parts[1:], pats[1:])


def inspect_input(path: str) -> InputInfo:
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    fs, p = open_fs(path)
    if any(c in p for c in _WILDCARDS):
        parts = p.split("/")
        first = next(i for i, part in enumerate(parts) if any(c in part for c in _WILDCARDS))
        root = "/".join(parts[:first]) or "/"
        files = _list(fs, root, p) if fs.get_file_info(root).type == pafs.FileType.Directory else []
    else:
        kind = fs.get_file_info(p).type
        if kind == pafs.FileType.NotFound:
            raise UsageError(f"INPUT {path!r} does not exist")
        root = p if kind == pafs.FileType.Directory else posixpath.dirname(p)
        files = _list(fs, p, None) if kind == pafs.FileType.Directory else [p]
    if not files:
        raise UsageError(f"INPUT {path!r} holds no Parquet files")
    try:
        schema = pq.read_schema(files[0], filesystem=fs)
    except Exception as exc:
        raise UsageError(f"cannot read Parquet file {files[0]!r}: {exc}") from exc
    num_rows = None
    if len(files) <= MAX_FOOTERS:
        from concurrent.futures import ThreadPoolExecutor

        def rows(f: str) -> int:
            try:
                with fs.open_input_file(f) as fh:
                    return pq.ParquetFile(fh).metadata.num_rows
            except Exception as exc:
                raise UsageError(f"cannot read Parquet file {f!r}: {exc}") from exc

        with ThreadPoolExecutor(16) as pool:
            num_rows = sum(pool.map(rows, files))
    return InputInfo(path, fs, root, files, schema, num_rows)


def check_input(info: InputInfo, config: ScoreConfig) -> None:
    """Columns exist and text/target are strings; raises `UsageError` otherwise."""
    import pyarrow as pa

    names = info.schema.names
    needed = S.input_columns(config, names)
    if config.id_column != "id" and config.id_column not in names:
        needed.append(config.id_column)  # an explicitly named id column must exist
    S.check_columns("read", needed, names, f"input {info.path!r}")
    for col in filter(None, (config.text_column, config.target_column)):
        t = info.schema.field(col).type
        if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
                or pa.types.is_large_binary(t) or pa.types.is_string_view(t)):
            raise UsageError(f"column {col!r} has type {t}; expected a string column")


def derive_ids(batch, root: str, id_column: str):
    from dsv4batch.pipeline.ids import DeriveIds

    return DeriveIds(root, id_column)(batch)


def read(config: ScoreConfig, info: InputInfo):
    """`ray.data.read_parquet` of the needed columns; derives ids when the input has none."""
    import ray

    names = info.schema.names
    derive = config.id_column not in names
    ds = ray.data.read_parquet(info.files, filesystem=info.filesystem,
                               columns=S.input_columns(config, names), include_paths=derive,
                               include_row_hash=derive, override_num_blocks=config.num_blocks)
    if derive:
        ds = ds.map_batches(derive_ids, fn_kwargs={"root": info.root, "id_column": config.id_column},
                            batch_format="pyarrow", batch_size=None, zero_copy_batch=True,
                            udf_modifying_row_count=False)
    return ds
