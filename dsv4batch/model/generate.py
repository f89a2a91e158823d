"""`Engine.generate`'s step loop: continuous batching over the cache pool, one sample per request.

Each step (`Scheduler.schedule`) packs one decode token of every running request that has its
first token, then prefill segments; the model runs them as one `StepContext` (decodes read and
append the pool in place, prefill segments go through the planner's chunks and keep their state
in the pool), the head's logits are taken only at the rows that sample (every decode token, and
the last prompt position of a request whose prefill ends in this step), and every such request
draws its token (`sampling.sample`), unless its logits are not finite (one reduction over the
step's rows): it then stops with `Generation.error`. Under tensor parallelism every rank runs the same loop on
the same schedule: the logits are all-gathered, every rank samples the same rows the same way,
and rank 0's tokens are broadcast so that no rank can ever run a different schedule.
"""

from __future__ import annotations

import time
from typing import NamedTuple, Sequence as Seq

import numpy as np
import torch

from .head import nonfinite_error
from .sampling import SamplingParams, sample
from .scheduler import Scheduler
from .sequence import Sequence
from .stats import StepStats


class Generation(NamedTuple):
    """One request's generation (n = generated tokens)."""

    token_ids: np.ndarray  # int32 [n]: stop token ids and EOS included
    text: str  # decoded without special tokens, cut before a stop string
    finish_reason: str  # "stop" | "length" | "eos" | "error"
    stop_reason: str | int | None  # the stop string or stop token id that ended it
    logprobs: np.ndarray  # float32 [n]: log p(token) under the model (before temperature/filters)
    top_ids: np.ndarray  # int32 [n, K] (K = params.top_logprobs)
    top_logprobs: np.ndarray  # float32 [n, K]
    num_prompt_tokens: int
    ttft_s: float  # seconds from the call's start to this request's first token
    error: str | None = None  # why it stopped early: `head.nonfinite_error` (finish_reason "error")


def validate_generation(prompts, params: Seq[SamplingParams], vocab: int, max_model_len: int) -> None:
    """`ValueError` naming the first request whose prompt or parameters cannot generate."""
    if len(prompts) != len(params):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling parameters")
    for i, (ids, p) in enumerate(zip(prompts, params)):
        if not isinstance(p, SamplingParams):
            raise ValueError(f"request {i}: params must be SamplingParams, got {type(p).__name__}")
        bad = [t for t in p.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"request {i}: stop_token_ids {bad} outside the vocabulary [0, {vocab})")
        if len(ids) + p.max_tokens > max_model_len:
            raise ValueError(f"request {i}: prompt ({len(ids)} tokens) + max_tokens ({p.max_tokens}) is more "
                             f"than max_model_len={max_model_len}")


@torch.inference_mode()
def run_generation(engine, prompts, params: Seq[SamplingParams], on_step=None) -> tuple[list[Generation], StepStats]:
    """The loop of `Engine.generate` (validated prompts as int64 arrays, one params each);
    `on_step(stats, running, waiting)` after every step (progress reports)."""
    model, config, tp = engine.model, engine.config, engine.model.tp
    t0 = time.perf_counter()
    seqs = [Sequence(ids, p, i) for i, (ids, p) in enumerate(zip(prompts, params))]
    pool = engine.generation_pool()
    sched = Scheduler(seqs, pool, max_num_batched_tokens=config.max_num_batched_tokens,
                      max_num_seqs=config.max_num_seqs)
    stats = StepStats(model_calls=1, cache_capacity_bytes=pool.capacity_bytes)
    collective_s, pool.peak_bytes, engine.pool.peak_bytes = tp.collective_s, 0, 0
    eos = model.config.eos_token_id
    while sched.has_work:
        step_t0 = time.perf_counter()
        decodes, segs = sched.schedule()
        stats.peak_running = max(stats.peak_running, len(sched.running))
        stats.peak_waiting = max(stats.peak_waiting, len(sched.waiting))
        hidden = engine.forward_step(segs, decodes, pool, stats)
        sampling, rows = sampling_rows(decodes, segs)
        for st in decodes:
            st.done += 1
        for st, _, end in segs:
            st.done = end
        draws = draw_tokens(model, hidden[rows], sampling) if sampling else []
        draws = tp.broadcast_object(draws)  # rank 0's: every rank continues on the same tokens
        for seq, draw in zip(sampling, draws):
            if draw is None:
                seq.fail(nonfinite_error(len(seq.generated)))
            else:
                seq.append(draw, eos=eos, tokenizer=engine.tokenizer, max_model_len=config.max_model_len, t0=t0)
            if seq.is_finished:
                sched.finish(seq)
        account(stats, decodes, segs, len(sampling), time.perf_counter() - step_t0)
        if on_step is not None:
            on_step(stats, len(sched.running), len(sched.waiting))
    stats.forward_s = time.perf_counter() - t0
    stats.collective_s = tp.collective_s - collective_s
    stats.peak_cache_bytes = pool.peak_bytes
    stats.peak_workspace_bytes = engine.pool.peak_bytes
    return [result(seq, engine.tokenizer) for seq in seqs], stats


def sampling_rows(decodes, segs) -> tuple[list[Sequence], torch.Tensor]:
    """The requests that draw a token after this step and their rows of the step's hidden
    states: every decode token (rows 0..D-1), then each segment that ends its prompt (its last row)."""
    seqs, rows = list(decodes), list(range(len(decodes)))
    row = len(decodes)
    for st, start, end in segs:
        row += end - start
        if end == st.num_prompt:
            seqs.append(st)
            rows.append(row - 1)
    return seqs, torch.tensor(rows, dtype=torch.long)


def draw_tokens(model, hidden: torch.Tensor, seqs: list[Sequence]) -> list:
    """Each request's `sampling.Draw` from the logits of its row (one per request), or None for
    a row whose logits are not all finite (one reduction over the step's rows finds them)."""
    logits = model.logits(hidden).cpu()
    finite = torch.isfinite(logits).all(dim=1).tolist()
    return [sample(logits[i], seq.params, len(seq.generated)) if finite[i] else None
            for i, seq in enumerate(seqs)]


def account(stats: StepStats, decodes, segs, num_sampled: int, seconds: float) -> None:
    """Count one step: its prefill and decode tokens, and its time split between them by tokens."""
    prefill = sum(e - s for _, s, e in segs)
    stats.num_prefill_tokens += prefill
    stats.num_decode_tokens += len(decodes)
    stats.num_generated += num_sampled
    total = prefill + len(decodes)
    stats.prefill_s += seconds * prefill / total
    stats.decode_s += seconds * len(decodes) / total


def result(seq: Sequence, tokenizer) -> Generation:
    k = seq.params.top_logprobs
    n = len(seq.generated)
    return Generation(
        token_ids=np.asarray(seq.generated, np.int32), text=seq.final_text(tokenizer),
        finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
        logprobs=np.asarray(seq.logprobs, np.float32),
        top_ids=np.stack(seq.top_ids).astype(np.int32) if n and k else np.zeros((n, k), np.int32),
        top_logprobs=np.stack(seq.top_logprobs).astype(np.float32) if n and k else np.zeros((n, k), np.float32),
        num_prompt_tokens=seq.num_prompt, ttft_s=float(seq.ttft_s or 0.0), error=seq.error)
