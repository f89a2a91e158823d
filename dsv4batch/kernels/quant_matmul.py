"""``quant_linear``: a linear layer on a weight kept as the checkpoint stores it (FP8 or FP4).

Everything that multiplies by a stored quantized weight calls :func:`quant_linear`, which runs

* ``"reference"``: :func:`dsv4batch.kernels.quant_reference.quant_linear_reference`, pure torch,
  CPU or CUDA (the definition of the contract below is
  :func:`dsv4batch.kernels.ref.quant_linear_ref`: the whole weight dequantized, one fp64 matmul).
  It dequantizes one block row (128 output rows) of the weight at a time into x's dtype and
  multiplies it, so the dense weight never exists whole; with fp32 x the result equals ``F.linear(x, W)`` on the
  weight dequantized at load (``weights="compute"``) up to fp32 GEMM blocking (about 1e-7
  relative); or
* ``"cuda"``: :func:`dsv4batch.kernels.quant_cuda.quant_linear_cuda`, torch's block-scaled FP8
  GEMM (cuBLASLt, sm90+; fp8 weights with K and N multiples of 128). The activation is quantized
  to e4m3 per token and 128 columns (DeepSeek's dynamic activation scheme), so results match the
  reference only approximately (relative error of order 2**-5 per output); or
* ``"triton"``: :func:`dsv4batch.kernels.triton.quant_linear_triton` (``kernels/triton/quant.py``):
  FP8 and FP4 on CUDA sm80+. bf16/fp16 x with FP8 weights on sm89+: an fp8 ``tl.dot`` on the
  activation quantized as the cuda backend quantizes it (approximate as above); otherwise W is
  dequantized in the kernel, tile by tile, as the reference dequantizes it (equal up to the GEMM's
  summation order). CPU tensors run under ``TRITON_INTERPRET=1`` only (tests).

Backend choice: ``backend="auto"`` takes ``"cuda"`` when the call fits it and a one-time probe on
that device agreed with the reference, else ``"triton"`` on the same terms (CUDA only), else
``"reference"``; ``"auto"`` first takes the active :class:`~dsv4batch.kernels.config.KernelConfig`'s
``quant`` (``auto``/``reference``/``cuda``/``triton``; set by bench and tests). Forcing ``"cuda"`` or
``"triton"`` where it cannot run raises ``RuntimeError`` with the reason.

========== ============================ ====================================================
x          [n, in]                      float32, bfloat16 or float16; n may be 0
qweight    fp8: [out, in]               float8_e4m3fn
           fp4: [out, in / 2]           int8 or uint8; low nibble = even column, e2m1 codes
scale      fp8: [ceil(out/128), ceil(in/128)]   float32, bfloat16 or float8_e8m0fnu (ue8m0)
           fp4: [out, ceil(in/32)]              same dtypes
fmt        "fp8" or "fp4"
returns    [n, out]                     x.dtype
========== ============================ ====================================================

Edge cases: ``in``/``out`` need not be multiples of 128 (partial blocks use their block's
scale); ``n == 0`` gives ``[0, out]``. Rows are independent (row i of the result depends only on
``x[i]``), but BLAS picks other code paths for a handful of rows: callers that must be batch
invariant pad x to at least 16 rows, as ``dsv4batch.model.layers`` does for every GEMM.
"""

from __future__ import annotations

import torch

from . import quant_cuda as _cuda
from . import triton as _triton
from .config import current
from .quant_reference import check_quant_shapes, in_features_of, quant_linear_reference

__all__ = ["quant_linear", "quant_backends"]

_BACKENDS = ("auto", "reference", "cuda", "triton")
_PROBED: dict[torch.device, str | None] = {}  # device -> why the cuda backend failed its probe


def _probe(device: torch.device) -> str | None:
    """Run the cuda backend once on a small problem and compare it with the reference."""
    if device not in _PROBED:
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(16, 256, generator=gen).to(device, torch.bfloat16)
        w = torch.randn(256, 256, generator=gen)
        scale = torch.full((2, 2), 2.0 ** -6)
        q = (w / 2.0 ** -6).clamp(-448, 448).to(torch.float8_e4m3fn).to(device)
        try:
            got = _cuda.quant_linear_cuda(x, q, scale.to(device)).float()
            ref = quant_linear_reference(x.float(), q, scale.to(device), "fp8")
            err = float((got - ref).norm() / ref.norm())
            _PROBED[device] = None if err < 0.1 else f"probe relative error {err:.3g} vs the reference"
        except RuntimeError as exc:
            _PROBED[device] = f"probe raised {type(exc).__name__}: {exc}"
    return _PROBED[device]


def requested_backend(backend: str) -> str:
    """`backend`, where "auto" yields to the active `KernelConfig.quant`."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    return current().quant if backend == "auto" else backend


def _resolve(backend: str, x: torch.Tensor, qweight: torch.Tensor, fmt: str) -> str:
    backend = requested_backend(backend)
    if backend == "reference":
        return backend
    if backend == "triton":
        reason = _triton.quant_unsupported_reason(x, qweight, fmt)
        if reason is not None:
            raise RuntimeError(f"triton quant backend requested but unavailable: {reason}")
        return backend
    reason = _cuda.unsupported_reason(x, qweight, fmt)
    if reason is None:
        reason = _probe(x.device)
    if backend == "cuda" and reason is not None:
        raise RuntimeError(f"cuda quant backend requested but unavailable: {reason}")
    if reason is None:
        return "cuda"
    return "triton" if x.device.type == "cuda" and _triton.quant_auto_reason(x, qweight, fmt) is None else "reference"


def quant_backends(x: torch.Tensor, qweight: torch.Tensor, fmt: str) -> list[str]:
    """Backends that can run this call: ``"reference"`` always, ``"cuda"`` / ``"triton"`` when it
    fits and probed ok (triton: on CUDA; the interpreter is not listed)."""
    reason = _cuda.unsupported_reason(x, qweight, fmt)
    names = ["reference"] + (["cuda"] if reason is None and _probe(x.device) is None else [])
    return names + (["triton"] if x.device.type == "cuda" and _triton.quant_auto_reason(x, qweight, fmt) is None
                    else [])


def quant_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, fmt: str, *,
                 backend: str = "auto") -> torch.Tensor:
    """``x [n, in] @ W.T -> [n, out]`` (x.dtype) with W = the dense weight ``qweight``/``scale``
    store in ``fmt``. Shapes, dtypes and edge cases: see the module docstring; the definition is
    :func:`dsv4batch.kernels.ref.quant_linear_ref`."""
    check_quant_shapes(qweight, scale, fmt)
    if x.dim() != 2 or x.shape[1] != in_features_of(qweight, fmt):
        raise ValueError(f"x must be [n, {in_features_of(qweight, fmt)}], got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"x must be a float tensor, got {x.dtype}")
    chosen = _resolve(backend, x, qweight, fmt)
    if chosen == "cuda":
        return _cuda.quant_linear_cuda(x, qweight, scale)
    if chosen == "triton":
        return _triton.quant_linear_triton(x, qweight, scale, fmt)
    return quant_linear_reference(x, qweight, scale, fmt)
