"""`dsv4batch score` end to end on the session's local Ray."""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dsv4batch.jobs.score import main
from tests.jobs.conftest import FAST, TEXTS, read_output, wait_for


pytestmark = pytest.mark.usefixtures("local_ray")  # one local Ray for this module


def reference(engine, prompt, target=None):
    """Per-token logprobs of the scored tokens straight from Engine.score_tokens."""
    enc = engine.tokenizer.encode
    p = enc(prompt, add_special_tokens=False).ids
    t = enc(target, add_special_tokens=False).ids if target is not None else None
    lp = engine.score_tokens([[engine.model.config.bos_token_id, *p, *(t or [])]])[0]
    return lp[-len(t):] if t is not None else lp


def test_cli_scores_match_the_model(tmp_path, checkpoint, engine):
    src = tmp_path / "in.parquet"
    table = pa.table({"id": np.arange(100, 100 + len(TEXTS)), "prompt": TEXTS,
                      "source": [f"s{i}" for i in range(len(TEXTS))], "unused": list(range(len(TEXTS)))})
    pq.write_table(table, src, row_group_size=3)
    out = tmp_path / "out"
    assert main(["score", str(src), str(out), "--model", checkpoint, "--token-logprobs",
                 "--keep-columns", "source", *FAST]) == 0
    result, metrics = read_output(out)
    assert result.column_names == ["id", "num_tokens", "num_scored_tokens", "logprob_sum",
                                   "logprob_mean", "perplexity", "is_greedy", "token_logprobs",
                                   "error", "source"]
    assert result.schema.field("id").type == pa.int64()
    assert result.schema.field("num_tokens").type == pa.int32()
    assert result.schema.field("token_logprobs").type == pa.list_(pa.float32())
    rows = {r["id"]: r for r in result.to_pylist()}
    assert sorted(rows) == table["id"].to_pylist()  # rows out == rows in, each id once
    for i, text in zip(table["id"].to_pylist(), TEXTS):
        r = rows[i]
        assert r["source"] == f"s{i - 100}"
        if text is None:
            assert r["error"] == "null text" and r["logprob_sum"] is None
            continue
        ref = reference(engine, text)
        assert r["error"] is None and r["num_scored_tokens"] == len(ref) == r["num_tokens"] - 1
        assert abs(r["logprob_sum"] - float(ref.sum(dtype=np.float64))) <= 1e-4 * max(1, len(ref))
        np.testing.assert_allclose(r["token_logprobs"], ref, atol=1e-4)
    # readable by Ray Data too
    import ray

    assert ray.data.read_parquet(str(out)).count() == len(TEXTS)
    assert metrics["rows_errored"] == 1 and metrics["rows_scored"] == len(TEXTS) - 1
    assert metrics["input_tokens"] == sum(r["num_tokens"] for r in rows.values())
    assert metrics["num_actors"] == 1 and metrics["actors"][0]["rows"] == len(TEXTS)
    assert metrics["head_precision"] == "fp32" and metrics["actors"][0]["head_precision"] == "fp32"
    assert metrics["actors"][0]["attn_kernel"] == "cpu"  # the fused kernel: CI has a compiler
    assert metrics["actors"][0]["torch_threads"] == 1  # --torch-threads reaches the actor
    chosen = metrics["actors"][0]["cpu_kernels"]  # what the actor's CPU runs, per kernel
    assert chosen["isa"] in ("avx512", "avx2", "generic") and set(chosen["kernels"]) == {
        "sparse_mla", "indexer", "head", "elementwise"}
    assert metrics["tokens_per_s"] > 0 and metrics["time_s"]["forward"] > 0
    assert metrics["num_steps"] >= 1 and metrics["peak_workspace_bytes"] > 0
    assert metrics["time_s"]["tokenize"] > 0


def test_cli_target_column_and_derived_ids(tmp_path, checkpoint, engine):
    src = tmp_path / "in"
    (src / "b").mkdir(parents=True)
    prompts = ["The capital of France is", "Two plus two equals", "", "Water boils at"]
    targets = [" Paris.", " four.", " Hello world", " one hundred degrees Celsius " * 8]
    pq.write_table(pa.table({"prompt": prompts[:2], "answer": targets[:2]}), src / "a.parquet")
    pq.write_table(pa.table({"prompt": prompts[2:], "answer": targets[2:]}), src / "b" / "c.parquet")
    out = tmp_path / "out"
    assert main([str(src), str(out), "--model", checkpoint, "--target-column", "answer",
                 "--max-model-len", "40", *FAST]) == 0
    result, _ = read_output(out)
    rows = {r["id"]: r for r in result.to_pylist()}
    assert sorted(rows) == ["a.parquet:0", "a.parquet:1", "b/c.parquet:0", "b/c.parquet:1"]
    assert rows["b/c.parquet:1"]["error"].startswith("too long:")
    for key, p, t in zip(["a.parquet:0", "a.parquet:1", "b/c.parquet:0"], prompts, targets):
        ref = reference(engine, p, t)
        assert rows[key]["num_scored_tokens"] == len(ref)  # only the target's tokens
        assert abs(rows[key]["logprob_sum"] - float(ref.sum(dtype=np.float64))) <= 1e-4 * len(ref)


def test_tp2_with_default_resources_runs_on_two_cpus(tmp_path, checkpoint, engine):
    """--tp 2 and no resource flag on the 2-CPU head (refused before: 2 ranks x 0.5 CPU and the
    tokenizers left less than 1 CPU for reads): the ranks' share sizes itself to the cluster
    and each rank runs torch on its share of the cores."""
    src, out = tmp_path / "in.parquet", tmp_path / "out"
    texts = [t for t in TEXTS if t]
    pq.write_table(pa.table({"id": list(range(len(texts))), "prompt": texts}), src)
    assert main([str(src), str(out), "--model", checkpoint, "--tp", "2", "--no-progress"]) == 0
    result, metrics = read_output(out)
    for r in result.to_pylist():
        ref = reference(engine, texts[r["id"]])
        assert r["error"] is None and abs(r["logprob_sum"] - float(ref.sum(dtype=np.float64))) <= 1e-4 * len(ref)
    [actor] = metrics["actors"]
    assert [(r["rank"], r["torch_threads"]) for r in actor["ranks"]] == [(0, 1), (1, 1)]
    with open(out / "_job.json") as f:
        config = json.load(f)["config"]
    assert (config["cpus_per_replica"], config["torch_threads"]) == (0.25, 1)


def test_python_api_composes_with_ray_data(checkpoint, engine):
    import ray
    from ray.data.expressions import col

    import dsv4batch.pipeline as pipeline

    ds = ray.data.from_items([{"id": f"r{i}", "prompt": t} for i, t in enumerate(TEXTS) if t])
    cfg = pipeline.ScoreConfig(model=checkpoint, cpus_per_replica=0.5, tokenize_num_cpus=0.25,
                               batch_size=4)
    scored = pipeline.score(ds, cfg).filter(expr=col("num_scored_tokens") > 0)
    rows = {r["id"]: r for r in scored.take_all()}
    expected = {f"r{i}": t for i, t in enumerate(TEXTS) if t}
    assert sorted(rows) == sorted(expected)
    for key, text in expected.items():
        assert abs(rows[key]["logprob_sum"] - float(reference(engine, text).sum())) < 1e-3


def test_usage_errors_exit_2_before_scoring(tmp_path, capsys):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [1], "text": ["hello"]}), src)
    assert main([str(src), str(tmp_path / "o1")]) == 2
    assert "['prompt'] not in the input" in capsys.readouterr().err
    out = tmp_path / "o2"
    out.mkdir()
    (out / "_job.json").write_text('{"writer": "dsv4batch", "run_id": "x", "result": {}}')
    (out / "part-0123abcd-000000.parquet").write_bytes(b"")
    assert main([str(src), str(out), "--text-column", "text"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert sorted(os.listdir(out)) == ["_job.json", "part-0123abcd-000000.parquet"]
    assert main([str(src), str(tmp_path / "o4"), "--text-column", "text", "--model",
                 str(tmp_path)]) == 2
    assert "has no config.json" in capsys.readouterr().err
    # actors that would take every CPU (Ray Data's read/write tasks could never run): refused
    assert main([str(src), str(tmp_path / "o3"), "--text-column", "text", "--replicas", "2",
                 "--cpus-per-replica", "0.5"]) == 2
    assert "leave less than 1 of the cluster's 2 CPUs" in capsys.readouterr().err


def test_collector_progress_and_actor_metrics(capsys):
    import ray

    from dsv4batch.actors.telemetry import ActorTelemetry
    from dsv4batch.jobspec.stats import BatchStats
    from dsv4batch.pipeline.metrics import start_collector
    from dsv4batch.pipeline.progress import Progress

    stats = BatchStats(t_first=1.0, t_last=2.0, busy_s=1.0, batches=1, rows=4, rows_scored=3,
                       rows_errored=1, input_tokens=40, scored_tokens=36, forward_s=0.9,
                       planner_s=0.01, num_steps=2, num_chunks=4, peak_workspace_bytes=10,
                       model_calls=1)
    telemetry = ActorTelemetry("test")
    assert telemetry.enabled
    telemetry.record(stats)  # counters + step-latency histogram through ray.util.metrics
    collector = start_collector()
    collector.register_actor.remote({"actor_id": "a1", "node_id": "n1", "device": "cpu"})
    collector.record_batch.remote("a1", stats)
    err = []

    def logged() -> bool:  # the progress thread's lines so far
        err.append(capsys.readouterr().err)
        return "[dsv4batch] 4/4 rows  40 tokens" in "".join(err)

    with Progress(collector, total=4, poll_s=0.05, log_every=0.0):
        wait_for(logged, "the progress line with the recorded batch", timeout=60)
    snap = ray.get(collector.snapshot.remote())
    assert snap["actors"][0]["rows"] == 4 and snap["actors"][0]["num_steps"] == 2
    ray.kill(collector)
