"""Throughput accounting: a `StatsCollector` Ray actor fed by the steps, and the run summary.

Scoring actors push one small dict per batch and tokenize tasks one per batch
(fire-and-forget); the driver polls `snapshot()` for live progress and builds the summary
(`_metrics.json`) at the end. Row and token totals in the summary come from what the sink
wrote, so a retried batch is never counted twice; timings come from the collector.
"""

from __future__ import annotations

import time
from typing import Any

_SUMS = ("batches", "rows", "rows_scored", "rows_errored", "input_tokens", "scored_tokens",
         "busy_s", "forward_s", "planner_s", "num_steps", "num_chunks", "model_calls")


class StatsCollector:
    def __init__(self):
        self.actors: dict[str, dict[str, Any]] = {}
        self.tokenize = {"batches": 0, "rows": 0, "seconds": 0.0}

    def _actor(self, actor_id: str) -> dict[str, Any]:
        if actor_id not in self.actors:
            self.actors[actor_id] = {"actor_id": actor_id, **{k: 0 for k in _SUMS},
                                     "peak_workspace_bytes": 0, "t_first": None, "t_last": None}
        return self.actors[actor_id]

    def register_actor(self, info: dict[str, Any]) -> None:
        self._actor(info["actor_id"]).update(info)

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
        return {"actors": [dict(a) for a in self.actors.values()],
                "tokenize": dict(self.tokenize), "time": time.time()}


def start_collector():
    """The collector as a zero-CPU Ray actor (Ray must be initialized)."""
    import ray

    return ray.remote(num_cpus=0, max_restarts=-1)(StatsCollector).remote()


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
            "batches": a["batches"], "rows": a["rows"], "input_tokens": a["input_tokens"],
            "scored_tokens": a["scored_tokens"], "busy_s": round(a["busy_s"], 3),
            "active_s": round(span, 3), "tokens_per_s": _rate(a["input_tokens"], span),
            "rows_per_s": _rate(a["rows"], span), "forward_s": round(a["forward_s"], 3),
            "planner_s": round(a["planner_s"], 3), "num_steps": a["num_steps"],
            "num_chunks": a["num_chunks"], "peak_workspace_bytes": a["peak_workspace_bytes"]})
    tok = snapshot["tokenize"]
    return {
        "rows": written["rows"], "rows_scored": written["rows"] - written["rows_errored"],
        "rows_errored": written["rows_errored"], "input_tokens": written["input_tokens"],
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
        "num_actors": len(actors), "actors": per_actor, "files": written.get("files", []),
        **(extra or {})}


def format_summary(m: dict) -> str:
    lines = [f"rows {m['rows']} (scored {m['rows_scored']}, errors {m['rows_errored']})  "
             f"tokens {m['input_tokens']} (scored {m['scored_tokens']})",
             f"wall {m['wall_s']:.1f}s  {m['tokens_per_s']:.0f} tok/s  {m['rows_per_s']:.1f} "
             f"rows/s  (while actors ran: {m['active_tokens_per_s']:.0f} tok/s)",
             "time: " + "  ".join(f"{k} {v:.2f}s" for k, v in m["time_s"].items())
             + f"  steps {m['num_steps']}  chunks {m['num_chunks']}  peak workspace "
             f"{m['peak_workspace_bytes'] / 2**20:.1f} MiB"]
    for a in m["actors"]:
        lines.append(f"  actor {a['actor_id'][:12]} node {str(a['node_id'])[:12]} {a['device']}: "
                     f"{a['rows']} rows  {a['tokens_per_s']:.0f} tok/s  {a['rows_per_s']:.1f} "
                     f"rows/s  busy {a['busy_s']:.1f}s")
    return "\n".join(lines)
