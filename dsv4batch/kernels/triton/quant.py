"""Triton block-scaled FP8 and FP4 linears under ``dsv4batch.kernels.quant_linear``'s contract.

Imported on first use (see ``dsv4batch.kernels.triton``). ``y [M, N] = x [M, K] @ W^T`` with W
as the checkpoint stores it (formats: ``quant_reference.py``). Two paths:

* ``"dequant"`` (any sm80+ GPU, fp32 activations, FP4, the interpreter): each K tile of W is
  decoded in registers from its bytes (e4m3 or e2m1 bit patterns -> fp32, no fp8 types, which
  Triton refuses below sm89), multiplied by its ue8m0 / fp32 scale, rounded to x's dtype as the
  reference rounds it, and multiplied in x's dtype with fp32 accumulation. Equal to
  ``quant_linear_reference`` up to the GEMM's summation order.
* ``"fp8"`` (FP8 weights, bf16/fp16 x, sm89+; the default there): x is quantized in torch per row
  and 128 columns to e4m3 with power-of-two scales (``quant_cuda.act_quant``, DeepSeek's dynamic
  activation scheme; in torch because fp32 -> fp8 casts inside a kernel round wrongly under the
  interpreter), each 128-deep K block is one fp8 x fp8 ``tl.dot`` into fp32, scaled by the
  activation's and the weight block's scales. Matches the reference only approximately (the
  activation's e4m3 rounding, ~2^-4 relative per element).

ue8m0 scales are decoded as ``2^(byte - 127)`` by placing the byte in an fp32 exponent: byte 0
(2^-127) reads as 0 and 0xFF (NaN) as inf; neither occurs in a checkpoint (the loader refuses
NaN scales; a 2^-127 block is zero to fp32 GEMM precision anyway).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ..quant_cuda import act_quant
from ..quant_reference import BLOCK, FP4_GROUP

PATHS = ("dequant", "fp8")
_DT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


# Each @triton.jit helper call costs the interpreter a re-patch of triton.language (~5 ms), so
# the per-K-tile work is one helper, `_weight_tile`, with its decoding written out inline.

@triton.jit
def _weight_tile(w_ptr, s_ptr, rn, kb, N, K, G, stride_wn, stride_sn,
                 FP4: tl.constexpr, E8M0: tl.constexpr, DT: tl.constexpr, UPCAST: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """W[rn, kb*BLOCK_K : (kb+1)*BLOCK_K] [BLOCK_N, BLOCK_K] dequantized in fp32 (0 outside W),
    then rounded to x's dtype (DT 0 fp32, 1 bf16, 2 fp16) as the reference rounds it.
    FP8: bytes [N, K], scale [ceil(N/128), G] (BLOCK_K == 128: one scale column per tile);
    FP4: bytes [N, K/2] (low nibble = even column), scale [N, G] per 32 columns.
    UPCAST (interpreter): the rounded value stays fp32, bf16 rounded with integer ops (the
    interpreter's own fp32 -> bf16 cast truncates)."""
    nmask = rn < N
    if FP4:
        k2 = kb * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        b = tl.load(w_ptr + rn[:, None] * stride_wn + k2[None, :], mask=nmask[:, None] & (k2 < K // 2)[None, :],
                    other=0).to(tl.int32)
        c = tl.join(b & 15, b >> 4)  # e2m1 codes of columns 2c, 2c + 1
        e = (c & 7) >> 1
        f = c & 1
        val = tl.where(e == 0, f.to(tl.float32) * 0.5, (((e + 126) << 23) | (f << 22)).to(tl.float32, bitcast=True))
        w = tl.reshape(tl.where((c & 8) != 0, -val, val), [BLOCK_N, BLOCK_K // 32, 32])
        g = kb * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
        s = tl.load(s_ptr + rn[:, None] * stride_sn + g[None, :], mask=nmask[:, None] & (g < G)[None, :], other=0)
        if E8M0:  # ue8m0: the byte is an fp32 exponent
            s = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        w = tl.reshape(w * s.to(tl.float32)[:, :, None], [BLOCK_N, BLOCK_K])
    else:
        k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        b = tl.load(w_ptr + rn[:, None] * stride_wn + k[None, :], mask=nmask[:, None] & (k < K)[None, :],
                    other=0).to(tl.int32)
        e = (b & 0x7F) >> 3  # e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits; 0x7F (NaN) reads 480
        m = b & 7
        val = tl.where(e == 0, m.to(tl.float32) * 0.001953125, (((e + 120) << 23) | (m << 20)).to(tl.float32,
                                                                                                  bitcast=True))
        s = tl.load(s_ptr + (rn // 128) * stride_sn + kb, mask=nmask, other=0)
        if E8M0:
            s = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        w = tl.where((b & 0x80) != 0, -val, val) * s.to(tl.float32)[:, None]
    if DT == 1:
        if UPCAST:  # round to nearest even at bit 16
            bits = w.to(tl.int32, bitcast=True)
            w = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        else:
            w = w.to(tl.bfloat16)
    elif DT == 2:
        w = w.to(tl.float16).to(tl.float32) if UPCAST else w.to(tl.float16)
    return w


@triton.jit
def _tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Rows and columns of program `pid`'s output tile: GROUP_M row tiles at a time, so that they
    reuse W's column tiles in L2."""
    n_n = tl.cdiv(N, BLOCK_N)
    first_m = pid // (GROUP_M * n_n) * GROUP_M
    size_m = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    rm = (first_m + (pid % (GROUP_M * n_n)) % size_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid % (GROUP_M * n_n)) // size_m * BLOCK_N + tl.arange(0, BLOCK_N)
    return rm, rn


@triton.jit
def _dequant_linear_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, G, stride_xm, stride_wn, stride_sn, stride_ym,
    FP4: tl.constexpr, E8M0: tl.constexpr, DT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """y tile = sum over K tiles of x tile @ (dequantized W tile)^T in x's dtype, fp32 sums.
    Tiles are ordered GROUP_M row tiles at a time, so that they reuse W's column tiles in L2."""
    rm, rn = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=(rm < M)[:, None] & (k < K)[None, :], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
        w = _weight_tile(w_ptr, s_ptr, rn, kb, N, K, G, stride_wn, stride_sn, FP4, E8M0, DT, UPCAST,
                         BLOCK_N, BLOCK_K)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit
def _fp8_linear_kernel(
    xq_ptr, sx_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_sxm, stride_wn, stride_sn, stride_ym,
    E8M0: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):
    """y tile = sum over 128-deep K blocks of (e4m3 x e4m3 dot, fp32) * x scale[row] * W scale[block];
    tile order as in :func:`_dequant_linear_kernel`."""
    rm, rn = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    mmask = rm < M
    nmask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, tl.cdiv(K, 128)):
        k = kb * 128 + tl.arange(0, 128)
        a = tl.load(xq_ptr + rm[:, None].to(tl.int64) * stride_xm + k[None, :], mask=mmask[:, None], other=0.0)
        b = tl.load(w_ptr + rn[:, None] * stride_wn + k[None, :], mask=nmask[:, None] & (k < K)[None, :], other=0.0)
        sa = tl.load(sx_ptr + rm * stride_sxm + kb, mask=mmask, other=0.0)
        sb = tl.load(s_ptr + (rn // 128) * stride_sn + kb, mask=nmask, other=0)
        if E8M0:
            sb = (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        acc += tl.dot(a, tl.trans(b)) * sa[:, None] * sb.to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


INTERPRET = type(_fp8_linear_kernel).__name__ == "InterpretedFunction"


@dataclass(frozen=True)
class Config:
    """Tiles of one launch: rows (tokens), columns (output features), K depth, warps, stages."""

    block_m: int
    block_n: int
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8


def default_config(m: int, x_dtype: torch.dtype) -> Config:
    """Few rows (decode, a routed expert's tokens): 16-64-row tiles and 64 columns, so that a
    skinny GEMM still spreads W over many programs; many rows: 128 x 128. fp32 activations
    halve the K depth. Not yet tuned on a GPU (`bench/gpu.py` records what these reach)."""
    block_m = min(128, max(16, triton.next_power_of_2(m)))
    if INTERPRET:
        return Config(min(block_m, 64), 128, 128, 1, 1)
    block_n = 64 if m <= 64 else 128
    block_k = 64 if x_dtype == torch.float32 else 128
    return Config(block_m, block_n, block_k, 8 if block_m * block_n >= 128 * 128 else 4, 3)


def default_path(x: torch.Tensor, fmt: str) -> str:
    """"fp8" for FP8 weights and 16-bit x on sm89+ (fp8 tensor cores), else "dequant"."""
    if fmt != "fp8" or x.dtype == torch.float32 or INTERPRET or x.device.type != "cuda":
        return "dequant"
    return "fp8" if torch.cuda.get_device_capability(x.device) >= (8, 9) else "dequant"


@torch.no_grad()
def quant_linear_triton(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, fmt: str, *,
                        path: Optional[str] = None, config: Optional[Config] = None) -> torch.Tensor:
    """``x [M, K] @ W^T -> [M, N]`` in x.dtype (fp32 / bf16 / fp16), W stored in ``fmt``:
    "fp8": qweight [N, K] float8_e4m3fn, scale [ceil(N/128), ceil(K/128)]; "fp4": qweight
    [N, K/2] int8/uint8 (low nibble = even column), scale [N, ceil(K/32)]; scales fp32, bf16
    or float8_e8m0fnu. path: "dequant" or "fp8" (None: :func:`default_path`); config: tiles
    (None: :func:`default_config`). The caller checked shapes and support."""
    path = path or default_path(x, fmt)
    if path not in PATHS or (path == "fp8" and fmt != "fp8"):
        raise ValueError(f"path must be one of {PATHS} ('fp8' for fp8 weights only), got {path!r}")
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32 if INTERPRET else x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y.to(x.dtype)
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = qweight.contiguous().view(torch.uint8) if path == "dequant" else qweight.contiguous()
    e8m0 = scale.dtype == torch.float8_e8m0fnu
    s = scale.contiguous().view(torch.uint8) if e8m0 else scale.float().contiguous()
    cfg = config or default_config(m, x.dtype)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    if path == "fp8":
        _launch_fp8(x, w, s, y, e8m0, cfg, grid)
    else:
        _dequant_linear_kernel[grid](
            x, w, s, y, m, n, k, s.shape[1], x.stride(0), w.stride(0), s.stride(0), y.stride(0),
            FP4=fmt == "fp4", E8M0=e8m0, DT=_DT[x.dtype], UPCAST=INTERPRET,
            IEEE=INTERPRET or x.dtype == torch.float32,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK if fmt == "fp8" else cfg.block_k,
            GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y.to(x.dtype)


def _launch_fp8(x, w, s, y, e8m0: bool, cfg: Config, grid) -> None:
    """Quantize x per row and 128 columns (zero-padded to a multiple of 128), launch the fp8 kernel."""
    m, k = x.shape
    pad = -k % BLOCK
    xq, sx = act_quant(torch.nn.functional.pad(x, (0, pad)) if pad else x)
    _fp8_linear_kernel[grid](
        xq, sx, w, s, y, m, w.shape[0], k, xq.stride(0), sx.stride(0), w.stride(0), s.stride(0), y.stride(0),
        E8M0=e8m0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


assert FP4_GROUP == 32 and BLOCK == 128  # the kernels hard-code both
