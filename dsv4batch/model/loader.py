"""Checkpoint loading: safetensors only, names looked up against the model's native attribute names.

Accepted names: the native DeepSeek ones (`embed.weight`, `layers.0.attn.wq_a.weight`,
`layers.0.ffn.experts.3.w1.weight`, ...), optionally under `model.`, and the mixed form
transformers' `save_pretrained` writes (`model.embed_tokens.weight`, `model.hc_head.hc_fn`, ...).
`mtp.*` (multi-token prediction) tensors are ignored. Every problem names the tensor.
"""

from __future__ import annotations

import glob
import json
import os
import re

import torch

from .config import EngineConfig, ModelLoadError, load_config
from .quant import SCALE_SUFFIXES, dequantize, scale_name

IGNORED = re.compile(r"^mtp\.")
ALIASES = {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
           "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}
EXPERT = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")


STACKED = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(w[123])$")  # the model's [E, ...] experts


def checkpoint_tensors(params: dict):
    """(checkpoint name, tensor) per model tensor: stacked experts split into one per expert."""
    for name, p in params.items():
        m = STACKED.match(name)
        if m:
            for e in range(p.shape[0]):
                yield f"{m.group(1)}.{e}.{m.group(2)}.weight", p[e]
        else:
            yield name, p


def check_complete(params: dict, filled: set[str], unknown: list[str]) -> None:
    """Every checkpoint tensor matched a parameter and every parameter was filled."""
    if unknown:
        raise ModelLoadError(f"{len(unknown)} checkpoint tensor(s) match no DeepSeek-V4 parameter, "
                             f"e.g. {unknown[:3]}")
    missing = sorted({n for n, _ in checkpoint_tensors(params)} - filled)
    if missing:
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:3]}")


def canonical(name: str) -> str:
    """Checkpoint tensor name -> the model's parameter name (experts keep their index: see EXPERT)."""
    name = name[len("model."):] if name.startswith("model.") else name
    return ALIASES.get(name, name)


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as fh:
            names = sorted(set(json.load(fh)["weight_map"].values()))
        files = [os.path.join(path, n) for n in names]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ModelLoadError(f"{index} lists shard {os.path.basename(missing[0])}, which is missing")
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        pickles = glob.glob(os.path.join(path, "*.bin")) + glob.glob(os.path.join(path, "*.pt"))
        hint = " (pickle checkpoints are not loaded; convert them to safetensors)" if pickles else ""
        raise ModelLoadError(f"{path!r} has no *.safetensors weights{hint}")
    return files


def load_state(model, files: list[str]) -> None:
    """Copy every checkpoint tensor into `model`, checking names, shapes and finiteness."""
    from safetensors import safe_open

    params = dict(model.named_parameters())
    params.update(model.named_buffers())
    filled = set()
    unknown = []
    for file in files:
        with safe_open(file, framework="pt") as fh:
            names = set(fh.keys())
            for raw in sorted(names):
                if IGNORED.match(raw) or raw.endswith(SCALE_SUFFIXES):
                    continue  # scales are read with their weight
                name = canonical(raw)
                m = EXPERT.match(name)
                target_name = f"{m.group(1)}.{m.group(3)}" if m else name
                if target_name not in params:
                    unknown.append(raw)
                    continue
                target = params[target_name][int(m.group(2))] if m else params[target_name]
                tensor = fh.get_tensor(raw)
                scale = scale_name(raw, names)
                if scale is not None:
                    try:
                        tensor = dequantize(tensor, fh.get_tensor(scale), tuple(target.shape))
                    except ValueError as exc:
                        raise ModelLoadError(f"tensor {raw!r}: {exc}") from exc
                elif tensor.dtype in (torch.float8_e4m3fn, torch.int8) and target.is_floating_point():
                    raise ModelLoadError(f"tensor {raw!r} is quantized ({tensor.dtype}) but its scale "
                                         f"({raw[:-len('.weight')]}.scale) is not in the same shard")
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ModelLoadError(f"tensor {raw!r} in {os.path.basename(file)} has shape "
                                         f"{tuple(tensor.shape)}, expected {tuple(target.shape)}")
                if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                    raise ModelLoadError(f"tensor {raw!r} in {os.path.basename(file)} has NaN or Inf values")
                with torch.no_grad():
                    target.copy_(tensor.to(target.dtype))
                filled.add(name)
    check_complete(params, filled, unknown)


def build_empty(cls, config, engine):
    """The module tree without running default initialisers (every tensor is loaded next)."""
    with torch.device("meta"):
        model = cls(config, engine)
    return model.to_empty(device="cpu")


def load_model(cls, path_or_name: str, *, device="cpu", dtype=torch.float32, engine: EngineConfig | None = None):
    """Build `cls` from a checkpoint folder or the embedded 'tiny', on `device` in `dtype`."""
    from .tokenizer import load_tokenizer

    if path_or_name == "tiny":
        from .tiny import tiny_config, tiny_state

        model = build_empty(cls, tiny_config(), engine)
        with torch.no_grad():
            for name, tensor in tiny_state(model).items():
                model.get_parameter(name).copy_(tensor) if name in dict(model.named_parameters()) \
                    else model.get_buffer(name).copy_(tensor)
        tok_path = None
    else:
        config = load_config(path_or_name)
        model = build_empty(cls, config, engine)
        load_state(model, safetensors_files(path_or_name))
        tok_path = path_or_name if os.path.isfile(os.path.join(path_or_name, "tokenizer.json")) else None
    keep_fp32 = re.compile(r"(norm|hc_|attn_sink|ape|gate\.bias)")
    for name, p in model.named_parameters():
        if not keep_fp32.search(name):
            p.data = p.data.to(dtype)
    model.to(device).eval()
    model.tokenizer = load_tokenizer(tok_path)
    return model


def save_checkpoint(model, path: str) -> None:
    """Write `model` as a native-named safetensors checkpoint folder (config.json, tokenizer.json).

    transformers' `DeepseekV4ForCausalLM.from_pretrained(path)` reads it (its conversion mapping
    renames native names), so the same weights can be run by the reference implementation.
    """
    import shutil

    from safetensors.torch import save_file

    from .tokenizer import packaged_tokenizer_path

    os.makedirs(path, exist_ok=True)
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    state = {name: t.detach().contiguous().cpu() for name, t in checkpoint_tensors(params)}
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    model.config.to_json_file(os.path.join(path, "config.json"))
    shutil.copy(packaged_tokenizer_path(), os.path.join(path, "tokenizer.json"))
