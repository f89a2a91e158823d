"""Token-wise DSv4 blocks on packed tokens `[T, ...]`: norms, interleaved RoPE, mHC, MoE.

Attribute names follow the native checkpoint (`wq_a`, `hc_attn_fn`, `ffn.gate.tid2eid`, ...)
so that loading is a name lookup. The maths follows transformers' `modeling_deepseek_v4.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


# BLAS takes other code paths (GEMV, split-K) for a handful of rows, and their rounding differs:
# a token's result would then depend on how many tokens share its step. Padding every GEMM to at
# least MIN_ROWS rows keeps each row's arithmetic identical whatever the batch (batch invariance).
MIN_ROWS = 16


def pad_rows(x: torch.Tensor, rows: int = MIN_ROWS) -> torch.Tensor:
    """x [n, ...] -> [max(n, rows), ...] (zero rows appended when n < rows)."""
    if x.shape[0] >= rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))])


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear on x [n, in] -> [n, out], computed on at least MIN_ROWS rows."""
    return F.linear(pad_rows(x), weight)[: x.shape[0]]


def grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-group projection: x [n, G, in], weight [G, out, in] -> [n, G, out]."""
    y = torch.bmm(pad_rows(x).transpose(0, 1), weight.transpose(1, 2))
    return y.transpose(0, 1)[: x.shape[0]]


class Linear(nn.Linear):
    """Bias-free nn.Linear over [n, in] rows that pads small batches (see MIN_ROWS)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMSNorm over the last dim, computed in fp32, returned in x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with an fp32 weight (DSv4 keeps norm weights in fp32). x: [..., dim]."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


class Rope:
    """Interleaved (GPT-J) RoPE on the trailing `2 * len(inv_freq)` dims of each head.

    inv_freq: [rd/2] fp32 (from transformers' rope init, so yarn etc. match exactly).
    """

    def __init__(self, inv_freq: torch.Tensor, scaling: float):
        self.inv_freq = inv_freq
        self.scaling = scaling

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [n] int64 -> cos, sin [n, rd] fp32 (already repeat-interleaved)."""
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)
        cos = (freqs.cos() * self.scaling).repeat_interleave(2, dim=-1)
        sin = (freqs.sin() * self.scaling).repeat_interleave(2, dim=-1)
        return cos, sin

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [n, ..., d]; cos/sin [n, rd] broadcast over middle dims. Rotates x[..., -rd:]."""
        rd = cos.shape[-1]
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (rd,)
        cos, sin = cos.view(shape), sin.view(shape)
        rope = x[..., -rd:].float()
        rotated = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
        out = (rope * cos + rotated * sin).to(x.dtype)
        return torch.cat([x[..., :-rd], out], dim=-1)


def hc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
           iters: int, eps: float, norm_eps: float):
    """Manifold-constrained hyper-connection weights.

    x: [T, hc, H] streams -> (post [T, hc] fp32, comb [T, hc, hc] fp32 Sinkhorn-normalised,
    collapsed [T, H] in x's dtype).
    """
    flat = rms(x.flatten(1).float(), norm_eps)
    mixes = linear(flat, fn.float())
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    collapsed = (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)
    return post, comb, collapsed


def hc_post(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams [T, hc, H]: stream j = post_j * out + sum_i comb[i, j] * x_i."""
    dtype = x.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), x)


class Gate(nn.Module):
    """MoE router: sqrt(softplus) scores; hash layers select experts by `tid2eid[token]`."""

    def __init__(self, config, is_hash: bool):
        super().__init__()
        num_experts, hidden = config.n_routed_experts, config.hidden_size
        self.top_k = config.num_experts_per_tok
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.is_hash = is_hash
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.register_buffer("bias", torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor):
        """x [T, H], input_ids [T] -> (weights [T, k], expert indices [T, k])."""
        scores = F.softplus(linear(x, self.weight)).sqrt()
        if self.is_hash:
            indices = self.tid2eid[input_ids].long()
        else:
            indices = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, indices


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class Expert(nn.Module):
    """One dense SwiGLU MLP (the shared expert): w2(silu(clamp(w1 x)) * clamp(w3 x))."""

    def __init__(self, hidden: int, inter: int, limit: float):
        super().__init__()
        self.w1 = Linear(hidden, inter)
        self.w2 = Linear(inter, hidden)
        self.w3 = Linear(hidden, inter)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x), self.limit))


class Experts(nn.Module):
    """Routed experts stacked per projection: w1, w3 [E, I, H]; w2 [E, H, I].

    The checkpoint's `experts.{e}.w1.weight` is row e of `w1` (the loader stacks them).
    Tokens are grouped by expert (one sort), so the loop runs over experts, not tokens.
    """

    def __init__(self, num_experts: int, hidden: int, inter: int, limit: float):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, inter, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.w3 = nn.Parameter(torch.empty(num_experts, inter, hidden))
        self.limit = limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights/indices [T, k] -> [T, H]."""
        k = indices.shape[1]
        flat = indices.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.w1.shape[0]).tolist()
        token_of = order // k
        xs = x[token_of]
        ws = weights.flatten()[order].unsqueeze(-1)
        out = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:
                seg = xs[start:start + n]
                h = swiglu(linear(seg, self.w1[e]), linear(seg, self.w3[e]), self.limit)
                out[start:start + n] = linear(h, self.w2[e]) * ws[start:start + n].to(x.dtype)
            start += n
        return torch.zeros_like(x).index_add_(0, token_of, out)


class MoE(nn.Module):
    """DSv4 MoE block: routed experts (hash or top-k gate) plus one shared expert."""

    def __init__(self, config, is_hash: bool):
        super().__init__()
        hidden, inter, limit = config.hidden_size, config.moe_intermediate_size, config.swiglu_limit
        self.gate = Gate(config, is_hash)
        self.experts = Experts(config.n_routed_experts, hidden, inter, limit)
        self.shared_experts = Expert(hidden, inter, limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, indices = self.gate(x, input_ids)
        return self.experts(x, weights, indices) + self.shared_experts(x)
