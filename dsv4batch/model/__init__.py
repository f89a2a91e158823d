"""DeepSeek-V4 model: loading (safetensors only), packed multi-step prefill, scoring.

`from dsv4batch.model import DSv4Model, EngineConfig` imports torch; `dsv4batch` alone does not.
"""

from .config import EngineConfig, ModelLoadError


def __getattr__(name):
    if name == "DSv4Model":
        from .model import DSv4Model

        return DSv4Model
    raise AttributeError(name)


__all__ = ["DSv4Model", "EngineConfig", "ModelLoadError"]
