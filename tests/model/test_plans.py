"""Results never depend on the chunk plan: adaptive, fixed, dp, one chunk per request, sorted or not."""

import numpy as np
import pytest

from dsv4batch.model import Engine, EngineConfig
from tests.model_factory import make_hf_checkpoint


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("plans"))
    make_hf_checkpoint(p, seed=11, sliding_window=64)
    return p


def test_plans_give_identical_logprobs(path):
    rng = np.random.default_rng(5)
    # mixed lengths; with a 96-token step budget the long ones span steps (prefixes carried over)
    batch = [rng.integers(0, 512, size=n).tolist() for n in (3, 250, 40, 9, 180, 131, 77, 300, 12, 64)]
    model = Engine.from_pretrained(path).model  # one model, one engine per configuration
    results, chunks = {}, {}
    for planner in ("adaptive", "fixed", "dp", "single"):
        for sort in (False, True):
            config = EngineConfig(max_num_batched_tokens=96, max_model_len=512, prefill_chunk_size=2,
                                  planner=planner, sort_by_length=sort)
            results[planner, sort], stats = Engine(model, config).score(batch)
            chunks[planner, sort] = stats.num_chunks
            assert stats.num_steps > 5
    ref = results["single", False]
    # equal up to fp32 rounding: where a plan cuts a request's positions into steps decides its
    # attention's dense blocks (kernels/sparse_mla_torch.py), which round differently (seen: 3.8e-6)
    for key, got in results.items():
        for a, b in zip(got, ref):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0, err_msg=str(key))
    # the plans really differ: fixed uses at least as many chunks as adaptive, single the most
    assert chunks["single", False] >= chunks["fixed", False] >= chunks["adaptive", False]
    assert chunks["single", False] > chunks["adaptive", False]
