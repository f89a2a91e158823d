"""`ScoringActor`: the Ray Data map_batches step that owns a DSv4 model replica.

The model is loaded once in `__init__`; each call takes a tokenized Arrow batch, lets the engine
pack its requests into forward steps of at most `max_batched_tokens` query tokens (long requests
span steps, short ones share one) with planned prefill chunks (`Engine.score_details`: per
position the logprob, whether the token was the argmax, and the top `--top-logprobs` tokens),
and returns one output row per input row. Per-batch stats go to the driver's `StatsCollector` (when given) and to
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

from dsv4batch.model.stats import StepStats
from dsv4batch.pipeline import schema as S
from dsv4batch.pipeline.config import ScoreConfig
from dsv4batch.pipeline.errors import BatchError, ReplicaLost, row_error
from dsv4batch.pipeline.faults import BatchGuard
from dsv4batch.pipeline.stages.replica import load_engine
from dsv4batch.pipeline.stages.telemetry import ActorTelemetry
from dsv4batch.pipeline.stages.watchdog import Watchdog
from dsv4batch.pipeline.stats import BatchStats


class ScoringActor:
    # how the engine is loaded (a subclass may load another: bench/stream.py measures the
    # pipeline without a forward)
    load = staticmethod(load_engine)

    @staticmethod
    def spec(config: ScoreConfig) -> S.StageSpec:
        truncated = config.truncate != "none"
        reads = (S.ID, S.INPUT_IDS, S.NUM_SCORED, *([S.NUM_TRUNCATED] if truncated else []),
                 S.ERROR, *config.keep_columns)
        return S.StageSpec("score", reads, tuple(S.output_names(
            config.token_logprobs, truncated, config.top_logprobs)))

    def __init__(self, config: ScoreConfig, stats: Any = None, num_gpus: float = 0.0):
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

        self.info = {"actor_id": self.actor_id, "node_id": self.node_id, "pid": os.getpid(),
                     "device": self.device, "dtype": self.dtype, "head_precision": self.engine.head_precision,
                     "attn_kernel": self.engine.attn_kernel, "load_s": time.perf_counter() - t0,
                     "torch_threads": torch.get_num_threads(),
                     **({"ranks": self.engine.ranks} if hasattr(self.engine, "ranks") else {})}
        if stats is not None:
            stats.register_actor.remote(self.info)

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
        S.check_columns("score", self.spec(self.config).reads, batch.column_names, "batch")
        ids, scored, errors = read_requests(batch)
        incoming = [e is not None for e in errors]
        lengths = [len(x) for x in ids]
        results: list = [None] * batch.num_rows  # per row: `TokenScores` of its scored tokens
        row_ids = batch[S.ID].to_pylist()
        key, isolate = self.guard.begin(row_ids)
        model_stats = StepStats()
        if isolate:  # this batch used up its attempts: answer its rows, do not score it again
            errors = [e if e is not None else isolate for e in errors]
        else:
            todo = []
            for i in range(batch.num_rows):
                if errors[i] is None:
                    if scored[i] > 0:
                        todo.append(i)
                    else:  # e.g. empty text: nothing to score, zero scored tokens, no error
                        results[i] = no_scores(self.config.top_logprobs)
            try:
                model_stats = self._score(ids, scored, todo, results, errors)
            except Exception as exc:
                self.guard.failed(key, row_error(exc))
                raise BatchError(f"batch from id {row_ids[0]!r}: {row_error(exc)}") from exc
        out = build_output(batch, lengths, scored, results, errors, self.config)
        ok = [i for i in range(batch.num_rows) if errors[i] is None]
        failed = [i for i in range(batch.num_rows) if errors[i] is not None and not incoming[i]]
        stats = BatchStats(**model_stats.to_dict(), batches=1, rows=batch.num_rows,
                           rows_scored=len(ok), rows_errored=batch.num_rows - len(ok),
                           rows_failed=len(failed),
                           input_tokens=int(sum(lengths[i] for i in ok)),
                           scored_tokens=int(sum(int(scored[i]) for i in ok)),
                           busy_s=time.perf_counter() - p0, t_first=t_start, t_last=time.time())
        self.telemetry.record(stats)
        if self.stats is not None:
            self.stats.record_batch.remote(self.actor_id, stats)
        self.guard.end(key, len(failed), row_ids[0] if row_ids else None,
                       errors[failed[0]] if failed else None, bool(isolate))
        return out

    def _score(self, ids, scored, todo, results, errors) -> StepStats:
        """Score rows `todo` in one engine call; if it fails, row by row to isolate the cause.
        Sets `results[i]` to the `TokenScores` of row i's last `scored[i]` positions."""
        if not todo:
            return StepStats()
        try:
            outs, stats = self._call([ids[i] for i in todo])
        except ReplicaLost:
            raise  # a rank failed, not a row: the whole batch is retried on the restarted ranks
        except Exception:
            failures, stats = [], StepStats()
            for i in todo:
                try:
                    out, one = self._call([ids[i]])
                    results[i], stats = tail(out[0], int(scored[i])), stats + one
                except ReplicaLost:
                    raise  # a rank died meanwhile: retry the batch, do not blame the row
                except Exception as exc:  # noqa: PERF203 - isolate the failing rows
                    errors[i] = row_error(exc)
                    failures.append(exc)
            if len(failures) == len(todo) and not isinstance(failures[0], ValueError):
                raise failures[0]  # the engine itself is broken: let Ray retry/restart
            return stats
        for i, ts in zip(todo, outs):
            results[i] = tail(ts, int(scored[i]))
        return stats

    def _call(self, requests) -> tuple[list, StepStats]:
        outs, stats = self.engine.score_details([r.tolist() for r in requests],
                                                top_k=self.config.top_logprobs)
        if len(outs) != len(requests):
            raise RuntimeError(f"model returned {len(outs)} results for {len(requests)} requests")
        return outs, stats


# -- the output columns ----------------------------------------------------------------------

def read_requests(batch):
    """(token id lists, scored-token counts, incoming errors) from a tokenized Arrow batch."""
    import numpy as np

    col = batch[S.INPUT_IDS].combine_chunks()
    offsets = col.offsets.to_numpy()
    values = col.values.to_numpy(zero_copy_only=False)
    ids = [values[offsets[i]:offsets[i + 1]] for i in range(len(col))]
    scored = batch[S.NUM_SCORED].to_numpy(zero_copy_only=False).astype(np.int64)
    return ids, scored, batch[S.ERROR].to_pylist()


def tail(scores, n: int):
    """The last `n` positions of a `TokenScores` (each field [len - 1, ...] cut alike)."""
    return type(scores)(*(f[len(f) - n:] for f in scores))


def no_scores(top_k: int):
    """The `TokenScores` of a row with nothing to score (zero positions)."""
    import numpy as np

    from dsv4batch.model import TokenScores

    return TokenScores(logprobs=np.zeros(0, np.float32), is_greedy=np.zeros(0, bool),
                       top_ids=np.zeros((0, top_k), np.int32),
                       top_logprobs=np.zeros((0, top_k), np.float32))


def nested(rows, k: int, pa_type):
    """list<list<pa_type>> from per-row arrays [n_i, k] (None: a null row)."""
    import numpy as np
    import pyarrow as pa

    valid = [r is not None for r in rows]
    counts = np.array([len(r) if r is not None else 0 for r in rows], np.int64)
    outer = np.zeros(len(rows) + 1, np.int32)
    np.cumsum(counts, out=outer[1:])
    parts = [np.asarray(r).reshape(-1, k) for r in rows if r is not None]
    flat = np.concatenate(parts) if parts else np.zeros((0, k), pa_type.to_pandas_dtype())
    inner = pa.ListArray.from_arrays(pa.array(np.arange(0, flat.size + 1, k, dtype=np.int32)),
                                     pa.array(flat.reshape(-1), pa_type))
    return pa.ListArray.from_arrays(pa.array(outer), inner,
                                    mask=pa.array(~np.array(valid, bool)))


def build_output(batch, lengths, scored, results, errors, config):
    """Output table in `schema.output_schema` order for `config` (a `ScoreConfig`).

    lengths[i]: tokens fed for row i (0 when errored); results[i]: the `TokenScores` of the
    row's scored positions (logprobs float32 [scored[i]], is_greedy bool [scored[i]], top_ids
    int32 / top_logprobs float32 [scored[i], top_logprobs]) or None when the row has an error.
    """
    import numpy as np
    import pyarrow as pa

    n = batch.num_rows
    sums = np.full(n, np.nan)
    valid = np.zeros(n, bool)
    greedy = np.zeros(n, bool)
    for i, r in enumerate(results):
        if r is not None and errors[i] is None:
            sums[i] = float(np.sum(r.logprobs, dtype=np.float64))
            greedy[i] = bool(np.all(r.is_greedy))
            valid[i] = True
    num_scored = np.where(valid, scored, 0).astype(np.int32)
    with np.errstate(invalid="ignore", divide="ignore"):
        means = sums / num_scored
    has_mean = valid & (num_scored > 0)
    ppl = np.exp(-means, where=has_mean, out=np.full(n, np.nan))
    cols = {
        S.ID: batch[S.ID],
        "num_tokens": pa.array(np.where(valid, lengths, 0).astype(np.int32)),
        "num_scored_tokens": pa.array(num_scored),
        "logprob_sum": pa.array(sums, mask=~valid),
        "logprob_mean": pa.array(means, mask=~has_mean),
        "perplexity": pa.array(ppl, mask=~has_mean),
        "is_greedy": pa.array(greedy, mask=~valid),
    }
    if config.token_logprobs:
        cols[S.TOKEN_LOGPROBS] = pa.array(
            [r.logprobs.astype(np.float32) if v else None for r, v in zip(results, valid)],
            pa.list_(pa.float32()))
    if config.top_logprobs:
        k = config.top_logprobs
        cols[S.TOP_IDS] = nested([r.top_ids if v else None for r, v in zip(results, valid)],
                                 k, pa.int32())
        cols[S.TOP_LOGPROBS] = nested(
            [r.top_logprobs if v else None for r, v in zip(results, valid)], k, pa.float32())
    if config.truncate != "none":  # tokens dropped to fit max_model_len (0: the row fit)
        cols[S.TRUNCATED] = batch[S.NUM_TRUNCATED]
    cols[S.ERROR] = pa.array(errors, pa.string())
    for c in config.keep_columns:
        cols[c] = batch[c]
    return pa.table(cols)
