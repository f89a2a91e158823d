"""Every bad input gets a clear answer (issue 5 (a)-(l)): refused before scoring with a message
that names the problem (exit 2), or answered per row with an `error`, never a crash. Each test
also checks the row invariant (rows in == rows scored + rows with an error, ids unique)."""

import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dsv4batch.jobs.score import main
from tests.jobs.conftest import SMALL_PARTS, finished, nothing_scored

CONTROL = "bell\x07 nul\x00 esc\x1b[31mred\x1b[0m rtl\u202eevil bom\ufeff\r\n\ttab"
LONG = "one two three four five six seven eight nine ten eleven twelve thirteen " * 3


def score(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def write(path, **columns) -> str:
    pq.write_table(pa.table(columns), path)
    return str(path)


# -- refused before anything is scored (exit 2, no Ray needed) -----------------------------

def test_a_input_missing_or_without_parquet(tmp_path, capsys):
    out = tmp_path / "out"
    code, err = score(capsys, tmp_path / "nope.parquet", out)
    assert code == 2 and f"INPUT '{tmp_path / 'nope.parquet'}' does not exist" in err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("not parquet")
    code, err = score(capsys, tmp_path / "empty", out)
    assert code == 2 and f"INPUT '{tmp_path / 'empty'}' holds no Parquet files" in err
    code, err = score(capsys, tmp_path / "empty" / "*.parquet", out)
    assert code == 2 and "holds no Parquet files" in err
    assert not out.exists()  # nothing written, not even _job.json


@pytest.mark.parametrize("flags, missing", [
    ([], "prompt"),
    (["--text-column", "text", "--target-column", "answer"], "answer"),
    (["--text-column", "text", "--id-column", "key"], "key"),
])
def test_b_missing_column_lists_the_available_ones(tmp_path, capsys, flags, missing):
    src = write(tmp_path / "in.parquet", id=[1, 2], text=["a", "b"], label=["x", "y"])
    code, err = score(capsys, src, tmp_path / "out", *flags)
    assert code == 2
    assert f"['{missing}'] not in the input" in err
    assert "available columns: ['id', 'label', 'text']" in err
    nothing_scored(tmp_path / "out")


def test_c_wrong_column_types(tmp_path, capsys):
    src = write(tmp_path / "in.parquet", id=[1, 2], prompt=[3, 4], answer=[5, 6],
                key=pa.array([[1], [2]]), ok=["a", "b"])
    code, err = score(capsys, src, tmp_path / "o1")
    assert code == 2 and "column 'prompt' has type int64" in err and "expected a string" in err
    code, err = score(capsys, src, tmp_path / "o2", "--text-column", "ok", "--target-column",
                      "answer")
    assert code == 2 and "column 'answer' has type int64" in err
    code, err = score(capsys, src, tmp_path / "o3", "--text-column", "ok", "--id-column", "key")
    assert code == 2 and "id column 'key' has type list<" in err
    assert "expected integers or strings" in err
    # a second file whose schema disagrees is named, not discovered mid-run
    d = tmp_path / "mixed"
    d.mkdir()
    write(d / "a.parquet", id=[1], prompt=["fine"])
    write(d / "b.parquet", id=[2], prompt=[7])
    code, err = score(capsys, d, tmp_path / "o4")
    assert code == 2 and f"input file '{d / 'b.parquet'}'" in err and "has type int64" in err
    for o in ("o1", "o2", "o3", "o4"):
        nothing_scored(tmp_path / o)


def test_h_corrupt_parquet_file_is_named(tmp_path, capsys):
    d = tmp_path / "in"
    d.mkdir()
    write(d / "good.parquet", id=[1, 2], prompt=["a", "b"])
    data = (d / "good.parquet").read_bytes()
    (d / "bad.parquet").write_bytes(data[: len(data) // 2])  # cut short: no footer
    code, err = score(capsys, d, tmp_path / "out")
    assert code == 2 and f"cannot read Parquet file '{d / 'bad.parquet'}'" in err
    nothing_scored(tmp_path / "out")


def copy_checkpoint(src, dst, edit_state=None, edit_config=None) -> str:
    from safetensors.torch import load_file, save_file

    os.makedirs(dst)
    state = load_file(os.path.join(src, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    (edit_state or (lambda s: None))(state)
    (edit_config or (lambda c: None))(config)
    save_file(state, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    shutil.copy(os.path.join(src, "tokenizer.json"), dst)  # a folder without one is refused (issue 39)
    return str(dst)


def _shrink(state):
    import torch

    state["model.layers.2.attn.wkv.weight"] = torch.zeros(3, 3)


@pytest.mark.parametrize("case, edit_state, edit_config, message", [
    ("no_config", None, None, "has no config.json"),
    ("model_type", None, lambda c: c.update(model_type="llama"), "model_type 'llama'"),
    ("missing_tensor", lambda s: s.pop("model.layers.1.attn.wq_a.weight"), None,
     r"missing 1 tensor(s), e.g. ['layers.1.attn.wq_a.weight']"),
    ("wrong_shape", _shrink, None,
     "tensor 'model.layers.2.attn.wkv.weight' in model.safetensors has shape (3, 3), "
     "expected (32, 64)"),
])
def test_i_invalid_model_folder_is_refused_before_ray(tmp_path, capsys, checkpoint, case,
                                                      edit_state, edit_config, message):
    import ray

    model = copy_checkpoint(checkpoint, tmp_path / case, edit_state, edit_config)
    if case == "no_config":
        os.remove(os.path.join(model, "config.json"))
    src = write(tmp_path / "in.parquet", id=[1], prompt=["hello"])
    started = ray.is_initialized()
    code, err = score(capsys, src, tmp_path / "out", "--model", model)
    assert code == 2 and message in err, err
    assert ray.is_initialized() == started  # refused on the driver: no Ray, no actor
    nothing_scored(tmp_path / "out")


def test_j_empty_dataset_gives_empty_output_with_success(tmp_path, capsys):
    src = write(tmp_path / "in.parquet", id=pa.array([], pa.int64()),
                prompt=pa.array([], pa.string()))
    out = tmp_path / "out"
    code, _ = score(capsys, src, out, "--token-logprobs")
    assert code == 0
    rows, metrics = finished(out, [])
    assert rows == {} and metrics["rows"] == 0 and metrics["input_rows"] == 0
    table = pq.read_table(str(out))  # readers get the output columns, with the input's id type
    assert table.num_rows == 0 and table.schema.field("id").type == pa.int64()
    assert "token_logprobs" in table.column_names


def test_l_output_not_writable_is_refused_before_any_work(tmp_path, capsys):
    src = write(tmp_path / "in.parquet", id=[1], prompt=["hello"])
    blocker = tmp_path / "file.txt"
    blocker.write_text("a file, not a folder")
    code, err = score(capsys, src, blocker / "out")
    assert code == 2 and f"OUTPUT '{blocker / 'out'}' is not writable" in err
    code, err = score(capsys, src, blocker)
    assert code == 2 and "is a file; it must be a folder" in err
    assert blocker.read_text() == "a file, not a folder"


# -- found by the Ray Data id scan, before scoring --------------------------------------------

def test_g_duplicate_ids_are_refused_before_scoring(tmp_path, capsys, local_ray):
    d = tmp_path / "in"
    d.mkdir()
    write(d / "a.parquet", id=["r1", "r2", "r3"], prompt=["a", "b", "c"])
    write(d / "b.parquet", id=["r4", "r2", "r5"], prompt=["d", "e", "f"])
    out = tmp_path / "out"
    code, err = score(capsys, d, out, *SMALL_PARTS)
    assert code == 2
    assert "INPUT has 1 id(s) on more than one row in column 'id', e.g. 'r2' (2 rows)" in err
    nothing_scored(out)
    write(d / "b.parquet", id=pa.array(["r4", None, None]), prompt=["d", "e", "f"])
    code, err = score(capsys, d, out, "--overwrite", *SMALL_PARTS)
    assert code == 2 and "INPUT has 2 row(s) with a null id in column 'id'" in err
    nothing_scored(out)


# -- answered per row: one run over every kind of bad row ---------------------------------------

@pytest.fixture(scope="module")
def mixed(tmp_path_factory, checkpoint, local_ray):
    """(rows by id, metrics) of one CLI run over a normal, a null (d), an empty (e), a too long
    (f) row and rows with control characters and invalid UTF-8 (k)."""
    tmp = tmp_path_factory.mktemp("mixed")
    texts = pa.array([b"Ray Data streams rows.", None, b"", LONG.encode(), CONTROL.encode(),
                      b"caf\xe9 \xff\xfe half \xe2\x82 euro"], pa.binary())
    # a string column holding invalid UTF-8, as writers that do not validate produce it
    src = write(tmp / "in.parquet", id=np.arange(6), prompt=texts.view(pa.string()))
    out = tmp / "out"
    assert main([str(src), str(out), "--model", checkpoint, "--max-model-len", "32", *SMALL_PARTS]) == 0
    return finished(out, list(range(6)))


def test_d_null_text_is_a_row_error(mixed):
    rows, metrics = mixed
    assert rows[1]["error"] == "null text" and rows[1]["num_tokens"] == 0
    assert rows[0]["error"] is None and rows[0]["num_scored_tokens"] > 0
    assert metrics["rows_failed"] == 0  # input errors are answers, not scoring failures


def test_e_empty_text_is_scored_with_zero_tokens(mixed):
    rows, _ = mixed
    r = rows[2]
    assert r["error"] is None and r["num_tokens"] == 1 and r["num_scored_tokens"] == 0
    assert r["logprob_sum"] == 0.0 and r["perplexity"] is None


def test_f_too_long_is_a_row_error(mixed):
    rows, _ = mixed
    assert rows[3]["error"].startswith("too long: ") and "> max_model_len 32" in rows[3]["error"]
    assert rows[3]["logprob_sum"] is None


def test_k_control_characters_and_invalid_utf8_are_scored(mixed, checkpoint):
    from dsv4batch.model.tokenizer import load_tokenizer

    rows, metrics = mixed
    tok = load_tokenizer(checkpoint)
    for i, text in ((4, CONTROL), (5, "caf\ufffd \ufffd\ufffd half \ufffd euro")):
        n = len(tok.encode(text, add_special_tokens=False).ids)
        assert rows[i]["error"] is None and rows[i]["num_scored_tokens"] == n
        assert np.isfinite(rows[i]["logprob_sum"])
    assert metrics["rows_errored"] == 2 and metrics["rows_scored"] == 4


def test_i_nan_weights_stop_the_job_at_the_first_actor(tmp_path, capsys, checkpoint, local_ray):
    def poison(state):
        state["model.layers.0.attn.wo_b.weight"][0, 0] = float("nan")

    model = copy_checkpoint(checkpoint, tmp_path / "nan", poison)
    src = write(tmp_path / "in.parquet", id=list(range(8)), prompt=["hello world"] * 8)
    out = tmp_path / "out"
    code, err = score(capsys, src, out, "--model", model, *SMALL_PARTS)
    assert code == 1, err
    assert "a scoring actor could not load the model: " in err
    assert "tensor 'model.layers.0.attn.wo_b.weight' in model.safetensors has NaN or Inf" in err
    nothing_scored(out)


# -- --truncate: the scoring actor in-process on the scores the model gives the kept tokens -----

@pytest.mark.parametrize("side", ["left", "right"])
def test_f_truncate_scores_the_kept_end(checkpoint, engine, side):
    from dsv4batch.actors.score import ScoringActor
    from dsv4batch.jobspec.config import ScoreConfig
    from dsv4batch.pipeline.stages.tokenize import Tokenize

    cfg = ScoreConfig(model=checkpoint, max_model_len=16, truncate=side)
    out = ScoringActor(cfg)(Tokenize(cfg)(pa.table({"id": [1, 2, 3],
                                                    "prompt": [LONG, "Short one.", None]})))
    rows = out.to_pylist()
    assert [r["id"] for r in rows] == [1, 2, 3]
    assert sum(r["error"] is None for r in rows) + sum(r["error"] is not None for r in rows) == 3
    tokens = engine.tokenizer.encode(LONG, add_special_tokens=False).ids
    kept = tokens[-15:] if side == "left" else tokens[:15]
    ref = engine.score_tokens([[0, *kept]])[0]
    r = rows[0]
    assert r["error"] is None and r["num_tokens"] == 16 and r["num_scored_tokens"] == 15
    assert r["truncated_tokens"] == len(tokens) - 15
    assert abs(r["logprob_sum"] - float(ref.sum(dtype=np.float64))) <= 1e-4 * 15
    assert rows[1]["truncated_tokens"] == 0 and rows[1]["error"] is None
    assert rows[2]["error"] == "null text"
