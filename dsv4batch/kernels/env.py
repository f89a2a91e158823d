"""The kernels' environment switches (`DSV4BATCH_ATTN_BACKEND`, `DSV4BATCH_QUANT_BACKEND`,
`DSV4BATCH_CPU_GEMM`, `DSV4BATCH_CPU_ELEMENTWISE`): one rule for reading and checking them."""

from __future__ import annotations

import os


def env_choice(name: str, choices) -> str:
    """The environment variable `name`, stripped and lower-cased ("" when unset or blank).
    ValueError naming the variable when it is set to anything but one of `choices`."""
    value = os.environ.get(name, "").strip().lower()
    if value and value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value
