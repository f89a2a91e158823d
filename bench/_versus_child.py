"""The child of `bench/versus.py`: one checkout's engine on a bench model, timing what it is sent.

Run as `python bench/_versus_child.py MODEL` with PYTHONPATH naming the checkout whose `dsv4batch`
to time (so it imports nothing from `bench`, which that checkout may lack or hold differently).
It builds MODEL (`tiny`, `dsv4-shape` or `unseen`, the seeded weights of `model/tiny.py`) with the
API that checkout has (`Engine`, or the older `DSv4Model.score_tokens`), answers its first line
once warm, then answers each stdin line {"lengths", "seed"} with {"seconds", "tokens"}: one
timed call on random prompts of those lengths.
"""

from __future__ import annotations

import json
import os
import sys
import time

# this folder is sys.path[0] when run as a script: its profile.py, pipeline.py, ... would shadow
# the standard library's and transformers' imports
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import numpy as np  # noqa: E402


def configure(name: str):
    """The model config of bench model `name` (the values of bench/forward.py's builders)."""
    from dsv4batch.model.tiny import tiny_config

    cfg = tiny_config()
    if name == "tiny":
        return cfg
    values = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, head_dim=512, q_lora_rank=128,
                  o_groups=2, o_lora_rank=128, index_n_heads=8, index_head_dim=64, index_topk=64,
                  moe_intermediate_size=128, qk_rope_head_dim=64, rope=64 / 512)
    if name == "unseen":
        values.update(vocab_size=32768, hidden_size=512, num_attention_heads=16, head_dim=128, q_lora_rank=192,
                      o_groups=4, o_lora_rank=96, index_n_heads=4, index_head_dim=128, index_topk=32,
                      moe_intermediate_size=192, qk_rope_head_dim=32, rope=32 / 128)
    rope = values.pop("rope")
    for key, value in values.items():
        setattr(cfg, key, value)
    cfg.partial_rotary_factor = rope
    cfg.layer_types = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                       "compressed_sparse_attention"]
    cfg.mlp_layer_types = ["hash_moe", "moe", "moe", "moe"]
    for params in cfg.rope_parameters.values():
        params["partial_rotary_factor"] = rope
    return cfg


def scorer(name: str):
    """score(batch) of this checkout's engine on bench model `name`, fp32, the bench's settings."""
    import torch

    from dsv4batch.model import DSv4Model, EngineConfig
    from dsv4batch.model.tiny import tiny_state

    settings = EngineConfig(max_num_batched_tokens=4096, max_model_len=16384)
    try:
        from dsv4batch.model import Engine
    except ImportError:  # before the Engine: the model scores and takes the settings
        model = DSv4Model(configure(name), settings)
        score = model.score_tokens
    else:
        model = DSv4Model(configure(name))
        score = Engine(model, settings).score
    with torch.no_grad():
        for key, value in tiny_state(model).items():
            (model.get_parameter if key in dict(model.named_parameters()) else model.get_buffer)(key).copy_(value)
    return score, model.config.vocab_size


def main(name: str) -> None:
    try:  # this checkout's kernels on the ISA the bench asked for (checkouts before them: nothing to set)
        from dsv4batch.kernels import cpu

        cpu.use_isa(os.environ.get("DSV4BATCH_BENCH_ISA", "native"))
    except (ImportError, AttributeError):
        pass
    score, vocab = scorer(name)
    score([[0] + list(range(3, 300))])  # warm: kernels built, heads packed
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        rng = np.random.default_rng(request["seed"])
        batch = [[0] + rng.integers(3, vocab, size=n - 1).tolist() for n in request["lengths"]]
        t0 = time.perf_counter()
        score(batch)
        print(json.dumps({"seconds": time.perf_counter() - t0, "tokens": sum(n - 1 for n in request["lengths"])}),
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
