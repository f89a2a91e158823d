"""Where the lm-eval backend's token requests are scored or generated: here or on Ray Data.

A scoring request is (ids, n): the whole token sequence fed to the model (at most
`max_model_len` ids) and how many of its trailing ids are scored. Both scorers answer every
request with (sum of the n scored logprobs, whether each of the n tokens was the argmax at its
position). A generation request is (prompt ids, `SamplingParams`), answered with the
`Generated` token ids (EOS included when it ended the request) and finish reason; no padding
anywhere: the engine batches requests continuously.

- `LocalScorer`: one `Engine` here; requests sorted by length (longest first, like the `hf`
  backend) go `config.batch_size` at a time into one `Engine.score_details` call each, which
  packs them into forward steps of `max_batched_tokens` tokens. `generate` gives each list it
  is handed to `Engine.generate` (the caller sizes them).
- `RayScorer`: the requests become a Ray dataset that runs through the same scoring stage as
  `dsv4batch score` (`pipeline.score_tokenized`: `ScoringActor` replicas on the cluster),
  `config.batch_size` requests per actor batch; generation likewise through the stage of
  `dsv4batch generate` (`pipeline.generate_tokenized`: `GenerateActor` replicas), each row's
  sampling parameters as JSON text.
Identical scoring requests are scored once (identical generation requests may sample
differently: they are all generated).
"""

from __future__ import annotations

import sys
import time
from typing import NamedTuple

from dsv4batch.jobspec.config import ScoreConfig

Request = tuple[list[int], int]  # (the ids fed, how many trailing ids are scored)
SAMPLING_COLUMN = "sampling_params"  # the Ray rows' JSON sampling parameters


class Generated(NamedTuple):
    """One generation request's answer."""

    token_ids: list[int]  # generated ids, stop token / EOS included
    finish_reason: str  # "stop" | "length" | "eos"


def _unique(requests: list[Request]) -> tuple[list[Request], list[int]]:
    """(distinct requests, for each request the index of its distinct one)."""
    index: dict = {}
    where = [index.setdefault((tuple(ids), n), len(index)) for ids, n in requests]
    return [(list(k[0]), k[1]) for k in index], where


class Scorer:
    """Base: dedupe, score the distinct requests, spread the answers back; timing in `stats`.
    `splits_batches`: whether a call's requests are cut into `config.batch_size` batches here
    (Ray) or the caller must hand over one batch per call (local generation)."""

    splits_batches = False

    def __init__(self, config: ScoreConfig, log=None):
        self.config = config
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.stats = {"requests": 0, "scored_requests": 0, "tokens": 0, "seconds": 0.0,
                      "generations": 0, "generated_tokens": 0, "generate_seconds": 0.0}

    def score(self, requests: list[Request]) -> list[tuple[float, bool]]:
        """[(logprob sum, is_greedy)] per request, in order."""
        if not requests:
            return []
        distinct, where = _unique(requests)
        t0 = time.perf_counter()
        answers = self._score(distinct)
        self.stats["requests"] += len(requests)
        self.stats["scored_requests"] += len(distinct)
        self.stats["tokens"] += sum(len(ids) for ids, _ in distinct)
        self.stats["seconds"] += time.perf_counter() - t0
        return [answers[i] for i in where]

    def _score(self, requests: list[Request]) -> list[tuple[float, bool]]:
        raise NotImplementedError

    def generate(self, requests: list) -> list[Generated]:
        """[`Generated`] per (prompt ids, `SamplingParams`) request, in order. A request that
        cannot generate (prompt + max_tokens over max_model_len, ...) raises the engine's
        `ValueError` here, a `RuntimeError` naming it on Ray."""
        if not requests:
            return []
        t0 = time.perf_counter()
        answers = self._generate(requests)
        self.stats["generations"] += len(requests)
        self.stats["generated_tokens"] += sum(len(a.token_ids) for a in answers)
        self.stats["generate_seconds"] += time.perf_counter() - t0
        return answers

    def _generate(self, requests: list) -> list[Generated]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class LocalScorer(Scorer):
    """The engine in this process (CUDA when `device` allows and a GPU is there)."""

    def __init__(self, config: ScoreConfig, device: str | None = None, log=None):
        super().__init__(config, log)
        import torch

        from dsv4batch.actors.engine import load_engine

        gpus = 1.0 if torch.cuda.is_available() and not (device or "").startswith("cpu") else 0.0
        self.engine, self.device, self.dtype = load_engine(config, gpus)

    def _score(self, requests: list[Request]) -> list[tuple[float, bool]]:
        import numpy as np

        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][0]))
        out: list = [None] * len(requests)
        size = self.config.batch_size
        for start in range(0, len(order), size):
            chunk = order[start:start + size]
            details, _ = self.engine.score_details([requests[i][0] for i in chunk])
            for i, d in zip(chunk, details):
                n = requests[i][1]
                out[i] = (float(np.sum(d.logprobs[len(d.logprobs) - n:], dtype=np.float64)),
                          bool(np.all(d.is_greedy[len(d.is_greedy) - n:])))
        return out

    def _generate(self, requests: list) -> list[Generated]:
        generations, _ = self.engine.generate([ids for ids, _ in requests],
                                              [params for _, params in requests])
        return [Generated([int(t) for t in g.token_ids], g.finish_reason) for g in generations]


class RayScorer(Scorer):
    """`pipeline.score_tokenized` / `generate_tokenized` on Ray (joined at
    `config.ray_address`, else started here)."""

    splits_batches = True

    def __init__(self, config: ScoreConfig, log=None):
        super().__init__(config, log)
        from dsv4batch.pipeline.cluster import configure_data_context, connect
        from dsv4batch.pipeline.graph import resolve

        self.started = connect(config.ray_address)
        configure_data_context(progress_bars=config.progress)
        self.config = resolve(config)

    def _score(self, requests: list[Request]) -> list[tuple[float, bool]]:
        import pyarrow as pa

        from dsv4batch.jobspec import schema as S
        from dsv4batch.pipeline.graph import score_tokenized

        table = _requests_table([ids for ids, _ in requests],
                                {S.NUM_SCORED: pa.array([n for _, n in requests], pa.int32())})
        rows = self._run(table, lambda ds, stats: score_tokenized(ds, self.config, stats=stats),
                         ["logprob_sum", "is_greedy"])
        return [(float(lp), bool(greedy)) for lp, greedy in rows]

    def _generate(self, requests: list) -> list[Generated]:
        import json

        import pyarrow as pa

        from dsv4batch.pipeline.graph import generate_tokenized

        config = generate_config(self.config)
        table = _requests_table([ids for ids, _ in requests], {
            SAMPLING_COLUMN: pa.array([json.dumps(p.to_dict()) for _, p in requests], pa.string())})
        rows = self._run(table, lambda ds, stats: generate_tokenized(ds, config, stats=stats),
                         ["generated_token_ids", "finish_reason"])
        return [Generated(list(ids), reason) for ids, reason in rows]

    def _run(self, table, stage, columns: list[str]) -> list[tuple]:
        """`stage(dataset, stats)` over the request `table`; each request's `columns` in order.
        `RuntimeError` for a request that comes back with an error or not at all."""
        import ray

        from dsv4batch.jobspec import schema as S
        from dsv4batch.pipeline.metrics import start_collector

        rows = self.config.batch_size * 4
        blocks = [table.slice(i, rows) for i in range(0, table.num_rows, rows)]
        collector = start_collector(0)
        out: list = [None] * table.num_rows
        try:
            result = stage(ray.data.from_arrow(blocks), collector)
            for b in result.select_columns([S.ID, *columns, S.ERROR]) \
                    .iter_batches(batch_format="pyarrow", batch_size=4096):
                for i, *values, err in zip(*(b[c].to_pylist() for c in b.column_names)):
                    if err is not None:
                        raise RuntimeError(f"request {i} ({len(table[S.INPUT_IDS][i])} tokens) "
                                           f"failed: {err}")
                    out[i] = tuple(values)
        finally:
            ray.kill(collector)
            if self.config.tp > 1:
                from dsv4batch.actors.shards import release_groups

                release_groups()  # this call's replicas are done: free their GPUs for the next
        missing = [i for i, o in enumerate(out) if o is None]
        if missing:
            raise RuntimeError(f"{len(missing)} request(s) came back without an answer")
        return out

    def close(self) -> None:
        import ray

        if self.started:
            ray.shutdown()


def _requests_table(id_lists: list[list[int]], columns: dict):
    """The Arrow table of token-id requests: id (0..n-1), schema.INPUT_IDS, `columns`, error."""
    import numpy as np
    import pyarrow as pa

    from dsv4batch.jobspec import schema as S

    offsets = np.zeros(len(id_lists) + 1, np.int32)
    np.cumsum([len(ids) for ids in id_lists], out=offsets[1:])
    flat = np.fromiter((t for ids in id_lists for t in ids), np.int32, int(offsets[-1]))
    return pa.table({S.ID: pa.array(np.arange(len(id_lists), dtype=np.int64)),
                     S.INPUT_IDS: pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat)),
                     **columns, S.ERROR: pa.nulls(len(id_lists), pa.string())})


def generate_config(config: ScoreConfig):
    """The `GenerateConfig` of the generation stage: `config`'s shared fields (model, engine,
    resources), sampling parameters per row in `SAMPLING_COLUMN`."""
    from dsv4batch.jobspec.config import GenerateConfig, JobConfig

    shared = {k: v for k, v in config.to_dict().items() if k in JobConfig.model_fields}
    return GenerateConfig(**shared, sampling_params_column=SAMPLING_COLUMN)


def make_scorer(config: ScoreConfig, device: str | None = None, log=None) -> Scorer:
    """`RayScorer` when `config` asks for replicas, ranks (--tp) or a Ray cluster (or
    RAY_ADDRESS is set), else `LocalScorer`."""
    import os

    if config.replicas > 1 or config.tp > 1 or config.ray_address or os.environ.get("RAY_ADDRESS"):
        return RayScorer(config, log)
    return LocalScorer(config, device, log)
