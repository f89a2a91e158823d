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

from dsv4batch.jobspec.stats import BatchStats, Written
from dsv4batch.pipeline.faults import BatchLedger


class StatsCollector(BatchLedger):
    def __init__(self, max_failed_rows: int | None = None):
        super().__init__(max_failed_rows)
        self.info: dict[str, dict[str, Any]] = {}  # actor id -> what register_actor said
        self.stats: dict[str, BatchStats] = {}  # actor id -> its batches, summed
        self.pids: dict[str, list] = {}
        self.tokenize = {"batches": 0, "rows": 0, "seconds": 0.0}
        self.live: dict[str, dict] = {}  # actor id -> its generation loop's latest state

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

    def record_live(self, actor_id: str, state: dict) -> None:
        """A generating actor's state now (running, waiting, generated tokens, cache bytes)."""
        self.live[actor_id] = state

    def record_tokenize(self, rows: int, seconds: float) -> None:
        self.tokenize["batches"] += 1
        self.tokenize["rows"] += rows
        self.tokenize["seconds"] += seconds

    def snapshot(self) -> dict[str, Any]:
        """{"actors": [info + BatchStats fields (time to first token as its quantiles) + pids per
        actor], "tokenize", "ledger", "live" (generating actors' states), "time"}."""
        return {"actors": [{**self.info[a], **self._stats(a), "pids": list(self.pids[a])} for a in self.info],
                "tokenize": dict(self.tokenize), "ledger": self.ledger_snapshot(), "live": dict(self.live),
                "time": time.time()}

    def _stats(self, actor_id: str) -> dict:
        d = self.stats[actor_id].to_dict()
        d["ttft_s"] = quantiles(d.pop("ttft_s"))
        return d


def start_collector(max_failed_rows: int | None = None):
    """The collector as a zero-CPU Ray actor (Ray must be initialized)."""
    import ray

    return ray.remote(num_cpus=0, max_restarts=-1)(StatsCollector).remote(max_failed_rows)


def quantiles(values: list) -> dict:
    """{"count", "p50", "p99"} of a list of seconds (None when empty)."""
    import numpy as np

    if not values:
        return {"count": 0, "p50": None, "p99": None}
    p50, p99 = np.percentile(np.asarray(values, float), [50, 99])
    return {"count": len(values), "p50": round(float(p50), 4), "p99": round(float(p99), 4)}


def generation_summary(actors: list[dict]) -> dict | None:
    """The generation part of `_metrics.json` (None when no actor generated): prefill and decode
    tokens and their rates (each actor's tokens over its own time in such steps, a mixed step's
    time split by its token counts; summed over actors, which run side by side), generated
    tokens, the most requests running and waiting at once, the cache pool's peak and capacity,
    and time to first token (p50 / p99 over the rows, from a batch's start)."""
    gen = [a for a in actors if a.get("num_generated")]
    if not gen:
        return None
    ttft = [a["ttft_s"] for a in gen]
    weight = sum(t["count"] for t in ttft) or 1
    return {
        "prefill_tokens": sum(a["num_prefill_tokens"] for a in gen),
        "decode_tokens": sum(a["num_decode_tokens"] for a in gen),
        "generated_tokens": sum(a["num_generated"] for a in gen),
        "prefill_tokens_per_s": round(sum(_rate(a["num_prefill_tokens"], a["prefill_s"]) for a in gen), 3),
        "decode_tokens_per_s": round(sum(_rate(a["num_decode_tokens"], a["decode_s"]) for a in gen), 3),
        "peak_running": max(a["peak_running"] for a in gen), "peak_waiting": max(a["peak_waiting"] for a in gen),
        "peak_cache_bytes": max(a["peak_cache_bytes"] for a in gen),
        "cache_capacity_bytes": max(a["cache_capacity_bytes"] for a in gen),
        # each actor's quantiles, weighted by its rows (exact with one actor)
        "ttft_p50_s": round(sum((t["p50"] or 0) * t["count"] for t in ttft) / weight, 4),
        "ttft_p99_s": max((t["p99"] or 0) for t in ttft),
    }


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
            "cpu_kernels": a.get("cpu_kernels"), "load_s": round(a.get("load_s", 0.0), 3),
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
        "scored_tokens": written.scored_tokens, "generated_tokens": written.generated_tokens,
        "wall_s": round(wall_s, 3),
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
        **({"generation": gen} if (gen := generation_summary(actors)) else {}),
        **(extra or {})}


def format_summary(m: dict) -> str:
    skipped = f"  skipped {m['rows_skipped']} already in OUTPUT" if m.get("rows_skipped") else ""
    done = "generated" if m.get("task") == "generate" else "scored"
    lines = [f"rows {m['rows']} ({done} {m['rows_scored']}, errors {m['rows_errored']}, of "
             f"which failed {m.get('rows_failed', 0)}){skipped}  "
             f"tokens {m['input_tokens']} ({done} {m[done + '_tokens']})",
             f"wall {m['wall_s']:.1f}s  {m['tokens_per_s']:.0f} tok/s  {m['rows_per_s']:.1f} "
             f"rows/s  (while actors ran: {m['active_tokens_per_s']:.0f} tok/s)",
             "time: " + "  ".join(f"{k} {v:.2f}s" for k, v in m["time_s"].items())
             + f"  steps {m['num_steps']}  chunks {m['num_chunks']}  peak workspace "
             f"{m['peak_workspace_bytes'] / 2**20:.1f} MiB"]
    gen = m.get("generation")
    if gen:
        lines.append(f"generation: {gen['generated_tokens']} tokens generated  prefill "
                     f"{gen['prefill_tokens_per_s']:.0f} tok/s  decode {gen['decode_tokens_per_s']:.0f} tok/s  "
                     f"running <= {gen['peak_running']}  waiting <= {gen['peak_waiting']}  cache "
                     f"{gen['peak_cache_bytes'] / 2**20:.1f} of {gen['cache_capacity_bytes'] / 2**20:.1f} MiB  "
                     f"first token p50 {gen['ttft_p50_s']:.2f}s p99 {gen['ttft_p99_s']:.2f}s")
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
           "generated_tokens", "wall_s")
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
