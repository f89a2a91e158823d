"""DSv4Model: the DeepSeek-V4 stack over one packed prefill step, and the per-token logprobs.

Computation only: loading is `model/loader.py`, scheduling, scoring and the workspace pool are
`model/engine.py`'s `Engine`.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import Attention
from .config import layer_ratio
from .head import VOCAB_TILE, PackedHead, fused_scores, sliced_details, tiled_logprobs
from .layers import Linear, MoE, RMSNorm, Rope, hc_collapse, hc_mixes, hc_post, hc_pre, linear, sigmoid
from .parallel import SINGLE, check_split
from .step import StepContext


class Block(nn.Module):
    """One decoder layer: mHC around attention and around the MoE (native parameter names)."""

    def __init__(self, config, layer_idx: int, tp=SINGLE):
        super().__init__()
        hidden, hc = config.hidden_size, config.hc_mult
        self.ratio = layer_ratio(config, layer_idx)
        self.attn = Attention(config, self.ratio, tp)
        self.ffn = MoE(config, is_hash=config.mlp_layer_types[layer_idx] == "hash_moe", tp=tp)
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
        h = hc_post(h, self.attn(self.attn_norm(x), ctx, layer, backend), post, comb)
        post, comb, x = hc_pre(h, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, *self.hc_args)
        return hc_post(h, self.ffn(self.ffn_norm(x), ctx.input_ids), post, comb)


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `model` by native name: the tensors a checkpoint fills."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


class DSv4Model(nn.Module):
    """DeepSeek-V4 for scoring, from a `DeepseekV4Config`. Load with `loader.load_model(path | TINY)`.

    Attributes are named like the native checkpoint (`embed`, `layers.i.attn.wq_a`, `head`, ...).
    `ratios`: the layers' distinct compress ratios (the engine plans chunks once per ratio and step);
    `ropes`: "main" / "compress" -> `Rope` (the step context turns them into cos/sin per position).
    `tp`: this rank's place when the replica is split T ways (`model/parallel.py`: local heads,
    groups, experts and vocabulary slice; `SINGLE`: the whole model). `vocab_start`: the first
    token id of this rank's `embed` / `head` rows.
    """

    def __init__(self, config, tp=SINGLE):
        super().__init__()
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

        check_split(config, tp.size)
        self.config, self.tp = config, tp
        hidden, hc = config.hidden_size, config.hc_mult
        self.vocab_start, vocab_end = tp.local_range(config.vocab_size)
        self.embed = nn.Embedding(vocab_end - self.vocab_start, hidden)
        self.layers = nn.ModuleList(Block(config, i, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.head = Linear(hidden, vocab_end - self.vocab_start)
        self.packed_head = PackedHead()  # the head's packed copies (CPU fp32), built when first used
        self.hc_head_fn = nn.Parameter(torch.zeros(hc, hc * hidden))
        self.hc_head_base = nn.Parameter(torch.zeros(hc))
        self.hc_head_scale = nn.Parameter(torch.ones(1))
        with torch.device("cpu"):  # real tensors even when the loader builds the rest on "meta"
            rotary = DeepseekV4RotaryEmbedding(config)  # reuse transformers' (YaRN) inverse frequencies
        self.ropes = {name: Rope(getattr(rotary, f"{name}_inv_freq"), getattr(rotary, f"{name}_attention_scaling"))
                      for name in ("main", "compress")}
        self.ratios = sorted({layer.ratio for layer in self.layers})

    @property
    def device(self):
        return self.head.weight.device

    def hidden_step(self, ctx: StepContext, backend: str) -> torch.Tensor:
        """Run all layers on one packed step -> final normed hidden [T, hidden]."""
        h = self.embed_tokens(ctx.input_ids).unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        for i, layer in enumerate(self.layers):
            h = layer(h, ctx, i, backend)
        pre = sigmoid(hc_mixes(h, self.hc_head_fn, self.config.rms_norm_eps) * self.hc_head_scale.float()
                      + self.hc_head_base.float()) + self.config.hc_eps
        return self.norm(hc_collapse(pre, h))

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] int64 -> [T, hidden]; vocabulary-parallel: each rank looks up the ids in its
        slice (zeros elsewhere) and one all-reduce sums them (exact: one nonzero term per row)."""
        if self.tp.size == 1:
            return self.embed(ids)
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.embed.num_embeddings)
        rows = self.embed(local.clamp(0, self.embed.num_embeddings - 1))
        return self.tp.all_reduce(rows * inside.unsqueeze(1).to(rows.dtype))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> fp32 logits [n, vocab] over the whole vocabulary (the sampler's
        input). One GEMM on at least `MIN_ROWS` rows (a row's logits do not depend on its
        batch-mates); vocabulary-parallel: every rank gets all ranks' slices (all-gather)."""
        weight = self.head.weight
        out = linear(hidden.to(weight.dtype), weight).float()
        if self.tp.size > 1:
            out = self.tp.all_gather(out).permute(1, 0, 2).flatten(1)  # [T, n, V/T] -> [n, V]
        return out

    def token_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, slice_rows: int,
                       precision: str = "fp32") -> torch.Tensor:
        """hidden [n, hidden], targets [n] int64 -> log p(target) [n] fp32, `slice_rows` rows at a
        time (`precision`: `EngineConfig.head_precision`).

        On the CPU in fp32: `head.fused_scores`, one call whose per-row arithmetic is fixed (no
        slices). Else every slice has exactly `slice_rows` rows (the last is zero-padded) and goes
        through `tiled_logprobs`: one fixed shape means one GEMM/reduction strategy, so a row's
        logprob does not depend on its step's size or on its slice-mates. Vocabulary-parallel
        (T > 1): `head_details`' combination of the ranks' slices.
        """
        if self.tp.size > 1:
            return self.head_details(hidden, targets, slice_rows, 0, precision)[0]
        panels = self.packed_head.panels(self.head.weight, precision)
        if panels is not None:
            return fused_scores(hidden, self.head.weight, targets, panels)[0]
        step, n = slice_rows, hidden.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=hidden.device)
        padded = hidden.new_zeros(step, hidden.shape[1])
        padded_targets = targets.new_zeros(step)
        weight = self.head.weight
        packed = self.packed_head.tiles(weight, VOCAB_TILE, step, precision)
        for a in range(0, n, step):
            rows = min(step, n - a)
            padded[:rows], padded_targets[:rows] = hidden[a:a + rows], targets[a:a + rows]
            out[a:a + rows] = tiled_logprobs(padded, weight, padded_targets, VOCAB_TILE, packed)[:rows]
        return out

    def head_details(self, hidden: torch.Tensor, targets: torch.Tensor, slice_rows: int, top_k: int,
                     precision: str = "fp32"):
        """`head.sliced_details` over this rank's vocabulary slice, combined across ranks:
        (logprob [n] fp32, is_greedy [n] bool, top_ids [n, K] int64, top_logprobs [n, K] fp32).
        Where `token_logprobs` runs `head.fused_scores` (one rank), logprob and is_greedy come
        from it (the same bits as `token_logprobs`) and only a top-K (K > 0) walks the tiles."""
        weight = self.head.weight
        panels = self.packed_head.panels(weight, precision) if self.tp.size == 1 else None
        if panels is not None:
            logprob, greedy = fused_scores(hidden, weight, targets, panels)
            if top_k == 0:
                n = hidden.shape[0]
                return logprob, greedy, targets.new_zeros(n, 0), logprob.new_zeros(n, 0)
            _, _, top_ids, top_logprobs = sliced_details(hidden, weight, targets, slice_rows, top_k, self.tp,
                                                         self.vocab_start,
                                                         self.packed_head.tiles(weight, VOCAB_TILE, slice_rows,
                                                                                precision))
            return logprob, greedy, top_ids, top_logprobs
        return sliced_details(hidden, weight, targets, slice_rows, top_k, self.tp, self.vocab_start,
                              self.packed_head.tiles(weight, VOCAB_TILE, slice_rows, precision))
