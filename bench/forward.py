"""Forward tokens/s: this engine vs transformers' eager DeepseekV4ForCausalLM on the same weights.

Both score every token (full-vocabulary log-softmax). transformers runs each request alone (no
padding waste, its best case); ours packs the batch. Two models: `tiny` (hidden 128: the 129,280
vocabulary head dominates its cost) and `dsv4-shape` (DSv4's attention shape scaled down: head_dim
512, 8 heads, index_topk 64, so attention is the cost that grows with length, as in the real model).
Measured in one run, best of `--repeats`, engines interleaved; transformers runs in a process of
its own (`bench/_transformers.py`: our engine's heap setting is process-wide; `--hf-shared` runs
it in ours, as before). `*_layers_*` time the decoder
stack alone (no vocabulary projection), which is where the sparse attention's saving shows: the
129,280-row head costs both engines the same per token and caps the end-to-end ratio.

`--weights stored,compute` replaces the comparison: each model is written as a native FP8/FP4
checkpoint and loaded both ways (weights kept as stored vs dequantized at load); it reports
their tokens/s (end to end and decoder stack only: the vocabulary head is dense in both), resident
parameter + buffer bytes (all, and under `layers.`) and the largest logprob difference.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from bench._transformers import BaselineProcess, twin_checkpoint
from bench.common import best_of, emit, machine, random_prompts


def dsv4_shape_config():
    from dsv4batch.model.tiny import tiny_config

    cfg = tiny_config()
    for key, value in dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, head_dim=512,
                           q_lora_rank=128, o_groups=2, o_lora_rank=128, index_n_heads=8, index_head_dim=64,
                           index_topk=64, partial_rotary_factor=64 / 512, moe_intermediate_size=128).items():
        setattr(cfg, key, value)
    cfg.layer_types = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                       "compressed_sparse_attention"]
    cfg.mlp_layer_types = ["hash_moe", "moe", "moe", "moe"]
    cfg.qk_rope_head_dim = 64
    for rope in cfg.rope_parameters.values():
        rope["partial_rotary_factor"] = 64 / 512
    return cfg


def unseen_config():
    """A third shape no kernel was tuned on: 16 heads of 128 (tiny: 4 of 64; dsv4-shape: 8 of 512),
    a 32,768-id vocabulary (both others: 129,280), hidden 512, indexer 4 heads of 128 with top-k 32
    (the indexer kernel's 8-head block left unused), layers SWA / CSA / HCA / CSA."""
    cfg = dsv4_shape_config()
    for key, value in dict(vocab_size=32768, hidden_size=512, num_attention_heads=16, head_dim=128,
                           q_lora_rank=192, o_groups=4, o_lora_rank=96, index_n_heads=4, index_head_dim=128,
                           index_topk=32, partial_rotary_factor=32 / 128, moe_intermediate_size=192).items():
        setattr(cfg, key, value)
    cfg.qk_rope_head_dim = 32
    for rope in cfg.rope_parameters.values():
        rope["partial_rotary_factor"] = 32 / 128
    return cfg


# the seeded bench models other than `tiny` (which ships with the package)
CONFIGS = {"dsv4-shape": dsv4_shape_config, "unseen": unseen_config}


def seeded_model(name: str):
    """`DSv4Model` of bench model `name` (a key of CONFIGS) with `tiny.seed_weights`' values."""
    from dsv4batch.model import DSv4Model
    from dsv4batch.model.tiny import seed_weights

    if name not in CONFIGS:
        raise ValueError(f"unknown model {name!r}: tiny or one of {sorted(CONFIGS)}")
    model = DSv4Model(CONFIGS[name]())
    seed_weights(model)
    return model


def build_pair(name: str, config, is_shared: bool = False):
    """(our Engine, transformers on identical seeded weights as a `BaselineProcess`: its own
    process unless is_shared). One checkpoint folder serves both; the baseline's close removes it."""
    from dsv4batch.model import TINY, Engine

    if name == TINY:
        ours = Engine.from_pretrained(TINY, config=config)
        path = twin_checkpoint(ours.model)
    else:
        path = twin_checkpoint(seeded_model(name))
        ours = Engine.from_pretrained(path, config=config)
    return ours, BaselineProcess(path, is_shared)


def ours_layers(ours, batch):
    """Engine.score with the vocabulary projection skipped: the decoder stack's own cost."""
    ours.model.token_logprobs = lambda hidden, *args: torch.zeros(hidden.shape[0])
    try:
        ours.score(batch)
    finally:
        del ours.model.token_logprobs  # the class's method again


def quantized_checkpoint(name: str) -> str:
    """A native FP8/FP4 checkpoint folder of model `name`: its seeded weights written in the native
    layout (FP8 128x128-block linears, FP4 routed experts; `save_checkpoint(quantize=True)`)."""
    import os

    from dsv4batch.model import TINY
    from dsv4batch.model.loader import load_model, save_checkpoint

    model = load_model(TINY) if name == TINY else seeded_model(name)
    path = tempfile.mkdtemp(prefix="dsv4batch-bench-quant-")
    save_checkpoint(model, path, quantize=True)
    os.remove(os.path.join(path, "tokenizer.json"))  # the packaged tokenizer is the same
    return path


def weights_bench(args, config) -> dict:
    """`--weights stored,compute`: tokens/s and resident bytes of each mode on a quantized checkpoint."""
    import os

    import numpy as np

    from dsv4batch.model import Engine
    from dsv4batch.model.model import model_tensors

    modes = args.weights.split(",")
    result = {"bench": "forward", **machine(args.isa), "weights": modes, "threads": torch.get_num_threads(),
              "models": {}}
    for model_name in args.models.split(","):
        path = quantized_checkpoint(model_name)
        engines = {w: Engine.from_pretrained(path, config=config, weights=w) for w in modes}
        files = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
        row = {"checkpoint_bytes": files}
        for w, engine in engines.items():
            sizes = {n: t.numel() * t.element_size() for n, t in model_tensors(engine.model).items()}
            row[f"{w}_resident_bytes"] = sum(sizes.values())
            row[f"{w}_layers_resident_bytes"] = sum(v for n, v in sizes.items() if n.startswith("layers."))
        for name, case in {**{f"single_{n}": [int(n)] for n in args.lengths.split(",")},
                           "mixed_batch": [64, 200, 512, 700, 1024, 1500, 2048]}.items():
            batch = random_prompts(case, engines[modes[0]].model.config.vocab_size, seed=len(name))
            tokens = sum(len(ids) - 1 for ids in batch)
            outs = {w: e.score_tokens(batch) for w, e in engines.items()}  # warm-up, and the parity check
            times = {f"{w}{part}": float("inf") for w in modes for part in ("", "_layers")}
            for _ in range(args.repeats):  # interleaved, so machine noise hits both modes alike
                for w, e in engines.items():
                    times[w] = min(times[w], best_of(lambda: e.score(batch), 1))
                    times[w + "_layers"] = min(times[w + "_layers"], best_of(lambda: ours_layers(e, batch), 1))
            row[name] = {"tokens": tokens, **{f"{k}_tok_s": round(tokens / t, 1) for k, t in times.items()},
                         "max_abs_logprob_diff": float(max(np.abs(a - b).max() for a, b in
                                                           zip(outs[modes[0]], outs[modes[-1]])))}
        result["models"][model_name] = row
        del engines
    return result


def main(argv):
    parser = argparse.ArgumentParser(prog="python -m dsv4batch.bench forward")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--models", default="tiny,dsv4-shape")
    parser.add_argument("--lengths", default="512,2048,8192")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hf-shared", action="store_true", help="run transformers in this process "
                        "(it then shares our engine's glibc heap settings) instead of its own")
    parser.add_argument("--weights", help="e.g. 'stored,compute': instead of the transformers comparison, "
                        "time these load modes of a native FP8/FP4 checkpoint of each model")
    parser.add_argument("--head-precision", default="fp32", help="our engine's EngineConfig.head_precision "
                        "(bf16: the opt-in bf16 head where the CPU has bf16 units)")
    parser.add_argument("--isa", default="native", help="the C++ kernels' build: native, avx512, avx2 or generic")
    args = parser.parse_args(argv)
    from dsv4batch.model import EngineConfig

    config = EngineConfig(max_num_batched_tokens=4096, max_model_len=16384, head_precision=args.head_precision)
    if args.weights:
        emit(weights_bench(args, config), args.json)
        return
    result = {"bench": "forward", **machine(args.isa), "threads": torch.get_num_threads(),
              "head_precision": args.head_precision, "models": {}}
    for model_name in args.models.split(","):
        ours, hf = build_pair(model_name, config, args.hf_shared)
        cases = {f"single_{n}": [int(n)] for n in args.lengths.split(",")}
        cases["mixed_batch"] = [64, 200, 512, 700, 1024, 1500, 2048]
        rows = {}
        for name, case in cases.items():
            batch = random_prompts(case, ours.model.config.vocab_size, seed=len(name))
            tokens = sum(len(ids) - 1 for ids in batch)
            _, stats = ours.score(batch)  # warm-up (step and chunk counts do not depend on timing)
            t = {k: float("inf") for k in ("ours", "hf", "ours_layers", "hf_layers")}
            for _ in range(args.repeats):  # interleaved, so machine noise hits both engines alike
                t["ours"] = min(t["ours"], best_of(lambda: ours.score(batch), 1))
                t["hf"] = min(t["hf"], hf.seconds(batch))
                t["ours_layers"] = min(t["ours_layers"], best_of(lambda: ours_layers(ours, batch), 1))
                t["hf_layers"] = min(t["hf_layers"], hf.seconds(batch, head=False))
            rows[name] = {"tokens": tokens, "ours_tok_s": round(tokens / t["ours"], 1),
                          "hf_tok_s": round(tokens / t["hf"], 1), "speedup": round(t["hf"] / t["ours"], 2),
                          "ours_layers_tok_s": round(tokens / t["ours_layers"], 1),
                          "hf_layers_tok_s": round(tokens / t["hf_layers"], 1),
                          "layers_speedup": round(t["hf_layers"] / t["ours_layers"], 2),
                          "ours_steps": stats.num_steps, "ours_chunks": stats.num_chunks}
        result["models"][model_name] = rows
        hf.close()
        del ours, hf
    emit(result, args.json)
