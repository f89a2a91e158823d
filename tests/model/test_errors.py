"""Bad input to the model layer gets a clear error naming the problem, not a torch stack trace."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4batch.model import TINY, Engine, EngineConfig, ModelLoadError
from dsv4batch.model.loader import check_checkpoint
from tests.model_factory import make_hf_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("good"))
    make_hf_checkpoint(path, seed=1)
    return path


def copy_ckpt(src, dst, edit_state=None, edit_config=None):
    os.makedirs(dst, exist_ok=True)
    state = load_file(os.path.join(src, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as fh:
        config = json.load(fh)
    if edit_state:
        edit_state(state)
    if edit_config:
        edit_config(config)
    save_file(state, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(config, fh)
    return str(dst)


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        Engine.from_pretrained(str(tmp_path))


def test_missing_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="not a folder"):
        Engine.from_pretrained(str(tmp_path / "nope"))


def test_wrong_model_type(ckpt, tmp_path):
    path = copy_ckpt(ckpt, tmp_path, edit_config=lambda c: c.update(model_type="llama"))
    with pytest.raises(ModelLoadError, match="model_type 'llama'"):
        Engine.from_pretrained(path)


def add_bogus(state):
    state["model.layers.0.attn.bogus.weight"] = torch.zeros(2)


def add_ninth_expert(state):  # the config has 8 experts (0..7)
    state["model.layers.1.ffn.experts.8.w1.weight"] = state["model.layers.1.ffn.experts.0.w1.weight"].clone()


def shrink(state):
    state["model.layers.2.attn.wkv.weight"] = torch.zeros(3, 3)


BROKEN = {
    "unknown": (add_bogus, r"1 checkpoint tensor\(s\) match no DeepSeek-V4 parameter.*layers\.0\.attn\.bogus\.weight"),
    "expert_out_of_range": (add_ninth_expert, r"match no DeepSeek-V4 parameter.*layers\.1\.ffn\.experts\.8\.w1"),
    "misshapen": (shrink, r"layers\.2\.attn\.wkv\.weight.*shape \(3, 3\), expected \(32, 64\)"),
    "missing": (lambda s: s.pop("model.layers.1.attn.wq_a.weight"),
                r"missing 1 tensor.*layers\.1\.attn\.wq_a\.weight"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_checkpoint_is_named_by_check_and_load(ckpt, tmp_path, case):
    """`check_checkpoint` (headers only) and loading refuse the same tensor with the same message."""
    edit, message = BROKEN[case]
    path = copy_ckpt(ckpt, tmp_path, edit_state=edit)
    with pytest.raises(ModelLoadError, match=message):
        check_checkpoint(path)
    with pytest.raises(ModelLoadError, match=message):
        Engine.from_pretrained(path)


def test_check_checkpoint_accepts_good_and_tiny(ckpt):
    assert check_checkpoint(ckpt).vocab_size == 512  # the folder's config
    assert check_checkpoint(TINY).model_type == "deepseek_v4"


def test_check_checkpoint_checks_the_config(ckpt, tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        check_checkpoint(str(tmp_path))
    path = copy_ckpt(ckpt, tmp_path / "llama", edit_config=lambda c: c.update(model_type="llama"))
    with pytest.raises(ModelLoadError, match="model_type 'llama'"):
        check_checkpoint(path)


def test_nan_weights_are_named(ckpt, tmp_path):
    def poison(state):
        state["model.layers.0.attn.wo_b.weight"][0, 0] = float("nan")

    path = copy_ckpt(ckpt, tmp_path, edit_state=poison)
    with pytest.raises(ModelLoadError, match=r"layers\.0\.attn\.wo_b\.weight.*NaN"):
        Engine.from_pretrained(path)


def test_pickle_only_folder_is_refused(ckpt, tmp_path):
    path = copy_ckpt(ckpt, tmp_path)
    os.remove(os.path.join(path, "model.safetensors"))
    open(os.path.join(path, "pytorch_model.bin"), "wb").close()
    with pytest.raises(ModelLoadError, match="pickle checkpoints are not loaded"):
        Engine.from_pretrained(path)


def test_bad_requests(ckpt):
    engine = Engine.from_pretrained(ckpt, config=EngineConfig(max_model_len=64))
    with pytest.raises(ValueError, match="request 1 is empty"):
        engine.score_tokens([[0, 5], []])
    with pytest.raises(ValueError, match=r"token id 512 outside the vocabulary \[0, 512\)"):
        engine.score_tokens([[0, 512]])
    with pytest.raises(ValueError, match="token id -1"):
        engine.score_tokens([[0, -1]])
    with pytest.raises(ValueError, match="more than max_model_len=64"):
        engine.score_tokens([[0] * 65])
    assert [len(x) for x in engine.score_tokens([[0], [0, 1, 2]])] == [0, 2]


def test_engine_config_rejects_unknown_and_bad_fields():
    with pytest.raises(ValueError, match="unknown EngineConfig field"):
        EngineConfig.from_dict({"max_num_batched_token": 5})
    with pytest.raises(ValueError, match="planner must be one of"):
        EngineConfig(planner="greedy")
    with pytest.raises(ValueError, match="positive int"):
        EngineConfig(max_model_len=0)
