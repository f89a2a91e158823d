"""A replica actor's model: device, dtype and engine settings from the job config."""

from __future__ import annotations

from dsv4batch.actors.device import pick_device, torch_dtype
from dsv4batch.jobspec.config import JobConfig


def load_engine(config: JobConfig, num_gpus: float):
    """Load the `Engine` once per actor; returns (engine, device, dtype name).

    A model folder that is missing on this node, or that cannot load, raises the loader's
    `ModelLoadError` naming the problem. With `config.tp` > 1 the engine is a `ShardedEngine`
    over T rank workers (`num_gpus` / `cpus_per_replica` each)."""
    import torch

    from dsv4batch.model import Engine, EngineConfig

    if config.tp > 1:
        from dsv4batch.actors.shards import ShardedEngine

        engine = ShardedEngine(config, num_gpus, config.cpus_per_replica or 0.0)
        return engine, engine.ranks[0]["device"], engine.ranks[0]["dtype"]
    device = pick_device(num_gpus)
    if device == "cpu" and config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    dtype = torch_dtype(config.dtype, device)
    engine = Engine.from_pretrained(config.model, device=device, dtype=dtype,
                                    config=EngineConfig(**config.engine_kwargs()),
                                    weights=config.weights_dtype, tokenizer=config.tokenizer)
    return engine, device, str(dtype).removeprefix("torch.")
