"""`ReplicaActor`: what every Ray Data step that owns a DSv4 model replica does around its work.

The model is loaded once in `__init__` (`engine.load_engine`: one `Engine`, or a `ShardedEngine`
over a --tp replica's rank workers); each call takes a tokenized Arrow batch and returns one
output row per input row (the subclass's `process`: `ScoringActor`, `GenerateActor`). Per-batch
stats go to the driver's `StatsCollector` (when given) and to `ray.util.metrics`. A request the
model rejects becomes that row's `error`, not a failed batch.

Faults: an attempt where the engine fails for every row raises `BatchError`, which Ray Data
retries; the collector's ledger counts attempts (crashed ones included), and a batch past
`max_batch_attempts` is answered with row errors instead of being processed again. Rows whose
processing failed are reported to the ledger, which stops the job past `max_errored_rows`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable

from dsv4batch.actors.engine import load_engine
from dsv4batch.actors.guard import BatchGuard
from dsv4batch.actors.telemetry import ActorTelemetry
from dsv4batch.actors.watchdog import Watchdog
from dsv4batch.jobspec import schema as S
from dsv4batch.jobspec.errors import BatchError, ReplicaLost, row_error
from dsv4batch.jobspec.stats import BatchStats
from dsv4batch.model.stats import StepStats


@dataclass
class Answer:
    """A processed batch: its output table and what the engine did for it."""

    table: Any  # pyarrow.Table, one row per input row
    model_stats: StepStats
    input_tokens: int = 0  # tokens of the rows answered without an error
    output_tokens: int = 0  # scored or generated tokens of those rows
    ttft_s: tuple = ()  # generation: per row, seconds to its first token


class ReplicaActor:
    # how the engine is loaded (a subclass may load another: bench/stream.py measures the
    # pipeline without a forward)
    load = staticmethod(load_engine)

    def __init__(self, config, stats: Any = None, num_gpus: float = 0.0):
        t0 = time.perf_counter()
        self.config, self.stats = config, stats
        self.guard = BatchGuard(stats, config.max_batch_attempts)
        try:
            self.engine, self.device, self.dtype = self.load(config, num_gpus)
        except Exception as exc:  # recorded by type here: the driver explains the stop with it
            self.guard.load_failed(exc)
            raise
        self.telemetry = ActorTelemetry(config.model)
        self.actor_id, self.node_id, self.watchdog = f"local-{os.getpid()}", None, None
        try:
            import ray

            if ray.is_initialized() and ray.get_runtime_context().get_actor_id():
                ctx = ray.get_runtime_context()
                self.actor_id, self.node_id = ctx.get_actor_id(), ctx.get_node_id()
                # only in a Ray actor: the watchdog kills the process it runs in
                self.watchdog = Watchdog(config.batch_timeout_s)
        except Exception:
            pass
        import torch

        from dsv4batch import kernels

        self.info = {"actor_id": self.actor_id, "node_id": self.node_id, "pid": os.getpid(),
                     "device": self.device, "dtype": self.dtype, "head_precision": self.engine.head_precision,
                     "attn_kernel": self.engine.attn_kernel, "load_s": time.perf_counter() - t0,
                     "torch_threads": torch.get_num_threads(),
                     "cpu_kernels": kernels.selection() if self.device == "cpu" else None,
                     **({"ranks": self.engine.ranks} if hasattr(self.engine, "ranks") else {})}
        if stats is not None:
            stats.register_actor.remote(self.info)

    @staticmethod
    def spec(config) -> S.StageSpec:
        raise NotImplementedError

    def prepare(self, batch, errors: list) -> Any:
        """What `process` needs from the rows before the model runs; sets the `errors` entries of
        rows with an input problem (they are answers, not failures). Default: nothing."""
        return None

    def process(self, batch, errors: list, isolate: str | None, prepared: Any, incoming: list) -> Answer:
        """The output of `batch`; `errors` [rows]: each row's error so far (None: to process),
        filled in for rows that fail; `isolate`: an error to answer every row with instead;
        `prepared`: what `prepare` returned; `incoming` [rows]: whether the row's error is an
        input problem (set before the model ran)."""
        raise NotImplementedError

    def __call__(self, batch):
        if self.watchdog is None:
            return self._answer(batch)
        self.watchdog.busy()
        try:
            return self._answer(batch)
        finally:
            self.watchdog.idle()

    def _answer(self, batch):
        t_start, p0 = time.time(), time.perf_counter()
        spec = self.spec(self.config)
        S.check_columns(spec.name, spec.reads, batch.column_names, "batch")
        errors = batch[S.ERROR].to_pylist()
        prepared = self.prepare(batch, errors)
        incoming = [e is not None for e in errors]  # input problems: answers, not failures
        row_ids = batch[S.ID].to_pylist()
        key, isolate = self.guard.begin(row_ids)
        if isolate:  # this batch used up its attempts: answer its rows, do not process it again
            errors = [e if e is not None else isolate for e in errors]
        try:
            answer = self.process(batch, errors, isolate, prepared, incoming)
        except Exception as exc:
            self.guard.failed(key, row_error(exc))
            raise BatchError(f"batch from id {row_ids[0]!r}: {row_error(exc)}") from exc
        ok = sum(e is None for e in errors)
        failed = [i for i in range(batch.num_rows) if errors[i] is not None and not incoming[i]]
        stats = BatchStats(**answer.model_stats.to_dict(), batches=1, rows=batch.num_rows, rows_scored=ok,
                           rows_errored=batch.num_rows - ok, rows_failed=len(failed),
                           input_tokens=answer.input_tokens, scored_tokens=answer.output_tokens,
                           ttft_s=list(answer.ttft_s), busy_s=time.perf_counter() - p0, t_first=t_start,
                           t_last=time.time())
        self.telemetry.record(stats)
        if self.stats is not None:
            self.stats.record_batch.remote(self.actor_id, stats)
        self.guard.end(key, len(failed), row_ids[0] if row_ids else None,
                       errors[failed[0]] if failed else None, bool(isolate))
        return answer.table

    @staticmethod
    def run_rows(call: Callable, todo: list[int], results: list, errors: list,
                 keep: Callable = lambda i, out: out) -> StepStats:
        """`call(rows)` -> (one output per row, StepStats) on rows `todo` at once; where that
        raises, row by row to find the cause: a failing row gets its `errors` entry, the others
        their `results` (`keep(i, output)`). Raises when every row failed for a reason that is
        not the rows' own (not a `ValueError`: the engine itself is broken, let Ray retry), and
        at once for `ReplicaLost` (a rank failed, not a row: the batch is retried)."""
        if not todo:
            return StepStats()
        try:
            outs, stats = call(todo)
        except ReplicaLost:
            raise
        except Exception:
            failures, stats = [], StepStats()
            for i in todo:
                try:
                    out, one = call([i])
                    results[i], stats = keep(i, out[0]), stats + one
                except ReplicaLost:
                    raise  # a rank died meanwhile: retry the batch, do not blame the row
                except Exception as exc:  # noqa: PERF203 - isolate the failing rows
                    errors[i] = row_error(exc)
                    failures.append(exc)
            if len(failures) == len(todo) and not isinstance(failures[0], ValueError):
                raise failures[0]  # the engine itself is broken: let Ray retry/restart
            return stats
        for i, out in zip(todo, outs):
            results[i] = keep(i, out)
        return stats
