"""The model folder, checked on the driver before Ray starts (cheap: no tensor data is read).

`config.json` must be a DeepSeek-V4 config, and every safetensors tensor must match a parameter
of the model that config describes, with its shape; none may be missing. The expected names
and shapes come from the model built on torch's `meta` device (no memory), the file side from
the safetensors headers. The rules are the loader's (`dsv4batch.model.loader.load_state`);
values (NaN/Inf) and quantized tensors are checked by each actor when it loads them, and a
failure there stops the job at the first actor.
"""

from __future__ import annotations

import os

from dsv4batch.pipeline.config import UsageError


def check_model(model: str) -> None:
    """Raise `UsageError` naming the problem for a local checkpoint folder that cannot load."""
    if model == "tiny" or "://" in model:
        return
    from dsv4batch.model.config import ModelLoadError, load_config

    try:
        check_tensors(model, load_config(model))
    except ModelLoadError as exc:
        raise UsageError(f"model {model!r}: {exc}") from exc


def check_tensors(path: str, config) -> None:
    import torch
    from safetensors import safe_open

    from dsv4batch.model.config import ModelLoadError
    from dsv4batch.model.loader import (EXPERT, IGNORED, canonical, check_complete,
                                        safetensors_files)
    from dsv4batch.model.model import DSv4Model
    from dsv4batch.model.quant import SCALE_SUFFIXES, scale_name

    with torch.device("meta"):
        model = DSv4Model(config)
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    filled, unknown = set(), []
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as fh:
            names = set(fh.keys())
            for raw in sorted(names):
                if IGNORED.match(raw) or raw.endswith(SCALE_SUFFIXES):
                    continue
                name = canonical(raw)
                m = EXPERT.match(name)
                target = params.get(f"{m.group(1)}.{m.group(3)}" if m else name)
                if target is None or (m and int(m.group(2)) >= target.shape[0]):
                    unknown.append(raw)
                    continue
                shape = tuple(target.shape[1:] if m else target.shape)
                got = tuple(fh.get_slice(raw).get_shape())
                if scale_name(raw, names) is None and got != shape:  # quantized: actor checks
                    raise ModelLoadError(f"tensor {raw!r} in {os.path.basename(file)} has shape "
                                         f"{got}, expected {shape}")
                filled.add(name)
    check_complete(params, filled, unknown)
