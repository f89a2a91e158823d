"""`ScoringActor`: the Ray Data map_batches step that owns a DSv4 model replica.

The model is loaded once in `__init__`; each call takes a tokenized Arrow batch, lets the engine
pack its requests into forward steps of at most `max_batched_tokens` query tokens (long requests
span steps, short ones share one) with planned prefill chunks, and returns one output row per
input row. Per-batch stats go to the driver's `StatsCollector` (when given) and to
`ray.util.metrics`. A request the model rejects becomes that row's `error`, not a failed batch.

Faults: an attempt where the engine fails for every row raises `BatchError`, which Ray Data
retries; the collector's ledger counts attempts (crashed ones included), and a batch past
`max_batch_attempts` is answered with row errors instead of being scored again. Rows whose
scoring failed are reported to the ledger, which stops the job past `max_errored_rows`.
"""

from __future__ import annotations

import os
import time
from typing import Any

from dsv4batch.actors.errors import BatchError
from dsv4batch.actors.guard import BatchGuard
from dsv4batch.actors.loader import load_model
from dsv4batch.actors.results import build_output, error_text, read_requests
from dsv4batch.actors.telemetry import ActorTelemetry
from dsv4batch.pipeline import schema as S
from dsv4batch.pipeline.config import ScoreConfig

_SUM_STATS = ("num_steps", "num_chunks", "forward_s", "planner_s")


class ScoringActor:
    # how the model is loaded (a subclass may load another: bench/stream.py measures the
    # pipeline without a forward)
    load = staticmethod(load_model)

    @staticmethod
    def spec(config: ScoreConfig) -> S.StageSpec:
        truncated = config.truncate != "none"
        reads = (S.ID, S.INPUT_IDS, S.NUM_SCORED, *([S.NUM_TRUNCATED] if truncated else []),
                 S.ERROR, *config.keep_columns)
        return S.StageSpec("score", reads,
                           tuple(S.output_names(config.token_logprobs, truncated)))

    def __init__(self, config: ScoreConfig, stats: Any = None, num_gpus: float = 0.0):
        t0 = time.perf_counter()
        self.config, self.stats = config, stats
        self.model, self.device, self.dtype = self.load(config, num_gpus)
        self.telemetry = ActorTelemetry(config.model)
        self.actor_id, self.node_id = f"local-{os.getpid()}", None
        try:
            import ray

            if ray.is_initialized():
                ctx = ray.get_runtime_context()
                self.actor_id = ctx.get_actor_id() or self.actor_id
                self.node_id = ctx.get_node_id()
        except Exception:
            pass
        self.guard = BatchGuard(stats, config.max_batch_attempts)
        self.info = {"actor_id": self.actor_id, "node_id": self.node_id, "pid": os.getpid(),
                     "device": self.device, "dtype": self.dtype,
                     "load_s": time.perf_counter() - t0}
        if stats is not None:
            stats.register_actor.remote(self.info)

    def __call__(self, batch):
        t_start, p0 = time.time(), time.perf_counter()
        S.check_columns("score", self.spec(self.config).reads, batch.column_names, "batch")
        ids, scored, errors = read_requests(batch)
        incoming = [e is not None for e in errors]
        lengths = [len(x) for x in ids]
        logprobs: list = [None] * batch.num_rows
        row_ids = batch[S.ID].to_pylist()
        key, isolate = self.guard.begin(row_ids)
        model_stats = {k: 0 for k in _SUM_STATS} | {"peak_workspace_bytes": 0, "model_calls": 0}
        if isolate:  # this batch used up its attempts: answer its rows, do not score it again
            errors = [e if e is not None else isolate for e in errors]
        else:
            todo = []
            for i in range(batch.num_rows):
                if errors[i] is None:
                    if scored[i] > 0:
                        todo.append(i)
                    else:  # e.g. empty text: nothing to score, zero scored tokens, no error
                        logprobs[i] = ids[i][:0].astype("float32")
            try:
                model_stats = self._score(ids, scored, todo, logprobs, errors)
            except Exception as exc:
                self.guard.failed(key, error_text(exc))
                raise BatchError(f"batch from id {row_ids[0]!r}: {error_text(exc)}") from exc
        out = build_output(batch, lengths, scored, logprobs, errors, self.config)
        ok = [i for i in range(batch.num_rows) if errors[i] is None]
        failed = [i for i in range(batch.num_rows) if errors[i] is not None and not incoming[i]]
        stats = {"t_start": t_start, "t_end": time.time(), "busy_s": time.perf_counter() - p0,
                 "rows": batch.num_rows, "rows_scored": len(ok),
                 "rows_errored": batch.num_rows - len(ok), "rows_failed": len(failed),
                 "input_tokens": int(sum(lengths[i] for i in ok)),
                 "scored_tokens": int(sum(int(scored[i]) for i in ok)), **model_stats}
        self.telemetry.record(stats)
        if self.stats is not None:
            self.stats.record_batch.remote(self.actor_id, stats)
        self.guard.end(key, len(failed), row_ids[0] if row_ids else None,
                       errors[failed[0]] if failed else None, bool(isolate))
        return out

    def _score(self, ids, scored, todo, logprobs, errors) -> dict:
        """Score rows `todo` in one engine call; if it fails, row by row to isolate the cause."""
        agg = {k: 0 for k in _SUM_STATS} | {"peak_workspace_bytes": 0, "model_calls": 0}
        if not todo:
            return agg
        try:
            outs = self._call([ids[i] for i in todo], agg)
        except Exception:
            failures = []
            for i in todo:
                try:
                    logprobs[i] = self._call([ids[i]], agg)[0][-int(scored[i]):]
                except Exception as exc:  # noqa: PERF203 - isolate the failing rows
                    errors[i] = error_text(exc)
                    failures.append(exc)
            if len(failures) == len(todo) and not isinstance(failures[0], ValueError):
                raise failures[0]  # the engine itself is broken: let Ray retry/restart
            return agg
        for i, lp in zip(todo, outs):
            logprobs[i] = lp[-int(scored[i]):]
        return agg

    def _call(self, requests, agg: dict) -> list:
        outs = self.model.score_tokens([r.tolist() for r in requests])
        st = getattr(self.model, "last_stats", None) or {}
        for k in _SUM_STATS:
            agg[k] += st.get(k, 0) or 0
        agg["peak_workspace_bytes"] = max(agg["peak_workspace_bytes"],
                                          int(st.get("peak_workspace_bytes", 0) or 0))
        agg["model_calls"] += 1
        if len(outs) != len(requests):
            raise RuntimeError(f"model returned {len(outs)} results for {len(requests)} requests")
        return outs
