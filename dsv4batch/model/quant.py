"""Dequantization of the native DSv4 checkpoint formats to the model's dtype at load time.

- FP8 (e4m3) weights `X.weight [out, in]` with `X.scale` (or transformers' `X.weight_scale_inv`)
  `[ceil(out/128), ceil(in/128)]` (ue8m0 or fp32): w = weight * scale per 128 x 128 block.
- FP4 (e2m1) experts: int8 `X.weight [out, in/2]`, low nibble = even column, with `X.scale`
  `[out, in/32]`: w[r, c] = LUT[code] * scale[r, c // 32].
"""

from __future__ import annotations

import torch

SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
FP4_LUT = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
BLOCK = 128
FP4_GROUP = 32


def scale_name(weight_name: str, names) -> str | None:
    """The checkpoint name of `weight_name`'s scale tensor, if the checkpoint has one."""
    stem = weight_name[: -len(".weight")] if weight_name.endswith(".weight") else weight_name
    for candidate in (stem + ".scale", weight_name + "_scale_inv"):
        if candidate in names:
            return candidate
    return None


def dequantize(weight: torch.Tensor, scale: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Quantized `weight` + `scale` -> fp32 tensor of the parameter's `shape`."""
    scale = scale.float()
    if weight.dtype == torch.int8 and weight.shape[-1] * 2 == shape[-1]:  # packed FP4
        codes = weight.view(torch.uint8)
        nibbles = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2).long()
        values = FP4_LUT[nibbles]
        return values * scale.repeat_interleave(FP4_GROUP, dim=-1)[..., : shape[-1]]
    if weight.dtype == torch.float8_e4m3fn:
        full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        return weight.float() * full[: weight.shape[0], : weight.shape[1]]
    raise ValueError(f"cannot dequantize a {weight.dtype} tensor of shape {tuple(weight.shape)} "
                     f"with a scale of shape {tuple(scale.shape)}")
