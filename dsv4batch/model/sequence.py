"""One generating request: its ids, what it generated, and when and why it stops.

`Sequence` is the `RequestState` of generation (nano-vllm's sequence): the scheduler feeds its
prompt over prefill steps, then one token per decode step; `append` takes each sampled token and
decides whether the request is finished: a stop token id, the end-of-sentence token (unless
`ignore_eos`), a stop string in the text so far (the text is cut before it; it may span tokens),
`max_tokens`, or the model's `max_model_len`; `fail` stops it with an error (its logits were
not finite: finish_reason "error"). The text is decoded incrementally (only the newest
tokens are decoded each step), so checking stop strings costs the same at every step.
"""

from __future__ import annotations

import time

import numpy as np

from .sampling import Draw, SamplingParams
from .step import RequestState

FINISH_REASONS = ("stop", "length", "eos", "error")


class Sequence(RequestState):
    """A request of `prompt` ids generating under `params`; `index`: its place in the caller's batch.

    ids: prompt then generated ids (a list that grows); done: positions fed so far. After it
    finishes: finish_reason ("stop" | "length" | "eos" | "error"), stop_reason (the stop string or
    stop token id hit, else None), text (the generated text, special tokens left out, cut before a
    stop string), error (None, or why it failed: `fail`)."""

    def __init__(self, prompt, params: SamplingParams, index: int = 0):
        super().__init__(ids=[int(t) for t in prompt])
        self.params, self.index, self.num_prompt = params, index, len(self.ids)
        self.logprobs: list[float] = []
        self.top_ids: list[np.ndarray] = []
        self.top_logprobs: list[np.ndarray] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.text, self._prefix, self._read = "", 0, 0  # incremental detokenizer state
        self.ttft_s: float | None = None
        self.error: str | None = None

    def keeps_cache(self, end: int) -> bool:
        return self.cache is not None  # its decode steps read it

    @property
    def generated(self) -> list[int]:
        return self.ids[self.num_prompt:]

    @property
    def is_prefilled(self) -> bool:
        return self.done >= self.num_prompt

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, draw: Draw, *, eos: int | None, tokenizer, max_model_len: int, t0: float) -> None:
        """Take the sampled `draw`; sets finish_reason when this token ends the request."""
        self.ids.append(draw.token)
        self.logprobs.append(draw.logprob)
        self.top_ids.append(draw.top_ids)
        self.top_logprobs.append(draw.top_logprobs)
        if self.ttft_s is None:
            self.ttft_s = time.perf_counter() - t0
        p, token = self.params, draw.token
        if token in p.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", token
        elif token == eos and not p.ignore_eos:
            self.finish_reason = "eos"
        elif p.stop and tokenizer is not None and self._find_stop(tokenizer):
            self.finish_reason = "stop"
        elif len(self.generated) >= p.max_tokens or len(self.ids) >= max_model_len:
            self.finish_reason = "length"

    def fail(self, error: str) -> None:
        """Stop the request without a token at this step: `error` says why."""
        self.finish_reason, self.error = "error", error

    def _find_stop(self, tokenizer) -> bool:
        """Decode the newest tokens into `text`; True (text cut, stop_reason set) when a stop
        string appeared. Only the text that can hold a new match is searched."""
        gen = self.generated
        before = tokenizer.decode(gen[self._prefix:self._read], skip_special_tokens=True)
        now = tokenizer.decode(gen[self._prefix:], skip_special_tokens=True)
        if len(now) <= len(before) or now.endswith("\ufffd"):  # an incomplete character: wait
            return False
        delta = now[len(before):]
        self._prefix, self._read = self._read, len(gen)
        longest = max(len(s) for s in self.params.stop)
        lo = max(0, len(self.text) - longest + 1)
        self.text += delta
        hits = [(i, s) for s in self.params.stop if (i := self.text.find(s, lo)) >= 0]
        if not hits:
            return False
        cut, self.stop_reason = min(hits)
        self.text = self.text[:cut]
        return True

    def final_text(self, tokenizer) -> str:
        """The generated text: cut before the stop string, or all of it decoded."""
        if isinstance(self.stop_reason, str) or tokenizer is None:
            return self.text
        return tokenizer.decode(self.generated, skip_special_tokens=True)
