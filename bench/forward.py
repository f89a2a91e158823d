"""Forward tokens/s: this engine vs transformers' eager DeepseekV4ForCausalLM, same tiny weights.

Both score every token (full-vocabulary log-softmax). transformers runs each request alone (no
padding waste, its best case); ours packs the batch. Measured in one run, best of `--repeats`.
"""

from __future__ import annotations

import argparse

import torch

from bench.common import best_of, emit, random_prompts, tiny_pair


def hf_score(hf, batch):
    with torch.no_grad():
        for ids in batch:
            x = torch.tensor([ids])
            logits = hf(input_ids=x, use_cache=False).logits[0, :-1].float()
            logits.log_softmax(-1).gather(1, x[0, 1:, None])


def main(argv):
    parser = argparse.ArgumentParser(prog="python -m dsv4batch.bench forward")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--lengths", default="512,2048,8192")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    from dsv4batch.model import EngineConfig

    engine = EngineConfig(max_num_batched_tokens=4096, max_model_len=16384)
    ours, hf = tiny_pair(engine)
    lengths = [int(n) for n in args.lengths.split(",")]
    cases = {f"single_{n}": [n] for n in lengths}
    cases["mixed_batch"] = [64, 200, 512, 700, 1024, 1500, 2048]
    rows = {}
    for name, case in cases.items():
        batch = random_prompts(case, ours.config.vocab_size, seed=len(name))
        tokens = sum(len(ids) - 1 for ids in batch)
        ours.score_tokens(batch)  # warm-up
        t_ours = best_of(lambda: ours.score_tokens(batch), args.repeats)
        t_hf = best_of(lambda: hf_score(hf, batch), args.repeats)
        rows[name] = {"tokens": tokens, "ours_tok_s": round(tokens / t_ours, 1), "hf_tok_s": round(tokens / t_hf, 1),
                      "speedup": round(t_hf / t_ours, 2), "ours_steps": ours.last_stats["num_steps"],
                      "ours_chunks": ours.last_stats["num_chunks"]}
    emit({"bench": "forward", "model": "tiny", "threads": torch.get_num_threads(), "cases": rows}, args.json)
