"""Plan cost metrics: kernel launches and workspace size (chunk workspace ``[end - start, M, head_dim]``)."""

from __future__ import annotations

from .lengths import Chunk


def plan_cost(plan: list[Chunk]) -> dict[str, int]:
    """``num_chunks``, ``workspace_rows = sum (e - s) * M`` and ``peak_rows = max (e - s) * M``."""
    rows = [(e - s) * m for s, e, _, m in plan]
    return {"num_chunks": len(plan), "workspace_rows": sum(rows), "peak_rows": max(rows, default=0)}


def workspace_bytes(plan: list[Chunk], head_dim: int, dtype_bytes: int) -> dict[str, int]:
    """Total/peak elements and bytes of the per-chunk ``[e - s, M, head_dim]`` workspaces."""
    cost = plan_cost(plan)
    total, peak = cost["workspace_rows"] * head_dim, cost["peak_rows"] * head_dim
    return {"total_elements": total, "peak_elements": peak,
            "total_bytes": total * dtype_bytes, "peak_bytes": peak * dtype_bytes}
