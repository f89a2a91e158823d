"""Model loading for a scoring actor: device, dtype and engine settings from `ScoreConfig`."""

from __future__ import annotations

import os

from dsv4batch.pipeline.config import ScoreConfig


def pick_device(num_gpus: float) -> str:
    """CUDA when the actor holds a GPU and CUDA works; otherwise the CPU backend.

    Logical GPUs (tests, `ray.cluster_utils.Cluster`) have no CUDA device: they fall back to CPU.
    """
    import torch

    return "cuda" if num_gpus > 0 and torch.cuda.is_available() else "cpu"


def torch_dtype(name: str, device: str):
    import torch

    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_model(config: ScoreConfig, num_gpus: float):
    """Load `DSv4Model` once per actor; returns (model, device, dtype name)."""
    import torch

    from dsv4batch.model import DSv4Model, EngineConfig

    device = pick_device(num_gpus)
    if device == "cpu" and config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    dtype = torch_dtype(config.dtype, device)
    if config.model != "tiny" and "://" not in config.model and not os.path.isdir(config.model):
        raise FileNotFoundError(f"model folder {config.model!r} not found on this node")
    model = DSv4Model.from_pretrained(config.model, device=device, dtype=dtype,
                                      engine=EngineConfig(**config.engine_kwargs()))
    return model, device, str(dtype).removeprefix("torch.")
