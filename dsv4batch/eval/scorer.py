"""Where the lm-eval backend's token requests are scored: in this process or on Ray Data.

A request is (ids, n): the whole token sequence fed to the model (at most `max_model_len` ids)
and how many of its trailing ids are scored. Both scorers answer every request with
(sum of the n scored logprobs, whether each of the n tokens was the argmax at its position).

- `LocalScorer`: one `Engine` here; requests sorted by length (longest first, like the `hf`
  backend) go `config.batch_size` at a time into one `Engine.score_details` call each, which
  packs them into forward steps of `max_batched_tokens` tokens.
- `RayScorer`: the requests become a Ray dataset that runs through the same scoring stage as
  `dsv4batch score` (`pipeline.score_tokenized`: `ScoringActor` replicas on the cluster),
  `config.batch_size` requests per actor batch.
Identical requests are scored once.
"""

from __future__ import annotations

import sys
import time

from dsv4batch.pipeline.config import ScoreConfig

Request = tuple[list[int], int]  # (the ids fed, how many trailing ids are scored)


def _unique(requests: list[Request]) -> tuple[list[Request], list[int]]:
    """(distinct requests, for each request the index of its distinct one)."""
    index: dict = {}
    where = [index.setdefault((tuple(ids), n), len(index)) for ids, n in requests]
    return [(list(k[0]), k[1]) for k in index], where


class Scorer:
    """Base: dedupe, score the distinct requests, spread the answers back; timing in `stats`."""

    def __init__(self, config: ScoreConfig, log=None):
        self.config = config
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.stats = {"requests": 0, "scored_requests": 0, "tokens": 0, "seconds": 0.0}

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

    def close(self) -> None:
        pass


class LocalScorer(Scorer):
    """The engine in this process (CUDA when `device` allows and a GPU is there)."""

    def __init__(self, config: ScoreConfig, device: str | None = None, log=None):
        super().__init__(config, log)
        import torch

        from dsv4batch.pipeline.stages.replica import load_engine

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


class RayScorer(Scorer):
    """`pipeline.score_tokenized` on Ray (joined at `config.ray_address`, else started here)."""

    def __init__(self, config: ScoreConfig, log=None):
        super().__init__(config, log)
        from dsv4batch.pipeline.cluster import configure_data_context, connect
        from dsv4batch.pipeline.graph import resolve

        self.started = connect(config.ray_address)
        configure_data_context(progress_bars=config.progress)
        self.config = resolve(config)

    def _score(self, requests: list[Request]) -> list[tuple[float, bool]]:
        import numpy as np
        import pyarrow as pa
        import ray

        from dsv4batch.pipeline import schema as S
        from dsv4batch.pipeline.graph import score_tokenized
        from dsv4batch.pipeline.metrics import start_collector

        lengths = np.array([len(ids) for ids, _ in requests], np.int64)
        offsets = np.zeros(len(requests) + 1, np.int32)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.fromiter((t for ids, _ in requests for t in ids), np.int32, int(offsets[-1]))
        table = pa.table({S.ID: pa.array(np.arange(len(requests), dtype=np.int64)),
                          S.INPUT_IDS: pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat)),
                          S.NUM_SCORED: pa.array([n for _, n in requests], pa.int32()),
                          S.ERROR: pa.nulls(len(requests), pa.string())})
        rows = self.config.batch_size * 4
        blocks = [table.slice(i, rows) for i in range(0, table.num_rows, rows)]
        collector = start_collector(0)
        try:
            scores = score_tokenized(ray.data.from_arrow(blocks), self.config, stats=collector)
            out: list = [None] * len(requests)
            for b in scores.select_columns([S.ID, "logprob_sum", "is_greedy", S.ERROR]) \
                    .iter_batches(batch_format="pyarrow", batch_size=4096):
                for i, lp, greedy, err in zip(*(b[c].to_pylist() for c in b.column_names)):
                    if err is not None:
                        raise RuntimeError(f"request {i} ({len(requests[i][0])} tokens) could "
                                           f"not be scored: {err}")
                    out[i] = (float(lp), bool(greedy))
        finally:
            ray.kill(collector)
            if self.config.tp > 1:
                from dsv4batch.pipeline.stages.shards import release_groups

                release_groups()  # this call's replicas are done: free their GPUs for the next
        missing = [i for i, o in enumerate(out) if o is None]
        if missing:
            raise RuntimeError(f"{len(missing)} request(s) came back without a score")
        return out

    def close(self) -> None:
        import ray

        if self.started:
            ray.shutdown()


def make_scorer(config: ScoreConfig, device: str | None = None, log=None) -> Scorer:
    """`RayScorer` when `config` asks for replicas, ranks (--tp) or a Ray cluster (or
    RAY_ADDRESS is set), else `LocalScorer`."""
    import os

    if config.replicas > 1 or config.tp > 1 or config.ray_address or os.environ.get("RAY_ADDRESS"):
        return RayScorer(config, log)
    return LocalScorer(config, device, log)
