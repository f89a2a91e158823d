"""Turn per-request log-probabilities into the output columns (one row per input row)."""

from __future__ import annotations

from dsv4batch.pipeline import schema as S


def read_requests(batch):
    """(token id lists, scored-token counts, incoming errors) from a tokenized Arrow batch."""
    import numpy as np

    col = batch[S.INPUT_IDS].combine_chunks()
    offsets = col.offsets.to_numpy()
    values = col.values.to_numpy(zero_copy_only=False)
    ids = [values[offsets[i]:offsets[i + 1]] for i in range(len(col))]
    scored = batch[S.NUM_SCORED].to_numpy(zero_copy_only=False).astype(np.int64)
    return ids, scored, batch[S.ERROR].to_pylist()


def build_output(batch, lengths, scored, logprobs, errors, config):
    """Output table in `schema.output_schema` order for `config` (a `ScoreConfig`).

    lengths[i]: tokens fed for row i (0 when errored); logprobs[i]: the row's scored log-probs
    (a float32 array of length scored[i]) or None when the row has an error.
    """
    import numpy as np
    import pyarrow as pa

    n = batch.num_rows
    sums = np.full(n, np.nan)
    valid = np.zeros(n, bool)
    for i, lp in enumerate(logprobs):
        if lp is not None and errors[i] is None:
            sums[i] = float(np.sum(lp, dtype=np.float64))
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
    }
    if config.token_logprobs:
        cols[S.TOKEN_LOGPROBS] = pa.array(
            [lp.astype(np.float32) if v else None for lp, v in zip(logprobs, valid)],
            pa.list_(pa.float32()))
    if config.truncate != "none":  # tokens dropped to fit max_model_len (0: the row fit)
        cols[S.TRUNCATED] = batch[S.NUM_TRUNCATED]
    cols[S.ERROR] = pa.array(errors, pa.string())
    for c in config.keep_columns:
        cols[c] = batch[c]
    return pa.table(cols)


def error_text(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {msg}"[:500]

