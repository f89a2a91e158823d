"""`GenerateActor`: the Ray Data map_batches step that generates each row's continuation.

Each call takes a tokenized Arrow batch (`[bos] + tokens(prompt)` per row), builds each row's
`SamplingParams` (its `--sampling-params-column` value over the CLI defaults; a row without a
seed gets one derived from the run's `--seed` and its id, so its output never depends on its
batch, its replica or a resume), and lets the engine generate them all with continuous batching
(`Engine.generate`). Bad parameters (or a prompt + max_tokens beyond max_model_len) are that
row's error, naming the field; a row whose logits were not finite at a step gets the engine's
`Generation.error` (a failed row, as in scoring). Loading, fault handling and statistics are the
replica actor's.
"""

from __future__ import annotations

import hashlib
import json
import time

from dsv4batch.actors.replica import Answer, ReplicaActor
from dsv4batch.actors.score import failed_rows, read_ids
from dsv4batch.jobspec import schema as S
from dsv4batch.jobspec.config import GenerateConfig


class GenerateActor(ReplicaActor):
    """The generation step: per row, its generated text, ids, finish reason (and logprobs)."""

    @staticmethod
    def spec(config: GenerateConfig) -> S.StageSpec:
        openai = (S.OPENAI_SAMPLING, S.OPENAI_META) if config.is_openai else ()
        reads = (S.ID, S.INPUT_IDS, S.ERROR, *config.row_columns(), *openai, *config.keep_columns)
        return S.StageSpec("generate", reads, tuple(config.output_columns()))

    def prepare(self, batch, errors: list) -> list:
        """Each row's `SamplingParams`; a bad one is the row's error (an input problem)."""
        return row_params(batch, self.config, errors)

    def process(self, batch, errors: list, isolate: str | None, params: list, incoming: list) -> Answer:
        from dsv4batch.model.stats import StepStats

        ids = read_ids(batch)
        results: list = [None] * batch.num_rows
        stats = StepStats()
        if not isolate:
            todo = [i for i in range(batch.num_rows) if errors[i] is None]
            stats = self.run_rows(lambda rows: self._generate([ids[i].tolist() for i in rows],
                                                              [params[i] for i in rows]), todo, results, errors)
            failed_rows(results, errors)  # stopped on non-finite logits
        done = [r for r, e in zip(results, errors) if r is not None and e is None]
        table = build_output(batch, results, errors, self.config)
        if self.config.is_openai:  # each request line's response needs its line, metadata and status
            table = add_openai_columns(table, batch, errors, incoming)
        return Answer(table, stats,
                      input_tokens=sum(r.num_prompt_tokens for r in done),
                      output_tokens=sum(len(r.token_ids) for r in done), ttft_s=tuple(r.ttft_s for r in done))


    def _generate(self, prompts, params):
        if hasattr(self.engine, "ranks"):  # a --tp replica's loop runs in its rank workers
            return self.engine.generate(prompts, params)
        try:
            return self.engine.generate(prompts, params, on_step=self._report)
        finally:  # the batch's tokens now count in its BatchStats
            self._report(None, 0, 0, force=True)

    def _report(self, stats, running: int, waiting: int, force: bool = False) -> None:
        """At most once a second: the generation loop's state (this batch's tokens so far) to
        the driver's live line."""
        now = time.monotonic()
        if self.stats is None or (not force and now - getattr(self, "_reported", 0.0) < LIVE_EVERY_S):
            return
        self._reported = now
        self.stats.record_live.remote(self.actor_id, {"running": running, "waiting": waiting,
                                                       "generated": stats.num_generated if stats else 0})


LIVE_EVERY_S = 1.0


def row_seed(run_seed: int, row_id) -> int:
    """The seed of a row without its own: a 63-bit digest of the run's seed and the row's id."""
    digest = hashlib.blake2b(repr((run_seed, row_id)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def row_params(batch, config: GenerateConfig, errors: list) -> list:
    """Each row's `SamplingParams` (None for a row with an error; a bad value becomes its error)."""
    from dsv4batch.model.sampling import SamplingParams

    defaults = config.sampling_defaults()
    column = config.params_column()
    values = batch[column].to_pylist() if column else [None] * batch.num_rows
    lengths = batch[S.INPUT_IDS].combine_chunks().value_lengths().to_pylist()
    out = []
    for i, (row_id, value) in enumerate(zip(batch[S.ID].to_pylist(), values)):
        if errors[i] is not None:
            out.append(None)
            continue
        try:
            given = _mapping(value)
            if given.get("top_logprobs", config.top_logprobs) != config.top_logprobs:
                raise ValueError("top_logprobs is one value for the whole run (--top-logprobs: the output's "
                                 "columns), not per row")
            params = SamplingParams.from_dict({**given, "seed": given.get("seed", row_seed(config.seed, row_id))},
                                              defaults)
            if lengths[i] + params.max_tokens > config.max_model_len:
                raise ValueError(f"max_tokens {params.max_tokens} + the prompt's {lengths[i]} tokens is more "
                                 f"than max_model_len={config.max_model_len}")
        except (ValueError, TypeError) as exc:
            errors[i] = f"sampling_params: {exc}"[:500]
            out.append(None)
            continue
        out.append(params)
    return out


def add_openai_columns(table, batch, errors: list, incoming: list):
    """`schema.OPENAI_COLUMNS` before `error`: the line, the response metadata, the status code
    (200 generated, 400 a bad request: an input problem, 500 its generation failed)."""
    import pyarrow as pa

    status = [200 if e is None else 400 if bad else 500 for e, bad in zip(errors, incoming)]
    at = table.column_names.index(S.ERROR)
    for name, column in ((S.OPENAI_LINE, batch[S.OPENAI_LINE]), (S.OPENAI_META, batch[S.OPENAI_META]),
                         (S.OPENAI_STATUS, pa.array(status, pa.int16()))):
        table = table.add_column(at, name, column)
        at += 1
    return table


def _mapping(value) -> dict:
    """A row's sampling parameters column value as a dict (a struct, a JSON object text, or null);
    a struct's null fields are left out (they take the defaults)."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a JSON object ({exc.msg})") from None
    if not isinstance(value, dict):
        raise ValueError(f"expected an object of sampling parameters, got {type(value).__name__}")
    return {k: v for k, v in value.items() if v is not None}


def build_output(batch, results: list, errors: list, config: GenerateConfig):
    """The output table in `schema.generate_schema` order; results[i]: the row's
    `generate.Generation`, None with an error."""
    import numpy as np
    import pyarrow as pa

    from dsv4batch.actors.score import nested

    ok = [r if e is None else None for r, e in zip(results, errors)]
    cols = {
        S.ID: batch[S.ID],
        "num_prompt_tokens": pa.array([r.num_prompt_tokens if r else None for r in ok], pa.int32()),
        "generated_text": pa.array([r.text if r else None for r in ok], pa.string()),
        "generated_token_ids": pa.array([r.token_ids if r else None for r in ok], pa.list_(pa.int32())),
        "num_generated_tokens": pa.array([len(r.token_ids) if r else None for r in ok], pa.int32()),
        "finish_reason": pa.array([r.finish_reason if r else None for r in ok], pa.string()),
        "stop_reason": pa.array([None if r is None or r.stop_reason is None else str(r.stop_reason)
                                 for r in ok], pa.string()),
    }
    if config.logprobs:
        cols[S.GENERATED_LOGPROBS] = pa.array([r.logprobs.astype(np.float32) if r else None for r in ok],
                                              pa.list_(pa.float32()))
    if config.top_logprobs:
        k = config.top_logprobs
        cols[S.TOP_IDS] = nested([r.top_ids if r else None for r in ok], k, pa.int32())
        cols[S.TOP_LOGPROBS] = nested([r.top_logprobs if r else None for r in ok], k, pa.float32())
    cols[S.ERROR] = pa.array(errors, pa.string())
    for c in config.keep_columns:
        cols[c] = batch[c]
    return pa.table(cols)
