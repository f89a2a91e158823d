"""Step statistics: small typed records summed in one place (`Stats.__add__`), no torch.

A field sums unless its metadata names another reduction (`max` for peaks, `min`/`max` for
first/last times); `None` counts as "not seen" for min/max. `dsv4batch.jobspec.stats` extends
`StepStats` with per-batch row counts, so the engine, the scoring stage, the driver's collector
and the summary all use one set of names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def peak(default: Any = 0) -> Any:
    """A field reduced with `max` (a peak, or the last time something happened)."""
    return field(default=default, metadata={"reduce": "max"})


def first(default: Any = None) -> Any:
    """A field reduced with `min` (the first time something happened)."""
    return field(default=default, metadata={"reduce": "min"})


def _reduce(how: str, a: Any, b: Any) -> Any:
    if how == "sum":
        return a + b
    if a is None or b is None:
        return b if a is None else a
    return max(a, b) if how == "max" else min(a, b)


@dataclass
class Stats:
    """Base of the statistics records: `a + b` combines two records field by field."""

    def __add__(self, other: "Stats") -> "Stats":
        if not isinstance(other, type(self)):
            return NotImplemented
        return type(self)(**{f.name: _reduce(f.metadata.get("reduce", "sum"),
                                             getattr(self, f.name), getattr(other, f.name))
                             for f in dataclasses.fields(self)})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "Stats":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})


@dataclass
class StepStats(Stats):
    """What the engine did for one or more `Engine.score` calls."""

    num_tokens: int = 0  # query tokens fed (every position but each request's last)
    num_steps: int = 0  # packed forward steps
    num_chunks: int = 0  # sparse-attention kernel calls (planned chunks x layers)
    workspace_elements: int = 0  # elements gathered into chunk workspaces
    model_calls: int = 0  # Engine.score calls
    planner_s: float = 0.0  # time in the chunk planner
    forward_s: float = 0.0  # wall time of the score calls
    collective_s: float = 0.0  # of which in tensor-parallel collectives (0 with one rank)
    peak_workspace_bytes: int = peak()  # largest chunk workspace
    # generation (Engine.generate): tokens fed in prefill segments and as decode tokens, tokens
    # sampled, the time of the steps split between the two by their token counts, queue and pool
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_generated: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    peak_running: int = peak()
    peak_waiting: int = peak()
    peak_cache_bytes: int = peak()
    cache_capacity_bytes: int = peak()
