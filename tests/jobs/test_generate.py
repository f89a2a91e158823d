"""`dsv4batch generate` end to end on one local Ray for the module: the output contract (every
row once, per-row parameters and their errors), and every row's output the same as the engine's
alone, with two replicas, and after a killed driver and --resume."""

import os
import signal
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dsv4batch.actors.generate import row_seed
from dsv4batch.jobs.score import main
from dsv4batch.model.sampling import SamplingParams
from tests.jobs.conftest import FAST, REPO, SMALL_PARTS, alive_pipeline_actors, part_rows, parts, wait_for, write_input

pytestmark = pytest.mark.usefixtures("local_ray")
RAY_DASHBOARD = True  # the killed driver's actors are awaited through ray.util.state

COLUMNS = ["id", "num_prompt_tokens", "generated_text", "generated_token_ids", "num_generated_tokens",
           "finish_reason", "stop_reason", "generated_logprobs", "error", "source"]
GEN = ["--max-tokens", "6", "--logprobs"]


def params_column(n: int) -> list:
    """Per-row sampling parameters: sampled rows (some with their own seed), greedy rows, and two
    bad rows (a negative temperature, a prompt + max_tokens beyond max_model_len)."""
    out = []
    for i in range(n):
        if i == 3:
            out.append({"temperature": -1.0, "seed": None, "max_tokens": None, "stop": None})
        elif i == 5:
            out.append({"temperature": None, "seed": None, "max_tokens": 5000, "stop": None})
        elif i % 3 == 0:
            out.append({"temperature": 0.9, "seed": 40 + i if i % 2 else None, "max_tokens": 4 + i % 5,
                        "stop": None})
        else:
            out.append(None)
    return out


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    src = tmp_path_factory.mktemp("gen") / "in.parquet"
    ids = write_input(str(src), 40)
    table = pq.read_table(src)
    params = pa.array(params_column(40), pa.struct([("temperature", pa.float64()), ("seed", pa.int64()),
                                                     ("max_tokens", pa.int64()), ("stop", pa.list_(pa.string()))]))
    table = table.append_column("params", params).append_column("source", pa.array([f"s{i}" for i in range(40)]))
    pq.write_table(table, src, row_group_size=8)
    return src, ids, table


def generate(src, out, checkpoint, *extra) -> int:
    return main(["generate", str(src), str(out), "--model", checkpoint, "--sampling-params-column", "params",
                 "--keep-columns", "source", "--max-model-len", "256", *GEN, *extra])


def kill_after_first_part(args: list, out, ray_address: str, tmp_path) -> None:
    """Run the CLI with `args` as a driver subprocess on the module's Ray, SIGKILL it once its
    first part file exists, and wait until Ray has ended its job's actors."""
    with open(tmp_path / "driver.log", "w") as log:
        driver = subprocess.Popen([sys.executable, "-m", "dsv4batch.jobs.score", *args, "--ray-address", ray_address],
                                  stdout=log, stderr=log, cwd=REPO)
        wait_for(lambda: parts(out), "the first part file", proc=driver)
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    wait_for(lambda: not alive_pipeline_actors(ray_address), "the killed job's actors to stop", 120)


def rows_by_id(out) -> dict:
    names = os.listdir(out)
    assert "_SUCCESS" in names and not [n for n in names if n.startswith("_tmp-")]
    table = pq.read_table(str(out))
    ids = table["id"].to_pylist()
    assert len(ids) == len(set(ids)), "an id was written twice"
    return {r["id"]: r for r in table.to_pylist()}


@pytest.fixture(scope="module")
def reference(dataset, checkpoint, tmp_path_factory):
    """The module's first run: one replica, every row."""
    src, _, _ = dataset
    out = tmp_path_factory.mktemp("ref") / "out"
    assert generate(src, out, checkpoint, *FAST) == 0
    return out


def test_every_row_once_with_per_row_parameters(dataset, reference, engine):
    src, ids, table = dataset
    out = pq.read_table(str(reference))
    assert out.column_names == COLUMNS
    assert out.schema.field("generated_token_ids").type == pa.list_(pa.int32())
    rows = rows_by_id(reference)
    assert sorted(rows) == sorted(ids)  # rows in == rows generated + rows with an error
    assert "temperature must be" in rows["row-3"]["error"] and rows["row-3"]["generated_text"] is None
    assert "max_tokens 5000" in rows["row-5"]["error"] and "max_model_len=256" in rows["row-5"]["error"]
    assert sum(r["error"] is not None for r in rows.values()) == 2
    bos, params = engine.model.config.bos_token_id, params_column(40)
    for i in (0, 1, 6, 9, 13):  # sampled with a derived seed, greedy, sampled with its own seed
        r, given = rows[f"row-{i}"], {k: v for k, v in (params[i] or {}).items() if v is not None}
        prompt = [bos, *engine.tokenizer.encode(table["prompt"][i].as_py(), add_special_tokens=False).ids]
        p = SamplingParams.from_dict({"seed": row_seed(0, f"row-{i}"), **given}, SamplingParams(max_tokens=6))
        want = engine.generate([prompt], p)[0][0]
        assert r["generated_token_ids"] == want.token_ids.tolist() and r["generated_text"] == want.text
        assert r["num_prompt_tokens"] == len(prompt) and r["finish_reason"] == want.finish_reason == "length"
        np.testing.assert_allclose(r["generated_logprobs"], want.logprobs, atol=1e-5)
        assert r["source"] == f"s{i}"
    import json

    with open(reference / "_metrics.json") as f:
        metrics = json.load(f)
    gen = metrics["generation"]
    assert metrics["task"] == "generate" and metrics["rows_errored"] == 2
    assert gen["generated_tokens"] == metrics["generated_tokens"] == sum(
        r["num_generated_tokens"] or 0 for r in rows.values())
    assert gen["decode_tokens_per_s"] > 0 and gen["prefill_tokens_per_s"] > 0
    assert 0 < gen["peak_cache_bytes"] <= gen["cache_capacity_bytes"] and gen["peak_running"] >= 1
    assert 0 < gen["ttft_p50_s"] <= gen["ttft_p99_s"]


def test_two_replicas_write_the_same_rows(dataset, reference, checkpoint, tmp_path):
    src, _, _ = dataset
    out = tmp_path / "out"
    assert generate(src, out, checkpoint, *FAST, "--replicas", "2", "--cpus-per-replica", "0.25",
                    "--tokenize-concurrency", "1", "--batch-size", "8") == 0
    assert rows_by_id(out) == rows_by_id(reference)


def test_killed_driver_then_resume_gives_the_same_rows(dataset, reference, checkpoint, local_ray, tmp_path):
    src, ids, _ = dataset
    out = tmp_path / "out"
    args = ["generate", str(src), str(out), "--model", checkpoint, "--sampling-params-column", "params",
            "--keep-columns", "source", "--max-model-len", "256", *GEN, *SMALL_PARTS]
    kill_after_first_part(args, out, local_ray, tmp_path)
    written = part_rows(out)
    assert 0 < written < len(ids) and "_SUCCESS" not in os.listdir(out)
    assert main([*args, "--resume"]) == 0
    assert rows_by_id(out) == rows_by_id(reference)


def test_tp2_generates_what_one_engine_generates(tmp_path, checkpoint, engine):
    """--tp 2 (two rank workers, gloo): greedy rows as the unsplit engine generates them, up to
    near-ties (the split sums round differently: a token may differ only where the unsplit
    engine's own top-2 logprobs are within 1e-4; the rows then continue differently)."""
    src, out = tmp_path / "in.parquet", tmp_path / "out"
    ids = write_input(str(src), 6)
    assert main(["generate", str(src), str(out), "--model", checkpoint, "--max-tokens", "8", "--tp", "2", *FAST,
                 "--cpus-per-replica", "0.25", "--tokenize-concurrency", "1"]) == 0
    rows = rows_by_id(out)
    assert sorted(rows) == sorted(ids)
    prompts = pq.read_table(src)["prompt"].to_pylist()
    bos = engine.model.config.bos_token_id
    for key, text in zip(ids, prompts):
        prompt = [bos, *engine.tokenizer.encode(text, add_special_tokens=False).ids]
        want = engine.generate([prompt], SamplingParams(max_tokens=8))[0][0].token_ids.tolist()
        got = rows[key]["generated_token_ids"]
        t = next((t for t, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if t is None:
            assert got == want
            continue
        top = engine.score_details([prompt + want[:t + 1]], top_k=2)[0][0].top_logprobs[-1]
        assert top[0] - top[1] < 1e-4, f"{key}: token {t} differs without a near-tie ({top})"


def batch_lines(n: int = 50) -> list[str]:
    """An OpenAI batch file: chat and completion requests, some with stop / seed / logprobs, and
    malformed lines (bad JSON, an unknown url, n > 1, tools, no user message, a prompt too long
    for max_model_len, a line without custom_id)."""
    import json

    lines = []
    for i in range(n):
        chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Count {i}"}],
                "max_tokens": 4 + i % 3}
        text = {"prompt": f"Item {i}: the", "max_tokens": 3}
        body, url = (chat, "/v1/chat/completions") if i % 2 else (text, "/v1/completions")
        body = dict(body)
        if i % 5 == 1:
            body.update(temperature=0.8, seed=i, top_p=0.9)
        if i % 7 == 3:
            body.update(logprobs=True, top_logprobs=2) if url.endswith("chat/completions") else body.update(logprobs=2)
        if i % 6 == 2:
            body.update(stop=[" the", "\n"])
        line = {"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}
        bad = {4: '{"custom_id": "req-4", "method": "POST", "url": ',
               10: json.dumps({**line, "url": "/v1/embeddings"}), 16: json.dumps({**line, "body": {**body, "n": 2}}),
               22: json.dumps({**line, "url": "/v1/chat/completions", "body": {"messages": [], "tools": []}}),
               28: json.dumps({**line, "url": "/v1/completions", "body": {"prompt": "x " * 400}}),
               34: json.dumps({k: v for k, v in line.items() if k != "custom_id"})}
        lines.append(bad.get(i, json.dumps(line)))
    return lines


def test_openai_batch_file_in_and_out(tmp_path, checkpoint, local_ray):
    import json

    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    src, out = tmp_path / "requests.jsonl", tmp_path / "out"
    src.write_text("\n".join(batch_lines()) + "\n")
    args = ["generate", str(src), str(out), "--model", checkpoint, "--input-format", "openai-batch",
            "--output-format", "openai-batch", "--max-model-len", "256", "--logprobs", "--top-logprobs", "2",
            *SMALL_PARTS]
    kill_after_first_part(args, out, local_ray, tmp_path)  # then resumed
    assert 0 < part_rows(out) < 50 and "output.jsonl" not in os.listdir(out)
    assert main([*args, "--resume"]) == 0
    lines = [json.loads(x) for x in (out / "output.jsonl").read_text().splitlines()]
    assert len(lines) == 50
    ids = [x["custom_id"] for x in lines]
    # input order, each once; a line that is not JSON, or has no custom_id, answers with a null one
    assert ids == [None if i in (4, 34) else f"req-{i}" for i in range(50)]
    bad = {i for i, x in enumerate(lines) if x["response"]["status_code"] == 400}
    assert bad == {4, 10, 16, 22, 28}
    assert "not JSON" in lines[4]["response"]["body"]["error"]["message"]
    assert "n must be 1" in lines[16]["response"]["body"]["error"]["message"]
    assert "max_model_len" in lines[28]["response"]["body"]["error"]["message"]
    for i, x in enumerate(lines):
        if i in bad:
            continue
        assert x["response"]["status_code"] == 200 and x["error"] is None
        body = x["response"]["body"]
        if i % 2:
            choice = ChatCompletion.model_validate(body).choices[0]
            assert (choice.logprobs is not None) == (i % 7 == 3) and isinstance(choice.message.content, str)
        else:
            choice = Completion.model_validate(body).choices[0]
            assert (choice.logprobs is not None) == (i % 7 == 3)
        assert choice.finish_reason in ("stop", "length")
    dup = tmp_path / "dup.jsonl"
    dup.write_text("\n".join(batch_lines(3) + [batch_lines(3)[0]]) + "\n")
    assert main(["generate", str(dup), str(tmp_path / "o2"), "--model", checkpoint, "--input-format",
                 "openai-batch", *FAST]) == 2  # duplicate custom_id: refused before the run
