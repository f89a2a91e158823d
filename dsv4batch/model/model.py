"""DSv4Model: the DeepSeek-V4 stack over packed prefill steps, and the scoring API."""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .attention import Attention, WorkspacePool
from .config import EngineConfig, layer_ratio
from .layers import Linear, MoE, RMSNorm, Rope, hc_post, hc_pre, linear, rms
from .step import RequestState, StepContext


class Block(nn.Module):
    """One decoder layer: mHC around attention and around the MoE (native parameter names)."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        hidden, hc = config.hidden_size, config.hc_mult
        self.ratio = layer_ratio(config, layer_idx)
        self.attn = Attention(config, self.ratio)
        self.ffn = MoE(config, is_hash=config.mlp_layer_types[layer_idx] == "hash_moe")
        self.attn_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(hidden, config.rms_norm_eps)
        mix = (2 + hc) * hc
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.zeros(mix, hc * hidden)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros(mix)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3)))
        self.hc_args = (hc, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, ctx: StepContext, layer: int, backend: str) -> torch.Tensor:
        """h [T, hc, hidden] -> [T, hc, hidden]."""
        post, comb, x = hc_pre(h, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, *self.hc_args)
        cache_out = {}
        out = self.attn(self.attn_norm(x), ctx, ctx.cache_in(layer), cache_out, backend)
        ctx.store(layer, cache_out)
        h = hc_post(h, out, post, comb)
        post, comb, x = hc_pre(h, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, *self.hc_args)
        return hc_post(h, self.ffn(self.ffn_norm(x), ctx.input_ids), post, comb)


class DSv4Model(nn.Module):
    """DeepSeek-V4 for scoring. Build with `DSv4Model.from_pretrained(path | "tiny")`.

    Attributes are named like the native checkpoint (`embed`, `layers.i.attn.wq_a`, `head`, ...).
    """

    def __init__(self, config, engine: EngineConfig | None = None):
        super().__init__()
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

        self.config, self.engine = config, engine or EngineConfig()
        hidden, hc = config.hidden_size, config.hc_mult
        self.embed = nn.Embedding(config.vocab_size, hidden)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.head = Linear(hidden, config.vocab_size)
        self.hc_head_fn = nn.Parameter(torch.zeros(hc, hc * hidden))
        self.hc_head_base = nn.Parameter(torch.zeros(hc))
        self.hc_head_scale = nn.Parameter(torch.ones(1))
        with torch.device("cpu"):  # real tensors even when the loader builds the rest on "meta"
            rotary = DeepseekV4RotaryEmbedding(config)  # reuse transformers' (YaRN) inverse frequencies
        self.ropes = {name: Rope(getattr(rotary, f"{name}_inv_freq"), getattr(rotary, f"{name}_attention_scaling"))
                      for name in ("main", "compress")}
        self.ratios = sorted({layer.ratio for layer in self.layers})
        self.pool = WorkspacePool()
        self.tokenizer = None
        self.last_stats: dict = {}

    @classmethod
    def from_pretrained(cls, path_or_name: str, device="cpu", dtype=torch.float32, engine: EngineConfig | None = None):
        """Load a checkpoint folder (config.json, *.safetensors, tokenizer.json) or the embedded 'tiny'."""
        from .loader import load_model

        return load_model(cls, path_or_name, device=device, dtype=dtype, engine=engine)

    @property
    def device(self):
        return self.head.weight.device

    def hidden_step(self, ctx: StepContext, backend: str) -> torch.Tensor:
        """Run all layers on one packed step -> final normed hidden [T, hidden]."""
        h = self.embed(ctx.input_ids).unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        for i, layer in enumerate(self.layers):
            h = layer(h, ctx, i, backend)
        flat = rms(h.flatten(1).float(), self.config.rms_norm_eps)
        pre = torch.sigmoid(linear(flat, self.hc_head_fn.float()) * self.hc_head_scale.float()
                            + self.hc_head_base.float()) + self.config.hc_eps
        return self.norm((pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype))

    def token_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden], targets [n] -> log p(target) [n] fp32, `logits_slice` rows at a time.

        Every slice has exactly `logits_slice` rows (the last is zero-padded): one fixed shape means
        one GEMM/reduction strategy, so a row's logprob does not depend on its step's size.
        """
        step, n = self.engine.logits_slice, hidden.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=hidden.device)
        padded = hidden.new_zeros(step, hidden.shape[1])
        padded_targets = targets.new_zeros(step)
        for a in range(0, n, step):
            rows = min(step, n - a)
            padded[:rows], padded_targets[:rows] = hidden[a:a + rows], targets[a:a + rows]
            logits = self.head(padded).float()
            # fused log-softmax + gather (one pass fewer than logsumexp over the vocabulary)
            out[a:a + rows] = -F.cross_entropy(logits, padded_targets, reduction="none")[:rows]
        return out

    def validate(self, batch) -> list[np.ndarray]:
        vocab, max_len = self.config.vocab_size, self.engine.max_model_len
        arrays = []
        for i, ids in enumerate(batch):
            arr = np.asarray(ids, dtype=np.int64).reshape(-1)
            if arr.size == 0:
                raise ValueError(f"request {i} is empty: give at least one token id (e.g. bos)")
            if arr.min() < 0 or arr.max() >= vocab:
                bad = int(arr[(arr < 0) | (arr >= vocab)][0])
                raise ValueError(f"request {i} has token id {bad} outside the vocabulary [0, {vocab})")
            if arr.size > max_len:
                raise ValueError(f"request {i} has {arr.size} tokens, more than max_model_len={max_len}")
            arrays.append(arr)
        return arrays

    def schedule(self, states: list[RequestState]):
        """Yield steps [(state, start, end)] of at most max_num_batched_tokens query tokens.

        A request feeds positions [0, len - 1): the last token is only a target. Long requests
        span steps and continue first in the next one.
        """
        budget, step = self.engine.max_num_batched_tokens, []
        pending = [s for s in states if len(s.ids) > 1]
        used = 0
        while pending:
            st = pending[0]
            take = min(len(st.ids) - 1 - st.done, budget - used)
            step.append((st, st.done, st.done + take))
            st.done += take
            used += take
            if st.done == len(st.ids) - 1:
                pending.pop(0)
            if used == budget or not pending:
                yield step
                step, used = [], 0

    @torch.inference_mode()
    def score_tokens(self, batch: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """For each request of ids, float32 [len(ids) - 1]: element t-1 = log p(ids[t] | ids[:t])."""
        arrays = self.validate(batch)
        stats = dict(num_tokens=0, num_steps=0, num_chunks=0, workspace_elements=0, planner_s=0.0)
        t0 = time.perf_counter()
        order = np.argsort([len(a) for a in arrays], kind="stable") if self.engine.sort_by_length \
            else np.arange(len(arrays))
        states = [RequestState(arrays[i]) for i in order]
        outputs = {id(st): np.zeros(len(st.ids) - 1, np.float32) for st in states}
        self.pool.peak_bytes = 0
        window, device = self.config.sliding_window, self.device
        backend = self.engine.attn_backend
        for segs in self.schedule(states):
            ctx = StepContext(segs, ratios=self.ratios, window=window, engine=self.engine, ropes=self.ropes,
                              pool=self.pool, stats=stats, device=device)
            hidden = self.hidden_step(ctx, backend)
            targets = torch.from_numpy(np.concatenate([st.ids[s + 1:e + 1] for st, s, e in segs])).to(device)
            logprobs = self.token_logprobs(hidden, targets).cpu().numpy()
            for b, (st, s, e) in enumerate(segs):
                outputs[id(st)][s:e] = logprobs[ctx.cu[b]:ctx.cu[b + 1]]
                if e == len(st.ids) - 1:
                    st.layers = {}  # finished: drop carried tensors now
            stats["num_tokens"] += int(ctx.cu[-1])
            stats["num_steps"] += 1
        result = [None] * len(arrays)
        for st, i in zip(states, order):
            result[i] = outputs[id(st)]
        stats["forward_s"] = time.perf_counter() - t0
        stats["peak_workspace_bytes"] = self.pool.peak_bytes
        self.last_stats = stats
        return result
