"""The embedded `TINY` model: a scaled-down DSv4 with seeded weights (the engine adds the real tokenizer).

Same numbers on every machine: weights come from numpy's PCG64 stream (platform independent)
in sorted-name order. All three attention layer types, hash and top-k MoE, hc_mult 4, window
128, compress rates 4/128, and index_topk 16 so the indexer prunes beyond 64 tokens.
`loader.load_model(TINY)` builds it; `seed_weights` fills any `DSv4Model` the same way.
"""

from __future__ import annotations

import numpy as np
import torch

from .model import DSv4Model, model_tensors
from .parallel import rank_slice, split_of

SEED = 20260609


def tiny_config():
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        vocab_size=129280, hidden_size=128, num_hidden_layers=6, num_attention_heads=4, head_dim=64,
        q_lora_rank=64, o_groups=2, o_lora_rank=32, moe_intermediate_size=64, n_routed_experts=8,
        num_experts_per_tok=2, hc_mult=4, sliding_window=128, index_n_heads=8, index_head_dim=32,
        index_topk=16, partial_rotary_factor=16 / 64, max_position_embeddings=65536,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"],
    )


def seed_weights(model) -> None:
    """Fill every tensor of `model` (any DSv4 shape) in place with `tiny_state(model)`; a rank
    of a split model (`model.tp`) gets its slices of the whole model's seeded values."""
    tensors, tp = model_tensors(model), model.tp
    if tp.size > 1:
        with torch.device("meta"):
            whole = DSv4Model(model.config)
    state = tiny_state(model if tp.size == 1 else whole)
    with torch.no_grad():
        for name, tensor in tensors.items():
            split = split_of(name) if tp.size > 1 else None
            value = state[name] if split is None else rank_slice(state[name], split[1], tp.rank,
                                                                 tensor.shape[split[1]])
            tensor.copy_(value)


def tiny_state(model) -> dict[str, torch.Tensor]:
    """Seeded values for every parameter/buffer of a `DSv4Model` built from `tiny_config()`."""
    rng = np.random.Generator(np.random.PCG64(SEED))
    cfg = model.config
    state = {}
    tensors = model_tensors(model)
    for name in sorted(tensors):
        shape = tuple(tensors[name].shape)
        if name.endswith("tid2eid"):
            first = rng.integers(0, cfg.n_routed_experts, size=shape[0])
            second = (first + rng.integers(1, cfg.n_routed_experts, size=shape[0])) % cfg.n_routed_experts
            state[name] = torch.from_numpy(np.stack([first, second], 1))
            continue
        if name.endswith("norm.weight") or name.endswith("_scale"):
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("_base") or name.endswith("attn_sink") or name.endswith("gate.bias") or "ape" in name:
            value = 0.5 * rng.standard_normal(shape)
        else:
            fan_in = shape[-1]
            value = rng.standard_normal(shape) * (1.0 / np.sqrt(fan_in))
        state[name] = torch.from_numpy(value.astype(np.float32))
    return state
