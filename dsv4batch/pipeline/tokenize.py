"""Tokenize step: text (+ target) -> `[bos] + tokens(prompt) [+ tokens(target)]`.

Runs in an autoscaling pool of small CPU actors (tokenizer loaded once in `__init__`), apart
from the scoring actors, so tokenization overlaps the forward instead of running serially
before it (Ray Data only fuses task steps into an actor step, never two actor steps). Rows that
cannot be scored (null text or target, too many tokens) keep their place and get an `error`;
the scoring actor skips them. Every row in comes out exactly once, in order.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from dsv4batch.pipeline import schema as S
from dsv4batch.pipeline.config import ScoreConfig


def tokenizer_source(model: str) -> str | None:
    """The checkpoint's tokenizer.json when it has one, else None (the packaged DSv4 tokenizer).

    Same rule as `dsv4batch.model.loader`, so tokenize tasks and the model agree.
    """
    if model != "tiny" and os.path.isfile(os.path.join(model, "tokenizer.json")):
        return model
    return None


def bos_token_id(model: str) -> int:
    path = os.path.join(model, "config.json")
    if model != "tiny" and os.path.exists(path):
        with open(path) as f:
            bos = json.load(f).get("bos_token_id")
        if isinstance(bos, int):
            return bos
    return 0


class Tokenize:
    """Stateful tokenize step; `spec` lists the columns it reads and adds."""

    @staticmethod
    def spec(config: ScoreConfig) -> S.StageSpec:
        reads = (config.text_column, config.id_column, *config.keep_columns)
        if config.target_column:
            reads = (*reads, config.target_column)
        return S.StageSpec("tokenize", reads, (S.INPUT_IDS, S.NUM_SCORED, S.ERROR))

    def __init__(self, config: ScoreConfig, stats: Any = None):
        from dsv4batch.model.tokenizer import load_tokenizer

        self.config, self.stats = config, stats
        self.tokenizer = load_tokenizer(tokenizer_source(config.model))
        self.bos = bos_token_id(config.model)

    def _encode(self, texts: list) -> list[list[int] | None]:
        """Token ids per text; None for a null text. Bytes are decoded leniently."""
        strs = [t.decode("utf-8", "replace") if isinstance(t, bytes) else t for t in texts]
        present = [i for i, t in enumerate(strs) if t is not None]
        encs = self.tokenizer.encode_batch_fast([strs[i] for i in present],
                                                add_special_tokens=False)
        out: list[list[int] | None] = [None] * len(strs)
        for i, e in zip(present, encs):
            out[i] = e.ids
        return out

    def __call__(self, batch):
        t0 = time.perf_counter()
        out = self.tokenize(batch)
        if self.stats is not None:  # fire-and-forget to the driver's StatsCollector
            self.stats.record_tokenize.remote(out.num_rows, time.perf_counter() - t0)
        return out

    def tokenize(self, batch):
        import numpy as np
        import pyarrow as pa

        cfg = self.config
        S.check_columns("tokenize", self.spec(cfg).reads, batch.column_names, "batch")
        prompts = self._encode(batch[cfg.text_column].to_pylist())
        targets = (self._encode(batch[cfg.target_column].to_pylist()) if cfg.target_column
                   else None)
        ids_out, scored, errors = [], np.zeros(batch.num_rows, np.int32), [None] * batch.num_rows
        for i, p in enumerate(prompts):
            t = targets[i] if targets is not None else []
            if p is None or t is None:
                errors[i] = "null text" if p is None else "null target"
                ids_out.append([])
                continue
            n = 1 + len(p) + len(t)
            if n > cfg.max_model_len:  # errored rows carry no ids: nothing is fed to the model
                errors[i] = f"too long: {n} tokens > max_model_len {cfg.max_model_len}"
                ids_out.append([])
                continue
            ids_out.append([self.bos, *p, *t])
            scored[i] = len(t) if targets is not None else len(p)
        lengths = np.fromiter((len(x) for x in ids_out), np.int32, len(ids_out))
        offsets = np.zeros(len(ids_out) + 1, np.int32)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.fromiter((t for x in ids_out for t in x), np.int32, int(offsets[-1]))
        keep = [cfg.id_column, *cfg.keep_columns]
        out = batch.select(keep)
        if cfg.id_column != S.ID:
            out = out.rename_columns([S.ID if c == cfg.id_column else c for c in keep])
        out = out.append_column(S.INPUT_IDS, pa.ListArray.from_arrays(offsets, flat))
        out = out.append_column(S.NUM_SCORED, pa.array(scored, pa.int32()))
        return out.append_column(S.ERROR, pa.array(errors, pa.string()))

