"""Checkpoint layouts: sharded with an index, native names without the `model.` prefix, round trip."""

import json
import os

import numpy as np
from safetensors.torch import load_file, save_file

from dsv4batch.model import Engine
from dsv4batch.model.loader import save_checkpoint
from tests.model_factory import build_hf_model

IDS = [[0, 17, 300, 5, 42, 99, 7, 256, 1, 3]]


def test_sharded_and_native_layouts_load_the_same_weights(tmp_path):
    hf = build_hf_model(seed=9)
    single, sharded, native = (str(tmp_path / n) for n in ("single", "sharded", "native"))
    hf.save_pretrained(single)
    hf.save_pretrained(sharded, max_shard_size="100KB")
    files = [f for f in os.listdir(sharded) if f.endswith(".safetensors")]
    assert len(files) > 1 and os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    # official native names: no `model.` prefix, `embed.weight`, `hc_head_fn`, ...
    os.makedirs(native)
    state = load_file(os.path.join(single, "model.safetensors"))
    renamed = {}
    for name, tensor in state.items():
        name = name.removeprefix("model.")
        name = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn",
                "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}.get(name, name)
        renamed[name] = tensor
    save_file(renamed, os.path.join(native, "model.safetensors"))
    with open(os.path.join(single, "config.json")) as fh:
        json.dump(json.load(fh), open(os.path.join(native, "config.json"), "w"))
    ref = Engine.from_pretrained(single).score_tokens(IDS)[0]
    for path in (sharded, native):
        np.testing.assert_array_equal(Engine.from_pretrained(path).score_tokens(IDS)[0], ref)
    # and our own export reloads bit-identically
    again = str(tmp_path / "again")
    save_checkpoint(Engine.from_pretrained(native).model, again)
    np.testing.assert_array_equal(Engine.from_pretrained(again).score_tokens(IDS)[0], ref)
