"""Bad input to the model layer gets a clear error naming the problem, not a torch stack trace."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4batch.model import DSv4Model, EngineConfig, ModelLoadError
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
        DSv4Model.from_pretrained(str(tmp_path))


def test_missing_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="not a folder"):
        DSv4Model.from_pretrained(str(tmp_path / "nope"))


def test_wrong_model_type(ckpt, tmp_path):
    path = copy_ckpt(ckpt, tmp_path, edit_config=lambda c: c.update(model_type="llama"))
    with pytest.raises(ModelLoadError, match="model_type 'llama'"):
        DSv4Model.from_pretrained(path)


def test_missing_tensor_is_named(ckpt, tmp_path):
    path = copy_ckpt(ckpt, tmp_path, edit_state=lambda s: s.pop("model.layers.1.attn.wq_a.weight"))
    with pytest.raises(ModelLoadError, match=r"missing 1 tensor.*layers\.1\.attn\.wq_a\.weight"):
        DSv4Model.from_pretrained(path)


def test_wrong_shape_is_named(ckpt, tmp_path):
    def shrink(state):
        state["model.layers.2.attn.wkv.weight"] = torch.zeros(3, 3)

    path = copy_ckpt(ckpt, tmp_path, edit_state=shrink)
    with pytest.raises(ModelLoadError, match=r"layers\.2\.attn\.wkv\.weight.*shape \(3, 3\), expected \(32, 64\)"):
        DSv4Model.from_pretrained(path)


def test_nan_weights_are_named(ckpt, tmp_path):
    def poison(state):
        state["model.layers.0.attn.wo_b.weight"][0, 0] = float("nan")

    path = copy_ckpt(ckpt, tmp_path, edit_state=poison)
    with pytest.raises(ModelLoadError, match=r"layers\.0\.attn\.wo_b\.weight.*NaN"):
        DSv4Model.from_pretrained(path)


def test_pickle_only_folder_is_refused(ckpt, tmp_path):
    path = copy_ckpt(ckpt, tmp_path)
    os.remove(os.path.join(path, "model.safetensors"))
    open(os.path.join(path, "pytorch_model.bin"), "wb").close()
    with pytest.raises(ModelLoadError, match="pickle checkpoints are not loaded"):
        DSv4Model.from_pretrained(path)


def test_bad_requests(ckpt):
    model = DSv4Model.from_pretrained(ckpt, engine=EngineConfig(max_model_len=64))
    with pytest.raises(ValueError, match="request 1 is empty"):
        model.score_tokens([[0, 5], []])
    with pytest.raises(ValueError, match=r"token id 512 outside the vocabulary \[0, 512\)"):
        model.score_tokens([[0, 512]])
    with pytest.raises(ValueError, match="token id -1"):
        model.score_tokens([[0, -1]])
    with pytest.raises(ValueError, match="more than max_model_len=64"):
        model.score_tokens([[0] * 65])
    assert [len(x) for x in model.score_tokens([[0], [0, 1, 2]])] == [0, 2]


def test_engine_config_rejects_unknown_and_bad_fields():
    with pytest.raises(ValueError, match="unknown EngineConfig field"):
        EngineConfig.from_dict({"max_num_batched_token": 5})
    with pytest.raises(ValueError, match="planner must be one of"):
        EngineConfig(planner="greedy")
    with pytest.raises(ValueError, match="positive int"):
        EngineConfig(max_model_len=0)
