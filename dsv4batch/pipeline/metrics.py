"""Throughput accounting: a `StatsCollector` Ray actor fed by the stages, and the run summary.

Scoring actors push one `BatchStats` per batch and tokenize actors one small call per batch
(fire-and-forget); the driver polls `snapshot()` for live progress and builds the summary
(`_metrics.json`) at the end. Row and token totals in the summary come from what the sink
wrote (`Written`), so a retried batch is never counted twice; timings come from the collector.
The same actor keeps the batch ledger (`faults.BatchLedger`): attempts and failed rows.
"""

from __future__ import annotations

import time
from typing import Any

from dsv4batch.pipeline.faults import BatchLedger
from dsv4batch.pipeline.stats import BatchStats, Written


class StatsCollector(BatchLedger):
    def __init__(self, max_failed_rows: int | None = None):
        super().__init__(max_failed_rows)
        self.info: dict[str, dict[str, Any]] = {}  # actor id -> what register_actor said
        self.stats: dict[str, BatchStats] = {}  # actor id -> its batches, summed
        self.pids: dict[str, list] = {}
        self.tokenize = {"batches": 0, "rows": 0, "seconds": 0.0}

    def _actor(self, actor_id: str) -> None:
        self.info.setdefault(actor_id, {"actor_id": actor_id})
        self.stats.setdefault(actor_id, BatchStats())
        self.pids.setdefault(actor_id, [])

    def register_actor(self, info: dict[str, Any]) -> None:
        """Called by each scoring actor process once its model is loaded (again after a
        restart: Ray keeps the actor id, the process id changes)."""
        self._actor(info["actor_id"])
        self.info[info["actor_id"]].update(info)
        self.pids[info["actor_id"]].append(info.get("pid"))

    def record_batch(self, actor_id: str, stats: BatchStats) -> None:
        self._actor(actor_id)
        self.stats[actor_id] += stats

    def record_tokenize(self, rows: int, seconds: float) -> None:
        self.tokenize["batches"] += 1
        self.tokenize["rows"] += rows
        self.tokenize["seconds"] += seconds

    def snapshot(self) -> dict[str, Any]:
        """{"actors": [info + BatchStats fields + pids per actor], "tokenize", "ledger", "time"}."""
        return {"actors": [{**self.info[a], **self.stats[a].to_dict(), "pids": list(self.pids[a])}
                           for a in self.info],
                "tokenize": dict(self.tokenize), "ledger": self.ledger_snapshot(),
                "time": time.time()}


def start_collector(max_failed_rows: int | None = None):
    """The collector as a zero-CPU Ray actor (Ray must be initialized)."""
    import ray

    return ray.remote(num_cpus=0, max_restarts=-1)(StatsCollector).remote(max_failed_rows)


def _rate(x: float, s: float) -> float:
    return round(x / s, 3) if s > 0 else 0.0


def summarize(snapshot: dict, written: Written, wall_s: float, extra: dict | None = None) -> dict:
    """The `_metrics.json` document: totals, rates overall and per actor, time breakdown."""
    actors = sorted(snapshot["actors"], key=lambda a: (str(a.get("node_id")), a["actor_id"]))
    starts = [a["t_first"] for a in actors if a["t_first"]]
    ends = [a["t_last"] for a in actors if a["t_last"]]
    active = (max(ends) - min(starts)) if starts else 0.0
    per_actor = []
    for a in actors:
        span = (a["t_last"] - a["t_first"]) if a["t_first"] else 0.0
        per_actor.append({
            "actor_id": a["actor_id"], "node_id": a.get("node_id"), "device": a.get("device"),
            "dtype": a.get("dtype"), "head_precision": a.get("head_precision"),
            "attn_kernel": a.get("attn_kernel"), "torch_threads": a.get("torch_threads"),
            "load_s": round(a.get("load_s", 0.0), 3),
            "pids": a.get("pids", []), "restarts": max(len(a.get("pids", [])) - 1, 0),
            "batches": a["batches"], "rows": a["rows"], "input_tokens": a["input_tokens"],
            "scored_tokens": a["scored_tokens"], "busy_s": round(a["busy_s"], 3),
            "active_s": round(span, 3), "tokens_per_s": _rate(a["input_tokens"], span),
            "rows_per_s": _rate(a["rows"], span), "forward_s": round(a["forward_s"], 3),
            "planner_s": round(a["planner_s"], 3), "collective_s": round(a.get("collective_s", 0.0), 3),
            "num_steps": a["num_steps"], "num_chunks": a["num_chunks"],
            "peak_workspace_bytes": a["peak_workspace_bytes"],
            **({"ranks": a["ranks"]} if "ranks" in a else {})})  # --tp > 1: pid, node, bytes per rank
    tok = snapshot["tokenize"]
    return {
        "rows": written.rows, "rows_scored": written.rows - written.rows_errored,
        "rows_errored": written.rows_errored,
        "rows_failed": snapshot.get("ledger", {}).get("failed_rows", 0),
        "input_tokens": written.input_tokens,
        "scored_tokens": written.scored_tokens, "wall_s": round(wall_s, 3),
        "tokens_per_s": _rate(written.input_tokens, wall_s),
        "scored_tokens_per_s": _rate(written.scored_tokens, wall_s),
        "rows_per_s": _rate(written.rows, wall_s),
        "active_s": round(active, 3), "active_tokens_per_s": _rate(written.input_tokens, active),
        "time_s": {"tokenize": round(tok["seconds"], 3),
                   "actor_busy": round(sum(a["busy_s"] for a in actors), 3),
                   "forward": round(sum(a["forward_s"] for a in actors), 3),
                   "planner": round(sum(a["planner_s"] for a in actors), 3),
                   "collective": round(sum(a.get("collective_s", 0.0) for a in actors), 3),
                   "model_load_max": round(max((a.get("load_s", 0.0) for a in actors),
                                               default=0.0), 3)},
        "num_steps": sum(a["num_steps"] for a in actors),
        "num_chunks": sum(a["num_chunks"] for a in actors),
        "peak_workspace_bytes": max((a["peak_workspace_bytes"] for a in actors), default=0),
        "faults": {k: v for k, v in snapshot.get("ledger", {}).items()
                   if k not in ("stop", "load_failure")},
        "num_actors": len(actors), "actors": per_actor, "files": written.files,
        **(extra or {})}


def format_summary(m: dict) -> str:
    skipped = f"  skipped {m['rows_skipped']} already in OUTPUT" if m.get("rows_skipped") else ""
    lines = [f"rows {m['rows']} (scored {m['rows_scored']}, errors {m['rows_errored']}, of "
             f"which failed scoring {m.get('rows_failed', 0)}){skipped}  "
             f"tokens {m['input_tokens']} (scored {m['scored_tokens']})",
             f"wall {m['wall_s']:.1f}s  {m['tokens_per_s']:.0f} tok/s  {m['rows_per_s']:.1f} "
             f"rows/s  (while actors ran: {m['active_tokens_per_s']:.0f} tok/s)",
             "time: " + "  ".join(f"{k} {v:.2f}s" for k, v in m["time_s"].items())
             + f"  steps {m['num_steps']}  chunks {m['num_chunks']}  peak workspace "
             f"{m['peak_workspace_bytes'] / 2**20:.1f} MiB"]
    total = m.get("total") or {}
    if total.get("num_runs", 1) > 1:
        lines.append(f"all {total['num_runs']} runs into OUTPUT: rows {total['rows']} (errors "
                     f"{total['rows_errored']})  tokens {total['input_tokens']}  wall "
                     f"{total['wall_s']:.1f}s; OUTPUT holds {m.get('rows_in_output')} rows")
    for a in m["actors"]:
        restarts = f"  restarts {a['restarts']}" if a.get("restarts") else ""
        head = f" head {a['head_precision']}" if a.get("head_precision") else ""
        head += f" attention {a['attn_kernel']}" if a.get("attn_kernel") else ""
        lines.append(f"  actor {a['actor_id'][:12]} node {str(a['node_id'])[:12]} {a['device']}{head}: "
                     f"{a['rows']} rows  {a['tokens_per_s']:.0f} tok/s  {a['rows_per_s']:.1f} "
                     f"rows/s  busy {a['busy_s']:.1f}s{restarts}")
    asked = m.get("head_precision")
    other = [a for a in m["actors"] if asked == "bf16" and a.get("head_precision") == "fp32"]
    if other:
        lines.append(f"note: head_precision 'bf16' was asked, but {len(other)} of {len(m['actors'])} "
                     "actor(s) computed the head in fp32 (no bf16 GEMM units on their CPU)")
    return "\n".join(lines)


_TOTALS = ("rows", "rows_scored", "rows_errored", "rows_failed", "input_tokens", "scored_tokens",
           "wall_s")
_HISTORY = ("run_id", "resumed", "rows_skipped", *_TOTALS)


def accumulate(previous: dict | None, current: dict) -> dict:
    """`current` (this run's summary) with `total` over every run into OUTPUT and `runs`, the
    history (one line per finished run; a run killed before it finished wrote no summary, and
    its rows are counted in `rows_in_output` only)."""
    runs = [*(previous or {}).get("runs", []), {k: current.get(k) for k in _HISTORY}]
    total = {k: round(sum(r.get(k) or 0 for r in runs), 3) for k in _TOTALS}
    total.update(num_runs=len(runs), tokens_per_s=_rate(total["input_tokens"], total["wall_s"]),
                 rows_per_s=_rate(total["rows"], total["wall_s"]))
    return {**current, "total": total, "runs": runs}
