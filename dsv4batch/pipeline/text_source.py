"""Ray Data's JSON and CSV readers, with the `row_hash` column Ray gives only Parquet rows.

Derived ids (`<file>:<row>`) and `--resume` locate a row by its file (`path`, from
`include_paths`) and its position in the file, which `read_parquet(include_row_hash=True)`
encodes as `row_hash` and Ray's other readers do not provide. Ray reads each file whole in one
read task, in order, so the datasources below (Ray's own `ArrowJSONDatasource` and
`CSVDatasource`, reading as they do) count the rows of each file as its blocks come out and
append the same hash Ray computes for Parquet (`ids.hashing.row_hash`). A retried read replays
a file from its start, so the positions are the same on every attempt.

They read text as the driver's scan does (`formats`' invalid-text rule): a CSV's text columns
are decoded as each block comes out (`schema.utf8_columns`), a JSONL file's raw NUL bytes are
escaped before pyarrow parses it (`formats.escape_nul`).
"""

from __future__ import annotations

from ray.data._internal.datasource.csv_datasource import CSVDatasource
from ray.data._internal.datasource.json_datasource import ArrowJSONDatasource
from ray.data.datasource import FileBasedDatasource

from dsv4batch.jobspec.schema import utf8_columns
from dsv4batch.pipeline import formats as F
from dsv4batch.pipeline.ids.hashing import row_hash


class _Positions:
    """Mixin for a `FileBasedDatasource`: `row_hash` on every block when `located`."""

    located = False

    def _read_stream(self, f, path: str):
        import pyarrow as pa

        start = 0
        for block in super()._read_stream(f, path):
            n = block.num_rows
            if self.located:
                block = block.append_column("row_hash", pa.array(row_hash(path, start, n)))
            start += n
            yield block


class _NulEscaped:
    """A file whose `read_buffer` (all Ray's JSON reader calls) returns its bytes with raw NUL
    bytes escaped (`formats.escape_nul`); the file itself is left as it is."""

    def __init__(self, f):
        self.f = f

    def read_buffer(self):
        import numpy as np
        import pyarrow as pa

        buffer = self.f.read_buffer()
        if buffer.size and np.frombuffer(buffer, np.uint8).min() == 0:  # a NUL byte: escape them
            return pa.py_buffer(F.escape_nul(buffer.to_pybytes()))
        return buffer


class _EscapedJSON:
    """Mixin for Ray's JSON datasource: parse the file with raw NUL bytes escaped."""

    def _read_stream(self, f, path: str):
        yield from super()._read_stream(_NulEscaped(f), path)


class _DecodedText:
    """Mixin for Ray's CSV datasource: `text_columns` decoded in every block (`schema.utf8_columns`)."""

    text_columns: tuple = ()

    def _read_stream(self, f, path: str):
        for block in super()._read_stream(f, path):
            yield utf8_columns(block, self.text_columns)


class JSONLSource(_Positions, _EscapedJSON, ArrowJSONDatasource):
    """`ray.data.read_json`'s pyarrow reader (one JSON object per line) + `row_hash`."""


class CSVSource(_Positions, _DecodedText, CSVDatasource):
    """`ray.data.read_csv`'s reader + `row_hash`."""


class _RequestLines(FileBasedDatasource):
    """An OpenAI batch file's request lines as rows (`openai_batch.tables`)."""

    def _read_stream(self, f, path: str):
        from dsv4batch.pipeline.openai_batch import tables

        yield from tables(f, path)


class OpenAIBatchSource(_Positions, _RequestLines):
    """`_RequestLines` + `row_hash`."""


def read_text(files: list[str], info, columns: list[str], located: bool):
    """A Ray dataset of `columns` of JSONL/CSV `files` (an `InputInfo`'s format and options),
    plus `path` and `row_hash` when `located`."""
    import ray

    common = dict(filesystem=info.filesystem, include_paths=located, file_extensions=None,
                  partitioning=None)
    if info.format == "json":
        source = JSONLSource(files, arrow_json_args={
            "read_options": F.json_read_options(info.longest_line)}, **common)
    elif info.format == "openai-batch":
        source = OpenAIBatchSource(files, **common)
    else:
        source = CSVSource(files, arrow_csv_args=F.csv_options(info.text_columns, columns),
                           **common)
        source.text_columns = info.text_columns
    source.located = located
    ds = ray.data.read_datasource(source)
    return ds.select_columns([*columns, *(["path", "row_hash"] if located else [])])
