"""Tokenize, id derivation, sink and input/output checks, called directly (no Ray cluster)."""

import json
import os
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dsv4batch.model.tokenizer import load_tokenizer
from dsv4batch.pipeline import output as O
from dsv4batch.pipeline import schema as S
from dsv4batch.pipeline.config import ScoreConfig, UsageError
from dsv4batch.pipeline.ids import DeriveIds, _mix, _seed, row_index
from dsv4batch.pipeline.read import check_input, inspect_input
from dsv4batch.pipeline.sink import ParquetPartSink
from dsv4batch.pipeline.tokenize import Tokenize


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False).ids


def test_tokenize_prompt_rows_in_order_with_errors(tok):
    cfg = ScoreConfig(max_model_len=12, keep_columns=("src",))
    long = "one two three four five six seven eight nine ten eleven twelve"
    batch = pa.table({"id": [5, 6, 7, 8], "prompt": ["Hello world", None, "", long],
                      "src": list("abcd"), "unused": [1, 2, 3, 4]})
    out = Tokenize(cfg)(batch)
    assert out.column_names == ["id", "src", S.INPUT_IDS, S.NUM_SCORED, S.NUM_TRUNCATED, S.ERROR]
    rows = out.to_pylist()
    assert [r["id"] for r in rows] == [5, 6, 7, 8] and [r["src"] for r in rows] == list("abcd")
    assert rows[0][S.INPUT_IDS] == [0, *enc(tok, "Hello world")]
    assert rows[0][S.NUM_SCORED] == len(enc(tok, "Hello world")) and rows[0]["error"] is None
    assert rows[1]["error"] == "null text" and rows[1][S.INPUT_IDS] == []
    assert rows[2] == {"id": 7, "src": "c", S.INPUT_IDS: [0], S.NUM_SCORED: 0,
                       S.NUM_TRUNCATED: 0, "error": None}
    assert rows[3]["error"].startswith("too long:") and rows[3][S.INPUT_IDS] == []


def test_tokenize_target_scores_only_target_and_renames_id(tok):
    cfg = ScoreConfig(target_column="answer", id_column="key")
    batch = pa.table({"key": ["a", "b"], "prompt": ["The capital of France is", "x"],
                      "answer": [" Paris", None]})
    rows = Tokenize(cfg)(batch).to_pylist()
    p, t = enc(tok, "The capital of France is"), enc(tok, " Paris")
    assert rows[0]["id"] == "a" and rows[0][S.INPUT_IDS] == [0, *p, *t]
    assert rows[0][S.NUM_SCORED] == len(t)
    assert rows[1]["error"] == "null target"


@pytest.mark.parametrize("side, ids, scored, truncated", [
    ("left", lambda p, t: [0, *(p + t)[-7:]], 3, 2),  # keeps the end: the whole target
    ("right", lambda p, t: [0, *(p + t)[:7]], 1, 2),  # keeps the start: the target's first token
])
def test_tokenize_truncate_with_target(tok, side, ids, scored, truncated):
    p, t = enc(tok, "one two three four five six"), enc(tok, " seven eight nine")
    assert (len(p), len(t)) == (6, 3)
    cfg = ScoreConfig(target_column="answer", max_model_len=8, truncate=side)
    batch = pa.table({"id": [1, 2], "prompt": ["one two three four five six", "one " * 20],
                      "answer": [" seven eight nine", " x"]})
    rows = Tokenize(cfg)(batch).to_pylist()
    assert rows[0][S.INPUT_IDS] == ids(p, t) and rows[0]["error"] is None
    assert rows[0][S.NUM_SCORED] == scored and rows[0][S.NUM_TRUNCATED] == truncated
    if side == "right":  # the prompt alone fills max_model_len: no target token would be scored
        assert rows[1]["error"].endswith("truncating right leaves no target token")
    else:
        assert rows[1][S.NUM_SCORED] == len(enc(tok, " x")) and rows[1]["error"] is None


def test_tokenize_binary_and_invalid_utf8_text(tok):
    raw = [b"caf\xe9 ok", None, b"\x00\x1b[1m bold", b"plain"]
    cfg = ScoreConfig()
    for col in (pa.array(raw, pa.binary()), pa.array(raw, pa.binary()).view(pa.string())):
        rows = Tokenize(cfg)(pa.table({"id": [1, 2, 3, 4], "prompt": col})).to_pylist()
        assert rows[0][S.INPUT_IDS] == [0, *enc(tok, "caf\ufffd ok")]  # U+FFFD for bad bytes
        assert rows[1]["error"] == "null text"
        assert rows[2][S.INPUT_IDS] == [0, *enc(tok, "\x00\x1b[1m bold")]
        assert rows[3][S.INPUT_IDS] == [0, *enc(tok, "plain")]


def test_row_hash_inversion_matches_ray():
    from ray.data._internal.datasource_v2.common.synthesized_columns import _compute_row_hashes

    path = "/data/in/part-00001.parquet"
    hashes = _compute_row_hashes(path, 1000, 50)
    assert row_index(path, hashes).tolist() == list(range(1000, 1050))
    seeds = np.uint64(_seed(path)) + np.arange(3, dtype=np.uint64)
    assert np.array_equal(_mix(seeds), _compute_row_hashes(path, 0, 3))
    assert (row_index("/another/file.parquet", hashes) == -1).all()


def test_derive_ids_relative_to_root_with_fallback():
    from ray.data._internal.datasource_v2.common.synthesized_columns import _compute_row_hashes

    a, b = "/data/in/x/a.parquet", "/data/in/b.parquet"
    hashes = np.concatenate([_compute_row_hashes(a, 0, 2), _compute_row_hashes(b, 7, 1),
                             np.array([123], np.uint64)])
    batch = pa.table({"prompt": list("pqrs"), "path": [a, a, b, b],
                      "row_hash": pa.array(hashes, pa.uint64())})
    out = DeriveIds("/data/in")(batch)
    assert out.column_names == ["prompt", "id"]
    assert out["id"].to_pylist() == ["x/a.parquet:0", "x/a.parquet:1", "b.parquet:7",
                                     "b.parquet#000000000000007b"]


def test_sink_writes_through_temp_names(tmp_path):
    schema = S.output_schema(pa.int64(), False)
    def block(ids, err=None):
        n = len(ids)
        return pa.table({"id": ids, "num_tokens": pa.array([3] * n, pa.int32()),
                         "num_scored_tokens": pa.array([2] * n, pa.int32()),
                         "logprob_sum": [-1.0] * n, "logprob_mean": [-0.5] * n,
                         "perplexity": [1.6] * n, "error": pa.array([err] * n, pa.string())},
                        schema=schema)
    sink = ParquetPartSink(str(tmp_path / "out"), run_id="r1")
    sink.on_write_start()
    r0 = sink.write([block([1, 2]), block([], None), block([3], "boom")], SimpleNamespace(task_idx=0))
    r1 = sink.write([block([])], SimpleNamespace(task_idx=1))
    assert r0 == {"file": "part-r1-000000.parquet", "rows": 3, "rows_errored": 1,
                  "input_tokens": 9, "scored_tokens": 6}
    assert r1["file"] is None and r1["rows"] == 0
    sink.on_write_complete(SimpleNamespace(write_returns=[r0, r1]))
    assert sink.result["rows"] == 3 and sink.result["files"] == ["part-r1-000000.parquet"]
    assert os.listdir(tmp_path / "out") == ["part-r1-000000.parquet"]
    assert pq.read_table(tmp_path / "out").schema.equals(schema)

    class Broken:  # a failing block stream leaves no file behind, temporary or final
        def __iter__(self):
            yield block([4])
            raise RuntimeError("actor died")
    with pytest.raises(RuntimeError):
        sink.write(Broken(), SimpleNamespace(task_idx=2))
    assert os.listdir(tmp_path / "out") == ["part-r1-000000.parquet"]


def test_prepare_output_refuses_to_mix_runs(tmp_path):
    out = tmp_path / "out"
    O.prepare_output(str(out), overwrite=False)  # creates it
    (out / "part-a-000000.parquet").write_bytes(b"x")
    O.write_json(str(out), O.METRICS, {"rows": 1})
    assert json.loads((out / O.METRICS).read_text()) == {"rows": 1}
    with pytest.raises(UsageError, match="not empty"):
        O.prepare_output(str(out), overwrite=False)
    O.prepare_output(str(out), overwrite=True)
    assert os.listdir(out) == []
    (out / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="did not write"):
        O.prepare_output(str(out), overwrite=True)
    with pytest.raises(UsageError, match="is a file"):
        O.prepare_output(str(out / "notes.txt"), overwrite=True)


def test_inspect_and_check_input(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        inspect_input(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="no Parquet"):
        inspect_input(str(tmp_path / "empty"))
    d = tmp_path / "in"
    (d / "sub").mkdir(parents=True)
    pq.write_table(pa.table({"prompt": ["a", "b"], "n": [1, 2]}), d / "a.parquet")
    pq.write_table(pa.table({"prompt": ["c"], "n": [3]}), d / "sub" / "b.parquet")
    (d / "_tmp-x.parquet").write_bytes(b"junk")  # hidden: ignored
    info = inspect_input(str(d))
    assert info.num_rows == 3 and len(info.files) == 2 and info.root == str(d)
    assert inspect_input(str(d / "*.parquet")).files == [str(d / "a.parquet")]
    assert len(inspect_input(str(d / "**" / "*.parquet")).files) == 2
    assert inspect_input(str(d / "a.parquet")).num_rows == 2
    check_input(info, ScoreConfig())  # no id column: ids are derived
    with pytest.raises(UsageError, match=r"\['answer'\] not in .*available columns: \['n', 'prompt'\]"):
        check_input(info, ScoreConfig(target_column="answer"))
    with pytest.raises(UsageError, match="has type int64"):
        check_input(info, ScoreConfig(text_column="n"))
    with pytest.raises(UsageError, match="key"):
        check_input(info, ScoreConfig(id_column="key"))
