"""Generation: this engine's `Engine.generate` vs transformers' `generate`, decode cost against
context, and decode tokens/s against the number of running requests.

- `vs_transformers`: `--requests` prompts of 64-512 tokens, `--new` greedy tokens each (EOS
  ignored); ours generates them all at once (continuous batching), transformers one request at a
  time in a process of its own (it refuses left padding for DSv4; `bench/_transformers.py`).
- `decode_cost`: `--decode-batch` requests whose prompts are `--contexts` tokens long generate 32
  tokens; the cost per token per request is the time of the steps that only decode, per token fed.
  Flat means a decode token does not re-read or copy a request's history (the cache is appended in
  place; only the indexer's scores and HCA's entries grow, by 1/4 and 1/128 of the context).
- `running`: decode tokens/s of decode-only steps with N requests running (prompts of 256 tokens).
fp32, best of `--repeats` (engines interleaved). The CPU model and its vector ISA are printed.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from bench.common import best_of, emit, machine, random_prompts
from bench.forward import build_pair


class StepClock:
    """Times every `Engine.forward_step` of `engine` and keeps (seconds, decode tokens, prefill
    tokens) per step, so that decode-only steps can be told apart."""

    def __init__(self, engine):
        self.engine, self.steps = engine, []
        inner = engine.forward_step

        def timed(segs, decodes, cache, stats):
            t0 = time.perf_counter()
            out = inner(segs, decodes, cache, stats)
            self.steps.append((time.perf_counter() - t0, len(decodes), sum(e - s for _, s, e in segs)))
            return out

        engine.forward_step = timed

    def decode_only(self) -> tuple[float, int]:
        """(seconds, decode tokens) of the steps that held no prefill tokens."""
        pure = [(t, d) for t, d, p in self.steps if p == 0 and d]
        return sum(t for t, _ in pure), sum(d for _, d in pure)


def vs_transformers(ours, hf, args) -> dict:
    from dsv4batch.model.sampling import SamplingParams

    rng = np.random.default_rng(0)
    lengths = rng.integers(64, 513, args.requests).tolist()
    batch = random_prompts(lengths, ours.model.config.vocab_size, seed=1)
    params = SamplingParams(max_tokens=args.new, ignore_eos=True)
    ours.generate(batch[:2], SamplingParams(max_tokens=4))  # warm-up
    t_ours, t_hf = float("inf"), float("inf")
    for _ in range(args.repeats):
        t_ours = min(t_ours, best_of(lambda: ours.generate(batch, params), 1))
        t_hf = min(t_hf, hf.generate_seconds(batch, args.new))
    new = args.requests * args.new
    return {"requests": args.requests, "prompt_tokens": sum(lengths), "new_tokens": new,
            "ours_s": round(t_ours, 3), "hf_s": round(t_hf, 3), "ours_gen_tok_s": round(new / t_ours, 1),
            "hf_gen_tok_s": round(new / t_hf, 1), "speedup": round(t_hf / t_ours, 2)}


def decode_cost(engine, args) -> dict:
    from dsv4batch.model.sampling import SamplingParams

    clock, rows = StepClock(engine), {}
    for context in (int(c) for c in args.contexts.split(",")):
        batch = random_prompts([context] * args.decode_batch, engine.model.config.vocab_size, seed=context)
        best = float("inf")
        for _ in range(args.repeats):
            clock.steps = []
            engine.generate(batch, SamplingParams(max_tokens=32, ignore_eos=True))
            seconds, tokens = clock.decode_only()
            best = min(best, seconds / max(tokens, 1))
        rows[context] = {"us_per_token": round(best * 1e6, 1)}
    first = rows[min(rows)]["us_per_token"]
    return {"requests": args.decode_batch, "contexts": rows,
            "growth_first_to_last": round(rows[max(rows)]["us_per_token"] / first, 3)}


def running_sweep(engine, args) -> dict:
    from dsv4batch.model.sampling import SamplingParams

    clock, rows = StepClock(engine), {}
    for n in (int(c) for c in args.running.split(",")):
        batch = random_prompts([256] * n, engine.model.config.vocab_size, seed=n)
        best = 0.0
        for _ in range(args.repeats):
            clock.steps = []
            engine.generate(batch, SamplingParams(max_tokens=32, ignore_eos=True))
            seconds, tokens = clock.decode_only()
            best = max(best, tokens / seconds if seconds else 0.0)
        rows[n] = {"decode_tok_s": round(best, 1)}
    return rows


def main(argv):
    parser = argparse.ArgumentParser(prog="python -m dsv4batch.bench generate")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--models", default="tiny,dsv4-shape")
    parser.add_argument("--parts", default="vs_transformers,decode_cost,running")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--contexts", default="1024,8192,32768")
    parser.add_argument("--decode-batch", type=int, default=4)
    parser.add_argument("--running", default="1,2,4,8,16,32,64")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    from dsv4batch.model import EngineConfig

    parts = args.parts.split(",")
    config = EngineConfig(max_num_batched_tokens=4096, max_model_len=34000, max_num_seqs=64)
    result = {"bench": "generate", **machine(), "threads": torch.get_num_threads(), "models": {}}
    for model_name in args.models.split(","):
        ours, hf = build_pair(model_name, config)
        row = {}
        if "vs_transformers" in parts:
            row["vs_transformers"] = vs_transformers(ours, hf, args)
        hf.close()
        if "decode_cost" in parts:
            row["decode_cost"] = decode_cost(ours, args)
        if "running" in parts:
            row["running"] = running_sweep(ours, args)
        result["models"][model_name] = row
        del ours, hf
    emit(result, args.json)
