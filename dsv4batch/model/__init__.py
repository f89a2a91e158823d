"""DeepSeek-V4 scoring: `Engine` (validate, schedule, score), `DSv4Model` (the computation).

Layout: `config` (EngineConfig, TINY, config.json), `loader` (every checkpoint rule; files read
by `tensor_file`), `tokenizer`, `engine`, `head` (the fused vocabulary head and its details),
`model` (+ `layers`, `attention`, `compressor`), `parallel` (tensor/expert-parallel splits and
collectives), `step` and `layout` (one packed prefill step), `stats`, `quant`, `capacity`,
`tiny`. `Engine` and `DSv4Model` import torch lazily: `import dsv4batch.model` stays torch-free.
"""

from .config import TINY, EngineConfig, ModelLoadError
from .stats import StepStats


def __getattr__(name):
    if name == "Engine":
        from .engine import Engine

        return Engine
    if name == "DSv4Model":
        from .model import DSv4Model

        return DSv4Model
    if name == "TokenScores":
        from .head import TokenScores

        return TokenScores
    raise AttributeError(name)


__all__ = ["DSv4Model", "Engine", "EngineConfig", "ModelLoadError", "StepStats", "TINY",
           "TokenScores"]
