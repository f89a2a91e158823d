"""Reliability, round three (issue 39): one test per finding, through the CLI where the finding
came through it, each checking the exit code, the one-line message, that OUTPUT is untouched
where a refusal promises it, and rows in = rows processed + rows with an error where rows run.

Order: refusals that need no Ray (the assertions check that none started), then the CLI's own
local Ray (a subprocess), then the runs on the module's local Ray."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from dsv4batch.jobs.score import main
from tests.jobs.conftest import FAST, REPO, finished, write_input
from tests.ray_head import leave

NONFINITE = "non-finite logits at position 0"


def cli(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def one_line(text: str) -> str:
    """The CLI's stderr is one error line: no traceback."""
    lines = [line for line in text.splitlines() if line.strip()]
    assert "Traceback" not in text and len(lines) == 1, text
    return lines[0]


def copy_model(src, dst, edit_state=None, edit_config=None, tokenizer=True) -> str:
    """A copy of the checkpoint folder `src`: config and state edited (else the weights linked)."""
    from safetensors.torch import load_file, save_file

    os.makedirs(dst)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    (edit_config or (lambda c: None))(config)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    if tokenizer:
        shutil.copy(os.path.join(src, "tokenizer.json"), dst)
    weights = os.path.join(src, "model.safetensors")
    if edit_state is None:
        os.symlink(weights, os.path.join(dst, "model.safetensors"))
    else:
        state = load_file(weights)
        edit_state(state)
        save_file(state, os.path.join(dst, "model.safetensors"))
    return str(dst)


def refused_before_ray(capsys, tmp_path, model, message, *flags) -> None:
    """`dsv4batch score` with `model` exits 2 naming the problem; no Ray, no OUTPUT."""
    import ray

    leave()  # the session's Ray, joined by an earlier module: this run must not start one
    src = tmp_path / "in.parquet"
    write_input(src, 2)
    out = tmp_path / "out"
    code, err = cli(capsys, src, out, "--model", model, *flags)
    assert code == 2 and message in one_line(err), err
    assert not ray.is_initialized() and not out.exists()


def plan(capsys, model, *flags) -> tuple[int, str]:
    return cli(capsys, "plan", "--model", model, "--gpu-memory-gib", "80", *flags)


# -- 2. no silent tokenizer swap -------------------------------------------------------------------

def test_2_a_model_folder_without_tokenizer_json_is_refused(tmp_path, capsys, checkpoint):
    model = copy_model(checkpoint, tmp_path / "notok", tokenizer=False)
    refused_before_ray(capsys, tmp_path, model, f"{model}/tokenizer.json does not exist")
    refused_before_ray(capsys, tmp_path, model, "names no tokenizer file", "--tokenizer", tmp_path / "nope.json")


def test_2_a_tokenizer_of_another_vocabulary_is_refused(tmp_path, capsys, checkpoint):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(checkpoint, "tokenizer.json"))
    tok.add_tokens(["<one more>"])  # id 129280: past the model's vocab_size
    tok.save(str(tmp_path / "bigger.json"))
    refused_before_ray(capsys, tmp_path, checkpoint, "has token ids up to 129280, but the model's vocab_size is "
                       "129280", "--tokenizer", tmp_path / "bigger.json")


# -- 3. pre-checks bounded by the config's sizes ---------------------------------------------------

@pytest.mark.parametrize("field, value", [("num_hidden_layers", 10_000_000), ("hidden_size", 10**9),
                                          ("vocab_size", 2**40), ("n_routed_experts", 10**6),
                                          ("num_attention_heads", -4), ("head_dim", 1.5)])
def test_3_sizes_no_checkpoint_has_are_refused_by_name(tmp_path, capsys, checkpoint, field, value):
    model = copy_model(checkpoint, tmp_path / "big", edit_config=lambda c: c.update({field: value}))
    t0 = time.time()
    code, err = plan(capsys, model)
    assert code == 2 and f"{field} {value!r} is not an integer in [" in one_line(err)
    assert time.time() - t0 < 30
    if field == "num_hidden_layers":
        refused_before_ray(capsys, tmp_path, model, f"{field} {value!r} is not an integer in [1, 1024]")


def test_3_a_fifo_in_the_model_folder_is_refused_not_waited_on(tmp_path, capsys, checkpoint):
    model = copy_model(checkpoint, tmp_path / "fifo")
    os.mkfifo(os.path.join(model, "x.safetensors"))
    run = subprocess.run([sys.executable, "-m", "dsv4batch.jobs.score", "plan", "--model", model,
                          "--gpu-memory-gib", "80"], capture_output=True, text=True, timeout=240, cwd=REPO)
    assert run.returncode == 2 and "x.safetensors is not a regular file (a FIFO)" in one_line(run.stderr)
    refused_before_ray(capsys, tmp_path, model, "x.safetensors is not a regular file (a FIFO)")


# -- 4. every model-folder fault refused before Ray starts, by plan too ----------------------------

def _routing(value):
    def edit(state):
        state["model.layers.0.ffn.gate.tid2eid"][5, 1] = value
    return edit


def _fp8_scale(shape, dtype=None):
    """layers.1.attn.wq_a as native FP8 with a scale of `shape` (right: (1, 1)) and `dtype`."""
    def edit(state):
        import torch

        from tests.model.test_quant_layout import quantize_fp8

        w, s, _ = quantize_fp8(state["model.layers.1.attn.wq_a.weight"])  # [32, 64]
        state["model.layers.1.attn.wq_a.weight"] = w
        state["model.layers.1.attn.wq_a.scale"] = torch.ones(shape, dtype=dtype or s.dtype)
    return edit


def _fp4_scale(state):
    from tests.model.test_quant_layout import quantize_fp4

    w, s, _ = quantize_fp4(state["model.layers.2.ffn.experts.3.w1.weight"])  # [32, 64]: scale [32, 2]
    state["model.layers.2.ffn.experts.3.w1.weight"] = w
    state["model.layers.2.ffn.experts.3.w1.scale"] = s[:, :1].contiguous()


def _cut(model):
    path = os.path.join(model, "model.safetensors")
    data = open(os.path.realpath(path), "rb").read()
    os.remove(path)
    with open(path, "wb") as f:
        f.write(data[:len(data) // 2])


def _past_the_end(model):
    """The last tensor's byte range moved past the end of the file (its length kept)."""
    import struct

    path = os.path.join(model, "model.safetensors")
    data = open(os.path.realpath(path), "rb").read()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    name = max((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][1])
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin + 4096, end + 4096]
    raw = json.dumps(header).encode()
    os.remove(path)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data[8 + size:])


FAULTS = {
    "tid2eid -1": (_routing(-1), None, "routes to expert -1, outside [0, 8) (n_routed_experts)"),
    "tid2eid 8": (_routing(8), None, "routes to expert 8, outside [0, 8) (n_routed_experts)"),
    "cut in half": (None, _cut, "model.safetensors is truncated: tensor '"),
    "past the end": (None, _past_the_end, "model.safetensors is truncated: tensor '"),
    "fp8 scale shape": (_fp8_scale((2, 1)), None, "has shape (2, 1), expected (1, 1)"),
    "fp8 scale dtype": (_fp8_scale((1, 1), dtype=__import__("torch").int64), None,
                        "is torch.int64; a scale is a float tensor"),
    "fp4 scale shape": (_fp4_scale, None, "'model.layers.2.ffn.experts.3.w1.scale'"),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_4_model_folder_faults_are_refused_by_plan_and_before_ray(tmp_path, capsys, checkpoint, fault):
    edit_state, edit_files, message = FAULTS[fault]
    model = copy_model(checkpoint, tmp_path / "model", edit_state)
    (edit_files or (lambda m: None))(model)
    code, err = plan(capsys, model)
    assert code == 2 and message in one_line(err), err
    refused_before_ray(capsys, tmp_path, model, message)


# -- 5. every number checked: one line, exit 2 -----------------------------------------------------

@pytest.mark.parametrize("flags, message", [
    (["--gpu-memory-gib", "nan"], "--gpu-memory-gib must be positive and finite (at most 1048576), got nan"),
    (["--gpu-memory-gib", "inf"], "--gpu-memory-gib must be positive and finite (at most 1048576), got inf"),
    (["--gpu-memory-gib", "1e308"], "got 1e+308"),
    (["--gpu-memory-utilization", "nan"], "--gpu-memory-utilization must be positive and finite (at most 1)"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization must be positive"),
    (["--gpu-memory-gib", "-1"], "--gpu-memory-gib must be positive"),
    (["--max-model-len", "0"], "--max-model-len must be >= 2, got 0"),
    (["--tp", "0"], "--tp must be >= 1, got 0"),
])
def test_5_plan_numbers_are_one_line_errors(capsys, flags, message):
    code, err = cli(capsys, "plan", "--model", "tiny", "--gpu-memory-gib", "80", *flags)
    assert code == 2 and message in one_line(err)


@pytest.mark.parametrize("flags, message", [
    (["--limit", "nan"], "--limit must be positive and finite, got nan"),
    (["--limit", "-1"], "--limit must be positive"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--gpus-per-replica", "inf"], "--gpus-per-replica must be >= 0 and finite, got inf"),
    (["--seed", "-1"], "--seed must be >= 0 (at most 4294967295), got -1"),
    (["--max-length", "1"], "--max-length must be >= 2, got 1"),
])
def test_5_eval_numbers_are_one_line_errors(capsys, flags, message):
    code, err = cli(capsys, "eval", "--model", "tiny", "--tasks", "x", *flags)
    assert code == 2 and message in one_line(err)


@pytest.mark.parametrize("job, flag, value", [
    ("score", "--gpu-memory-gib", "1e308"), ("score", "--max-block-mib", "1e300"),
    ("score", "--collective-timeout-s", "1e300"), ("generate", "--max-cache-mib", "1e300"),
    ("generate", "--temperature", "nan"), ("score", "--max-buffered-mib", "-1"),
])
def test_5_job_numbers_are_refused_before_anything(tmp_path, capsys, job, flag, value):
    import ray

    leave()
    src = tmp_path / "in.parquet"
    write_input(src, 2)
    code, err = cli(capsys, job, src, tmp_path / "out", flag, value)
    assert code == 2 and f"config field {flag[2:].replace('-', '_')!r}: must be" in one_line(err)
    assert not ray.is_initialized() and not (tmp_path / "out").exists()


# -- 8. the CLI's own local Ray listens on loopback only ------------------------------------------

LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def listening(pid: int) -> set:
    """(process name, address, port) of every listening socket of `pid` and its descendants."""
    import psutil

    found = set()
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return found
    for p in procs:
        try:
            found |= {(p.name(), c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            continue
    return found


def test_8_the_clis_local_ray_listens_on_loopback_only(tmp_path, checkpoint):
    src, out = tmp_path / "in.parquet", tmp_path / "out"
    ids = write_input(src, 4)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    job = subprocess.Popen([sys.executable, "-m", "dsv4batch.jobs.score", str(src), str(out), "--model",
                            checkpoint, *FAST], cwd=REPO, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    seen: set = set()
    deadline = time.time() + 480
    while job.poll() is None and time.time() < deadline:
        seen |= listening(job.pid)
        time.sleep(0.5)
    log = job.communicate(timeout=60)[0]
    assert job.returncode == 0, log
    finished(out, ids)
    names = {name for name, _, _ in seen}
    assert "gcs_server" in names and "raylet" in names, seen  # Ray's processes were watched
    exposed = sorted(s for s in seen if s[1] not in LOOPBACK)
    assert not exposed, exposed  # metrics, dashboard and gRPC ports: none on 0.0.0.0 or ::


# -- on the module's local Ray ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def overflow(tmp_path_factory, checkpoint):
    """The checkpoint with a finite head of magnitude 3e38: every logit overflows."""
    def edit(state):
        state["head.weight"] = state["head.weight"].sign() * 3e38

    return copy_model(checkpoint, tmp_path_factory.mktemp("overflow") / "model", edit)


TEXTS = ["Hello world.", "", "The quick brown fox.", "Ray Data streams rows.", "One more.", "Last."]


def test_1_non_finite_scores_are_row_errors_that_count(tmp_path, capsys, overflow, local_ray):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": list(range(6)), "prompt": TEXTS}), src)
    # the default limit (1 row of 6): the job stops. In a driver of its own, whose exit ends the
    # stopped dataset's actors (in this process they would hold the module Ray's CPUs)
    stopped = subprocess.run([sys.executable, "-m", "dsv4batch.jobs.score", str(src), str(tmp_path / "stopped"),
                              "--model", overflow, "--ray-address", local_ray, *FAST],
                             capture_output=True, text=True, timeout=600, cwd=REPO)
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    assert "rows failed scoring, more than max_errored_rows=1" in stopped.stderr and NONFINITE in stopped.stderr
    assert "_SUCCESS" not in os.listdir(tmp_path / "stopped")
    out = tmp_path / "out"
    code, err = cli(capsys, src, out, "--model", overflow, "--max-errored-rows", "10", "--token-logprobs", *FAST)
    assert code == 0, err
    rows, metrics = finished(out, list(range(6)))  # rows in = rows scored + rows with an error
    assert {i for i, r in rows.items() if r["error"] == NONFINITE} == {0, 2, 3, 4, 5}
    assert all(r["logprob_sum"] is None and r["token_logprobs"] is None for i, r in rows.items() if i != 1)
    assert rows[1]["error"] is None and rows[1]["num_scored_tokens"] == 0  # nothing to score: no logits
    assert metrics["rows_failed"] == 5 and metrics["rows_errored"] == 5


def test_1_non_finite_generations_are_row_errors(tmp_path, capsys, overflow, local_ray):
    src, out = tmp_path / "in.parquet", tmp_path / "out"
    pq.write_table(pa.table({"id": list(range(6)), "prompt": TEXTS}), src)
    code, err = cli(capsys, "generate", src, out, "--model", overflow, "--max-tokens", "3",
                    "--max-errored-rows", "10", *FAST)
    assert code == 0, err
    table = pq.read_table(out)
    assert sorted(table["id"].to_pylist()) == list(range(6)) and "_SUCCESS" in os.listdir(out)
    rows = table.to_pylist()
    assert all(r["error"] == NONFINITE and r["generated_token_ids"] is None for r in rows)  # rows in = errors
    assert json.loads((out / "_metrics.json").read_text())["rows_failed"] == 6


def test_2_tokenizer_flag_is_used_and_recorded_and_resume_checks_it(tmp_path, capsys, checkpoint, local_ray):
    from dsv4batch.model.tokenizer import packaged_tokenizer_path

    model = copy_model(checkpoint, tmp_path / "notok", tokenizer=False)
    tok = tmp_path / "tok.json"
    shutil.copy(packaged_tokenizer_path(), tok)
    src, out = tmp_path / "in.parquet", tmp_path / "out"
    ids = write_input(src, 4)
    code, err = cli(capsys, src, out, "--model", model, "--tokenizer", tok, *FAST)
    assert code == 0, err
    finished(out, ids)
    job = json.loads((out / "_job.json").read_text())
    assert job["tokenizer"] == {"source": "path", "path": str(tok),
                                "sha256": hashlib.sha256(tok.read_bytes()).hexdigest()}
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    tok.write_text(json.dumps(json.loads(tok.read_text()), indent=1))  # the same path, another file
    code, err = cli(capsys, src, out, "--model", model, "--tokenizer", tok, "--resume", *FAST)
    assert code == 2 and "--resume: the tokenizer" in one_line(err)
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before


# -- 6 and 7. one invalid-text rule for every format; dictionary-encoded text ------------------------

BAD_UTF8 = b"caf\xe9 \xff half \xe2\x82 euro"
NUL = b"before\x00after"


def write_texts(path, fmt) -> None:
    """Rows 0-2 (valid, invalid UTF-8, a NUL byte) in `fmt`, the bytes as they are."""
    if fmt == "parquet":  # a string column holding invalid UTF-8, as non-validating writers do
        texts = pa.array([b"valid text", BAD_UTF8, NUL], pa.binary()).view(pa.string())
        pq.write_table(pa.table({"id": [0, 1, 2], "prompt": texts}), path)
    elif fmt == "json":
        lines = [b'{"id": %d, "prompt": "%s"}\n' % (i, t) for i, t in enumerate([b"valid text", BAD_UTF8, NUL])]
        path.write_bytes(b"".join(lines))
    else:
        path.write_bytes(b"id,prompt\n0,valid text\n1," + BAD_UTF8 + b"\n2," + NUL + b"\n")


@pytest.fixture(scope="module")
def decoded(checkpoint):
    """The texts every format must score: invalid UTF-8 as U+FFFD, the NUL kept."""
    from dsv4batch.model.tokenizer import load_tokenizer

    tok = load_tokenizer(checkpoint)
    texts = ["valid text", BAD_UTF8.decode("utf-8", "replace"), NUL.decode()]
    return [len(tok.encode(t, add_special_tokens=False).ids) for t in texts]


@pytest.mark.parametrize("fmt, name", [("parquet", "in.parquet"), ("json", "in.jsonl"), ("csv", "in.csv")])
def test_6_invalid_utf8_and_nul_are_read_alike_in_every_format(tmp_path, capsys, checkpoint, local_ray, decoded,
                                                                fmt, name):
    src, out = tmp_path / name, tmp_path / "out"
    write_texts(src, fmt)
    code, err = cli(capsys, src, out, "--model", checkpoint, "--keep-columns", "prompt", *FAST)
    assert code == 0, err
    rows, _ = finished(out, [0, 1, 2])
    assert [rows[i]["error"] for i in range(3)] == [None] * 3
    assert [rows[i]["num_scored_tokens"] for i in range(3)] == decoded
    assert all(np.isfinite(rows[i]["logprob_sum"]) for i in range(3))
    # a kept text column is the decoded string, in every format
    assert rows[1]["prompt"] == BAD_UTF8.decode("utf-8", "replace") and rows[2]["prompt"] == NUL.decode()


def test_7_dictionary_encoded_text_is_read_as_strings(tmp_path, capsys, checkpoint, local_ray):
    import pandas as pd

    src, plain, out, ref = tmp_path / "cat.parquet", tmp_path / "plain.parquet", tmp_path / "out", tmp_path / "ref"
    texts = ["a b c", "the quick fox", "a b c", None, "the quick fox"]
    pd.DataFrame({"id": range(5), "prompt": pd.Categorical(texts)}).to_parquet(src)
    assert pa.types.is_dictionary(pq.read_schema(src).field("prompt").type)
    pq.write_table(pa.table({"id": list(range(5)), "prompt": texts}), plain)
    for path, folder in ((src, out), (plain, ref)):
        code, err = cli(capsys, path, folder, "--model", checkpoint, *FAST)
        assert code == 0, err
    rows, _ = finished(out, list(range(5)))
    expected, _ = finished(ref, list(range(5)))
    assert rows[3]["error"] == "null text"
    for i in range(5):
        assert rows[i]["num_scored_tokens"] == expected[i]["num_scored_tokens"]
        assert rows[i]["logprob_sum"] == expected[i]["logprob_sum"]
