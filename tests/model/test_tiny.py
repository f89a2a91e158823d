"""The embedded `tiny` model: real tokenizer, all layer types, deterministic numbers everywhere."""

import numpy as np

from dsv4batch.model import TINY, Engine

TEXT = "The quick brown fox jumps over the lazy dog."


def test_tiny_shape_and_golden_numbers():
    engine = Engine.from_pretrained(TINY)
    cfg = engine.model.config
    assert engine.tokenizer.get_vocab_size() == cfg.vocab_size == 129280
    assert set(cfg.layer_types) == {"sliding_attention", "compressed_sparse_attention",
                                    "heavily_compressed_attention"}
    assert set(cfg.mlp_layer_types) == {"hash_moe", "moe"} and cfg.hc_mult >= 2
    assert cfg.sliding_window == 128 and cfg.compress_rates == {"compressed_sparse_attention": 4,
                                                                "heavily_compressed_attention": 128}
    assert cfg.index_topk * 4 < 300  # the indexer prunes on prompts of a few hundred tokens
    ids = [cfg.bos_token_id] + engine.tokenizer.encode(TEXT).ids
    lp = engine.score_tokens([ids])[0]
    assert lp.shape == (len(ids) - 1,) and np.all(lp < 0)
    # Golden values: weights come from a platform-independent PCG64 stream, so these hold on any
    # machine; a change here means the tiny model changed.
    np.testing.assert_allclose(lp[:4], GOLDEN, atol=2e-3)


GOLDEN = [-14.142100, -12.340886, -11.417519, -12.689029]
