"""Input discovery and the streaming Parquet read (only the columns the pipeline needs).

`inspect_input` resolves INPUT (local or any pyarrow filesystem URI) to its Parquet files: a
path that exists is read as given (a file, or a folder searched recursively, OUTPUT's folder
left out); only a path that does not exist is a glob (`*`, `?`, `[...]`; `**` spans folders).
Schemas, row counts and a fingerprint per file (size, rows, footer digest: what `--resume`
compares) come from the footers, and a file whose footer cannot be read is named.
`check_input` validates the configured columns against every distinct schema and finds the
one id type of all files, so a bad path, file, column or type is reported before Ray starts. `read` streams the needed columns;
on `--resume` it reads only files with rows still to score and drops the rows already written.
"""

from __future__ import annotations

import fnmatch
import posixpath
from dataclasses import dataclass
from typing import Any

from dsv4batch.pipeline import schema as S
from dsv4batch.pipeline.config import ScoreConfig
from dsv4batch.pipeline.errors import UsageError
from dsv4batch.pipeline.fs import open_fs, read_footers
from dsv4batch.pipeline.ids.derive import relative

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
    file_rows: list[int] | None = None  # rows per file (None when the footers were not read)
    schemas: dict | None = None  # distinct schema -> first file that has it
    fingerprints: list[dict] | None = None  # per file: path (relative to root), size, rows, footer
    id_type: Any = None  # the ids' one type over all files (set by check_input)


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


def inspect_input(path: str, exclude: str | None = None) -> InputInfo:
    """INPUT's files, schemas and fingerprints; `exclude`: OUTPUT, never read as input."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    fs, p = open_fs(path)
    kind = fs.get_file_info(p).type
    if kind == pafs.FileType.NotFound and any(c in p for c in _WILDCARDS):
        parts = p.split("/")
        first = next(i for i, part in enumerate(parts) if any(c in part for c in _WILDCARDS))
        root = "/".join(parts[:first]) or "/"
        files = _list(fs, root, p) if fs.get_file_info(root).type == pafs.FileType.Directory else []
    elif kind == pafs.FileType.NotFound:
        raise UsageError(f"INPUT {path!r} does not exist")
    else:
        root = p if kind == pafs.FileType.Directory else posixpath.dirname(p)
        files = _list(fs, p, None) if kind == pafs.FileType.Directory else [p]
    if exclude is not None:
        out = open_fs(exclude)[1].rstrip("/") + "/"
        files = [f for f in files if not f.startswith(out)]
    if not files:
        raise UsageError(f"INPUT {path!r} holds no Parquet files")
    unreadable = [f for f in files if "?" in posixpath.basename(f)]
    if unreadable:
        raise UsageError(f"INPUT file name(s) with '?' cannot be read by Ray Data (it takes '?' "
                         f"as the start of a URL query), e.g. {unreadable[:3]}; rename them")
    try:
        schema = pq.read_schema(files[0], filesystem=fs)
    except Exception as exc:
        raise UsageError(f"cannot read Parquet file {files[0]!r}: {exc}") from exc
    info = InputInfo(path, fs, root, files, schema, None, schemas={schema: files[0]})
    if len(files) <= MAX_FOOTERS:
        footers = read_footers(fs, files, "Parquet file {!r}")
        info.file_rows = [ft.rows for ft in footers]
        info.num_rows = sum(info.file_rows)
        for f, ft in zip(files, footers):
            info.schemas.setdefault(ft.schema, f)
        info.fingerprints = [{"path": relative(root, f), "size": ft.size, "rows": ft.rows,
                              "footer": ft.digest} for f, ft in zip(files, footers)]
    return info


_TEXT_TYPES = ("is_string", "is_large_string", "is_string_view", "is_binary", "is_large_binary")
_ID_TYPES = ("is_integer", "is_string", "is_large_string", "is_binary", "is_large_binary")


def _is(t, kinds) -> bool:
    import pyarrow as pa

    return any(getattr(pa.types, k)(t) for k in kinds)


RAY_COLUMNS = ("path", "row_hash")  # what Ray Data's read adds for derived ids and --resume


def check_input(info: InputInfo, config: ScoreConfig) -> None:
    """Columns exist in every file; text/target are strings; ids integers or strings, of one
    kind in every file (`info.id_type`: int64 for mixed integer widths, large_string for mixed
    string kinds)."""
    import pyarrow as pa

    needed = S.input_columns(config, info.schema.names)
    if config.id_column != "id" and config.id_column not in needed:
        needed.append(config.id_column)  # an explicitly named id column must exist
    clash = [c for c in needed if c in RAY_COLUMNS]
    if clash:
        raise UsageError(f"input column(s) {clash} cannot be used: Ray Data's read adds its own "
                         f"{list(RAY_COLUMNS)} columns (derived ids and --resume need them); "
                         "rename the column(s) in the input")
    id_types: dict = {}
    for schema, file in (info.schemas or {info.schema: info.files[0]}).items():
        where = f"input {info.path!r}" if file == info.files[0] else f"input file {file!r}"
        names = schema.names
        S.check_columns("read", needed, names, where)
        for col in filter(None, (config.text_column, config.target_column)):
            t = schema.field(col).type
            if not _is(t, _TEXT_TYPES):
                raise UsageError(f"column {col!r} has type {t} in {where}; expected a string "
                                 "column (binary is read as UTF-8)")
        if config.id_column in names:
            t = schema.field(config.id_column).type
            if not _is(t, _ID_TYPES):
                raise UsageError(f"id column {config.id_column!r} has type {t} in {where}; "
                                 "expected integers or strings")
            id_types.setdefault(t, file)
    kinds = {S.id_kind(t) for t in id_types}
    if len(kinds) > 1:
        seen = "; ".join(f"{t} in {f!r}" for t, f in list(id_types.items())[:4])
        raise UsageError(f"id column {config.id_column!r} has different kinds of type across "
                         f"INPUT's files ({seen}); give every file the same id type")
    if not id_types:
        info.id_type = pa.string()  # derived '<file>:<row>' ids
    elif len(id_types) == 1:
        info.id_type = next(iter(id_types))
    else:
        info.id_type = {"integer": pa.int64(), "string": pa.large_string(),
                        "binary": pa.large_binary()}[kinds.pop()]


def cast_ids(batch, id_column: str, id_type):
    """Ids of one file's type -> INPUT's one id type (`InputInfo.id_type`)."""
    i = batch.schema.get_field_index(id_column)
    return batch.set_column(i, id_column, batch.column(i).cast(id_type))


def read(config: ScoreConfig, info: InputInfo, pending=None):
    """`ray.data.read_parquet` of the needed columns; derives ids when the input has none.

    `pending` (an `ids.rowset.Pending` from the id scan on --resume): only its files are read, and
    rows already in OUTPUT are dropped before anything else runs.
    """
    import ray

    names = info.schema.names
    derive = config.id_column not in names
    files = info.files if pending is None else pending.files
    located = derive or pending is not None
    ds = ray.data.read_parquet(files, filesystem=info.filesystem,
                               columns=S.input_columns(config, names), include_paths=located,
                               include_row_hash=located)
    if pending is not None and pending.done:
        from dsv4batch.pipeline.ids.rowset import keep_pending

        ds = ds.map_batches(keep_pending, fn_kwargs={"done": pending.done},
                            batch_format="pyarrow", batch_size=None, zero_copy_batch=True,
                            udf_modifying_row_count=True)
    if derive:
        from dsv4batch.pipeline.ids.derive import derive_ids

        ds = ds.map_batches(derive_ids,
                            fn_kwargs={"root": info.root, "id_column": config.id_column},
                            batch_format="pyarrow", batch_size=None, zero_copy_batch=True,
                            udf_modifying_row_count=False)
    elif located:
        ds = ds.drop_columns(list(RAY_COLUMNS))
    if not derive and info.schemas and len({s.field(config.id_column).type
                                           for s in info.schemas}) > 1:
        ds = ds.map_batches(cast_ids, fn_kwargs={"id_column": config.id_column,
                                                 "id_type": info.id_type},
                            batch_format="pyarrow", batch_size=None, zero_copy_batch=True,
                            udf_modifying_row_count=False)
    return ds
