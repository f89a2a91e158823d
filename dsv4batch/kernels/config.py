"""`KernelConfig`: which backend each kernel family runs, chosen once per engine.

========== ============================================ =========================================
field      choices                                      what it picks
========== ============================================ =========================================
attention  auto, torch, cpu, flashmla, triton            `sparse_mla_prefill` and `indexer_topk`
quant      auto, reference, cuda, triton                 `quant_linear`
gemm       auto, fused, onednn, blas                     the CPU vocabulary head (`dense.py`)
elementwise auto, torch                                  the token-wise C++ passes (`elementwise.py`)
========== ============================================ =========================================

``"auto"`` keeps each family's own resolution for the call at hand (attention: FlashMLA where it
fits, else Triton on CUDA, else the cpu kernel where `select.chosen`, else torch; quant: cuda,
else triton on CUDA, else the reference; gemm: the fused head where chosen, else oneDNN tiles,
else BLAS; elementwise: the C++ passes where they run). Anything else forces that backend.

The engine builds its config once (`Engine.kernels`: `EngineConfig.attn_backend` over the
config active when the engine was made) and makes it the active one around its steps
(:func:`use`); a kernel call whose ``backend`` is ``"auto"`` reads the active config, never the
environment. The user-facing choice is ``EngineConfig.attn_backend``; the other fields are for
bench and tests (``with use(gemm="blas"): ...``).
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from contextvars import ContextVar

ATTENTION = ("auto", "torch", "cpu", "flashmla", "triton")
QUANT = ("auto", "reference", "cuda", "triton")
GEMM = ("auto", "fused", "onednn", "blas")
ELEMENTWISE = ("auto", "torch")
CHOICES = {"attention": ATTENTION, "quant": QUANT, "gemm": GEMM, "elementwise": ELEMENTWISE}


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """The backend names of each kernel family (see the module docstring); ValueError for a name
    that is not one of its field's choices."""

    attention: str = "auto"
    quant: str = "auto"
    gemm: str = "auto"
    elementwise: str = "auto"

    def __post_init__(self):
        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"KernelConfig.{name} must be one of {choices}, got {getattr(self, name)!r}")

    def replace(self, **fields) -> "KernelConfig":
        """A copy with `fields` changed (checked as at construction)."""
        return dataclasses.replace(self, **fields)


_ACTIVE: ContextVar[KernelConfig] = ContextVar("dsv4batch_kernel_config", default=KernelConfig())


def current() -> KernelConfig:
    """The active config: the innermost `use` block's, else all "auto"."""
    return _ACTIVE.get()


@contextmanager
def use(config: KernelConfig | None = None, **fields: str):
    """Within the block, `config` (default: the active one) with `fields` replaced is active."""
    token = _ACTIVE.set((config or _ACTIVE.get()).replace(**fields))
    try:
        yield _ACTIVE.get()
    finally:
        _ACTIVE.reset(token)
