"""Model config (transformers' `DeepseekV4Config`) loading, the engine's own validated knobs, `TINY`.

A model is named either `TINY` (the embedded seeded model, `model/tiny.py`) or a local checkpoint
folder; every rule that tells the two apart compares with `TINY`. No torch here.
"""

from __future__ import annotations

import dataclasses
import json
import os

from ..planner import PLANNER_NAMES

TINY = "tiny"  # the embedded model's name; anything else is a checkpoint folder
HEAD_PRECISIONS = ("fp32", "bf16")  # EngineConfig.head_precision
ATTN_BACKENDS = ("auto", "torch", "cpu", "flashmla", "triton")  # EngineConfig.attn_backend: `dsv4batch.kernels` backends
LAYER_RATIO_KEYS = {
    "sliding_attention": None,
    "compressed_sparse_attention": "compressed_sparse_attention",
    "heavily_compressed_attention": "heavily_compressed_attention",
}


class ModelLoadError(ValueError):
    """A checkpoint folder that cannot be loaded; the message says which file or tensor and why."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine packs and plans prefill. Every field is validated in `__post_init__`.

    max_num_batched_tokens: query tokens in one forward step; longer requests span several steps.
    max_model_len: longest request (tokens, bos included) the engine accepts; sizes the planner budget.
    prefill_chunk_size: the workspace budget in "requests of maximal length" (vLLM's PREFILL_CHUNK_SIZE).
    planner: "adaptive" (vLLM #45061), "fixed" (pre-PR: chunks of `prefill_chunk_size`),
        "dp" (min padded area for the given order) or "single" (one request per chunk).
    sort_by_length: order requests by length before packing steps (outputs keep input order).
    logits_slice: rows of the tiled vocabulary head computed at once (every slice has exactly this
        many rows: one GEMM shape, batch-invariant; 512 measured 17% faster per row than 256 on CPU).
        The fused CPU head (fp32, `head.fused_scores`) takes all rows at once and ignores it.
    attn_backend: "auto", "torch", "cpu", "flashmla" or "triton" (see `dsv4batch.kernels`; "auto"
        takes FlashMLA on a GPU that fits it, else Triton on a GPU (sm80+), else the fused cpu
        kernel where it builds, else torch).
    head_precision: the vocabulary head's CPU GEMM: "fp32" (exact to fp32 rounding) or "bf16"
        (opt-in: a bf16 GEMM with fp32 sums and bf16 logits, the reduction in fp32, where the CPU
        has bf16 units (AVX512-BF16 or AMX), else fp32 with a warning: `kernels.dense`; 1.2-1.5x
        end to end on a Zen 4 EPYC; on the seeded models logprobs within ~1e-2 of fp32, mean
        ~2e-3, and more where logits are larger: each is rounded to bf16, 2^-9 of its size).
        bf16 logits tie more often, and a tie with the row's largest counts as greedy, so
        `is_greedy` can read higher than in fp32. CUDA ignores it.
    max_num_seqs: requests generating at once (each holds a slot of the cache pool).
    max_cache_mib: the generation cache pool's budget in MiB (`model/cache.py`: every running
        request's window, compressed entries, open compressor windows and indexer keys); None:
        `capacity.cache_budget` (what `max_num_seqs` requests of `max_model_len` need, within a
        quarter of the host's memory on the CPU, or what the GPU has left after the step's
        workspace and activations). Requests wait while it is full.
    """

    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    prefill_chunk_size: int = 4
    planner: str = "adaptive"
    sort_by_length: bool = True
    logits_slice: int = 512
    attn_backend: str = "auto"
    head_precision: str = "fp32"
    max_num_seqs: int = 64
    max_cache_mib: float | None = None

    def __post_init__(self):
        mib = self.max_cache_mib
        if mib is not None and (isinstance(mib, bool) or not isinstance(mib, (int, float)) or not mib > 0
                                or mib == float("inf")):
            raise ValueError(f"EngineConfig.max_cache_mib must be a positive finite number or None, got {mib!r}")
        for name in ("max_num_batched_tokens", "max_model_len", "prefill_chunk_size", "logits_slice",
                     "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        if self.planner not in PLANNER_NAMES:
            raise ValueError(f"EngineConfig.planner must be one of {PLANNER_NAMES}, got {self.planner!r}")
        if self.attn_backend not in ATTN_BACKENDS:
            raise ValueError(f"EngineConfig.attn_backend must be one of {ATTN_BACKENDS}, got {self.attn_backend!r}")
        if self.head_precision not in HEAD_PRECISIONS:
            raise ValueError(f"EngineConfig.head_precision must be one of {HEAD_PRECISIONS}, "
                             f"got {self.head_precision!r}")

    @classmethod
    def from_dict(cls, values: dict) -> "EngineConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown EngineConfig field(s) {unknown}; known: {sorted(known)}")
        return cls(**values)


def load_config(path: str):
    """Read `path/config.json` with `DeepseekV4Config` (native DeepSeek keys are folded in by it)."""
    from transformers import DeepseekV4Config

    if not os.path.isdir(path):
        raise ModelLoadError(f"model path {path!r} is not a folder (give a checkpoint folder or {TINY!r})")
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ModelLoadError(f"{path!r} has no config.json; a DeepSeek-V4 checkpoint folder needs one")
    try:
        with open(file) as fh:
            raw = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {file}: {exc}") from exc
    if raw.get("model_type") != "deepseek_v4":
        raise ModelLoadError(
            f"{file} has model_type {raw.get('model_type')!r}; dsv4batch only loads 'deepseek_v4' checkpoints"
        )
    try:
        return DeepseekV4Config.from_dict(raw)
    except Exception as exc:  # strict dataclass validation errors come in several types
        raise ModelLoadError(f"invalid DeepSeek-V4 config in {file}: {exc}") from exc


def layer_ratio(config, layer_idx: int) -> int:
    """Compress ratio of a layer: 1 for sliding-window-only layers, else the layer type's rate."""
    key = LAYER_RATIO_KEYS[config.layer_types[layer_idx]]
    return 1 if key is None else int(config.compress_rates[key])
