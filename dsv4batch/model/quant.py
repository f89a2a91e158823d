"""The native DSv4 quantized tensors on the checkpoint side: names, formats, holding, encoding.

- FP8 (e4m3) weights `X.weight [out, in]` with `X.scale` (or transformers' `X.weight_scale_inv`)
  `[ceil(out/128), ceil(in/128)]` (ue8m0 or fp32): w = weight * scale per 128 x 128 block.
- FP4 (e2m1) experts: int8 `X.weight [out, in/2]`, low nibble = even column, with `X.scale`
  `[out, in/32]`: w[r, c] = LUT[code] * scale[r, c // 32].

The arithmetic of both formats is defined once, in `dsv4batch.kernels.quant_reference`. This
module says which checkpoint tensor is stored how (`detect_format`), swaps a meta model's
`Linear` / stacked expert projections for `QuantLinear`s that hold them as stored
(`hold_stored`, `weights="stored"`), and writes the native layout (`quantize_state`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from ..kernels.quant_reference import BLOCK, FP4_GROUP, FP4_LUT, dequantize_into, stored_shapes
from .layers import Experts, Linear, QuantLinear

SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
E4M3_MAX, E2M1_MAX = 448.0, 6.0
# the linears the native checkpoint stores FP8 (routed experts are FP4: `quantize_state`)
NATIVE_FP8 = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])\.weight$")
NATIVE_FP4 = re.compile(r"^layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
DENSE_ONLY = ("head",)  # `DSv4Model.device` reads head.weight: the vocab head stays dense


def scale_name(weight_name: str, names) -> str | None:
    """The checkpoint name of `weight_name`'s scale tensor, if the checkpoint has one."""
    stem = weight_name[: -len(".weight")] if weight_name.endswith(".weight") else weight_name
    for candidate in (stem + ".scale", weight_name + "_scale_inv"):
        if candidate in names:
            return candidate
    return None


@dataclass(frozen=True)
class StoredFormat:
    """How one checkpoint weight is stored: `fmt` ("fp8"/"fp4") and the stored dtypes."""

    fmt: str
    qdtype: torch.dtype
    scale_dtype: torch.dtype


def detect_format(dtype: torch.dtype, stored_shape, logical_shape) -> str | None:
    """"fp8" / "fp4" for a weight stored with a scale as `dtype [stored_shape]`, else None."""
    stored_shape, logical_shape = tuple(stored_shape), tuple(logical_shape)
    if dtype == torch.float8_e4m3fn and stored_shape == logical_shape:
        return "fp8"
    if dtype in (torch.int8, torch.uint8) and stored_shape[:-1] == logical_shape[:-1] \
            and len(stored_shape) and stored_shape[-1] * 2 == logical_shape[-1]:
        return "fp4"
    return None


def dequantize(weight: torch.Tensor, scale: torch.Tensor, shape: tuple[int, ...],
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Quantized `weight` + `scale` -> the dense tensor of the parameter's `shape` (into `out`,
    else a new fp32 tensor), one 128-row slice at a time. `ValueError` for an unknown layout."""
    fmt = detect_format(weight.dtype, weight.shape, shape)
    if fmt is None or len(shape) != 2:
        raise ValueError(f"cannot dequantize a {weight.dtype} tensor of shape {tuple(weight.shape)} "
                         f"with a scale of shape {tuple(scale.shape)}")
    expected = stored_shapes(fmt, *shape)[1]
    if tuple(scale.shape) != expected:
        raise ValueError(f"its {fmt} scale has shape {tuple(scale.shape)}, expected {expected}")
    out = torch.empty(shape, dtype=torch.float32) if out is None else out
    return dequantize_into(out, weight, scale, fmt)


def nonfinite(t: torch.Tensor) -> bool:
    """Any NaN/Inf in `t`, for every dtype a checkpoint holds (e4m3: NaN only; ue8m0: 0xFF = NaN)."""
    if t.dtype == torch.float8_e4m3fn:
        return bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any())
    if t.dtype == torch.float8_e8m0fnu:
        return bool((t.view(torch.uint8) == 0xFF).any())
    return t.is_floating_point() and not bool(torch.isfinite(t).all())


def hold_stored(model: nn.Module, formats: dict[str, StoredFormat]) -> None:
    """Swap, on a `meta` model, every module or stacked expert parameter named in `formats`
    (`layers.0.attn.wq_a`, `layers.3.ffn.experts.w1`) for a `QuantLinear` in that format."""
    modules = dict(model.named_modules())
    with torch.device("meta"):
        for name, f in formats.items():
            parent_name, _, attr = name.rpartition(".")
            parent, old = modules[parent_name], getattr(modules[parent_name], attr)
            if isinstance(old, Linear):
                new = QuantLinear(old.in_features, old.out_features, f.fmt, qdtype=f.qdtype,
                                  scale_dtype=f.scale_dtype)
            elif isinstance(parent, Experts) and isinstance(old, nn.Parameter):
                experts, out_features, in_features = old.shape
                delattr(parent, attr)
                new = QuantLinear(in_features, out_features, f.fmt, qdtype=f.qdtype,
                                  scale_dtype=f.scale_dtype, experts=experts)
            else:
                raise TypeError(f"{name} is a {type(old).__name__}; only Linear and stacked experts "
                                "hold quantized weights")
            setattr(parent, attr, new)


def holder(name: str) -> str:
    """The `hold_stored` key of a canonical checkpoint weight name (experts.e.w1 -> experts.w1)."""
    stem = name[: -len(".weight")]
    return re.sub(r"\.experts\.\d+\.", ".experts.", stem)


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (e4m3 [out, in], ue8m0 scale [ceil(out/128), ceil(in/128)]), scale = the
    block's amax / 448 rounded up to a power of two (all-zero blocks get scale 1)."""
    out_f, in_f = w.shape
    ob, ib = -(-out_f // BLOCK), -(-in_f // BLOCK)
    padded = w.new_zeros(ob * BLOCK, ib * BLOCK, dtype=torch.float32)
    padded[:out_f, :in_f] = w
    blocks = padded.view(ob, BLOCK, ib, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX))), 1.0)
    q = (blocks / scale[:, None, :, None]).view_as(padded)[:out_f, :in_f]
    return q.to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] (in % 32 == 0) -> (int8 [out, in/2] packed e2m1, ue8m0 scale [out, in/32]):
    scale = the group's amax / 6 rounded up to a power of two, codes = nearest e2m1 magnitude."""
    out_f, in_f = w.shape
    groups = w.float().view(out_f, in_f // FP4_GROUP, FP4_GROUP)
    amax = groups.abs().amax(-1)
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / E2M1_MAX))), 1.0)
    x = (groups / scale[..., None]).view(out_f, in_f)
    mags = FP4_LUT[:8]
    codes = torch.bucketize(x.abs(), (mags[1:] + mags[:-1]) / 2)   # nearest (ties: smaller magnitude)
    codes = (codes | ((x < 0).long() << 3)).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), scale.to(torch.float8_e8m0fnu)


def quantize_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A native-named state dict in the native DSv4 layout: `NATIVE_FP8` linears as FP8 and routed
    experts (`NATIVE_FP4`) as FP4, each with its `.scale`; every other tensor (and any weight
    already stored with a scale) unchanged."""
    out = {}
    for name, tensor in state.items():
        encode = quantize_fp8 if NATIVE_FP8.search(name) else quantize_fp4 if NATIVE_FP4.match(name) else None
        if encode is None or name[: -len(".weight")] + ".scale" in state:
            out[name] = tensor
            continue
        out[name], out[name[: -len(".weight")] + ".scale"] = encode(tensor)
    return out
