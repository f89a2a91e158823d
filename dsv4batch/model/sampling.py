"""Sampling parameters and the sampler: one request's next token from its logits row.

A row's token depends only on its logits, its parameters and (when it samples) its seed and how
many tokens it generated before: every operation below runs on that one row (no batch-wide
reduction whose rounding could depend on batch-mates), and its random numbers come from its own
generator, seeded from (seed, step). Sampling draws exactly from the filtered softmax by the
exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) picks i with probability p_i / sum p.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

FIELDS_HELP = {
    "max_tokens": "most tokens to generate (>= 1)",
    "temperature": "0: greedy (ties to the lowest id); > 0 divides the logits before sampling",
    "top_p": "keep the most likely tokens whose mass reaches top_p, in (0, 1]",
    "top_k": "keep the k most likely tokens; 0 or -1: all",
    "min_p": "keep tokens with probability >= min_p x the largest, in [0, 1]",
    "seed": "the request's random seed (None: 0); with the step it seeds every draw",
    "stop": "strings that end the generation; the text is cut before the first one",
    "stop_token_ids": "token ids that end the generation (kept in the ids, left out of the text)",
    "ignore_eos": "go on past the end-of-sentence token",
    "top_logprobs": "also return the K most likely tokens and their logprobs at every step",
}


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates (the names of vLLM's / ray.data.llm's sampling_params; every
    field is checked in `__post_init__`, `ValueError` naming it)."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    top_logprobs: int = 0

    def __post_init__(self):
        set_ = object.__setattr__
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if isinstance(value, (str, int)) and not isinstance(value, bool):
                value = (value,)
            if isinstance(value, (list, np.ndarray)):
                value = tuple(value.tolist() if isinstance(value, np.ndarray) else value)
            set_(self, name, value if value is not None else ())
        _check_int(self, "max_tokens", 1)
        _check_int(self, "top_k", -1)
        _check_int(self, "top_logprobs", 0)
        _check_number(self, "temperature", 0.0, math.inf, low_open=False)
        _check_number(self, "top_p", 0.0, 1.0, low_open=True)
        _check_number(self, "min_p", 0.0, 1.0, low_open=False)
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63) or None, got {self.seed!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, tuple) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_dict(cls, values: dict[str, Any], defaults: "SamplingParams | None" = None) -> "SamplingParams":
        """`values` over `defaults` (None values keep the default); ValueError naming an
        unknown field."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        base = dataclasses.asdict(defaults or cls())
        base.update({k: v for k, v in values.items() if v is not None})
        return cls(**base)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["stop"], d["stop_token_ids"] = list(self.stop), list(self.stop_token_ids)
        return d


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _check_int(params, name: str, low: int) -> None:
    value = getattr(params, name)
    if not _is_int(value) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _check_number(params, name: str, low: float, high: float, *, low_open: bool) -> None:
    value = getattr(params, name)
    ok = isinstance(value, (int, float, np.floating)) and not isinstance(value, bool) and math.isfinite(value) \
        and (value > low if low_open else value >= low) and value <= high
    if not ok:
        where = f"in {'(' if low_open else '['}{low:g}, {high:g}]" if math.isfinite(high) else f">= {low:g}"
        raise ValueError(f"{name} must be a finite number {where}, got {value!r}")


class Draw(NamedTuple):
    """One step's pick for one request."""

    token: int
    logprob: float  # log p(token) under the model's distribution (before temperature or filters)
    top_ids: np.ndarray  # int32 [K]: the K most likely ids, most likely first
    top_logprobs: np.ndarray  # float32 [K]


def step_seed(seed: int | None, step: int) -> int:
    """The seed of a request's draw at generation step `step` (a 64-bit mix of both)."""
    state = np.random.SeedSequence([seed or 0, step]).generate_state(2, np.uint32)
    return int(state[0]) << 32 | int(state[1])


def sample(logits, params: SamplingParams, step: int) -> Draw:
    """Pick the next token from one request's fp32 logits [vocab] (a torch tensor)."""
    import torch

    logprobs = torch.log_softmax(logits, dim=-1)
    if params.is_greedy:
        token = int(torch.argmax(logits))  # the first of equal maxima: the lowest id
    else:
        probs = filtered_probs(logits, params)
        noise = torch.empty_like(probs).exponential_(generator=torch.Generator().manual_seed(step_seed(params.seed,
                                                                                                       step)))
        token = int(torch.argmax(probs / noise))
    k = params.top_logprobs
    top = torch.topk(logprobs, k) if k else None
    return Draw(token, float(logprobs[token]),
                top.indices.numpy().astype(np.int32) if k else np.zeros(0, np.int32),
                top.values.numpy().astype(np.float32) if k else np.zeros(0, np.float32))


def filtered_probs(logits, params: SamplingParams):
    """softmax(logits / temperature) with top_k, min_p, then top_p applied (dropped tokens 0;
    not renormalised: the exponential race does not need it)."""
    import torch

    z = logits / params.temperature
    if 0 < params.top_k < z.numel():
        kth = torch.topk(z, params.top_k).values[-1]
        z = z.masked_fill(z < kth, -math.inf)
    probs = torch.softmax(z, dim=-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        before = torch.cumsum(sorted_probs, 0) - sorted_probs  # mass of the more likely tokens
        drop = order[before >= params.top_p * sorted_probs.sum()]
        probs = probs.index_fill(0, drop, 0.0)
    return probs
