"""Which custom CPU kernels run by default, per instruction set: each only where it measured
faster than its torch path (``python -m dsv4batch.bench isa``; BENCHMARKS.md, "CPU kernels per
instruction set").

========== ============================ ==================================================
kernel     C++ (``csrc/``)              its torch path
========== ============================ ==================================================
sparse_mla ``sparse_mla.cpp``           ``sparse_mla_torch.sparse_mla_prefill_torch``
indexer    ``indexer.cpp``              ``indexer.indexer_topk_torch``
head       ``head.cpp``                 ``model/head.py``'s oneDNN vocabulary tiles
elementwise ``elementwise.cpp``: RoPE,  ``model/layers.py`` (one switch: the six measured
           mHC pre/collapse/post,       alike on every build)
           RMSNorm, SwiGLU
========== ============================ ==================================================

Measured (2,047-token requests on the tiny, dsv4-shape and unseen bench models): on avx2 (AMD
EPYC Zen 3) every kernel won; on avx512 (Intel Xeon, speed rounds seven and eight) every kernel
won; the generic build (4-float vectors, no FMA) lost the head (0.34-0.39x) and, on two of three
models, attention (0.62-0.92x) and the indexer (0.87-0.91x) to torch's vectorized paths, and won
the token-wise passes (1.1-3.1x). A static table, not a timing at engine load: the same machine
then always runs the same code, so a job's logprobs never depend on how busy the machine was
when it started (a last-bit difference can flip an indexer near-tie: 0.02 in a logprob).

The forced choices keep working whatever this table says: ``backend="cpu"``,
``KernelConfig(gemm="fused")``; ``KernelConfig(elementwise="torch")`` and ``backend="torch"`` turn
kernels off (``config.py``).
"""

from __future__ import annotations

import platform
from contextlib import contextmanager

from . import cpu

KERNELS = ("sparse_mla", "indexer", "head", "elementwise")
DEFAULTS = {"avx512": frozenset(KERNELS), "avx2": frozenset(KERNELS), "generic": frozenset({"elementwise"})}

_forced: dict = {}  # kernel -> bool: `force`'s overrides (bench, tests)


def chosen(kernel: str) -> bool:
    """Whether `kernel` (one of KERNELS) is the default path in this process: in DEFAULTS for the
    ISA in use (or as `force` set it), and the kernels built (building them on the first call)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    on = _forced.get(kernel, kernel in DEFAULTS[cpu.isa()])
    return on and cpu.available()


@contextmanager
def force(**on: bool):
    """Within the block, kernel=True/False replaces DEFAULTS' choice (bench and tests)."""
    unknown = set(on) - set(KERNELS)
    if unknown:
        raise ValueError(f"unknown kernels {sorted(unknown)}; known: {KERNELS}")
    saved = dict(_forced)
    _forced.update(on)
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(saved)


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("model name")), None)
        if line:
            return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def selection() -> dict:
    """What this process runs, for `_metrics.json`: the CPU, the ISA, whether its kernels built
    (else why not), and per kernel "cpu" (the C++ kernel) or "torch" by default."""
    built = cpu.available()
    return {"cpu": cpu_model(), "isa": cpu.isa(), "built": built, "build_error": cpu.build_error(),
            "kernels": {k: "cpu" if built and chosen(k) else "torch" for k in KERNELS}}
