"""Tensor/expert parallel splits without processes: each rank's tensors (shapes, bytes, values
read from the checkpoint's slices) against the whole model; refusals naming the config field.
The collectives themselves run in tests/actors/test_shards.py (gloo, Ray)."""

import pytest
import torch

from dsv4batch.model.loader import check_checkpoint, load_model, meta_model, save_checkpoint
from dsv4batch.model.model import model_tensors
from dsv4batch.model.parallel import SPLIT_FIELDS, TP, SplitError, split_of
from dsv4batch.model.tiny import seed_weights, tiny_config
from tests.model_factory import make_hf_checkpoint

SPLIT4 = dict(o_groups=4)  # the factory's 4 heads in 4 groups: splits 1, 2 and 4 ways


def nbytes(t) -> int:
    return t.numel() * t.element_size()


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_holds_one_tth_of_every_split_tensor(world):
    config = tiny_config()
    config.o_groups = 4
    whole = model_tensors(meta_model(config))
    per_rank = [model_tensors(meta_model(config, TP(r, world))) for r in range(world)]
    split_total = replicated = 0
    for name, t in whole.items():
        split = split_of(name)
        for tensors in per_rank:
            local = tensors[name]
            if split is None:
                assert local.shape == t.shape, name
            else:
                dim = split[1]
                assert local.shape[dim] * world == t.shape[dim], name
                assert local.shape[:dim] + local.shape[dim + 1:] == t.shape[:dim] + t.shape[dim + 1:], name
        if split is None:
            replicated += nbytes(t)
        else:
            split_total += nbytes(t)
    for tensors in per_rank:  # resident bytes: replicated + exactly 1/T of the split part
        assert sum(nbytes(t) for t in tensors.values()) == replicated + split_total // world
    assert {split_of(n)[0] for n in whole if split_of(n)} == \
        {"heads", "groups", "row_parallel", "experts", "shared_expert", "vocab"}


def test_ranks_read_their_slices_of_a_transformers_checkpoint(tmp_path):
    make_hf_checkpoint(str(tmp_path), seed=3, **SPLIT4)
    whole = model_tensors(load_model(str(tmp_path)))
    for world in (2, 4):
        seen_experts = set()
        for rank in range(world):
            model = load_model(str(tmp_path), tp=TP(rank, world))
            for name, t in model_tensors(model).items():
                split = split_of(name)
                want = whole[name] if split is None else \
                    whole[name].narrow(split[1], rank * t.shape[split[1]], t.shape[split[1]])
                assert torch.equal(t, want), (world, rank, name)
            seen_experts.update(range(model.layers[0].ffn.experts.first,
                                      model.layers[0].ffn.experts.first + model.layers[0].ffn.experts.num_experts))
        assert seen_experts == set(range(8))  # the blocks cover every expert once


def test_tiny_ranks_are_slices_of_the_seeded_model():
    whole = model_tensors(load_model("tiny"))
    model = load_model("tiny", tp=TP(1, 2))
    head = model.head.weight
    assert torch.equal(head, whole["head.weight"][head.shape[0]:])
    assert torch.equal(model.layers[2].ffn.experts.w1, whole["layers.2.ffn.experts.w1"][4:])


def test_quantized_weights_split_as_stored_when_blocks_align(tmp_path):
    config = tiny_config()  # FP8 slices of 128: heads 4 x 64 rows, 2 groups x 128, shared 256
    config.num_hidden_layers, config.layer_types, config.mlp_layer_types = 2, config.layer_types[:2], ["hash_moe", "moe"]
    config.o_lora_rank, config.moe_intermediate_size = 128, 256
    from dsv4batch.model.model import DSv4Model

    model = DSv4Model(config)
    seed_weights(model)
    save_checkpoint(model, str(tmp_path), quantize=True)
    stored = model_tensors(load_model(str(tmp_path)))
    for rank in range(2):
        part = load_model(str(tmp_path), tp=TP(rank, 2))
        tensors = model_tensors(part)
        q = tensors["layers.0.attn.wq_b.qweight"]
        assert q.dtype == torch.float8_e4m3fn and q.shape == (128, 64)
        for name in ("layers.0.attn.wq_b.qweight", "layers.0.attn.wq_b.scale", "layers.1.attn.wo_b.qweight",
                     "layers.1.attn.wo_b.scale", "layers.1.ffn.shared_experts.w2.scale"):
            dim = split_of(name)[1]
            n = tensors[name].shape[dim]
            assert torch.equal(tensors[name].view(torch.uint8),
                               stored[name].narrow(dim, rank * n, n).view(torch.uint8)), name
        assert tensors["layers.1.ffn.experts.w1.qweight"].shape[0] == 4  # FP4 experts: 4 of 8 per rank
        # weights="compute": dequantized, then the rank's slice of the dense weight
        dense = load_model(str(tmp_path), tp=TP(rank, 2), weights="compute")
        whole = load_model(str(tmp_path), weights="compute")
        w = model_tensors(dense)["layers.1.attn.wo_b.weight"]
        assert torch.equal(w, model_tensors(whole)["layers.1.attn.wo_b.weight"][:, rank * w.shape[1]:][:, :w.shape[1]])


def test_unsplittable_configs_are_refused_naming_the_field(tmp_path, checkpoint):
    with pytest.raises(SplitError, match="o_groups 2 is not divisible by tp 4"):
        check_checkpoint(checkpoint, 4)  # the factory's default: 2 output groups
    with pytest.raises(SplitError, match="n_routed_experts 8 is not divisible by tp 3"):
        check_checkpoint("tiny", 3)
    check_checkpoint(checkpoint, 2)
    assert "num_attention_heads" in SPLIT_FIELDS and "vocab_size" in SPLIT_FIELDS
    # FP8 as stored: a rank's slice must be whole 128 blocks (the factory's are 64 rows)
    from dsv4batch.model.loader import load_model as load

    src = load(checkpoint)
    save_checkpoint(src, str(tmp_path), quantize=True)
    with pytest.raises(SplitError, match="multiple of 128"):
        check_checkpoint(str(tmp_path), 2)
    assert check_checkpoint(str(tmp_path), 1).hidden_size == src.config.hidden_size  # unsplit: fine
