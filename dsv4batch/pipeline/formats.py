"""Input formats of `dsv4batch score`: Parquet, JSONL and CSV, by extension or `--input-format`.

- parquet (`.parquet`, `.pq`, `.parq`): read by `ray.data.read_parquet`.
- json (`.jsonl`, `.json`): one JSON object per line; blank lines are skipped (pyarrow's JSON
  reader, which Ray Data's `read_json` uses). A file that is one JSON array is not JSONL.
- csv (`.csv`): a header row, then one record per row; quoted values may hold newlines. The
  text and target columns are read as strings; other columns get the types pyarrow infers from
  the file's first block (an id column of integers is int64).

For JSONL and CSV the driver streams every file once before Ray starts (`scan_text`), with the
same pyarrow readers and options Ray Data's read uses: it counts the rows (what `<file>:<row>`
ids and `--resume` need: there are no footers), unifies the schema, digests the content (the
fingerprint `--resume` compares) and turns the first malformed line into a `UsageError` naming
the file and line. It holds one chunk of a file at a time, never the whole file. pyarrow only
(no Ray, no torch).

Invalid text, the same in every format (`schema.utf8_text`): in the text, target and
conversation columns invalid UTF-8 is decoded as U+FFFD and NUL is a character like any other,
never an error. Parquet and JSONL hand their strings over as stored and the tokenize step
decodes them; a CSV's text columns are read as bytes (pyarrow's CSV reader refuses invalid
UTF-8 in a string column) and decoded as each block is read (`schema.utf8_columns`), so they are strings
from the read on; a raw NUL byte inside a JSONL string (which JSON wants escaped) is read as the
escape \u0000 (`escape_nul`), as it already is in CSV and Parquet.
"""

from __future__ import annotations

import hashlib
import io
import re
from typing import Any, Iterator, NamedTuple

import numpy as np

from dsv4batch.jobspec.config_base import FORMATS
from dsv4batch.jobspec.errors import UsageError
from dsv4batch.jobspec.schema import utf8_columns

NAMES = {"parquet": "Parquet", "json": "JSONL", "csv": "CSV", "openai-batch": "OpenAI batch"}
CHUNK_BYTES = 8 << 20  # JSONL: whole lines parsed per pyarrow call (what the driver holds)
CSV_BLOCK_BYTES = 1 << 20  # CSV: pyarrow's read block (types are inferred from the first one)
JSON_BLOCK_BYTES = 1 << 20  # JSONL: Ray's read block, raised to fit the longest line
_JSON_ROW = re.compile(r"\s*in row (\d+)\s*$")
_CSV_ROW = re.compile(r"Row #(\d+): ?")


def format_of(path: str, given: str | None = None) -> str | None:
    """'parquet', 'json' or 'csv' for `path` (`given`, else by extension); None if unknown."""
    if given:
        return given
    name = path.lower()
    return next((f for f, exts in FORMATS.items() if name.endswith(exts)), None)


class TextFile(NamedTuple):
    """What `scan_text` found in one JSONL or CSV file."""

    rows: int
    schema: Any  # pyarrow.Schema, unified over the file's chunks
    size: int  # bytes
    digest: str  # blake2b of the content: the fingerprint --resume compares
    longest_line: int  # bytes of the longest line (Ray's JSON read block must hold one)


def csv_options(text_columns=(), columns=None) -> dict:
    """pyarrow.csv.open_csv's options, the same in `scan_text`, the id scan and Ray's read:
    serial reads of 1 MiB blocks (type inference and `Row #N` in errors depend on both),
    newlines allowed in quoted values, `text_columns` as bytes (`schema.utf8_columns` makes them
    strings), only `columns` when given."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    convert = pacsv.ConvertOptions(column_types={c: pa.binary() for c in text_columns if c},
                                   include_columns=list(columns) if columns else None)
    return {"read_options": pacsv.ReadOptions(use_threads=False, block_size=CSV_BLOCK_BYTES),
            "parse_options": pacsv.ParseOptions(newlines_in_values=True),
            "convert_options": convert}


def escape_nul(data: bytes) -> bytes:
    """JSONL bytes with every raw NUL byte written as the JSON escape \\u0000: inside a string it
    is then the NUL character (JSON forbids it raw); anywhere else the line stays malformed."""
    return data.replace(b"\x00", b"\\u0000") if b"\x00" in data else data


def json_read_options(longest_line: int = 0):
    """pyarrow.json.ReadOptions for Ray's read: serial, blocks that hold the longest line."""
    import pyarrow.json as pajson

    return pajson.ReadOptions(use_threads=False,
                              block_size=max(JSON_BLOCK_BYTES, 2 * (longest_line + 1)))


class _Digest(io.RawIOBase):
    """A pyarrow input stream as a Python raw stream that digests and counts the bytes read
    through it, and measures the longest line."""

    def __init__(self, stream):
        self.stream, self.hash, self.size, self.longest = stream, hashlib.blake2b(digest_size=16), 0, 0
        self._line = 0  # bytes of the line in progress

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.stream.read(len(buffer))
        n = len(data)
        buffer[:n] = data
        self.hash.update(data)
        self.size += n
        ends = np.flatnonzero(np.frombuffer(data, np.uint8) == 10)
        if len(ends):
            starts = np.concatenate([[0], ends[:-1] + 1])
            widths = ends - starts
            widths[0] += self._line
            self.longest = max(self.longest, int(widths.max()))
            self._line = n - int(ends[-1]) - 1
        else:
            self._line += n
        self.longest = max(self.longest, self._line)
        return n


def _json_chunks(stream) -> Iterator[tuple[bytes, int]]:
    """(whole lines of about CHUNK_BYTES, the number of their first line), streamed."""
    rest, line = b"", 1
    while True:
        data = stream.read(CHUNK_BYTES)
        if not data:
            break
        buf = rest + data
        cut = buf.rfind(b"\n") + 1
        if cut == 0:  # one line longer than a chunk: read on
            rest = buf
            continue
        yield buf[:cut], line
        line += buf.count(b"\n", 0, cut)
        rest = buf[cut:]
    if rest:
        yield rest, line


def _json_line(chunk: bytes, first: int, row: int) -> int:
    """The line number of the `row`-th (0-based) non-blank line of `chunk`."""
    seen = -1
    for i, text in enumerate(chunk.split(b"\n")):
        if text.strip():
            seen += 1
            if seen == row:
                return first + i
    return first


def _json_tables(stream, path: str, columns=None) -> Iterator[Any]:
    """pyarrow tables of a JSONL stream, one per chunk of lines; malformed -> `UsageError`."""
    import pyarrow as pa
    import pyarrow.json as pajson

    for chunk, first in _json_chunks(stream):
        if not chunk.strip():
            continue
        chunk = escape_nul(chunk)
        try:
            table = pajson.read_json(pa.BufferReader(chunk), read_options=pajson.ReadOptions(
                use_threads=False, block_size=len(chunk) + 1))
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            msg = str(exc)
            m = _JSON_ROW.search(msg)
            last = first + chunk.count(b"\n")
            where = f"line {_json_line(chunk, first, int(m.group(1)))}" if m else \
                f"lines {first}-{last}"
            raise UsageError(f"malformed JSONL file {path!r}, {where}: "
                             f"{_JSON_ROW.sub('', msg)} (one JSON object per line)") from exc
        if columns is not None:
            table = table.select([c for c in columns if c in table.column_names])
        yield table, first


def _csv_line(open_stream, record: int) -> int | None:
    """The physical line where CSV record `record` (1-based, header included, blank lines not
    counted: pyarrow's `Row #N`) starts; None when the file has fewer records."""
    import csv

    with open_stream() as raw:
        text = io.TextIOWrapper(io.BufferedReader(_Digest(raw)), encoding="utf-8",
                                errors="replace", newline="")
        reader, n, start = csv.reader(text), 0, 1
        try:
            for values in reader:
                if values:
                    n += 1
                    if n == record:
                        return start
                start = reader.line_num + 1
        except csv.Error:
            return start if n + 1 == record else None
    return None


def _csv_tables(stream, path: str, open_stream, text_columns=(), columns=None):
    """pyarrow tables of a CSV stream, one per read block; malformed -> `UsageError`."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    try:
        reader = pacsv.open_csv(stream, **csv_options(text_columns, columns))
        for batch in reader:
            yield utf8_columns(pa.Table.from_batches([batch]), text_columns), None
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        msg = str(exc)
        m = _CSV_ROW.search(msg)
        line = _csv_line(open_stream, int(m.group(1))) if m else None
        where = f", line {line}" if line else (f", record {m.group(1)}" if m else "")
        hint = (" (a CSV column's type is inferred from the file's first MiB)"
                if "conversion error" in msg else "")
        raise UsageError(f"malformed CSV file {path!r}{where}: {_CSV_ROW.sub('', msg)}{hint}"
                         ) from exc


def iter_tables(fs, path: str, fmt: str, text_columns=(), columns=None) -> Iterator[Any]:
    """A JSONL or CSV file's rows as pyarrow tables in file order (only `columns` when given),
    streamed; a malformed line is a `UsageError` naming file and line."""
    with fs.open_input_stream(path) as raw:
        yield from (t for t, _ in _tables(raw, fs, path, fmt, text_columns, columns))


def _tables(stream, fs, path, fmt, text_columns, columns):
    if fmt == "json":
        return _json_tables(stream, path, columns)
    if fmt == "openai-batch":
        from dsv4batch.pipeline.openai_batch import tables

        return ((t.select(columns) if columns else t, None) for t in tables(stream, path))
    return _csv_tables(stream, path, lambda: fs.open_input_stream(path), text_columns, columns)


def scan_text(fs, path: str, fmt: str, text_columns=()) -> TextFile:
    """Stream one JSONL or CSV file: rows, unified schema, size, digest, longest line."""
    import pyarrow as pa

    rows, schema = 0, None
    try:
        raw = fs.open_input_stream(path)
    except Exception as exc:
        raise UsageError(f"cannot read {NAMES[fmt]} file {path!r}: {exc}") from exc
    with raw:
        stream = _Digest(raw)
        for table, first in _tables(stream, fs, path, fmt, text_columns, None):
            rows += table.num_rows
            if schema is None:
                schema = table.schema
                continue
            try:
                schema = pa.unify_schemas([schema, table.schema], promote_options="permissive")
            except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
                raise UsageError(f"{NAMES[fmt]} file {path!r}: a column changes type "
                                 f"from line {first} on ({exc}); give each column one type"
                                 ) from exc
        while stream.read(1 << 20):  # CSV: digest what the reader left unread (nothing, usually)
            pass
    return TextFile(rows, schema if schema is not None else pa.schema([]), stream.size,
                    stream.hash.hexdigest(), stream.longest)
