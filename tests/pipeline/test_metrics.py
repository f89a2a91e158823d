"""The `_metrics.json` summary from collector snapshots and sink counts (pure functions)."""

from dsv4batch.jobspec.stats import BatchStats, Written
from dsv4batch.pipeline.metrics import StatsCollector, format_summary, summarize


def batch(t0, rows, tokens, **kw):
    return BatchStats(t_first=t0, t_last=t0 + 1.0, busy_s=1.0, batches=1, rows=rows,
                      rows_scored=rows, rows_errored=0, input_tokens=tokens,
                      scored_tokens=tokens - rows, forward_s=0.8, planner_s=0.1, num_steps=2,
                      num_chunks=3, peak_workspace_bytes=kw.get("peak", 100), model_calls=1)


def test_batch_stats_sum_counts_and_keep_peaks_and_times():
    total = batch(11.0, 4, 100, peak=500) + batch(10.0, 2, 50) + BatchStats()
    assert (total.batches, total.rows, total.input_tokens, total.num_steps) == (2, 6, 150, 4)
    assert total.peak_workspace_bytes == 500 and total.forward_s == 1.6
    assert (total.t_first, total.t_last) == (10.0, 12.0)  # None (no batch yet) is not a time
    written = sum([Written(rows=2, files=["b"]), Written(rows=1, files=["a"])], Written())
    assert written == Written(rows=3, files=["b", "a"])


def test_summary_overall_and_per_actor():
    c = StatsCollector()
    c.register_actor({"actor_id": "b", "node_id": "n2", "device": "cpu", "load_s": 2.0,
                      "head_precision": "fp32"})
    c.register_actor({"actor_id": "a", "node_id": "n1", "device": "cuda", "load_s": 3.0,
                      "pid": 11})
    c.register_actor({"actor_id": "a", "node_id": "n1", "device": "cuda", "load_s": 3.0,
                      "pid": 12, "head_precision": "bf16", "attn_kernel": "flashmla"})  # restarted: Ray keeps the actor id, the process is new
    c.begin_batch("k")
    c.end_batch("k", 1, "'r7'", "ValueError: bad")
    c.record_batch("a", batch(10.0, 4, 100))
    c.record_batch("a", batch(11.0, 4, 100, peak=500))
    c.record_batch("b", batch(10.5, 2, 50))
    c.record_tokenize(10, 0.5)
    written = Written(rows=10, rows_errored=1, input_tokens=250, scored_tokens=240,
                      files=["part-x-000000.parquet"])
    m = summarize(c.snapshot(), written, wall_s=5.0, extra={"run_id": "x", "head_precision": "bf16"})
    assert (m["rows"], m["rows_scored"], m["rows_errored"]) == (10, 9, 1)
    assert m["tokens_per_s"] == 50.0 and m["rows_per_s"] == 2.0 and m["active_s"] == 2.0
    assert m["active_tokens_per_s"] == 125.0 and m["num_actors"] == 2
    assert m["time_s"]["tokenize"] == 0.5 and m["time_s"]["forward"] == 2.4
    assert m["time_s"]["model_load_max"] == 3.0
    assert m["num_steps"] == 6 and m["num_chunks"] == 9 and m["peak_workspace_bytes"] == 500
    a = m["actors"][0]
    assert (a["actor_id"], a["rows"], a["batches"], a["active_s"]) == ("a", 8, 2, 2.0)
    assert a["tokens_per_s"] == 100.0 and a["device"] == "cuda"
    assert a["pids"] == [11, 12] and a["restarts"] == 1 and m["actors"][1]["restarts"] == 0
    assert m["rows_failed"] == 1 and m["faults"]["failures"][0]["first_id"] == "'r7'"
    assert m["run_id"] == "x" and m["files"] == ["part-x-000000.parquet"]
    assert [a["head_precision"] for a in m["actors"]] == ["bf16", "fp32"]
    text = format_summary(m)
    assert "actor a" in text and "cuda head bf16 attention flashmla:" in text
    assert [a["attn_kernel"] for a in m["actors"]] == ["flashmla", None]
    assert "'bf16' was asked, but 1 of 2 actor(s) computed the head in fp32" in text
    assert "was asked" not in format_summary({**m, "head_precision": "fp32"})


def test_summary_of_an_empty_run():
    m = summarize(StatsCollector().snapshot(), Written(), wall_s=1.0)
    assert m["rows"] == 0 and m["tokens_per_s"] == 0.0 and m["actors"] == []
    assert format_summary(m).startswith("rows 0 (scored 0, errors 0")
