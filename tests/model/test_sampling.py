"""The sampler on fixed logits (`model/sampling.py`): greedy ties, the filters' sets, seeds, and
the parameter checks."""

import math

import numpy as np
import pytest
import torch

from dsv4batch.model.sampling import SamplingParams, filtered_probs, sample

LOGITS = torch.tensor([2.0, 1.0, 3.0, 3.0, -1.0, 0.5, 2.5, -4.0])  # two equal maxima (ids 2 and 3)


def test_greedy_takes_the_lowest_of_equal_maxima():
    draw = sample(LOGITS, SamplingParams(top_logprobs=3), step=0)
    assert draw.token == 2
    ref = torch.log_softmax(LOGITS.double(), -1)
    assert math.isclose(draw.logprob, float(ref[2]), rel_tol=1e-6)
    assert draw.top_ids.tolist()[:2] in ([2, 3], [3, 2]) and draw.top_ids[2] == 6
    np.testing.assert_allclose(draw.top_logprobs, ref[[2, 3, 6]].numpy(), rtol=1e-6)


@pytest.mark.parametrize("params, allowed", [
    (dict(top_k=2), {2, 3}),
    (dict(top_k=3), {2, 3, 6}),
    (dict(min_p=0.5), {2, 3, 6}),  # p >= 0.5 p_max: logits >= 3 - ln 2
    (dict(top_p=0.5), {2, 3}),  # 2 and 3 hold ~0.62 of the mass: the set stops there
    (dict(top_p=0.3), {2}),  # id 2 alone holds 0.31: its equal twin is cut (lower ids first)
    (dict(top_k=4, min_p=0.3, top_p=0.99), {2, 3, 6, 0}),
])
def test_filters_never_emit_outside_their_set(params, allowed):
    p = SamplingParams(temperature=1.0, **params)
    kept = set(torch.nonzero(filtered_probs(LOGITS, p)).flatten().tolist())
    drawn = {sample(LOGITS, SamplingParams(temperature=1.0, seed=s, **params), step=3).token for s in range(400)}
    assert drawn <= kept == allowed


def test_a_seed_and_step_fix_the_draw():
    p = SamplingParams(temperature=1.5, seed=123)
    assert sample(LOGITS, p, 5).token == sample(LOGITS.clone(), p, 5).token
    draws = {sample(LOGITS, p, step).token for step in range(60)}
    assert len(draws) > 3  # another step draws anew


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
    ("max_tokens", 0), ("max_tokens", 2.5), ("min_p", -1), ("top_k", -2), ("seed", -1),
    ("stop", [1, 2]), ("stop", [""]), ("stop_token_ids", ["a"]), ("ignore_eos", "yes"),
])
def test_bad_parameters_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_from_dict_takes_defaults_and_refuses_unknown_fields():
    base = SamplingParams(max_tokens=7, temperature=0.5)
    p = SamplingParams.from_dict({"top_p": 0.9, "stop": "###", "seed": None}, base)
    assert (p.max_tokens, p.temperature, p.top_p, p.stop, p.seed) == (7, 0.5, 0.9, ("###",), None)
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        SamplingParams.from_dict({"temprature": 1.0})
