"""Dense fp32 projection on the CPU: ``y = x @ weight.T`` through oneDNN where it runs, else BLAS.

========== ============= =====================================================================
x          [n, in]       any float dtype, any strides (made contiguous for oneDNN)
weight     [out, in]     x.dtype; rows contiguous (a row slice of a weight is fine)
packed     opaque        optional: ``pack_weight(weight, rows)`` of this very weight, or None
returns    [n, out]      x.dtype, a new tensor; ``F.linear(x, weight)`` up to fp32 rounding
========== ============= =====================================================================

Why: torch's fp32 CPU GEMM is MKL's sgemm, which on AMD processors runs well below oneDNN (a
2-core EPYC, Zen 4: [512, 256] x [256, 2048] at 169 GF/s in MKL, 209 in oneDNN; the fused head
over 512 rows 1.14-1.19x faster). oneDNN is reached through ``torch.ops.mkldnn._linear_pointwise``, the
op torch's own CPU compiler emits for a linear layer; it has no autograd, so it serves only
fp32 CPU calls without grad, checked against BLAS once per process (any error or disagreement:
BLAS from then on). Both libraries keep a row's bits independent of its place among the rows
for a fixed shape (`tests/kernels/test_dense.py`); callers keep shapes fixed where a result must
not depend on its batch-mates (the head's fixed slices).

Its caller is the vocabulary head (`model/head.vocab_tiles`): a few large GEMMs of one shape. The
decoder's projections stay on ``F.linear``: oneDNN builds a primitive per new row count (15-30 us
a call) and lost on their many small, varying GEMMs (tiny's stack 0.82-0.91x, shapes of
[16-2047, 64-1024] x [.., 4-4096] mostly 0.4-1.0x).

``pack_weight`` reorders a weight once into oneDNN's blocked layout (its own copy, the weight's
size): every later GEMM skips repacking it, with the same bits as the plain weight (checked once
per process, with the oneDNN check). A head tile [512, 128 or 256] x [.., 2048] ran 3-5% faster.

``bf16_linear`` (opt-in, `EngineConfig.head_precision="bf16"`): oneDNN's bf16 GEMM on a
``pack_weight(weight, rows, is_bf16=True)`` copy (the weight rounded to bf16, half its bytes):
x [n, in] bf16 -> [n, out] bf16, products summed in fp32 inside and the result rounded once.
It runs where oneDNN has bf16 units (AVX512-BF16 or AMX: `bf16_available`). oneDNN's "bf16 math
mode" for fp32 GEMMs (``torch.backends.mkldnn.matmul.fp32_precision``) was not taken: it keeps an
fp32 output but applies only with AMX (on a Zen 4 EPYC with AVX512-BF16 it computed fp32, same
bits and time), so a head's numbers would depend on the CPU. A [512, 256] x [256, 2048] tile:
1.39 vs 2.68 ms on a 2-core Zen 4 EPYC; error against fp64 mean 0.0018 / max 0.014 at mean
|logit| 0.64 (0.0015 / 0.0097 from the input rounding alone).

The active `KernelConfig.gemm` (``config.py``; bench and tests set it) = ``auto`` (default: the
fused C++ head, `cpu.head_stats`, where it builds, and oneDNN when it works for the tiles), ``fused`` (the fused head, raise if it cannot
run), ``onednn`` (tiles on oneDNN, raise if it cannot run) or ``blas`` (tiles on ``F.linear``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import current

_onednn_ok: bool | None = None  # None: not checked yet in this process
_bf16_ok: bool | None = None


def cpu_gemm() -> str:
    """The active `KernelConfig.gemm`: "auto", "fused", "onednn" or "blas"."""
    return current().gemm


def onednn_available() -> bool:
    """Whether oneDNN's linear runs here and agrees with BLAS (checked once per process)."""
    global _onednn_ok
    if _onednn_ok is None:
        _onednn_ok = _check_onednn()
    return _onednn_ok


def bf16_available() -> bool:
    """Whether `bf16_linear` runs here: `KernelConfig.gemm` is not blas, oneDNN runs, the CPU
    has bf16 GEMM units (AVX512-BF16 or AMX), and a bf16 product agrees with fp32 to bf16
    rounding (checked once per process)."""
    global _bf16_ok
    if cpu_gemm() == "blas":
        return False
    if _bf16_ok is None:
        _bf16_ok = onednn_available() and _check_bf16()
    return _bf16_ok


def _onednn(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, None, "none", [], "")


def _pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), rows)


def _check_onednn() -> bool:
    return torch.backends.mkldnn.is_available() and _probe(torch.float32)


def _check_bf16() -> bool:
    # oneDNN's own check (`_is_mkldnn_bf16_supported`) is true on any AVX-512 CPU, where bf16 is
    # emulated and slower than fp32: ask for the bf16 units themselves
    units = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(f is not None and bool(f()) for f in units) and _probe(torch.bfloat16)


def _probe(dtype: torch.dtype) -> bool:
    """Whether oneDNN's linear in `dtype`, plain and on a packed weight, agrees with BLAS's fp32
    product to `dtype`'s rounding (an fp32 packed weight: the plain one's bits)."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 70, generator=gen), torch.randn(50, 70, generator=gen)
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 0.02, "atol": 0.2}
    try:
        with torch.no_grad():
            plain, packed = _onednn(x.to(dtype), w.to(dtype)), _onednn(x.to(dtype), _pack(w.to(dtype), 37))
            return bool(plain.dtype == dtype and torch.allclose(plain.float(), x @ w.t(), **tol)
                        and torch.equal(packed, plain))
    except (RuntimeError, AttributeError, NotImplementedError):  # op missing or unsupported CPU
        return False


def _is_onednn_call(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `dense_linear(x, weight)` runs on oneDNN (raises for a forced oneDNN that cannot)."""
    choice = cpu_gemm()
    usable = (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
              and weight.device.type == "cpu" and weight.stride(-1) == 1 and weight.stride(0) == weight.shape[1]
              and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))
    if choice == "blas" or not usable:
        return False
    if onednn_available():
        return True
    if choice == "onednn":
        raise RuntimeError("KernelConfig.gemm='onednn', but oneDNN's linear does not run on this machine")
    return False


def pack_weight(weight: torch.Tensor, rows: int, is_bf16: bool = False) -> torch.Tensor | None:
    """oneDNN's packed copy of weight [out, in] for GEMMs of about `rows` rows (any row count
    works), or None where `dense_linear` would not run this weight through oneDNN. is_bf16: the
    copy is the weight rounded to bf16, for `bf16_linear` (None where `bf16_available()` is not)."""
    if weight.requires_grad and torch.is_grad_enabled():
        return None
    if not _is_onednn_call(weight.new_empty(0, weight.shape[1]), weight) or (is_bf16 and not bf16_available()):
        return None
    with torch.no_grad():
        return _pack(weight.bfloat16() if is_bf16 else weight, rows)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, in] @ weight [out, in].T -> [n, out] (see the module docstring); `packed`, when
    given, stands in for `weight` on oneDNN (any other path uses `weight`)."""
    if _is_onednn_call(x, weight):
        return _onednn(x, weight if packed is None else packed)
    return F.linear(x, weight)


def bf16_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [n, in] bf16 @ weight.T -> [n, out] bf16, where packed = ``pack_weight(weight, rows,
    is_bf16=True)``: oneDNN sums the bf16 products in fp32 and rounds the result to bf16. A
    row's bits do not depend on its place among the rows at a fixed shape."""
    return _onednn(x, packed)
