"""lm-eval `generate_until` requests as engine requests, the way lm-eval 0.4.13's vllm backend
reads them (`vllm_causallms.VLLM.generate_until`), and the engine's tokens back as lm-eval text.

- `gen_kwargs` go through lm-eval's own `normalize_gen_kwargs` (max_gen_toks and its aliases,
  do_sample vs temperature) and `handle_stop_sequences` (`until` as a list, the EOS string
  appended); greedy when do_sample is false or the temperature is 0, else sampling at the
  temperature (1.0 when do_sample is true and none is given: transformers' and vLLM's default),
  with top_p / top_k / min_p when given. Any other key is a `ValueError` naming it: it would
  change the result and the engine has no such option.
- Each request's seed is a digest of the run's seed (or the request's own `seed` key), its
  context, its gen_kwargs and how many identical requests came before it (lm-eval's `repeats`
  send the same request several times): its text never depends on its batch or its order.
- The context is cut on the left to `max_length - max_gen_toks` ids (hf / vllm).
- The text (decoded as the `hf` backend decodes: special tokens skipped) is cut at every stop
  string, lm-eval's `postprocess_generated_text`; in thinking mode only what follows the last
  `</think>` is the answer, and the task's stops apply to it alone (vllm's `think_end_token`).
No torch here.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from typing import NamedTuple

from dsv4batch.model.chat import END_THINK
from dsv4batch.model.sampling import SamplingParams

log = logging.getLogger(__name__)

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's hf and vllm default
SAMPLING_KEYS = ("top_p", "top_k", "min_p")  # passed to the engine as they are
KNOWN_KEYS = ("until", "max_gen_toks", "do_sample", "temperature", "seed", *SAMPLING_KEYS)


class Plan(NamedTuple):
    """One `generate_until` request ready for the engine."""

    ids: list[int]  # the context ids fed (left-truncated)
    params: SamplingParams
    until: list[str]  # every stop string, the EOS string included
    truncated: int  # context ids dropped on the left


def parse_gen_kwargs(gen_kwargs: dict, eos: str,
                     default_max_gen_toks: int) -> tuple[dict, list[str], int]:
    """(sampling fields for `SamplingParams`, until, max_gen_toks) of one request's gen_kwargs.

    `ValueError` for a key the engine cannot honour or a value `SamplingParams` refuses."""
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

    if not isinstance(gen_kwargs, dict):
        raise ValueError(f"gen_kwargs must be a dict, got {type(gen_kwargs).__name__}")
    kwargs = dict(normalize_gen_kwargs(gen_kwargs, default_max_gen_toks=default_max_gen_toks))
    unknown = sorted(set(kwargs) - set(KNOWN_KEYS))
    if unknown:
        raise ValueError(f"generate_until: generation argument(s) {unknown} are not supported by "
                         f"the dsv4batch backend; supported: {list(KNOWN_KEYS)}")
    until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
    max_gen_toks = int(kwargs.pop("max_gen_toks"))
    do_sample = bool(kwargs.pop("do_sample"))
    temperature = float(kwargs.pop("temperature", 1.0 if do_sample else 0.0))
    fields = {"max_tokens": max_gen_toks, "temperature": temperature if do_sample else 0.0,
              **{k: kwargs[k] for k in SAMPLING_KEYS if kwargs.get(k) is not None}}
    SamplingParams(**fields)  # ValueError naming a bad value now, not at the engine
    return fields, until, max_gen_toks


def request_seed(run_seed: int, context: str, gen_kwargs: dict, occurrence: int) -> int:
    """A 63-bit seed from the run's seed, the request and its occurrence among identical ones."""
    key = json.dumps([run_seed, context, gen_kwargs, occurrence], sort_keys=True, default=str)
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1


def plan_requests(args: list[tuple[str, dict]], encode, *, eos: str, max_length: int,
                  default_max_gen_toks: int, seed: int, thinking: bool = False) -> list[Plan]:
    """A `Plan` per request `(context, gen_kwargs)`; `encode(context) -> ids` (the backend's
    `tok_encode`; an empty context is the caller's to replace). In thinking mode the engine
    stops only at EOS: the task's stops apply to the answer after `</think>`."""
    seen: Counter = Counter()
    plans = []
    for context, gen_kwargs in args:
        fields, until, max_gen_toks = parse_gen_kwargs(gen_kwargs, eos, default_max_gen_toks)
        key = json.dumps([context, gen_kwargs], sort_keys=True, default=str)
        base = gen_kwargs.get("seed", seed)
        fields["seed"] = request_seed(base, context, gen_kwargs, seen[key])
        seen[key] += 1
        room = max_length - max_gen_toks
        if room < 1:
            raise ValueError(f"max_gen_toks={max_gen_toks} leaves no room for the context in "
                             f"max_length={max_length}; raise max_length or lower max_gen_toks")
        ids = list(encode(context))
        stops = () if thinking else tuple(s for s in until if s)  # '' is no stop (lm-eval)
        plans.append(Plan(ids[-room:], SamplingParams(**fields, stop=stops), until,
                          max(0, len(ids) - room)))
    truncated = sum(p.truncated > 0 for p in plans)
    if truncated:
        log.warning("%d generate_until context(s) longer than max_length - max_gen_toks were "
                    "cut on the left (as lm-eval's hf and vllm backends do)", truncated)
    return plans


def batches(args: list[tuple[str, dict]], plans: list[Plan], size: int) -> list[list[int]]:
    """Request indices in batches of at most `size`: grouped by gen_kwargs (like the `hf`
    backend), longest context first within a group."""
    groups: dict[str, list[int]] = {}
    for i, (_, gen_kwargs) in enumerate(args):
        groups.setdefault(json.dumps(gen_kwargs, sort_keys=True, default=str), []).append(i)
    out = []
    for members in groups.values():
        members.sort(key=lambda i: -len(plans[i].ids))
        out += [members[k:k + size] for k in range(0, len(members), size)]
    return out


def finish_text(text: str, until: list[str], thinking: bool = False) -> str:
    """The answer lm-eval scores: after the last `</think>` in thinking mode (left-stripped),
    then cut before the first occurrence of any stop string."""
    from lm_eval.models.utils import postprocess_generated_text

    return postprocess_generated_text(text, until, END_THINK if thinking else None)
