"""`ScoringActor`: the Ray Data map_batches step that scores each row on a DSv4 model replica.

Each call takes a tokenized Arrow batch, lets the engine pack its requests into forward steps
of at most `max_batched_tokens` query tokens (long requests span steps, short ones share one)
with planned prefill chunks (`Engine.score_details`: per position the logprob, whether the token
was the argmax, and the top `--top-logprobs` tokens), and returns one output row per input row.
A row whose scores are not finite gets the engine's error ("non-finite logits at position N")
instead of NaN scores: a failed row (`failed_rows`).
Loading, fault handling and statistics are the replica actor's (`actors/replica.py`).
"""

from __future__ import annotations

from dsv4batch.actors.replica import Answer, ReplicaActor
from dsv4batch.jobspec import schema as S
from dsv4batch.jobspec.config import ScoreConfig
from dsv4batch.model.stats import StepStats


class ScoringActor(ReplicaActor):
    """The scoring step: per row, the logprobs of its scored tokens (`Engine.score_details`)."""

    @staticmethod
    def spec(config: ScoreConfig) -> S.StageSpec:
        truncated = config.truncate != "none"
        reads = (S.ID, S.INPUT_IDS, S.NUM_SCORED, *([S.NUM_TRUNCATED] if truncated else []),
                 S.ERROR, *config.keep_columns)
        return S.StageSpec("score", reads, tuple(config.output_columns()))

    def process(self, batch, errors: list, isolate: str | None, prepared=None, incoming=None) -> Answer:
        """Score the batch's rows (`isolate`: answer them all with that error instead)."""
        ids, scored, _ = read_requests(batch)
        lengths = [len(x) for x in ids]
        results: list = [None] * batch.num_rows  # per row: `TokenScores` of its scored tokens
        model_stats = StepStats()
        if not isolate:
            todo = []
            for i in range(batch.num_rows):
                if errors[i] is None:
                    if scored[i] > 0:
                        todo.append(i)
                    else:  # e.g. empty text: nothing to score, zero scored tokens, no error
                        results[i] = no_scores(self.config.top_logprobs)
            model_stats = self.run_rows(lambda rows: self._call([ids[i] for i in rows]), todo, results,
                                        errors, lambda i, out: tail(out, int(scored[i])))
            failed_rows(results, errors)
        out = build_output(batch, lengths, scored, results, errors, self.config)
        ok = [i for i in range(batch.num_rows) if errors[i] is None]
        return Answer(out, model_stats, input_tokens=int(sum(lengths[i] for i in ok)),
                      output_tokens=int(sum(int(scored[i]) for i in ok)))

    def _call(self, requests) -> tuple[list, StepStats]:
        outs, stats = self.engine.score_details([r.tolist() for r in requests],
                                                top_k=self.config.top_logprobs)
        if len(outs) != len(requests):
            raise RuntimeError(f"model returned {len(outs)} results for {len(requests)} requests")
        return outs, stats


def failed_rows(results: list, errors: list) -> None:
    """Give each row whose result carries an `error` (the engine's: non-finite logits, position
    N counted from the row's first scored token) that error: it failed, like a crashed batch's
    rows, and counts toward --max-errored-rows."""
    for i, r in enumerate(results):
        if r is not None and errors[i] is None and r.error is not None:
            errors[i] = r.error


# -- the output columns ----------------------------------------------------------------------

def read_ids(batch) -> list:
    """Each row's token ids (numpy int32 views) from a tokenized Arrow batch."""
    col = batch[S.INPUT_IDS].combine_chunks()
    offsets = col.offsets.to_numpy()
    values = col.values.to_numpy(zero_copy_only=False)
    return [values[offsets[i]:offsets[i + 1]] for i in range(len(col))]


def read_requests(batch):
    """(token id lists, scored-token counts, incoming errors) from a tokenized Arrow batch."""
    import numpy as np

    scored = batch[S.NUM_SCORED].to_numpy(zero_copy_only=False).astype(np.int64)
    return read_ids(batch), scored, batch[S.ERROR].to_pylist()


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
