"""Per-token logprobs of DSv4Model vs transformers' DeepseekV4ForCausalLM (fp32 eager), 1e-4 abs.

Ties: the indexer's ReLU can tie scores exactly (all heads negative -> 0.0) and torch.topk breaks
ties by position-dependent order, so a tied top-k boundary could pick different entries than
transformers. We use 16 indexer heads with random (not default) weights so an all-zero score row
needs 16 independent negatives, and a near-tie that flips membership is improbable; the seeds
below were not cherry-picked (any failure is a real difference).
"""

import numpy as np
import pytest

from dsv4batch.model import Engine, EngineConfig
from tests.model_factory import hf_logprobs, make_hf_checkpoint

CONFIGS = {
    # S, CSA, HCA, CSA; hc 2; 1 hash layer; index_topk 8 < entries of long prompts (CSA prunes)
    "base": {},
    # HCA first, hc 4, 2 hash layers, index_topk above every entry count (the indexer keeps all)
    "hca_first": dict(layer_types=["heavily_compressed_attention", "compressed_sparse_attention",
                                   "sliding_attention", "heavily_compressed_attention"],
                      mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], hc_mult=4, index_topk=512),
    # all top-k MoE, 3 layers, 3 experts active, small window so windows wrap often
    "topk_moe": dict(num_hidden_layers=3, layer_types=["compressed_sparse_attention", "sliding_attention",
                                                       "heavily_compressed_attention"],
                     mlp_layer_types=["moe", "moe", "moe"], num_experts_per_tok=3, sliding_window=32,
                     index_topk=4),
}
LENGTHS = [5, 37, 130, 301]  # < window, not a multiple of 4, >= 128 (HCA entries), > 4 * index_topk


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    hf = make_hf_checkpoint(path, seed=len(request.param), **CONFIGS[request.param])
    ours = Engine.from_pretrained(path, config=EngineConfig(max_num_batched_tokens=512, max_model_len=1024))
    return hf, ours


def prompts(n_vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, n_vocab, size=n).tolist() for n in LENGTHS]


def test_matches_transformers(pair):
    hf, ours = pair
    batch = prompts(hf.config.vocab_size)
    got = ours.score_tokens(batch)
    for ids, lp in zip(batch, got):
        ref = hf_logprobs(hf, ids).numpy()
        assert lp.shape == (len(ids) - 1,)
        np.testing.assert_allclose(lp, ref, atol=1e-4, rtol=0, err_msg=f"length {len(ids)}")


def test_packing_equals_alone(pair):
    _, ours = pair
    batch = prompts(ours.model.config.vocab_size, seed=1)
    together = ours.score_tokens(batch)
    for ids, lp in zip(batch, together):
        np.testing.assert_allclose(lp, ours.score_tokens([ids])[0], atol=1e-5, rtol=0)
