"""Throughput accounting: a `StatsCollector` Ray actor fed by the steps, and the run summary.

Scoring actors push one small dict per batch and tokenize tasks one per batch
(fire-and-forget); the driver polls `snapshot()` for live progress and builds the summary
(`_metrics.json`) at the end. Row and token totals in the summary come from what the sink
wrote, so a retried batch is never counted twice; timings come from the collector. The same
actor keeps the batch ledger (`dsv4batch.pipeline.ledger`): attempts and failed rows.
"""

from __future__ import annotations

import time
from typing import Any

from dsv4batch.pipeline.ledger import BatchLedger

_SUMS = ("batches", "rows", "rows_scored", "rows_errored", "rows_failed", "input_tokens",
         "scored_tokens", "busy_s", "forward_s", "planner_s", "num_steps", "num_chunks",
         "model_calls")


class StatsCollector(BatchLedger):
    def __init__(self, max_failed_rows: int | None = None):
        super().__init__(max_failed_rows)
        self.actors: dict[str, dict[str, Any]] = {}
        self.tokenize = {"batches": 0, "rows": 0, "seconds": 0.0}

    def _actor(self, actor_id: str) -> dict[str, Any]:
        if actor_id not in self.actors:
            self.actors[actor_id] = {"actor_id": actor_id, **{k: 0 for k in _SUMS},
                                     "peak_workspace_bytes": 0, "t_first": None, "t_last": None,
                                     "pids": []}
        return self.actors[actor_id]

    def register_actor(self, info: dict[str, Any]) -> None:
        """Called by each scoring actor process once its model is loaded (again after a
        restart: Ray keeps the actor id, the process id changes)."""
        a = self._actor(info["actor_id"])
        a.update(info)
        a["pids"].append(info.get("pid"))

    def record_batch(self, actor_id: str, stats: dict[str, Any]) -> None:
        a = self._actor(actor_id)
        a["batches"] += 1
        for k in _SUMS[1:]:
            a[k] += stats.get(k, 0) or 0
        a["peak_workspace_bytes"] = max(a["peak_workspace_bytes"],
                                        stats.get("peak_workspace_bytes", 0) or 0)
        a["t_first"] = min(filter(None, (a["t_first"], stats["t_start"])))
        a["t_last"] = max(filter(None, (a["t_last"], stats["t_end"])))

    def record_tokenize(self, rows: int, seconds: float) -> None:
        self.tokenize["batches"] += 1
        self.tokenize["rows"] += rows
        self.tokenize["seconds"] += seconds

    def snapshot(self) -> dict[str, Any]:
        return {"actors": [{**a, "pids": list(a["pids"])} for a in self.actors.values()],
                "tokenize": dict(self.tokenize), "ledger": self.ledger_snapshot(),
                "time": time.time()}


def start_collector(max_failed_rows: int | None = None):
    """The collector as a zero-CPU Ray actor (Ray must be initialized)."""
    import ray

    return ray.remote(num_cpus=0, max_restarts=-1)(StatsCollector).remote(max_failed_rows)


def _rate(x: float, s: float) -> float:
    return round(x / s, 3) if s > 0 else 0.0


def summarize(snapshot: dict, written: dict, wall_s: float, extra: dict | None = None) -> dict:
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
            "dtype": a.get("dtype"), "load_s": round(a.get("load_s", 0.0), 3),
            "pids": a.get("pids", []), "restarts": max(len(a.get("pids", [])) - 1, 0),
            "batches": a["batches"], "rows": a["rows"], "input_tokens": a["input_tokens"],
            "scored_tokens": a["scored_tokens"], "busy_s": round(a["busy_s"], 3),
            "active_s": round(span, 3), "tokens_per_s": _rate(a["input_tokens"], span),
            "rows_per_s": _rate(a["rows"], span), "forward_s": round(a["forward_s"], 3),
            "planner_s": round(a["planner_s"], 3), "num_steps": a["num_steps"],
            "num_chunks": a["num_chunks"], "peak_workspace_bytes": a["peak_workspace_bytes"]})
    tok = snapshot["tokenize"]
    return {
        "rows": written["rows"], "rows_scored": written["rows"] - written["rows_errored"],
        "rows_errored": written["rows_errored"],
        "rows_failed": snapshot.get("ledger", {}).get("failed_rows", 0),
        "input_tokens": written["input_tokens"],
        "scored_tokens": written["scored_tokens"], "wall_s": round(wall_s, 3),
        "tokens_per_s": _rate(written["input_tokens"], wall_s),
        "scored_tokens_per_s": _rate(written["scored_tokens"], wall_s),
        "rows_per_s": _rate(written["rows"], wall_s),
        "active_s": round(active, 3), "active_tokens_per_s": _rate(written["input_tokens"], active),
        "time_s": {"tokenize": round(tok["seconds"], 3),
                   "actor_busy": round(sum(a["busy_s"] for a in actors), 3),
                   "forward": round(sum(a["forward_s"] for a in actors), 3),
                   "planner": round(sum(a["planner_s"] for a in actors), 3),
                   "model_load_max": round(max((a.get("load_s", 0.0) for a in actors),
                                               default=0.0), 3)},
        "num_steps": sum(a["num_steps"] for a in actors),
        "num_chunks": sum(a["num_chunks"] for a in actors),
        "peak_workspace_bytes": max((a["peak_workspace_bytes"] for a in actors), default=0),
        "faults": {k: v for k, v in snapshot.get("ledger", {}).items() if k != "stop"},
        "num_actors": len(actors), "actors": per_actor, "files": written.get("files", []),
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
    for a in m["actors"]:
        restarts = f"  restarts {a['restarts']}" if a.get("restarts") else ""
        lines.append(f"  actor {a['actor_id'][:12]} node {str(a['node_id'])[:12]} {a['device']}: "
                     f"{a['rows']} rows  {a['tokens_per_s']:.0f} tok/s  {a['rows_per_s']:.1f} "
                     f"rows/s  busy {a['busy_s']:.1f}s{restarts}")
    return "\n".join(lines)
