"""Model config (transformers' `DeepseekV4Config`) loading, the engine's own validated knobs, `TINY`.

A model is named either `TINY` (the embedded seeded model, `model/tiny.py`) or a local checkpoint
folder; every rule that tells the two apart compares with `TINY`. No torch here.

Everything read from a model folder is bounded before it is used: a file must be a regular file
(`open_regular`: a FIFO would block a read forever, a device never end it) and JSON files are
read up to a size (`read_json`); config.json's sizes must be ones a DeepSeek-V4 checkpoint can
have (`SIZE_LIMITS`, far above V4-Pro's) before transformers builds the config, so every later
check's time and memory follow from them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat

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


MAX_CONFIG_BYTES = 1 << 20  # config.json (V4-Pro's: 2 KB)
# config.json's sizes: [low, high] for each field that sizes the model (V4-Pro in the comments),
# legacy names included; a value outside is refused before anything is built from it
SIZE_LIMITS = {
    "num_hidden_layers": (1, 1024),  # 61
    "hidden_size": (1, 1 << 16),  # 7168
    "vocab_size": (1, 1 << 22),  # 129280
    "num_attention_heads": (1, 1024),  # 128
    "num_key_value_heads": (1, 1024),  # 1
    "head_dim": (1, 8192),  # 512
    "q_lora_rank": (1, 1 << 16),  # 1536
    "o_lora_rank": (1, 1 << 16),  # 1024
    "o_groups": (1, 1024),  # 16
    "moe_intermediate_size": (1, 1 << 18),  # 3072
    "n_routed_experts": (1, 4096),  # 384
    "num_experts_per_tok": (1, 4096),  # 6
    "n_shared_experts": (0, 64),  # 1
    "index_n_heads": (1, 1024),  # 64
    "index_head_dim": (1, 8192),  # 128
    "index_topk": (1, 1 << 20),  # 1024
    "hc_mult": (1, 64),  # 4
    "hc_sinkhorn_iters": (0, 10_000),  # 20
    "sliding_window": (1, 1 << 20),  # 128
    "max_position_embeddings": (1, 1 << 26),  # 1048576
    "num_hash_layers": (0, 1024),  # 3
    "qk_rope_head_dim": (0, 8192),  # 64
    "num_nextn_predict_layers": (0, 64),  # 1
    "compress_rate_csa": (1, 1 << 16),  # 4
    "compress_rate_hca": (1, 1 << 16),  # 128
}


def open_regular(path: str) -> int:
    """A read-only file descriptor of `path` once it is known to be a regular file (a symlink to
    one is fine); `ModelLoadError` naming the path otherwise, or when it cannot be opened.
    (Opened non-blocking, so a FIFO is refused rather than waited on.)"""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise ModelLoadError(f"cannot open {path}: {exc.strerror}") from exc
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a folder" if stat.S_ISDIR(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket or other")
        raise ModelLoadError(f"{path} is not a regular file ({kind})")
    return fd


def read_bounded(path: str, limit: int) -> bytes:
    """The bytes of the regular file `path` (`open_regular`), `ModelLoadError` when it holds more
    than `limit` bytes."""
    with os.fdopen(open_regular(path), "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise ModelLoadError(f"{path} is larger than {limit} bytes; no DeepSeek-V4 checkpoint has such a file")
    return data


def read_json(path: str, limit: int = MAX_CONFIG_BYTES):
    """The JSON value in the regular file `path` of at most `limit` bytes; `ModelLoadError` naming
    the file otherwise."""
    try:
        return json.loads(read_bounded(path, limit))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def check_sizes(raw: dict, file: str) -> None:
    """`ModelLoadError` naming the first field of `SIZE_LIMITS` in config.json's `raw` values
    that is not an integer within its limits (no checkpoint of this family has it)."""
    for name, (low, high) in SIZE_LIMITS.items():
        value = raw.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ModelLoadError(f"{file}: {name} {value!r} is not an integer in [{low}, {high}]; no "
                                 "DeepSeek-V4 checkpoint has that size")
    rates = raw.get("compress_rates")
    for key, value in (rates.items() if isinstance(rates, dict) else ()):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 16:
            raise ModelLoadError(f"{file}: compress_rates[{key!r}] {value!r} is not an integer in [1, 65536]")


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
    """Read `path/config.json` with `DeepseekV4Config` (native DeepSeek keys are folded in by it),
    after `check_sizes`; `ModelLoadError` naming the file or field."""
    from transformers import DeepseekV4Config

    if not os.path.isdir(path):
        raise ModelLoadError(f"model path {path!r} is not a folder (give a checkpoint folder or {TINY!r})")
    file = os.path.join(path, "config.json")
    if not os.path.lexists(file):
        raise ModelLoadError(f"{path!r} has no config.json; a DeepSeek-V4 checkpoint folder needs one")
    raw = read_json(file)
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{file} holds a JSON {type(raw).__name__}, not an object")
    if raw.get("model_type") != "deepseek_v4":
        raise ModelLoadError(
            f"{file} has model_type {raw.get('model_type')!r}; dsv4batch only loads 'deepseek_v4' checkpoints"
        )
    check_sizes(raw, file)
    try:
        return DeepseekV4Config.from_dict(raw)
    except Exception as exc:  # strict dataclass validation errors come in several types
        raise ModelLoadError(f"invalid DeepSeek-V4 config in {file}: {exc}") from exc


def layer_ratio(config, layer_idx: int) -> int:
    """Compress ratio of a layer: 1 for sliding-window-only layers, else the layer type's rate."""
    key = LAYER_RATIO_KEYS[config.layer_types[layer_idx]]
    return 1 if key is None else int(config.compress_rates[key])
