"""Every checkpoint rule: which folder, which files, which names, which shapes (safetensors only).

A model is `TINY` (embedded, seeded: `model/tiny.py`) or a local checkpoint folder with
config.json and *.safetensors. Accepted tensor names: the native DeepSeek ones (`embed.weight`,
`layers.0.attn.wq_a.weight`, `layers.0.ffn.experts.3.w1.weight`, ...), optionally under
`model.`, and the mixed form transformers' `save_pretrained` writes (`model.embed_tokens.weight`,
`model.hc_head.hc_fn`, ...). `mtp.*` (multi-token prediction) tensors are ignored.

One walk (`matched_tensors`) matches checkpoint names to model tensors for both `load_state`
(reads values) and `check_checkpoint` (headers only, on a `meta` model), so the two cannot
disagree. Every problem raises `ModelLoadError` naming the tensor.
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from .config import TINY, ModelLoadError, load_config
from .model import DSv4Model, model_tensors
from .quant import SCALE_SUFFIXES, dequantize, scale_name

IGNORED = re.compile(r"^mtp\.")
ALIASES = {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
           "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}
EXPERT = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")
STACKED = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(w[123])$")  # the model's [E, ...] experts
KEEP_FP32 = re.compile(r"(norm|hc_|attn_sink|ape|gate\.bias)")  # DSv4 keeps these fp32 in any dtype


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


def target_tensor(params: dict, name: str):
    """The model tensor a canonical checkpoint name fills (one expert's row of a stacked one), or None."""
    m = EXPERT.match(name)
    if m is None:
        return params.get(name)
    stacked, expert = params.get(f"{m.group(1)}.{m.group(3)}"), int(m.group(2))
    return None if stacked is None or expert >= stacked.shape[0] else stacked[expert]


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


@dataclass
class Match:
    """One checkpoint tensor and the model tensor it fills."""

    raw: str  # its name in the checkpoint
    file: str  # the shard holding it
    handle: Any  # the open `safe_open` shard
    names: set[str]  # every name in that shard (a quantized weight's scale sits beside it)
    target: torch.Tensor  # the model tensor (an expert's row of a stacked [E, ...] parameter)

    @property
    def scale(self) -> str | None:
        return scale_name(self.raw, self.names)

    def check_shape(self, shape) -> None:
        if tuple(shape) != tuple(self.target.shape):
            raise ModelLoadError(f"tensor {self.raw!r} in {os.path.basename(self.file)} has shape "
                                 f"{tuple(shape)}, expected {tuple(self.target.shape)}")


def matched_tensors(params: dict, files: list[str]) -> Iterator[Match]:
    """Walk `files` (sorted names per shard) and yield a `Match` per tensor that fills `params`.

    Ignored (`mtp.*`) and scale tensors are skipped (scales are read with their weight); a name
    matching no model tensor (an expert index out of range included) is collected. A match
    counts as filled once the caller takes the next one. When the walk ends, unknown names or
    unfilled model tensors raise `ModelLoadError` (`check_complete`).
    """
    from safetensors import safe_open

    filled, unknown = set(), []
    for file in files:
        with safe_open(file, framework="pt") as fh:
            names = set(fh.keys())
            for raw in sorted(names):
                if IGNORED.match(raw) or raw.endswith(SCALE_SUFFIXES):
                    continue
                name = canonical(raw)
                target = target_tensor(params, name)
                if target is None:
                    unknown.append(raw)
                    continue
                yield Match(raw, file, fh, names, target)
                filled.add(name)
    check_complete(params, filled, unknown)


def load_state(model, files: list[str]) -> None:
    """Copy every checkpoint tensor into `model`, checking names, shapes and finiteness."""
    for match in matched_tensors(model_tensors(model), files):
        raw, target = match.raw, match.target
        tensor = match.handle.get_tensor(raw)
        scale = match.scale
        if scale is not None:
            try:
                tensor = dequantize(tensor, match.handle.get_tensor(scale), tuple(target.shape))
            except ValueError as exc:
                raise ModelLoadError(f"tensor {raw!r}: {exc}") from exc
        elif tensor.dtype in (torch.float8_e4m3fn, torch.int8) and target.is_floating_point():
            raise ModelLoadError(f"tensor {raw!r} is quantized ({tensor.dtype}) but its scale "
                                 f"({raw[:-len('.weight')]}.scale) is not in the same shard")
        match.check_shape(tensor.shape)
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise ModelLoadError(f"tensor {raw!r} in {os.path.basename(match.file)} has NaN or Inf values")
        with torch.no_grad():
            target.copy_(tensor.to(target.dtype))


def meta_model(config) -> DSv4Model:
    """The module tree on torch's `meta` device: names and shapes, no memory, no initialisers."""
    with torch.device("meta"):
        return DSv4Model(config)


def check_checkpoint(path: str) -> None:
    """Raise `ModelLoadError` unless the folder `path` would load (no tensor data is read).

    config.json must be a DeepSeek-V4 config and every safetensors tensor must match a tensor of
    the model it describes, with its shape (from the headers), none missing. Quantized tensors'
    shapes and all values (NaN/Inf) are only checked by `load_model`. `TINY` is always fine.
    """
    if path == TINY:
        return
    model = meta_model(load_config(path))
    for match in matched_tensors(model_tensors(model), safetensors_files(path)):
        if match.scale is None:  # a quantized tensor's stored shape is not the parameter's
            match.check_shape(match.handle.get_slice(match.raw).get_shape())


def load_model(path_or_name: str, *, device="cpu", dtype=torch.float32) -> DSv4Model:
    """A `DSv4Model` from a checkpoint folder or `TINY`, on `device` in `dtype` (norms etc. stay fp32)."""
    if path_or_name == TINY:
        from .tiny import seed_weights, tiny_config

        model = meta_model(tiny_config()).to_empty(device="cpu")
        seed_weights(model)
    else:
        config = load_config(path_or_name)
        model = meta_model(config).to_empty(device="cpu")  # every tensor is loaded next
        load_state(model, safetensors_files(path_or_name))
    for name, p in model.named_parameters():
        if not KEEP_FP32.search(name):
            p.data = p.data.to(dtype)
    return model.to(device).eval()


def save_checkpoint(model, path: str) -> None:
    """Write `model` as a native-named safetensors checkpoint folder (config.json, tokenizer.json).

    transformers' `DeepseekV4ForCausalLM.from_pretrained(path)` reads it (its conversion mapping
    renames native names), so the same weights can be run by the reference implementation.
    """
    import shutil

    from safetensors.torch import save_file

    from .tokenizer import packaged_tokenizer_path

    os.makedirs(path, exist_ok=True)
    state = {name: t.detach().contiguous().cpu() for name, t in checkpoint_tensors(model_tensors(model))}
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    model.config.to_json_file(os.path.join(path, "config.json"))
    shutil.copy(packaged_tokenizer_path(), os.path.join(path, "tokenizer.json"))
