"""Native FP8 (128x128 block scales) and FP4 (e2m1, 32-column scales) checkpoints: held as stored
(`weights="stored"`, the default) or dequantized at load (`weights="compute"`), same logprobs."""

import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4batch.model import Engine, EngineConfig, ModelLoadError
from dsv4batch.model.layers import QuantLinear
from dsv4batch.model.loader import check_checkpoint, load_model, save_checkpoint
from dsv4batch.model.quant import quantize_fp4 as package_fp4
from dsv4batch.model.quant import quantize_fp8 as package_fp8
from tests.model.test_quant_layout import COMMON, quantize_fp4, quantize_fp8, write_native
from tests.model_factory import make_hf_checkpoint

# a native-format model small enough for CPU: every layer type, hash + top-k MoE, FP8 blocks that
# end part-way (q_lora 192), FP4 experts
SMALL = dict(COMMON, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, q_lora_rank=192, o_lora_rank=128,
             o_groups=2, compress_ratios=[0, 4, 128, 4, 0], index_n_heads=4, index_head_dim=64, index_topk=8,
             n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, vocab_size=1024,
             num_hash_layers=1, routed_scaling_factor=1.5)
LENGTHS = [5, 150, 300, 40, 17]
CONFIG = EngineConfig(max_num_batched_tokens=128, max_model_len=512)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("native-small"))
    write_native(path, SMALL, seed=3)
    return path


def requests(vocab, lengths=LENGTHS, seed=0):
    rng = np.random.default_rng(seed)
    return [[0] + rng.integers(3, vocab, size=n - 1).tolist() for n in lengths]


def test_fp8_and_fp4_tensors_load_dequantized(tmp_path):
    """A mixed checkpoint: one FP8 linear (held as stored) and one FP4 expert among dense ones
    (its stacked projection is not uniformly quantized, so it is dequantized at load)."""
    path = str(tmp_path)
    make_hf_checkpoint(path, seed=4, hidden_size=256, q_lora_rank=160)
    file = os.path.join(path, "model.safetensors")
    state = load_file(file)
    wq, sq, wq_deq = quantize_fp8(state["model.layers.1.attn.wq_a.weight"])  # [160, 256]: partial blocks
    state["model.layers.1.attn.wq_a.weight"], state["model.layers.1.attn.wq_a.scale"] = wq, sq
    w1, s1, w1_deq = quantize_fp4(state["model.layers.2.ffn.experts.3.w1.weight"])  # [32, 256]
    state["model.layers.2.ffn.experts.3.w1.weight"], state["model.layers.2.ffn.experts.3.w1.scale"] = w1, s1
    save_file(state, file)
    check_checkpoint(path)  # a packed FP4 weight's stored shape [32, 128] is not refused
    for weights in ("stored", "compute"):
        engine = Engine.from_pretrained(path, weights=weights)
        model = engine.model
        assert isinstance(model.layers[1].attn.wq_a, QuantLinear) == (weights == "stored")
        assert torch.equal(model.layers[1].attn.wq_a.weight, wq_deq)
        assert torch.equal(model.layers[2].ffn.experts.w1[3], w1_deq)
        assert torch.isfinite(torch.tensor(engine.score_tokens([[0, 5, 9, 200]])[0])).all()


def test_stored_weights_score_like_dequantized_ones(small):
    """fp32 compute: stored FP8/FP4 weights give the logprobs of the dequantized model within 1e-5
    (multi-step requests, every layer type, the indexer pruning)."""
    stored = Engine.from_pretrained(small, config=CONFIG)
    compute = Engine.from_pretrained(small, config=CONFIG, weights="compute")
    held = {n for n, m in stored.model.named_modules() if isinstance(m, QuantLinear)}
    # per layer wq_a, wq_b, wkv, wo_a, wo_b, 3 shared, 3 stacked routed; CSA layers add indexer.wq_b
    assert len(held) == 4 * 11 + 2 and "layers.2.ffn.experts.w2" in held and "layers.1.attn.indexer.wq_b" in held
    assert not any(isinstance(m, QuantLinear) for m in compute.model.modules())
    batch = requests(SMALL["vocab_size"])
    got, ref = stored.score_tokens(batch), compute.score_tokens(batch)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_package_quantizer_writes_what_the_independent_one_does():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(200, 300, generator=gen)
    for mine, theirs in ((package_fp8(w), quantize_fp8(w)), (package_fp4(w[:, :288]), quantize_fp4(w[:, :288]))):
        assert mine[0].dtype == theirs[0].dtype and torch.equal(mine[0].view(torch.uint8), theirs[0].view(torch.uint8))
        assert torch.equal(mine[1].float(), theirs[1].float())


def test_stored_model_saves_as_stored_and_reloads(small, tmp_path):
    model = load_model(small)
    again = str(tmp_path / "again")
    save_checkpoint(model, again)
    state = load_file(os.path.join(again, "model.safetensors"))
    assert state["layers.1.attn.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert state["layers.1.ffn.experts.5.w2.weight"].dtype == torch.int8
    assert state["layers.1.ffn.experts.5.w2.scale"].shape == (256, 4)
    batch = requests(SMALL["vocab_size"], [60, 9])
    ref = Engine(model, CONFIG).score_tokens(batch)
    for a, b in zip(Engine.from_pretrained(again, config=CONFIG).score_tokens(batch), ref):
        np.testing.assert_array_equal(a, b)


def test_dense_model_saves_quantized(tmp_path):
    """`save_checkpoint(quantize=True)` writes the native layout, which then loads as stored."""
    dense = str(tmp_path / "dense")
    make_hf_checkpoint(dense, seed=2, hidden_size=128, moe_intermediate_size=64)
    quantized = str(tmp_path / "quantized")
    save_checkpoint(load_model(dense), quantized, quantize=True)
    state = load_file(os.path.join(quantized, "model.safetensors"))
    assert state["layers.0.attn.wo_b.weight"].dtype == torch.float8_e4m3fn
    assert state["layers.3.ffn.experts.7.w1.weight"].shape == (64, 64)
    assert state["layers.3.ffn.gate.weight"].dtype == torch.float32  # the router stays dense
    model = load_model(quantized)
    assert isinstance(model.layers[3].ffn.experts.w1, QuantLinear)
    assert isinstance(model.layers[0].attn.wo_b, QuantLinear)


def edit(src, dst, change):
    os.makedirs(dst, exist_ok=True)
    state = load_file(os.path.join(src, "model.safetensors"))
    change(state)
    save_file(state, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as fh, open(os.path.join(dst, "config.json"), "w") as out:
        out.write(fh.read())
    return dst


def test_bad_quantized_tensors_are_named(small, tmp_path):
    def bad_scale(state):
        state["layers.1.attn.wq_a.scale"] = state["layers.1.attn.wq_a.scale"][:1]

    def nan_code(state):
        state["layers.2.attn.wkv.weight"].view(torch.uint8)[3, 4] = 0x7F  # e4m3 NaN

    def nan_scale(state):
        state["layers.0.ffn.experts.1.w3.scale"].view(torch.uint8)[0, 0] = 0xFF  # ue8m0 NaN

    path = edit(small, str(tmp_path / "scale"), bad_scale)
    for call in (check_checkpoint, load_model):
        with pytest.raises(ModelLoadError, match=r"layers\.1\.attn\.wq_a\.scale.*shape \(1, 2\), expected \(2, 2\)"):
            call(path)
    for name, change in (("layers.2.attn.wkv.weight", nan_code), ("layers.0.ffn.experts.1.w3.weight", nan_scale)):
        path = edit(small, str(tmp_path / name), change)
        check_checkpoint(path)  # headers are fine
        for weights in ("stored", "compute"):
            with pytest.raises(ModelLoadError, match=name.replace(".", r"\.") + ".*NaN"):
                load_model(path, weights=weights)
    with pytest.raises(ValueError, match="weights must be one of"):
        load_model(small, weights="fp8")


def test_unreadable_and_truncated_files_are_named(small, tmp_path):
    with open(os.path.join(small, "model.safetensors"), "rb") as fh:
        data = fh.read()
    for name, content, call, message in (
            ("garbage", b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!", check_checkpoint,
             r"model\.safetensors is not a readable safetensors file \(JSONDecodeError"),
            ("truncated", data[:-1000], load_model, r"model\.safetensors is truncated: tensor '")):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(content)
        (folder / "config.json").write_text(open(os.path.join(small, "config.json")).read())
        with pytest.raises(ModelLoadError, match=message):
            call(str(folder))
