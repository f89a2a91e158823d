"""Seeded transformers DeepseekV4ForCausalLM checkpoints for tests (the reference nobody here wrote)."""

from __future__ import annotations

import os
import shutil

import torch

from dsv4batch.model.tokenizer import packaged_tokenizer_path

BASE = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=32, q_lora_rank=32,
    o_groups=2, o_lora_rank=16, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
    hc_mult=2, sliding_window=128, index_n_heads=16, index_head_dim=16, index_topk=8,
    partial_rotary_factor=8 / 32, max_position_embeddings=65536,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
)


def build_hf_model(seed: int = 0, **overrides):
    """A DeepseekV4ForCausalLM (fp32, eager) whose every parameter is seeded random, not default-init.

    Defaults leave sinks, position biases and router biases at 0 and tid2eid all 0; we randomise
    them so every code path carries signal.
    """
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    config = DeepseekV4Config(**{**BASE, **overrides})
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            elif "norm" in name or name.endswith("scale"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                e = config.n_routed_experts
                first = torch.randint(0, e, (b.shape[0],), generator=gen)
                second = (first + torch.randint(1, e, (b.shape[0],), generator=gen)) % e
                b.copy_(torch.stack([first, second], 1)[:, : b.shape[1]])
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    return model


def make_hf_checkpoint(path: str, seed: int = 0, **overrides):
    """save_pretrained a seeded model into `path` with the real DSv4 tokenizer.json; returns the model."""
    model = build_hf_model(seed, **overrides)
    model.save_pretrained(path)
    shutil.copy(packaged_tokenizer_path(), os.path.join(path, "tokenizer.json"))
    return model


@torch.no_grad()
def hf_logprobs(model, ids) -> torch.Tensor:
    """transformers' fp32 eager per-token logprobs [len(ids) - 1] for one request."""
    x = torch.tensor([ids])
    logits = model(input_ids=x, use_cache=False).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, x[0, 1:, None]).squeeze(1)
