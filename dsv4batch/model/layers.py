"""Token-wise DSv4 blocks on packed tokens `[T, ...]`: norms, interleaved RoPE, mHC, MoE.

Attribute names follow the native checkpoint (`wq_a`, `hc_attn_fn`, `ffn.gate.tid2eid`, ...)
so that loading is a name lookup. The maths follows transformers' `modeling_deepseek_v4.py`.

In fp32 on the CPU, the token-wise passes (`RMSNorm`, `Rope.apply`, `hc_pre` after its GEMM,
`hc_collapse`, `hc_post`, `swiglu`) run as one C++ pass each (`kernels/csrc/elementwise.cpp`, where
`kernels.elementwise_supported`); the torch code below stays their definition and fallback.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import (HC_MAX, elementwise_supported, hc_collapse_cpu, hc_post_cpu, hc_pre_cpu, quant_linear,
                       rms_norm_cpu, rope_cpu, swiglu_cpu)
from ..kernels.quant_reference import dequantize_into, stored_shapes
from ..kernels.rows import pad_rows
from .parallel import SINGLE


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear on x [n, in] -> [n, out], computed on at least `kernels.rows.MIN_ROWS` rows."""
    return F.linear(pad_rows(x), weight)[: x.shape[0]]


def grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-group projection: x [n, G, in], weight [G, out, in] -> [n, G, out]."""
    y = torch.bmm(pad_rows(x).transpose(0, 1), weight.transpose(1, 2))
    return y.transpose(0, 1)[: x.shape[0]]


class Linear(nn.Linear):
    """Bias-free nn.Linear over [n, in] rows that pads small batches (see `kernels.rows`)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class QuantLinear(nn.Module):
    """A bias-free linear layer whose weight stays as the checkpoint stores it (`weights="stored"`).

    Buffers (the checkpoint's bytes, see `dsv4batch.kernels.quant_linear` for the formats):
    `qweight` [*lead, out, in] float8_e4m3fn (fmt "fp8") or [*lead, out, in / 2] int8/uint8
    (fmt "fp4"); `scale` [*lead, ceil(out/128), ceil(in/128)] ("fp8") or [*lead, out, ceil(in/32)]
    ("fp4") in the checkpoint's scale dtype (ue8m0 or fp32). `lead` is () for one projection and
    (E,) for the routed experts' stacked projection (`experts=E`; call with `expert=e`).
    `compute_dtype`: the dtype `weight` dequantizes to (the loader sets the model's dtype).
    """

    def __init__(self, in_features: int, out_features: int, fmt: str, *, qdtype: torch.dtype | None = None,
                 scale_dtype: torch.dtype = torch.float8_e8m0fnu, experts: int | None = None):
        super().__init__()
        qshape, sshape = stored_shapes(fmt, out_features, in_features)
        lead = () if experts is None else (experts,)
        qdtype = qdtype or (torch.float8_e4m3fn if fmt == "fp8" else torch.int8)
        self.register_buffer("qweight", torch.empty(lead + qshape, dtype=qdtype))
        self.register_buffer("scale", torch.empty(lead + sshape, dtype=scale_dtype))
        self.in_features, self.out_features, self.fmt, self.experts = in_features, out_features, fmt, experts
        self.compute_dtype = torch.float32
        self.backend = "auto"

    @property
    def shape(self) -> tuple[int, ...]:
        """The dense weight's shape: (out, in), or (E, out, in) for stacked experts."""
        return (() if self.experts is None else (self.experts,)) + (self.out_features, self.in_features)

    def forward(self, x: torch.Tensor, expert: int | None = None) -> torch.Tensor:
        """x [n, in] -> [n, out] in x.dtype (expert `expert`'s projection when stacked), on >= MIN_ROWS rows."""
        q, s = (self.qweight, self.scale) if expert is None else (self.qweight[expert], self.scale[expert])
        return quant_linear(pad_rows(x), q, s, self.fmt, backend=self.backend)[: x.shape[0]]

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight `shape` in `compute_dtype`, dequantized now (for callers that need the
        matrix itself, e.g. attention's grouped `wo_a`); nothing is kept."""
        out = torch.empty(self.shape, dtype=self.compute_dtype, device=self.qweight.device)
        if self.experts is None:
            return dequantize_into(out, self.qweight, self.scale, self.fmt)
        for e in range(self.experts):
            dequantize_into(out[e], self.qweight[e], self.scale[e], self.fmt)
        return out

    def extra_repr(self) -> str:
        lead = "" if self.experts is None else f"experts={self.experts}, "
        return f"{lead}in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"


def expert_linear(weight, x: torch.Tensor, expert: int) -> torch.Tensor:
    """x [n, in] -> [n, out] through expert `expert` of a stacked [E, out, in] parameter or QuantLinear."""
    if isinstance(weight, QuantLinear):
        return weight(x, expert)
    return linear(x, weight[expert])


def inv_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x^2) + eps) over the last dim, fp32 [..., 1]: one read of x (vector_norm
    reduces in place; square().mean() writes and re-reads an x-sized temporary, and on this
    memory-bound CPU every pass over a [T, heads, 512] tensor costs as much as a small GEMM)."""
    norm = torch.linalg.vector_norm(x.float(), dim=-1, keepdim=True)
    return norm.square_().div_(x.shape[-1]).add_(eps).rsqrt_()


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMSNorm over the last dim, computed in fp32, returned in x's dtype."""
    return x * inv_rms(x, eps).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with an fp32 weight (DSv4 keeps norm weights in fp32). x: [..., dim]."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if elementwise_supported(x, self.weight):
            return rms_norm_cpu(x, self.weight, self.eps)
        h = x.float() * inv_rms(x, self.eps)
        return h.mul_(self.weight).to(x.dtype)


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
        """x [n, ..., d]; cos/sin [n, rd] broadcast over middle dims. Rotates x[..., -rd:] in place
        and returns x (every caller passes a fresh tensor: no copy of the d - rd untouched dims)."""
        rd = cos.shape[-1]
        if cos.shape[0] == x.shape[0] and elementwise_supported(x, cos, sin):
            return rope_cpu(x, cos, sin)  # one pass (kernels/csrc/elementwise.cpp)
        if x.dtype == torch.float32:
            # in place on the (even, odd) pairs: ~2.5 passes over the rope dims instead of ~8
            # (q [4096, 8, 512]: 13.4 -> 8.7 ms); other dtypes keep the fp32 copy below
            shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (rd // 2,)
            c, s = cos[:, 0::2].reshape(shape), sin[:, 0::2].reshape(shape)
            pairs = x[..., -rd:].unflatten(-1, (rd // 2, 2))
            x0, x1 = pairs[..., 0], pairs[..., 1]
            even = torch.addcmul(x0 * c, x1, s, value=-1.0)  # x0 c - x1 s
            x1.mul_(c).addcmul_(x0, s)                        # x1 c + x0 s (x0 still the input)
            x0.copy_(even)
            return x
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (rd,)
        cos, sin = cos.view(shape), sin.view(shape)
        rope = x[..., -rd:].float()
        rotated = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
        x[..., -rd:] = rope * cos + rotated * sin
        return x


def sum_of(parts) -> torch.Tensor:
    """Elementwise sum of same-shape tensors, left to right.

    Used instead of `.sum(dim)` over the small mHC / top-k dims: torch picks a reduction strategy
    (vector lanes, accumulator tree, thread split) from the whole tensor's shape, so a token's
    sum could round differently with another number of tokens in the step. Adding slices one by
    one gives every element the same operations whatever T is (batch invariance)."""
    parts = list(parts)
    out = parts[0].clone()
    for p in parts[1:]:
        out.add_(p)
    return out


# torch's CPU sigmoid / silu / softplus round a tensor's last (len % vector width) elements on a
# scalar path that differs from the vector one by an ulp, so a token's value would depend on where
# it sits in the step. exp / log1p / division round the same on both paths: build from those.
def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)), the same bits for an element wherever it sits (see above)."""
    return torch.exp(-x).add_(1).reciprocal_()


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(x)), x itself above 20 (F.softplus's threshold); position-independent bits."""
    return torch.where(x > 20, x, torch.log1p(torch.exp(x)))


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """linear(rms(flat x), fn) as linear(flat x, fn) * inv_rms(flat x): x [T, hc, H], fn [m, hc*H]
    -> [T, m] fp32. Scaling the m outputs instead of the hc*H inputs saves a [T, hc*H] pass."""
    flat = x.flatten(1).float()
    return linear(flat, fn.float()).mul_(inv_rms(flat, norm_eps))


def hc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
           iters: int, eps: float, norm_eps: float):
    """Manifold-constrained hyper-connection weights.

    x: [T, hc, H] streams -> (post [T, hc] fp32, comb [hc, hc, T] fp32 Sinkhorn-normalised
    (comb[i, j, t]: stream i's weight in new stream j; tokens last), collapsed [T, H] in x's dtype).
    """
    mixes = hc_mixes(x, fn, norm_eps)
    if hc <= HC_MAX and elementwise_supported(mixes, x, scale, base):
        return hc_pre_cpu(mixes, x, scale, base, iters, eps)  # the rest in one pass per token
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre = sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * sigmoid(post_w * scale[1] + post_b)
    # Tokens last ([i, j, T], contiguous): every row/column sum adds hc slices of [hc, T] one by
    # one, elementwise along T: the same arithmetic for a token whatever T (see `sinkhorn_`).
    logits = (comb_w * scale[2] + comb_b).t().contiguous().view(hc, hc, -1)
    peak = logits[:, 0].clone()
    for j in range(1, hc):
        peak = torch.maximum(peak, logits[:, j])
    comb = (logits - peak.unsqueeze(1)).exp_()
    sinkhorn_(comb, iters, eps)
    return post, comb, hc_collapse(pre, x)


def sinkhorn_(comb: torch.Tensor, iters: int, eps: float, is_numpy: bool | None = None) -> torch.Tensor:
    """In place on comb [hc, hc, T] (contiguous, >= 0): softmax-over-j normalisation (+ eps), then
    `iters` alternating column (over i) and row (over j) normalisations, as transformers' mHC.

    Only additions and divisions, each correctly rounded, in a fixed order per element: any
    path gives the same bits. On CPU (is_numpy, the default there) numpy runs them: ~200 ops of
    [hc, T] whose per-call cost is several times lower than torch's (2.4x faster at T=511)."""
    if is_numpy is None:
        is_numpy = comb.device.type == "cpu"
    c = comb.numpy() if is_numpy else comb
    hc = c.shape[0]

    def over_j():  # [hc, 1, T]: each row's sum over j
        r = c[:, 0:1] + c[:, 1:2]
        for j in range(2, hc):
            r += c[:, j:j + 1]
        return r

    def over_i():  # [hc, T]: each column's sum over i
        r = c[0] + c[1]
        for i in range(2, hc):
            r += c[i]
        return r

    c /= over_j()
    c += eps
    for it in range(iters):
        if it:
            r = over_j()
            r += eps
            c /= r
        r = over_i()
        r += eps
        c /= r
    return comb


def hc_collapse(weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """sum_i weights[:, i] * x[:, i]: weights [T, hc] fp32, x [T, hc, H] -> [T, H] in x's dtype."""
    if elementwise_supported(weights, x):
        return hc_collapse_cpu(weights, x)
    out = weights[:, 0:1] * x[:, 0]
    for i in range(1, x.shape[1]):
        out.addcmul_(weights[:, i:i + 1], x[:, i])
    return out.to(x.dtype)


def hc_post(x: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams [T, hc, H]: stream j = post_j * out + sum_i comb[i, j] * x_i.

    x [T, hc, H], out [T, H], post [T, hc], comb [hc, hc, T] (`hc_pre`'s layout). One fused
    multiply-add per source stream over [T, hc, H] instead of T tiny [hc, hc] x [hc, H] matmuls.
    """
    if elementwise_supported(x, out, post, comb):
        return hc_post_cpu(x, out, post, comb)
    dtype = x.dtype
    new = post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2)
    for i in range(x.shape[1]):
        new.addcmul_(comb[i].t().to(dtype).unsqueeze(-1), x[:, i:i + 1])
    return new


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
        scores = softplus(linear(x, self.weight)).sqrt()
        if self.is_hash:
            indices = self.tid2eid[input_ids].long()
        else:
            indices = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        weights = weights / (sum_of(weights.unbind(-1)).unsqueeze(-1) + 1e-20)
        return weights * self.scaling, indices


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    if gate.shape == up.shape and elementwise_supported(gate, up):
        return swiglu_cpu(gate, up, limit)
    gate = gate.clamp(max=limit)
    return gate * sigmoid(gate) * up.clamp(min=-limit, max=limit)  # silu(gate) * up, see `sigmoid`


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

    The checkpoint's `experts.{e}.w1.weight` is row e of `w1` (the loader stacks them). With
    `weights="stored"` the loader replaces a quantized projection by a stacked `QuantLinear`.
    Tokens are grouped by expert (one sort), so the loop runs over experts, not tokens.
    """

    def __init__(self, num_experts: int, hidden: int, inter: int, limit: float, first: int = 0,
                 total: int | None = None):
        super().__init__()
        # experts [first, first + num_experts) of `total` (expert parallel: a rank's block)
        self.num_experts, self.first, self.total = num_experts, first, total or num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, inter, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.w3 = nn.Parameter(torch.empty(num_experts, inter, hidden))
        self.limit = limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights/indices [T, k] (global expert ids) -> [T, H]: the sum over this
        module's experts only (a rank's share when experts are split; zero rows for tokens
        routed elsewhere)."""
        k = indices.shape[1]
        flat = indices.flatten()
        slot = None  # routed slots [T * k] kept here, when only a block of the experts is
        if self.num_experts != self.total:
            flat = flat - self.first
            slot = ((flat >= 0) & (flat < self.num_experts)).nonzero().squeeze(1)
            flat = flat[slot]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        if slot is not None:
            order = slot[order]
        token_of = order // k
        xs = x[token_of]
        ws = weights.flatten()[order].unsqueeze(-1)
        out = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:
                seg = xs[start:start + n]
                h = swiglu(expert_linear(self.w1, seg, e), expert_linear(self.w3, seg, e), self.limit)
                out[start:start + n] = expert_linear(self.w2, h, e) * ws[start:start + n].to(x.dtype)
            start += n
        return torch.zeros_like(x).index_add_(0, token_of, out)


class MoE(nn.Module):
    """DSv4 MoE block: routed experts (hash or top-k gate) plus one shared expert.

    With `tp` (`model/parallel.py`): this rank's block of routed experts and its 1/T of the shared
    expert's intermediate size; the router is replicated; one all-reduce sums the ranks' parts."""

    def __init__(self, config, is_hash: bool, tp=SINGLE):
        super().__init__()
        hidden, inter, limit = config.hidden_size, config.moe_intermediate_size, config.swiglu_limit
        first, last = tp.local_range(config.n_routed_experts)
        self.gate = Gate(config, is_hash)
        self.experts = Experts(last - first, hidden, inter, limit, first, config.n_routed_experts)
        self.shared_experts = Expert(hidden, inter // tp.size, limit)
        self.tp = tp

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, indices = self.gate(x, input_ids)
        return self.tp.all_reduce(self.experts(x, weights, indices) + self.shared_experts(x))
