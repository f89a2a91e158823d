"""Where a replica (or one rank of it) computes: device and compute dtype."""

from __future__ import annotations

from dsv4batch.jobspec.config import resolved_dtype


def pick_device(num_gpus: float) -> str:
    """CUDA when the actor holds a GPU and CUDA works; otherwise the CPU backend.

    Logical GPUs (tests, `ray.cluster_utils.Cluster`) have no CUDA device: they fall back to CPU.
    """
    import torch

    return "cuda" if num_gpus > 0 and torch.cuda.is_available() else "cpu"


def torch_dtype(name: str, device: str):
    import torch

    return getattr(torch, resolved_dtype(name, device))
