"""Tokenize step: text (+ target) -> `[bos] + tokens(prompt) [+ tokens(target)]`.

Runs in an autoscaling pool of small CPU actors (tokenizer loaded once in `__init__`), apart
from the scoring actors, so tokenization overlaps the forward instead of running serially
before it (Ray Data only fuses task steps into an actor step, never two actor steps). Rows that
cannot be scored (null text or target, too many tokens without --truncate, text the tokenizer
rejects) keep their place and get an `error`; the scoring actor skips them. Every row in comes
out exactly once, in order. Text is read by the one invalid-text rule of every input format
(`schema.utf8_text`: string, binary and dictionary columns; invalid UTF-8 decoded as U+FFFD,
NUL kept), conversations too (`schema.utf8_values`).
"""

from __future__ import annotations

import json
import time
from typing import Any

from dsv4batch.jobspec import schema as S
from dsv4batch.jobspec.config import JobConfig
from dsv4batch.model import chat
from dsv4batch.model.chat import ChatError
from dsv4batch.pipeline import openai_batch


# a row's text that could not be made: its error's prefix, by the problem's type
PROBLEMS = {ChatError: "messages", openai_batch.RequestError: "request"}


class Tokenize:
    """Stateful tokenize step; `spec` lists the columns it reads and adds."""

    @staticmethod
    def spec(config: JobConfig) -> S.StageSpec:
        reads = (*config.tokenizer_columns(), config.id_column, *config.row_columns(), *config.keep_columns)
        return S.StageSpec("tokenize", reads, (S.INPUT_IDS, S.NUM_SCORED, S.NUM_TRUNCATED, S.ERROR))

    def __init__(self, config: JobConfig, stats: Any = None):
        from dsv4batch.model.tokenizer import bos_token_id, load_tokenizer, tokenizer_source

        self.config, self.stats = config, stats
        self.tokenizer = load_tokenizer(tokenizer_source(config.model, config.tokenizer))
        self.bos = bos_token_id(config.model)

    def _encode(self, strs: list) -> list:
        """Token ids per row of texts: a list, None for a null, an error string if the
        tokenizer failed (or the text is one already: a row error)."""
        present = [i for i, t in enumerate(strs) if isinstance(t, str)]
        out: list = [None] * len(strs)
        try:
            encs = self.tokenizer.encode_batch_fast([strs[i] for i in present],
                                                    add_special_tokens=False)
        except Exception:  # noqa: BLE001 - find the row(s) the tokenizer rejects, answer the rest
            encs = []
            for i in present:
                try:
                    encs.append(self.tokenizer.encode(strs[i], add_special_tokens=False))
                except Exception as exc:  # noqa: BLE001, PERF203
                    encs.append(f"tokenizer failed: {type(exc).__name__}: {exc}"[:500])
        for i, e in zip(present, encs):
            out[i] = e if isinstance(e, str) else e.ids
        for i, t in enumerate(strs):
            if isinstance(t, Exception):  # a conversation or request line that cannot run
                out[i] = f"{PROBLEMS[type(t)]}: {t}"[:500]
        return out

    def _texts(self, batch) -> tuple[list, list | None, dict]:
        """(prompt texts, target texts or None, columns to add) of the batch's rows: its text (and
        target) columns, its conversations rendered by the DSv4 chat encoding (`model/chat.py`:
        generation renders the prompt, scoring splits off the last assistant reply as the target;
        a malformed conversation is its row's `ChatError`), or its OpenAI batch request lines
        (`openai_batch.parse`: the prompt, and the sampling parameters and response metadata as
        JSON columns)."""
        cfg = self.config
        if getattr(cfg, "is_openai", False):
            return self._requests(S.utf8_values(batch[cfg.text_column]))
        if not cfg.messages_column:
            target = getattr(cfg, "target_column", None)  # scoring's continuation column
            return _texts(batch[cfg.text_column]), _texts(batch[target]) if target else None, {}
        prompts, targets = [], []
        for value in S.utf8_values(batch[cfg.messages_column]):
            try:
                if cfg.task == "score":
                    prompt, reply = chat.split_last(value, cfg.thinking)
                else:
                    prompt, reply = chat.render(value, cfg.thinking), None
                prompts.append(prompt.removeprefix(chat.BOS))  # `_fit` puts the model's bos first
                targets.append(reply)
            except chat.ChatError as exc:
                prompts.append(exc)
                targets.append(exc)
        return prompts, targets if cfg.task == "score" else None, {}

    def _requests(self, lines: list) -> tuple[list, None, dict]:
        prompts, params, metas = [], [], []
        for line in lines:
            try:
                prompt, p, meta = openai_batch.parse(line, self.config.thinking)
            except openai_batch.RequestError as exc:
                prompt, p, meta = exc, {}, {"custom_id": openai_batch.custom_id(line)}
            prompts.append(prompt)
            params.append(json.dumps(p))
            metas.append(json.dumps(meta))
        return prompts, None, {S.OPENAI_SAMPLING: params, S.OPENAI_META: metas}

    def __call__(self, batch):
        t0 = time.perf_counter()
        out = self.tokenize(batch)
        if self.stats is not None:  # fire-and-forget to the driver's StatsCollector
            self.stats.record_tokenize.remote(out.num_rows, time.perf_counter() - t0)
        return out

    def _fit(self, p: list, t: list | None) -> tuple[list | None, int, int, str | None]:
        """(ids, scored, truncated, error) for one row under max_model_len and --truncate."""
        cfg, L = self.config, self.config.max_model_len
        seq, n = [*p, *(t or [])], 1 + len(p) + len(t or [])
        if n <= L:
            return [self.bos, *seq], len(t) if t is not None else len(p), 0, None
        too_long = f"too long: {n} tokens > max_model_len {L}"
        if getattr(cfg, "truncate", "none") == "none":
            return None, 0, 0, too_long
        drop = n - L
        kept = seq[drop:] if cfg.truncate == "left" else seq[:L - 1]
        if t is None:
            return [self.bos, *kept], len(kept), drop, None
        # a target is scored from its own tokens only: left keeps its end, right its start
        scored = min(len(t), len(kept)) if cfg.truncate == "left" else len(kept) - len(p)
        if scored <= 0:
            return None, 0, 0, too_long + " and truncating right leaves no target token"
        return [self.bos, *kept], scored, drop, None

    def tokenize(self, batch):
        import numpy as np
        import pyarrow as pa

        cfg = self.config
        S.check_columns("tokenize", self.spec(cfg).reads, batch.column_names, "batch")
        prompt_texts, target_texts, added = self._texts(batch)
        prompts = self._encode(prompt_texts)
        targets = self._encode(target_texts) if target_texts is not None else None
        n_rows = batch.num_rows
        ids_out, errors = [], [None] * n_rows
        scored, truncated = np.zeros(n_rows, np.int32), np.zeros(n_rows, np.int32)
        for i, p in enumerate(prompts):
            t = targets[i] if targets is not None else []
            if p is None or t is None or isinstance(p, str) or isinstance(t, str):
                # errored rows carry no ids: nothing is fed to the model
                errors[i] = ("null text" if p is None else "null target" if t is None
                             else p if isinstance(p, str) else t)
                ids_out.append([])
                continue
            ids, scored[i], truncated[i], errors[i] = self._fit(p, t if targets is not None
                                                                 else None)
            ids_out.append(ids or [])
        lengths = np.fromiter((len(x) for x in ids_out), np.int32, len(ids_out))
        offsets = np.zeros(len(ids_out) + 1, np.int32)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.fromiter((t for x in ids_out for t in x), np.int32, int(offsets[-1]))
        keep = [cfg.id_column, *cfg.row_columns(), *cfg.keep_columns]
        # a kept copy of the text reads as the text the model saw (not all writers validate UTF-8)
        out = S.utf8_columns(batch.select(keep), cfg.keep_columns, strings_only=True)
        if cfg.id_column != S.ID:
            out = out.rename_columns([S.ID if c == cfg.id_column else c for c in keep])
        out = out.append_column(S.INPUT_IDS, pa.ListArray.from_arrays(offsets, flat))
        out = out.append_column(S.NUM_SCORED, pa.array(scored, pa.int32()))
        out = out.append_column(S.NUM_TRUNCATED, pa.array(truncated, pa.int32()))
        for name, values in added.items():
            out = out.append_column(name, pa.array(values, pa.string()))
        return out.append_column(S.ERROR, pa.array(errors, pa.string()))


def _texts(column) -> list:
    """Python strings (None for null) of a text column by `schema.utf8_text`'s rule: a `binary`
    or dictionary column is UTF-8 text, and invalid UTF-8 (Parquet and JSON writers do not all
    validate) is decoded with U+FFFD."""
    return S.utf8_text(column).to_pylist()

