"""Issue 39, case 1 at the engine: logits that are not finite are said so, per request, never
returned as a score or a sampled token (the CLI's side is tests/jobs/test_reliability_three.py).

A `tiny` engine whose embedding row of one token is NaN: a request holding that token has
non-finite logits from its position on, the others are untouched."""

import numpy as np
import pytest
import torch

from dsv4batch.model import TINY, Engine, EngineConfig
from dsv4batch.model.head import first_nonfinite, nonfinite_error
from dsv4batch.model.sampling import SamplingParams

POISON = 1000  # a token id whose embedding row is NaN


@pytest.fixture(scope="module")
def engine():
    engine = Engine.from_pretrained(TINY, config=EngineConfig(max_num_batched_tokens=256, max_model_len=256))
    with torch.no_grad():
        engine.model.embed.weight[POISON] = float("nan")
    return engine


def test_first_nonfinite_finds_the_first_bad_position():
    assert first_nonfinite(np.zeros(4, np.float32)) is None
    assert first_nonfinite(np.array([0.0, -1.0, np.nan, -np.inf])) == 2
    assert first_nonfinite(np.zeros(3), np.array([[0.0, 0.0], [0.0, -np.inf], [np.nan, 0]])) == 1
    assert first_nonfinite(np.zeros(0), np.zeros((0, 2))) is None
    assert nonfinite_error(7) == "non-finite logits at position 7"


def test_scores_name_the_first_non_finite_position(engine):
    good, bad = [0, 5, 6, 7, 8, 9], [0, 5, 6, POISON, 8, 9]
    (lp_good, lp_bad), _ = engine.score([good, bad])
    assert np.isfinite(lp_good).all()
    # element t - 1 is log p(ids[t] | ids[:t]): element 3 is the first computed from the token
    assert first_nonfinite(lp_bad) == 3 and np.isfinite(lp_bad[:3]).all()
    details, _ = engine.score_details([good, bad], top_k=2)
    assert details[0].error is None
    assert details[1].error == "non-finite logits at position 3"
    np.testing.assert_array_equal(details[0].logprobs, lp_good)  # the good row is as alone
    alone, _ = engine.score([good])
    np.testing.assert_array_equal(alone[0], lp_good)


def test_generation_stops_a_request_on_non_finite_logits(engine):
    a, b = [0, 11, 12, 13, 14], [0, 21, 22, 23]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    (ref_a, ref_b), _ = engine.generate([a, b], params)
    assert ref_a.error is None and ref_a.finish_reason == "length"
    first = int(ref_a.token_ids[0])
    assert first not in (POISON, *b) and first not in ref_b.token_ids.tolist()
    with torch.no_grad():  # the token `a` generates first now reads a NaN embedding
        saved = engine.model.embed.weight[first].clone()
        engine.model.embed.weight[first] = float("nan")
    try:
        (got_a, got_b), _ = engine.generate([a, b], params)
        (at_prompt,), _ = engine.generate([[0, 5, POISON]], params)
    finally:
        with torch.no_grad():
            engine.model.embed.weight[first] = saved
    assert got_a.error == "non-finite logits at position 1" and got_a.finish_reason == "error"
    assert got_a.token_ids.tolist() == [first]  # the token drawn before, nothing after
    assert got_b.error is None and got_b.token_ids.tolist() == ref_b.token_ids.tolist()
    assert at_prompt.error == "non-finite logits at position 0" and len(at_prompt.token_ids) == 0
