"""`dsv4batch score` on JSONL and CSV inputs: the same scores as the same rows in Parquet,
derived ids and --resume on them, and a malformed line refused (exit 2) before scoring."""

import json
import os

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from dsv4batch.jobs.score import main
from tests.jobs.conftest import FAST, SMALL_PARTS, TEXTS, finished, nothing_scored

pytestmark = pytest.mark.usefixtures("local_ray")  # one local Ray for this module

ROWS = [{"id": 100 + i, "prompt": t, "src": f"s{i}"} for i, t in enumerate(TEXTS)]
ROWS[1]["prompt"] = 'He said "two\nlines", then, a comma.'  # quoting and a newline in a value


def write(path, rows, fmt):
    if fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif fmt == "json":
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    else:
        pacsv.write_csv(pa.Table.from_pylist(rows), path)


def score(capsys, *argv):
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


COLUMNS = ["logprob_sum", "num_tokens", "num_scored_tokens", "is_greedy", "error", "src"]


@pytest.fixture(scope="module")
def parquet_scores(tmp_path_factory, checkpoint):
    tmp = tmp_path_factory.mktemp("pq")
    write(tmp / "in.parquet", ROWS, "parquet")
    assert main([str(tmp / "in.parquet"), str(tmp / "out"), "--model", checkpoint,
                 "--keep-columns", "src", *FAST]) == 0
    rows, _ = finished(tmp / "out", [r["id"] for r in ROWS])
    return rows


@pytest.mark.parametrize("fmt, name", [("json", "in.jsonl"), ("json", "in.json"),
                                       ("csv", "in.csv")])
def test_text_formats_score_like_parquet(tmp_path, checkpoint, parquet_scores, fmt, name):
    src = tmp_path / name
    write(src, ROWS, fmt)
    out = tmp_path / "out"
    assert main([str(src), str(out), "--model", checkpoint, "--keep-columns", "src", *FAST]) == 0
    rows, _ = finished(out, [r["id"] for r in ROWS])
    for i, r in rows.items():
        ref = parquet_scores[i]
        if fmt == "csv" and ref["error"] == "null text":  # CSV has no null: an empty value
            assert r["error"] is None and r["num_scored_tokens"] == 0
            continue
        assert {c: r[c] for c in COLUMNS} == pytest.approx({c: ref[c] for c in COLUMNS})


def test_derived_ids_and_resume_on_jsonl(tmp_path, checkpoint, capsys):
    src, out = tmp_path / "in", tmp_path / "out"
    (src / "sub").mkdir(parents=True)
    rows = [{"prompt": f"row {i} of the input, with some words"} for i in range(20)]
    write(src / "a.jsonl", rows[:12], "json")
    write(src / "sub" / "b.jsonl", rows[12:], "json")
    ids = [f"a.jsonl:{i}" for i in range(12)] + [f"sub/b.jsonl:{i}" for i in range(8)]
    args = [src, out, "--model", checkpoint, *SMALL_PARTS]
    assert score(capsys, *args)[0] == 0
    first, _ = finished(out, ids)
    parts = sorted(n for n in os.listdir(out) if n.startswith("part-"))
    assert len(parts) >= 2
    os.remove(out / parts[0])  # as if the job had been killed before that part
    code, err = score(capsys, *args, "--resume")
    assert code == 0, err
    again, _ = finished(out, ids)
    assert {i: r["logprob_sum"] for i, r in again.items()} == \
        pytest.approx({i: r["logprob_sum"] for i, r in first.items()})
    lines = (src / "a.jsonl").read_text().splitlines()
    (src / "a.jsonl").write_text("\n".join(lines[1:]) + "\n")  # rows move: derived ids would lie
    code, err = score(capsys, *args, "--resume")
    assert code == 2 and "changed since the first run (['a.jsonl'])" in err
    code, err = score(capsys, *args, "--resume", "--top-logprobs", "3")
    assert code == 2 and "top_logprobs 0 -> 3" in err


@pytest.mark.parametrize("fmt, name, bad, message", [
    ("json", "in.jsonl", '{"id": 7, "prompt": "no end}', "JSON parse error"),
    ("csv", "in.csv", '7,"unbalanced,x', "CSV parse error"),
    ("csv", "in.csv", "7,a,b,c,d", "Expected 3 columns, got 5"),
])
def test_a_malformed_line_is_named_before_scoring(tmp_path, checkpoint, capsys, fmt, name, bad,
                                                  message):
    d = tmp_path / "in"
    d.mkdir()
    write(d / "good.jsonl" if fmt == "json" else d / "good.csv", ROWS[:3], fmt)
    src = d / name
    write(src, ROWS[:5], fmt)
    text = src.read_text().split("\n")
    # the row of id 102: JSONL line 3; in the CSV line 5 (header, and row 101 spans two lines)
    index = next(i for i, t in enumerate(text) if t.startswith(("102,", '{"id": 102')))
    text[index] = bad
    src.write_text("\n".join(text))
    out = tmp_path / "out"
    code, err = score(capsys, d, out, "--model", checkpoint, *FAST)
    assert code == 2, err
    assert index + 1 == (3 if fmt == "json" else 5)
    assert f"malformed {'JSONL' if fmt == 'json' else 'CSV'} file '{src}', line {index + 1}:" in err
    assert message in err
    nothing_scored(out)
    assert not out.exists()  # refused before OUTPUT was touched


def test_input_format_flag_and_mixed_folders(tmp_path, checkpoint, capsys):
    d = tmp_path / "in"
    d.mkdir()
    write(d / "a.parquet", ROWS[:4], "parquet")
    write(d / "b.jsonl", ROWS[4:], "json")
    code, err = score(capsys, d, tmp_path / "out", "--model", checkpoint, *FAST)
    assert code == 2 and "mixes formats" in err and "--input-format" in err
    code, err = score(capsys, d, tmp_path / "out", "--model", checkpoint, "--input-format", "json",
                      "--keep-columns", "src", *FAST)
    assert code == 0, err
    finished(tmp_path / "out", [r["id"] for r in ROWS[4:]])
    (tmp_path / "rows.txt").write_text((d / "b.jsonl").read_text())
    code, err = score(capsys, tmp_path / "rows.txt", tmp_path / "out2", "--model", checkpoint,
                      *FAST)
    assert code == 2 and "cannot tell the format" in err
