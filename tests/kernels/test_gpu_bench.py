"""`bench/gpu.py`'s model side without a GPU: the random V4-Flash-shaped model it builds holds
its weights as a native checkpoint does and scores finitely, and the layer count follows memory.
(The whole script runs on the CPU with `python -m dsv4batch.bench gpu --dry-run`.)"""

import numpy as np
import torch

from bench.gpu import attention_counts, fit_layers, flash_config, stored_model
from dsv4batch.model import Engine, EngineConfig
from dsv4batch.model.layers import QuantLinear


def test_random_stored_model_scores_finitely():
    config = flash_config(4, dry=True)
    assert config.layer_types == ["sliding_attention"] * 2 + ["compressed_sparse_attention",
                                                              "heavily_compressed_attention"]
    model = stored_model(config, torch.device("cpu"), torch.float32)
    held = {n: m.fmt for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert held["layers.0.attn.wq_a"] == "fp8" and held["layers.3.ffn.experts.w2"] == "fp4"
    assert held["layers.2.attn.indexer.wq_b"] == "fp8" and "head" not in held
    engine = Engine(model, EngineConfig(attn_backend="torch", max_model_len=64))
    scores = engine.score([[0] + list(range(3, 30))])[0][0]
    assert scores.shape == (27,) and np.isfinite(scores).all()


def test_layers_follow_free_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (140 * 2**30, 141 * 2**30))
    layers, info = fit_layers(torch.device("cuda"))
    assert layers == 30 and 6 < info["gib_per_csa_hca_pair"] < 7.5  # FP4 experts: ~3.3 GiB a layer
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (20 * 2**30, 80 * 2**30))
    assert fit_layers(torch.device("cuda"))[0] == 4
    flops, nbytes = attention_counts(4096, 64, 512, 2048)
    assert flops == 2.0 * 4096 * 64 * 2048 * 1024 and nbytes == 4096 * 2048 * 1024 + 4 * 4096 * 64 * 512
