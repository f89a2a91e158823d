"""Every checkpoint rule: which folder, which files, which names, which shapes (safetensors only).

A model is `TINY` (embedded, seeded: `model/tiny.py`) or a local checkpoint folder with
config.json and *.safetensors. Accepted tensor names: the native DeepSeek ones (`embed.weight`,
`layers.0.attn.wq_a.weight`, `layers.0.ffn.experts.3.w1.weight`, ...), optionally under
`model.`, and the mixed form transformers' `save_pretrained` writes (`model.embed_tokens.weight`,
`model.hc_head.hc_fn`, ...). `mtp.*` (multi-token prediction) tensors are ignored.

Quantized tensors (FP8 / FP4 with a `.scale`, `model/quant.py`) are held as stored with
`weights="stored"` (a `QuantLinear` per projection) or dequantized into the model's dtype with
`weights="compute"`. Files are read with `tensor_file.TensorFile`: the header is parsed and each
tensor's bytes (a rank's slice of them, in a `--tp` replica: `model/parallel.py`) are read
straight into the parameter that holds it (no mapping of the file, no second copy), so a load's
peak memory is the model's bytes plus at most one tensor in flight.

One walk (`matched_tensors`) matches checkpoint names to model tensors for `load_state` (reads
values), `check_checkpoint` (on a `meta` model) and the capacity plan, so they cannot disagree.
`check_checkpoint` is everything that can be known before the weights are read, bounded by the
config's sizes (`config.SIZE_LIMITS`): regular files, every header entry inside its file, names,
dtypes and shapes (scales included), and the values of the hash-routing tables (`tid2eid`, a few
MB: read in bounded pieces), whose expert ids must be in [0, n_routed_experts). Every problem
raises `ModelLoadError` naming the file or tensor.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from typing import Iterator

import torch

from ..kernels.quant_reference import SCALE_DTYPES, stored_shapes
from .config import TINY, ModelLoadError, load_config, read_json
from .layers import Experts, Linear, QuantLinear
from .model import DSv4Model, model_tensors
from .parallel import SINGLE, TP, check_split, rank_slice, split_of
from .quant import (DENSE_ONLY, SCALE_SUFFIXES, StoredFormat, dequantize, detect_format, hold_stored, holder,
                    nonfinite, quantize_state, scale_name)
from .tensor_file import MAX_HEADER, TensorFile

IGNORED = re.compile(r"^mtp\.")
ALIASES = {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
           "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}
EXPERT = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")
# the model's stacked [E, ...] experts: a parameter, or a QuantLinear's qweight / scale
STACKED = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(w[123])(?:\.(qweight|scale))?$")
KEEP_FP32 = re.compile(r"(norm|hc_|attn_sink|ape|gate\.bias)")  # DSv4 keeps these fp32 in any dtype
ROUTING = re.compile(r"\.gate\.tid2eid$")  # a hash layer's token -> experts table
ROUTING_CHUNK_BYTES = 8 << 20  # check_checkpoint reads a routing table this much at a time
WEIGHTS = ("stored", "compute")
def checkpoint_tensors(params: dict, tp=SINGLE):
    """(checkpoint name, tensor) per model tensor: stacked experts split into one per expert (rank
    `tp.rank`'s block of them, under their global index), and a `QuantLinear`'s `qweight` /
    `scale` under the native `weight` / `scale` names."""
    for name, p in params.items():
        m = STACKED.match(name)
        if m:
            suffix, first = "scale" if m.group(3) == "scale" else "weight", tp.rank * p.shape[0]
            for e in range(p.shape[0]):
                yield f"{m.group(1)}.{first + e}.{m.group(2)}.{suffix}", p[e]
        elif name.endswith(".qweight"):
            yield name[: -len("qweight")] + "weight", p
        else:
            yield name, p


def check_complete(params: dict, filled: set[str], unknown: list[str], tp=SINGLE) -> None:
    """Every checkpoint tensor matched a parameter and every parameter was filled."""
    if unknown:
        raise ModelLoadError(f"{len(unknown)} checkpoint tensor(s) match no DeepSeek-V4 parameter, "
                             f"e.g. {unknown[:3]}")
    missing, examples = 0, []  # counted without a set of every name (experts x layers can be millions)
    for name, _ in checkpoint_tensors(params, tp):
        if name not in filled:
            missing += 1
            examples += [name] if len(examples) < 3 else []
    if missing:
        raise ModelLoadError(f"checkpoint is missing {missing} tensor(s), e.g. {examples}")


def canonical(name: str) -> str:
    """Checkpoint tensor name -> the model's parameter name (experts keep their index: see EXPERT)."""
    name = name[len("model."):] if name.startswith("model.") else name
    return ALIASES.get(name, name)


ELSEWHERE = "elsewhere"  # `targets`: a routed expert another rank of the replica holds


def targets(params: dict, name: str, tp=SINGLE):
    """(model tensor, its scale buffer or None, split dim or None) that a canonical checkpoint
    weight name fills; None when it fills nothing, `ELSEWHERE` for another rank's expert.

    Experts fill one row of a stacked [E, ...] tensor (rank r holds the block `tp.local_range`);
    a weight held quantized fills `qweight`; a tensor `parallel.split_of` names is a slice of the
    checkpoint's along the split dim (its scale too)."""
    m = EXPERT.match(name)
    if m is None:
        stem = name[: -len(".weight")] if name.endswith(".weight") else None
        if name in params:
            key, hit = name, (params[name], None)
        elif stem is not None and stem + ".qweight" in params:
            key, hit = stem + ".qweight", (params[stem + ".qweight"], params[stem + ".scale"])
        else:
            return None
        split = split_of(key) if tp.size > 1 else None
        return (*hit, None if split is None else split[1])
    key, row = f"{m.group(1)}.{m.group(3)}", int(m.group(2))
    if key in params:
        tensor, scale = params[key], None
    elif key + ".qweight" in params:
        tensor, scale = params[key + ".qweight"], params[key + ".scale"]
    else:
        return None
    first = tp.local_range(tensor.shape[0] * tp.size)[0]
    if row >= tensor.shape[0] * tp.size:
        return None
    if not first <= row < first + tensor.shape[0]:
        return ELSEWHERE
    return tensor[row - first], None if scale is None else scale[row - first], None


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.lexists(index):
        listing = read_json(index, MAX_HEADER)
        weight_map = listing.get("weight_map") if isinstance(listing, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(n, str) for n in weight_map.values()):
            raise ModelLoadError(f"{index} has no weight_map of tensor names to shard files")
        names = sorted(set(weight_map.values()))
        files = [os.path.join(path, n) for n in names]
        missing = [f for f in files if not os.path.lexists(f)]
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
    """One checkpoint tensor and the model tensor(s) it fills."""

    raw: str  # its name in the checkpoint
    shard: TensorFile  # the file holding it (a quantized weight's scale sits beside it)
    target: torch.Tensor  # the model tensor (an expert's row of a stacked [E, ...] tensor)
    scale: str | None  # the checkpoint name of its scale, if quantized
    scale_target: torch.Tensor | None  # the scale buffer when the weight is held as stored
    tp: TP = SINGLE  # the rank reading it
    split_dim: int | None = None  # the target is the rank's slice along this dim (tensor parallel)

    def part(self) -> tuple[int, int] | None:
        """`TensorFile.read_into`'s part: (split dim, rank), or None for the whole tensor."""
        return None if self.split_dim is None else (self.split_dim, self.tp.rank)

    def full_shape(self, target: torch.Tensor) -> tuple[int, ...]:
        """The checkpoint shape whose rank slice is `target`."""
        shape = list(target.shape)
        if self.split_dim is not None:
            shape[self.split_dim] *= self.tp.size
        return tuple(shape)

    def check_shape(self, name: str, target: torch.Tensor) -> None:
        shape, want = tuple(self.shard.shape(name)), self.full_shape(target)
        if shape != want:
            split = "" if self.split_dim is None else f" (split {self.tp.size} ways along dim {self.split_dim})"
            raise ModelLoadError(f"tensor {name!r} in {self.shard.name} has shape "
                                 f"{shape}, expected {want}{split}")

    def check(self) -> None:
        """Names, dtypes and shapes against the target, from the header alone."""
        raw, dtype = self.raw, self.shard.dtype(self.raw)
        if self.scale is None:
            if dtype in (torch.float8_e4m3fn, torch.int8) and self.target.is_floating_point():
                raise ModelLoadError(f"tensor {raw!r} is quantized ({dtype}) but its scale "
                                     f"({raw[:-len('.weight')]}.scale) is not in the same shard")
            return self.check_shape(raw, self.target)
        if not self.shard.dtype(self.scale).is_floating_point:
            raise ModelLoadError(f"tensor {self.scale!r} in {self.shard.name} is {self.shard.dtype(self.scale)}; a "
                                 "scale is a float tensor (ue8m0, fp32 or bf16)")
        if self.scale_target is not None:
            self.check_shape(raw, self.target)
            return self.check_shape(self.scale, self.scale_target)
        full = self.full_shape(self.target)
        shape, fmt = self.shard.shape(raw), detect_format(dtype, self.shard.shape(raw), full)
        if fmt is None or self.target.dim() != 2:
            raise ModelLoadError(f"tensor {raw!r}: cannot dequantize a {dtype} tensor of shape {shape} "
                                 f"into {full}")
        want = stored_shapes(fmt, *full)[1]
        if tuple(self.shard.shape(self.scale)) != want:
            raise ModelLoadError(f"tensor {self.scale!r} in {self.shard.name} has shape "
                                 f"{self.shard.shape(self.scale)}, expected {want} for {fmt} {full}")


def matched_tensors(params: dict, shards: list[TensorFile], tp=SINGLE) -> Iterator[Match]:
    """Walk `shards` (sorted names per shard) and yield a `Match` per tensor that fills `params`
    (rank `tp.rank`'s slices of a `tp`-way split model: other ranks' experts are skipped).

    Ignored (`mtp.*`) and scale tensors are skipped (scales are read with their weight); a name
    matching no model tensor (an expert index out of range included) is collected. A match
    counts as filled once the caller takes the next one. When the walk ends, unknown names or
    unfilled model tensors raise `ModelLoadError` (`check_complete`).
    """
    filled, unknown = set(), []
    for shard in shards:
        names = shard.keys()
        for raw in sorted(names):
            if IGNORED.match(raw) or raw.endswith(SCALE_SUFFIXES):
                continue
            name = canonical(raw)
            hit = targets(params, name, tp)
            if hit is ELSEWHERE:
                continue
            if hit is None:
                unknown.append(raw)
                continue
            yield Match(raw, shard, hit[0], scale_name(raw, names), hit[1], tp, hit[2])
            filled.add(name)
            if hit[1] is not None:
                filled.add(name[: -len("weight")] + "scale")
    check_complete(params, filled, unknown, tp)


def stored_formats(model, shards: list[TensorFile]) -> dict[str, StoredFormat]:
    """From the headers: the `hold_stored` keys (`layers.0.attn.wq_a`, `layers.2.ffn.experts.w1`)
    whose checkpoint weights are FP8/FP4 and can be held as stored. A stacked expert projection
    qualifies only when all its experts share one format; `head` and non-Linear tensors (the
    router's weight) never do; all of those are dequantized at load instead."""
    params, modules = model_tensors(model), dict(model.named_modules())
    found: dict[str, dict[int | None, StoredFormat]] = {}
    for shard in shards:
        names = shard.keys()
        for raw in names:
            scale = None if IGNORED.match(raw) or raw.endswith(SCALE_SUFFIXES) else scale_name(raw, names)
            hit = None if scale is None else targets(params, canonical(raw))
            fmt = None if hit is None else detect_format(shard.dtype(raw), shard.shape(raw), hit[0].shape)
            if fmt is None or shard.dtype(scale) not in SCALE_DTYPES:
                continue
            m = EXPERT.match(canonical(raw))
            found.setdefault(holder(canonical(raw)), {})[m and int(m.group(2))] = \
                StoredFormat(fmt, shard.dtype(raw), shard.dtype(scale))
    formats = {}
    for key, per in found.items():
        module, parent = modules.get(key), modules.get(key.rpartition(".")[0])
        same = len(set(per.values())) == 1
        if isinstance(module, Linear) and key not in DENSE_ONLY:
            formats[key] = per[None]
        elif isinstance(parent, Experts) and same and len(per) == parent.num_experts:
            formats[key] = next(iter(per.values()))
    return formats


def check_routing(match: Match, values: torch.Tensor, n_experts: int) -> None:
    """`ModelLoadError` unless every expert id in `values` (rows of the hash-routing table
    `match.raw`) is in [0, n_experts): an id outside would index past the experts at the first
    token that routes through it."""
    if not values.numel():
        return
    low, high = int(values.min()), int(values.max())
    if low < 0 or high >= n_experts:
        raise ModelLoadError(f"tensor {match.raw!r} in {match.shard.name} routes to expert "
                             f"{low if low < 0 else high}, outside [0, {n_experts}) (n_routed_experts)")


def check_routing_file(match: Match, n_experts: int) -> None:
    """`check_routing` on a routing table read from its file in pieces of at most
    `ROUTING_CHUNK_BYTES` (never the whole table at once)."""
    shard, raw = match.shard, match.raw
    shape = shard.shape(raw)
    rows = shape[0] if shape else 0
    step = max(1, ROUTING_CHUNK_BYTES // max(1, shard.nbytes(raw) // max(rows, 1)))
    for start in range(0, rows, step):
        check_routing(match, shard.read_rows(raw, start, min(rows, start + step)), n_experts)


def read_match(match: Match) -> None:
    """Fill `match.target` (and its scale buffer) from the file, checking shapes and finiteness."""
    match.check()
    raw, shard, target = match.raw, match.shard, match.target
    part = match.part()
    if match.scale_target is not None:  # held as stored: the bytes as they are (the rank's blocks)
        shard.read(raw, into=target, part=part)
        shard.read(match.scale, into=match.scale_target, part=part)
        bad = [t for t in (target, match.scale_target) if nonfinite(t)]
    elif match.scale is not None:  # dequantized into the model's dtype, one slice at a time
        try:
            if part is None:
                dequantize(shard.read(raw), shard.read(match.scale), tuple(target.shape), out=target)
            else:  # a scale block may straddle two ranks: dequantize whole, keep the rank's slice
                full = dequantize(shard.read(raw), shard.read(match.scale), match.full_shape(target))
                with torch.no_grad():
                    target.copy_(rank_slice(full, *part, target.shape[part[0]]))
        except ValueError as exc:
            raise ModelLoadError(f"tensor {raw!r}: {exc}") from exc
        bad = [target] if nonfinite(target) else []
    else:
        bad = [target] if nonfinite(shard.read(raw, into=target, part=part)) else []
    if bad:
        raise ModelLoadError(f"tensor {raw!r} in {shard.name} has NaN or Inf values")


@torch.no_grad()
def load_state(model, shards: list[TensorFile]) -> None:
    """Copy every checkpoint tensor into `model` (its rank's slices when `model.tp` splits it),
    checking names, shapes and finiteness."""
    try:
        for match in matched_tensors(model_tensors(model), shards, model.tp):
            read_match(match)
            if ROUTING.search(match.raw):
                check_routing(match, match.target, model.config.n_routed_experts)
    finally:
        for shard in shards:
            shard.close()


def meta_model(config, tp=SINGLE) -> DSv4Model:
    """The module tree (rank `tp.rank`'s, when split) on torch's `meta` device: names and shapes,
    no memory, no initialisers."""
    with torch.device("meta"):
        return DSv4Model(config, tp)


def prepared_model(path_or_name: str, dtype=torch.float32, weights: str = "stored", tp=SINGLE):
    """(the `meta` model `load_model` fills, its `TensorFile`s or None for `TINY`): quantized projections
    swapped for `QuantLinear`s (`weights="stored"`), every tensor in the dtype it will be held in;
    rank `tp.rank`'s part of a `tp.size`-way split (`ValueError` naming the config field that
    does not divide)."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    if path_or_name == TINY:
        from .tiny import tiny_config

        model, shards = meta_model(tiny_config(), tp), None
    else:
        model = meta_model(load_config(path_or_name), tp)
        shards = [TensorFile(f) for f in safetensors_files(path_or_name)]
        if weights == "stored":
            # the formats come from the whole model's shapes (a rank's slice of a quantized
            # weight keeps its format); FP8 slices must be whole scale blocks
            formats = stored_formats(meta_model(model.config), shards)
            check_split(model.config, tp.size, quantized=any(
                f.fmt == "fp8" and split_of(key + ".qweight") for key, f in formats.items()))
            hold_stored(model, formats)
    for name, p in model.named_parameters():
        if not KEEP_FP32.search(name):
            p.data = p.data.to(dtype)
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.compute_dtype = dtype
    return model, shards


def check_checkpoint(path: str, tp: int = 1, weights: str = "stored"):
    """The model's config (a `DeepseekV4Config`) once the folder `path` is known to load; raises
    `ModelLoadError` naming the file, field or tensor otherwise, or `parallel.SplitError` naming
    the config field when it cannot be split `tp` ways.

    config.json must be a DeepSeek-V4 config of possible sizes (`config.SIZE_LIMITS`); every file
    read must be a regular file; every safetensors header entry must lie inside its file and match
    a tensor of the model it describes, with its dtype class and shape (quantized weights and
    their scales included; rank 0's slices when split), none missing; the hash-routing tables'
    expert ids must be in range (`check_tensors`). Time and memory are bounded by the config's
    sizes and the header's size: only the routing tables' values are read, in pieces. Other values
    (NaN/Inf) are only checked by `load_model`. `TINY` is fine whenever it splits.
    """
    if path == TINY:
        from .tiny import tiny_config

        check_split(tiny_config(), tp)
        return tiny_config()
    model, shards = prepared_model(path, weights=weights, tp=TP(0, tp))
    try:
        check_tensors(model, shards)
    finally:
        for shard in shards:
            shard.close()
    return model.config


def check_tensors(model, shards: list[TensorFile]) -> None:
    """`Match.check` every checkpoint tensor against the (meta) `model` it would fill, and
    `check_routing_file` its hash-routing tables (the only values read)."""
    for match in matched_tensors(model_tensors(model), shards, model.tp):
        match.check()
        if ROUTING.search(match.raw):
            check_routing_file(match, model.config.n_routed_experts)


def load_model(path_or_name: str, *, device="cpu", dtype=torch.float32, weights: str = "stored",
               tp=SINGLE) -> DSv4Model:
    """A `DSv4Model` from a checkpoint folder or `TINY`, on `device` in `dtype` (norms etc. stay fp32).

    weights: "stored" keeps FP8/FP4 checkpoint weights as stored (`QuantLinear`, multiplied by
    `kernels.quant_linear`); "compute" dequantizes them into `dtype` at load. Checkpoints without
    quantized tensors (and `TINY`) load the same either way. tp: the rank's place in a split
    replica (`model/parallel.py`): only its slices are read and held.
    """
    model, shards = prepared_model(path_or_name, dtype, weights, tp)
    model = model.to_empty(device="cpu")  # every tensor is filled next
    if shards is None:
        from .tiny import seed_weights

        seed_weights(model)
    else:
        load_state(model, shards)
    return model.to(device).eval()


def save_checkpoint(model, path: str, quantize: bool = False) -> None:
    """Write `model` as a native-named safetensors checkpoint folder (config.json, tokenizer.json).

    Weights held as stored are written as stored (`X.weight` + `X.scale`); `quantize=True` also
    writes the dense native-FP8 linears and routed experts in the native FP8 / FP4 layout
    (`quant.quantize_state`). transformers' `DeepseekV4ForCausalLM.from_pretrained(path)` reads a
    dense one (its conversion mapping renames native names), so the reference can run it.
    """
    import shutil

    from safetensors.torch import save_file

    from .tokenizer import packaged_tokenizer_path

    os.makedirs(path, exist_ok=True)
    state = {name: t.detach().contiguous().cpu() for name, t in checkpoint_tensors(model_tensors(model))}
    save_file(quantize_state(state) if quantize else state, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    model.config.to_json_file(os.path.join(path, "config.json"))
    shutil.copy(packaged_tokenizer_path(), os.path.join(path, "tokenizer.json"))
