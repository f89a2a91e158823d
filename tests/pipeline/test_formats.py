"""JSONL and CSV inputs: format detection, the driver's streamed check (rows, schema, digest,
the malformed line named), and Ray Data's read with the same row positions as Parquet's."""

import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from dsv4batch.jobspec.config import ScoreConfig
from dsv4batch.jobspec.errors import UsageError
from dsv4batch.pipeline import formats as F
from dsv4batch.pipeline.ids.hashing import row_hash, row_index
from dsv4batch.pipeline.read import check_input, inspect_input, read

FS = pafs.LocalFileSystem()
ROWS = [{"id": i, "prompt": f"line {i}, \"quoted\"\nand a second line" if i % 3 == 0 else f"p{i}",
         "n": i * 10} for i in range(12)]


def write_jsonl(path, rows, blank_every: int = 0):
    lines = []
    for i, r in enumerate(rows):
        lines.append(json.dumps(r))
        if blank_every and i % blank_every == 0:
            lines.append("   ")
    path.write_text("\n".join(lines) + "\n")


def write_csv(path, rows):
    import pyarrow.csv as pacsv

    pacsv.write_csv(pa.Table.from_pylist(rows), path)


def test_format_of_and_csv_options():
    assert [F.format_of(p) for p in ("a.parquet", "b.JSONL", "c.json", "d.csv", "e.txt")] == \
        ["parquet", "json", "json", "csv", None]
    assert F.format_of("e.txt", "csv") == "csv"
    opts = F.csv_options(("prompt", None), ["id", "prompt"])
    # read as bytes: invalid UTF-8 is decoded by one rule in every format (schema.utf8_text)
    assert opts["convert_options"].column_types == {"prompt": pa.binary()}
    assert opts["convert_options"].include_columns == ["id", "prompt"]
    assert not opts["read_options"].use_threads and opts["parse_options"].newlines_in_values


def test_scan_counts_rows_and_names_the_malformed_line(tmp_path):
    good = tmp_path / "good.jsonl"
    write_jsonl(good, ROWS, blank_every=4)  # blank lines are skipped, not rows
    scan = F.scan_text(FS, str(good), "json")
    assert scan.rows == 12 and scan.schema.names == ["id", "prompt", "n"]
    assert scan.size == good.stat().st_size and len(scan.digest) == 32
    assert scan.longest_line == max(len(line) for line in good.read_bytes().split(b"\n"))
    bad = tmp_path / "bad.jsonl"
    lines = good.read_text().split("\n")
    lines[6] = '{"id": 99, "prompt": "unterminated}'
    bad.write_text("\n".join(lines))
    with pytest.raises(UsageError, match=rf"malformed JSONL file '{bad}', line 7: JSON parse"):
        F.scan_text(FS, str(bad), "json")
    csv = tmp_path / "in.csv"
    write_csv(csv, ROWS)
    scan = F.scan_text(FS, str(csv), "csv", ("prompt",))
    assert scan.rows == 12 and scan.schema.field("id").type == pa.int64()
    text = csv.read_text().split("\n")
    bad_line = next(i for i, t in enumerate(text) if t.startswith("8,"))  # after multi-line rows
    text[bad_line] = "8,one,two,three"
    csv.write_text("\n".join(text))
    with pytest.raises(UsageError, match=rf"malformed CSV file '{csv}', line {bad_line + 1}: "
                                         r"CSV parse error: Expected 3 columns, got 4"):
        F.scan_text(FS, str(csv), "csv", ("prompt",))


def test_a_type_change_between_chunks_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(F, "CHUNK_BYTES", 64)
    path = tmp_path / "ids.jsonl"
    write_jsonl(path, [{"id": i, "prompt": "x"} for i in range(20)] + [{"id": "s", "prompt": "y"}])
    with pytest.raises(UsageError, match=r"JSONL file .* a column changes type from line 2[01] on"):
        F.scan_text(FS, str(path), "json")
    write_jsonl(path, [{"id": i, "prompt": None} for i in range(20)] + [{"id": 1.5, "prompt": "y"}])
    scan = F.scan_text(FS, str(path), "json")  # null -> string and int -> double promote
    assert scan.rows == 21 and scan.schema.field("prompt").type == pa.string()
    assert scan.schema.field("id").type == pa.float64()


def test_inspect_input_by_extension_or_flag(tmp_path):
    d = tmp_path / "in"
    (d / "sub").mkdir(parents=True)
    write_jsonl(d / "a.jsonl", ROWS[:5])
    write_jsonl(d / "sub" / "b.json", ROWS[5:])
    info = inspect_input(str(d))
    assert info.format == "json" and info.num_rows == 12 and info.file_rows == [5, 7]
    assert [f["path"] for f in info.fingerprints] == ["a.jsonl", "sub/b.json"]
    assert set(info.fingerprints[0]) == {"path", "size", "rows", "digest"}
    check_input(info, ScoreConfig(keep_columns=("n",)))
    assert info.id_type == pa.int64()
    pq.write_table(pa.Table.from_pylist(ROWS), d / "c.parquet")
    with pytest.raises(UsageError, match=r"mixes formats: JSONL .* Parquet .*--input-format"):
        inspect_input(str(d))
    assert inspect_input(str(d), input_format="parquet").files == [str(d / "c.parquet")]
    assert inspect_input(str(d), input_format="json").num_rows == 12
    (tmp_path / "rows.txt").write_text((d / "a.jsonl").read_text())
    with pytest.raises(UsageError, match="cannot tell the format .*rows.txt"):
        inspect_input(str(tmp_path / "rows.txt"))
    assert inspect_input(str(tmp_path / "rows.txt"), input_format="json").num_rows == 5
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="holds no CSV files"):
        inspect_input(str(tmp_path / "empty"), input_format="csv")
    (tmp_path / "empty" / "e.jsonl").write_text("")
    info = inspect_input(str(tmp_path / "empty"))
    check_input(info, ScoreConfig())  # an empty JSONL file has no columns and nothing to check
    assert info.num_rows == 0 and info.schema.names == ["prompt"]


def test_row_hash_is_parquets_and_inverts():
    hashes = row_hash("/data/x.jsonl", 5, 4)
    assert hashes.dtype == np.uint64
    assert row_index("/data/x.jsonl", hashes).tolist() == [5, 6, 7, 8]


@pytest.mark.usefixtures("local_ray")
@pytest.mark.parametrize("fmt", ["json", "csv"])
def test_ray_read_gives_the_rows_and_derived_ids_parquet_gives(tmp_path, fmt):
    rows = [{k: v for k, v in r.items() if k != "id"} for r in ROWS]
    pdir, tdir = tmp_path / "p", tmp_path / "t"
    pdir.mkdir()
    tdir.mkdir()
    pq.write_table(pa.Table.from_pylist(rows[:7]), pdir / "a.parquet", row_group_size=3)
    pq.write_table(pa.Table.from_pylist(rows[7:]), pdir / "b.parquet")
    ext = {"json": "jsonl", "csv": "csv"}[fmt]
    writer = write_jsonl if fmt == "json" else write_csv
    writer(tdir / f"a.{ext}", rows[:7])
    writer(tdir / f"b.{ext}", rows[7:])
    config = ScoreConfig(keep_columns=("n",))
    got = {}
    for d in (pdir, tdir):
        info = inspect_input(str(d), text_columns=("prompt",))
        check_input(info, config)
        table = pa.concat_tables(read(config, info).iter_batches(batch_format="pyarrow"))
        got[d] = sorted((re.sub(r"\.\w+:", ":", r["id"]), r["prompt"], r["n"])
                        for r in table.to_pylist())
    assert got[tdir] == got[pdir]  # same ids '<file>:<row>' (extension aside), text, values
    assert ("a:0", rows[0]["prompt"], 0) in got[pdir] and len(got[pdir]) == 12
    assert ("b:4", rows[11]["prompt"], 110) in got[tdir]


@pytest.mark.usefixtures("local_ray")
def test_resume_drops_written_rows_of_a_jsonl_file(tmp_path):
    from dsv4batch.pipeline.ids.rowset import RowBitmap

    path = tmp_path / "in.jsonl"
    write_jsonl(path, ROWS)
    config = ScoreConfig(keep_columns=("n",))
    info = inspect_input(str(path))
    check_input(info, config)
    written = RowBitmap(info.files, info.file_rows)
    written.add(np.array([0, 3, 11]))  # file 0, rows 0, 3 and 11 are in OUTPUT already
    table = pa.concat_tables(read(config, info, written.pending()).iter_batches(
        batch_format="pyarrow"))
    assert sorted(table["id"].to_pylist()) == sorted(set(range(12)) - {0, 3, 11})
