"""Multi-step prefill (carried window, compressor tail/overlap, entries, indexer keys) == one shot."""

import numpy as np
import pytest

from dsv4batch.model import Engine, EngineConfig
from tests.model_factory import make_hf_checkpoint


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("ms"))
    make_hf_checkpoint(p, seed=7, hc_mult=4, index_topk=8)
    return p


# step budgets: inside a ratio-4 window (37, 130), 4-aligned (64), the window / HCA boundary (128)
@pytest.mark.parametrize("budget", [37, 64, 128, 130])
def test_multistep_equals_one_shot(path, budget):
    rng = np.random.default_rng(budget)
    batch = [rng.integers(0, 512, size=n).tolist() for n in (300, 17, 260, 129)]
    one = Engine.from_pretrained(path, config=EngineConfig(max_num_batched_tokens=1024, max_model_len=1024))
    split = Engine(one.model, EngineConfig(max_num_batched_tokens=budget, max_model_len=1024))
    ref, one_stats = one.score(batch)
    got, split_stats = split.score(batch)
    assert one_stats.num_steps == 1 and split_stats.num_steps > 3
    # the same tokens are fed whatever the step budget: every position but each request's last
    assert one_stats.num_tokens == split_stats.num_tokens == sum(len(ids) - 1 for ids in batch)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
