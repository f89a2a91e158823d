"""Reference backend of :func:`dsv4batch.kernels.quant_linear` (the definition it is tested against:
``ref.quant_linear_ref``), and the weight formats.

The two native DeepSeek-V4 weight formats (``fmt``), for a logical weight ``w [out, in]``:

* ``"fp8"``: ``qweight [out, in]`` float8_e4m3fn and ``scale [ceil(out/128), ceil(in/128)]``
  (float32, bfloat16 or float8_e8m0fnu, i.e. ue8m0): ``w[r, c] = qweight[r, c] * scale[r//128, c//128]``.
* ``"fp4"``: ``qweight [out, in/2]`` int8 or uint8, two e2m1 codes per byte (low nibble = even
  column), and ``scale [out, ceil(in/32)]``: ``w[r, c] = FP4_LUT[code(r, c)] * scale[r, c//32]``.

Dequantized values are computed in fp32 and then cast to the compute dtype, so a weight
dequantized here is bit-identical to the loader's dequantize-at-load (``weights="compute"``).
The matmul never materialises the whole dense weight: it dequantizes one block-row slice of
``ROWS`` output rows at a time and multiplies it (``F.linear``) into its output columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 128  # FP8 scale blocks are BLOCK x BLOCK
FP4_GROUP = 32  # FP4 scales cover FP4_GROUP columns of one row
ROWS = BLOCK  # output rows dequantized at once by the reference matmul (one FP8 block row)
FORMATS = ("fp8", "fp4")
FP4_LUT = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
# value pair (low nibble, high nibble) of every byte: one gather decodes two columns
_FP4_PAIRS = torch.stack([FP4_LUT[torch.arange(256) & 0xF], FP4_LUT[torch.arange(256) >> 4]], -1)
_PAIRS_ON: dict[torch.device, torch.Tensor] = {}
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e8m0fnu)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def stored_shapes(fmt: str, out_features: int, in_features: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(qweight shape, scale shape) of a logical ``[out_features, in_features]`` weight in ``fmt``."""
    if fmt == "fp8":
        return (out_features, in_features), (_cdiv(out_features, BLOCK), _cdiv(in_features, BLOCK))
    if fmt == "fp4":
        if in_features % 2:
            raise ValueError(f"fp4 packs two columns per byte: in_features {in_features} must be even")
        return (out_features, in_features // 2), (out_features, _cdiv(in_features, FP4_GROUP))
    raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")


def in_features_of(qweight: torch.Tensor, fmt: str) -> int:
    """Logical input width of a stored 2-D ``qweight``."""
    return qweight.shape[-1] * 2 if fmt == "fp4" else qweight.shape[-1]


def check_quant_shapes(qweight: torch.Tensor, scale: torch.Tensor, fmt: str) -> None:
    """Raise ``ValueError`` unless ``qweight``/``scale`` are a 2-D weight stored in ``fmt``."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    want = torch.float8_e4m3fn if fmt == "fp8" else (torch.int8, torch.uint8)
    if qweight.dim() != 2 or qweight.dtype not in (want if isinstance(want, tuple) else (want,)):
        raise ValueError(f"{fmt} qweight must be 2-D {want}, got {tuple(qweight.shape)} {qweight.dtype}")
    if scale.dtype not in SCALE_DTYPES:
        raise ValueError(f"scale dtype must be one of {SCALE_DTYPES}, got {scale.dtype}")
    _, scale_shape = stored_shapes(fmt, qweight.shape[0], in_features_of(qweight, fmt))
    if tuple(scale.shape) != scale_shape:
        raise ValueError(f"{fmt} qweight {tuple(qweight.shape)} needs scale {scale_shape}, got {tuple(scale.shape)}")


def dequantize_rows(qweight: torch.Tensor, scale: torch.Tensor, fmt: str, start: int, stop: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows ``[start, stop)`` of the dense weight -> ``[stop - start, in]`` in ``dtype``.

    Computed in fp32 (the product of a code and its scale is exact there for ue8m0 scales), then
    cast. Temporaries are two fp32 ``[stop - start, in]`` slices; the rest of ``qweight`` is untouched.
    """
    rows, in_features = stop - start, in_features_of(qweight, fmt)
    if fmt == "fp8":
        w = qweight[start:stop].float()
        block_rows = torch.arange(start, stop, device=scale.device) // BLOCK
        s = scale.index_select(0, block_rows).float().repeat_interleave(BLOCK, dim=1)
    elif fmt == "fp4":
        pairs = _PAIRS_ON.get(qweight.device)
        if pairs is None:
            pairs = _PAIRS_ON.setdefault(qweight.device, _FP4_PAIRS.to(qweight.device))
        w = pairs[qweight[start:stop].view(torch.uint8).long()].view(rows, in_features)
        s = scale[start:stop].float().repeat_interleave(FP4_GROUP, dim=1)
    else:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    w.mul_(s[:, :in_features])
    return w if dtype == torch.float32 else w.to(dtype)


@torch.no_grad()
def dequantize_into(out: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """Fill the dense ``out [out_features, in]`` (any float dtype) one ``ROWS`` slice at a time."""
    for start in range(0, qweight.shape[0], ROWS):
        stop = min(start + ROWS, qweight.shape[0])
        out[start:stop] = dequantize_rows(qweight, scale, fmt, start, stop, out.dtype)
    return out


@torch.no_grad()
def quant_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x [n, in] @ dequantize(qweight, scale).T -> [n, out]`` in x.dtype, one ``ROWS`` slice of
    the weight dequantized (to x.dtype) and multiplied at a time. Shapes: see the module docstring."""
    out_features = qweight.shape[0]
    y = x.new_empty(x.shape[0], out_features)
    for start in range(0, out_features, ROWS):
        stop = min(start + ROWS, out_features)
        y[:, start:stop] = F.linear(x, dequantize_rows(qweight, scale, fmt, start, stop, x.dtype))
    return y
