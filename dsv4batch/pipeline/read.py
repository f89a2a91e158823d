"""Input discovery and the streaming read (only the columns the pipeline needs).

`inspect_input` resolves INPUT (local or any pyarrow filesystem URI) to its files: a path that
exists is read as given (a file, or a folder searched recursively, OUTPUT's folder left out);
only a path that does not exist is a glob (`*`, `?`, `[...]`; `**` spans folders). The format
(Parquet, JSONL, CSV: `formats`) comes from `--input-format` or the files' extensions, one per
INPUT. Schemas, row counts and a fingerprint per file (what `--resume` compares) come from the
Parquet footers, or from one streamed pass over each JSONL/CSV file that also names the first
malformed line. `check_input` validates the configured columns against every distinct schema
and finds the one id type of all files, so a bad path, file, line, column or type is reported
before Ray starts. Text columns may be strings, binary or dictionary-encoded strings (pandas
categoricals), read as text by the one invalid-text rule of every format (`schema.utf8_text`:
invalid UTF-8 decoded as U+FFFD, NUL kept; `formats` for how each format gets there). `read`
streams the needed columns through Ray Data's readers; on `--resume` it reads only files with
rows still to score and drops the rows already written.
"""

from __future__ import annotations

import fnmatch
import posixpath
from dataclasses import dataclass
from typing import Any

from dsv4batch.jobspec import schema as S
from dsv4batch.jobspec.config import JobConfig
from dsv4batch.jobspec.config_base import FORMATS
from dsv4batch.jobspec.errors import UsageError
from dsv4batch.pipeline import formats as F
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
    fingerprints: list[dict] | None = None  # per file: path (relative to root), size, rows,
    # and the footer digest (Parquet) or the content digest (JSONL, CSV)
    id_type: Any = None  # the ids' one type over all files (set by check_input)
    format: str = "parquet"  # one of config_base.FORMATS
    text_columns: tuple = ()  # CSV: columns read as text (`schema.utf8_columns`): the tokenizer's
    longest_line: int = 0  # JSONL: the longest line over all files, in bytes


def _list(fs, base: str, pattern: str | None, fmt: str | None) -> list[str]:
    """Files under `base`: those matching `pattern`, else those of format `fmt` (any known
    format when None)."""
    import pyarrow.fs as pafs

    infos = fs.get_file_info(pafs.FileSelector(base, recursive=True))
    files = [i.path for i in infos if i.type == pafs.FileType.File]
    files = [f for f in files if not any(p.startswith(("_", "."))
                                         for p in posixpath.relpath(f, base).split("/"))]
    if pattern:
        return sorted(f for f in files if _match(f.split("/"), pattern.split("/")))
    return sorted(f for f in files if F.format_of(f) is not None
                  and (fmt is None or F.format_of(f) == fmt))


def _one_format(path: str, files: list[str], given: str | None) -> str:
    """INPUT's one format: `given`, else the files' extensions (all alike)."""
    if given:
        return given
    kinds: dict = {}
    for f in files:
        kinds.setdefault(F.format_of(f), f)
    if None in kinds:
        raise UsageError(f"cannot tell the format of INPUT file {kinds[None]!r} from its name "
                         f"(known: {', '.join(e for x in FORMATS.values() for e in x)}); "
                         "pass --input-format parquet|json|csv")
    if len(kinds) > 1:
        seen = ", ".join(f"{F.NAMES[k]} ({f!r})" for k, f in kinds.items())
        raise UsageError(f"INPUT {path!r} mixes formats: {seen}; pass --input-format to read "
                         "one of them")
    return next(iter(kinds))


def _match(parts: list[str], pats: list[str]) -> bool:
    """Glob match per path segment: `*` stays within a folder, `**` spans folders."""
    if not pats:
        return not parts
    if pats[0] == "**":
        return any(_match(parts[i:], pats[1:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pats[0]) and _match(parts[1:], pats[1:])


def inspect_input(path: str, exclude: str | None = None, input_format: str | None = None,
                  text_columns: tuple = ()) -> InputInfo:
    """INPUT's files, format, schemas and fingerprints; `exclude`: OUTPUT, never read as
    input; `input_format`: None (by extension) or a key of `config_base.FORMATS`; `text_columns`:
    read as strings from CSV (the configured text and target columns)."""
    import pyarrow.fs as pafs

    fs, p = open_fs(path)
    kind = fs.get_file_info(p).type
    if kind == pafs.FileType.NotFound and any(c in p for c in _WILDCARDS):
        parts = p.split("/")
        first = next(i for i, part in enumerate(parts) if any(c in part for c in _WILDCARDS))
        root = "/".join(parts[:first]) or "/"
        files = (_list(fs, root, p, input_format)
                 if fs.get_file_info(root).type == pafs.FileType.Directory else [])
    elif kind == pafs.FileType.NotFound:
        raise UsageError(f"INPUT {path!r} does not exist")
    else:
        root = p if kind == pafs.FileType.Directory else posixpath.dirname(p)
        files = _list(fs, p, None, input_format) if kind == pafs.FileType.Directory else [p]
    if exclude is not None:
        out = open_fs(exclude)[1].rstrip("/") + "/"
        files = [f for f in files if not f.startswith(out)]
    if not files:
        what = (f"{F.NAMES[input_format]} files" if input_format
                else "Parquet files (nor JSONL or CSV files)")
        raise UsageError(f"INPUT {path!r} holds no {what}")
    fmt = _one_format(path, files, input_format)
    unreadable = [f for f in files if "?" in posixpath.basename(f)]
    if unreadable:
        raise UsageError(f"INPUT file name(s) with '?' cannot be read by Ray Data (it takes '?' "
                         f"as the start of a URL query), e.g. {unreadable[:3]}; rename them")
    if fmt != "parquet":
        return _inspect_text(InputInfo(path, fs, root, files, None, None, format=fmt,
                                       text_columns=tuple(c for c in text_columns if c)))
    return _inspect_parquet(InputInfo(path, fs, root, files, None, None))


def _inspect_parquet(info: InputInfo) -> InputInfo:
    import pyarrow.parquet as pq

    fs, files, root = info.filesystem, info.files, info.root
    try:
        info.schema = pq.read_schema(files[0], filesystem=fs)
    except Exception as exc:
        raise UsageError(f"cannot read Parquet file {files[0]!r}: {exc}") from exc
    info.schemas = {info.schema: files[0]}
    if len(files) <= MAX_FOOTERS:
        footers = read_footers(fs, files, "Parquet file {!r}")
        info.file_rows = [ft.rows for ft in footers]
        info.num_rows = sum(info.file_rows)
        for f, ft in zip(files, footers):
            info.schemas.setdefault(ft.schema, f)
        info.fingerprints = [{"path": relative(root, f), "size": ft.size, "rows": ft.rows,
                              "footer": ft.digest} for f, ft in zip(files, footers)]
    return info


def _inspect_text(info: InputInfo) -> InputInfo:
    """Stream every JSONL/CSV file once (`formats.scan_text`): rows, schemas, fingerprints."""
    import pyarrow as pa

    scans = [F.scan_text(info.filesystem, f, info.format, info.text_columns) for f in info.files]
    info.file_rows = [s.rows for s in scans]
    info.num_rows = sum(info.file_rows)
    info.longest_line = max(s.longest_line for s in scans)
    info.schemas = {}
    for f, s in zip(info.files, scans):
        if s.rows:  # an empty JSONL file has no columns to check
            info.schemas.setdefault(s.schema, f)
    info.schema = next(iter(info.schemas), pa.schema([]))
    info.fingerprints = [{"path": relative(info.root, f), "size": s.size, "rows": s.rows,
                          "digest": s.digest} for f, s in zip(info.files, scans)]
    return info


_ID_TYPES = ("is_integer", "is_string", "is_large_string", "is_binary", "is_large_binary")


def _is(t, kinds) -> bool:
    import pyarrow as pa

    return any(getattr(pa.types, k)(t) for k in kinds)


RAY_COLUMNS = ("path", "row_hash")  # what Ray Data's read adds for derived ids and --resume


def check_input(info: InputInfo, config: JobConfig) -> None:
    """Columns exist in every file; text/target are strings; ids integers or strings, of one
    kind in every file (`info.id_type`: int64 for mixed integer widths, large_string for mixed
    string kinds)."""
    import pyarrow as pa

    if info.num_rows == 0 and not info.schemas:  # only empty JSONL files: nothing has columns
        names = S.input_columns(config, [])
        info.schema = pa.schema([(c, pa.string()) for c in names])
        info.schemas, info.id_type = {info.schema: info.files[0]}, pa.string()
        return
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
        for col in config.text_columns():
            t = schema.field(col).type
            if not S.is_text_type(t):
                raise UsageError(f"column {col!r} has type {t} in {where}; expected a string "
                                 "column (binary and dictionary-encoded strings are read as UTF-8)")
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


def read(config: JobConfig, info: InputInfo, pending=None):
    """Ray Data's read of the needed columns (`read_parquet`, or its JSON/CSV readers through
    `text_source`); derives ids when the input has none.

    `pending` (an `ids.rowset.Pending` from the id scan on --resume): only its files are read, and
    rows already in OUTPUT are dropped before anything else runs.
    """
    import ray

    names = info.schema.names
    derive = config.id_column not in names
    files = info.files if pending is None else pending.files
    located = derive or pending is not None
    columns = S.input_columns(config, names)
    if info.format == "parquet":
        ds = ray.data.read_parquet(files, filesystem=info.filesystem, columns=columns,
                                   include_paths=located, include_row_hash=located)
    else:
        from dsv4batch.pipeline.text_source import read_text

        ds = read_text(files, info, columns, located)
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
