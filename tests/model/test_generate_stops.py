"""How generation ends (stop strings, stop token ids, EOS, max_tokens) and the cache budget, on
the embedded `tiny` model with the real DSv4 tokenizer."""

import numpy as np
import pytest

from dsv4batch.model import Engine, EngineConfig
from dsv4batch.model.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained("tiny", config=EngineConfig(max_num_batched_tokens=256, max_model_len=512))


@pytest.fixture(scope="module")
def free_run(engine):
    """A prompt and its greedy 24 tokens with no stop of any kind."""
    prompt = [0] + engine.tokenizer.encode("The quick brown fox jumps over", add_special_tokens=False).ids
    out = engine.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0][0]
    return prompt, out


def test_max_tokens_ends_with_length(free_run, engine):
    prompt, out = free_run
    assert out.finish_reason == "length" and out.stop_reason is None and len(out.token_ids) == 24
    assert out.text == engine.tokenizer.decode(out.token_ids.tolist(), skip_special_tokens=True)


def test_a_stop_string_spanning_two_tokens_cuts_the_text_before_it(free_run, engine):
    prompt, out = free_run
    pieces = [engine.tokenizer.decode([t]) for t in out.token_ids.tolist()]
    i = next(i for i in range(3, 20) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    start = out.text.find(stop)
    assert start >= 0
    got = engine.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True, stop=["never there", stop]))[0][0]
    assert (got.finish_reason, got.stop_reason, got.text) == ("stop", stop, out.text[:start])
    # generation stopped at the token that completed the string (the ids keep it)
    np.testing.assert_array_equal(got.token_ids, out.token_ids[:len(got.token_ids)])
    assert stop in engine.tokenizer.decode(got.token_ids.tolist()) and len(got.token_ids) <= i + 2


def test_stop_token_ids_and_eos(free_run, engine):
    prompt, out = free_run
    target = int(out.token_ids[5])
    first = int(np.flatnonzero(out.token_ids == target)[0])
    got = engine.generate([prompt], SamplingParams(max_tokens=24, stop_token_ids=[target]))[0][0]
    assert (got.finish_reason, got.stop_reason, len(got.token_ids)) == ("stop", target, first + 1)
    eos = engine.model.config.eos_token_id
    engine.model.config.eos_token_id = target  # make the model "say" EOS at that token
    try:
        ended = engine.generate([prompt], SamplingParams(max_tokens=24))[0][0]
        ignored = engine.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0][0]
    finally:
        engine.model.config.eos_token_id = eos
    assert (ended.finish_reason, ended.stop_reason, len(ended.token_ids)) == ("eos", None, first + 1)
    assert ended.text == engine.tokenizer.decode(out.token_ids[:first + 1].tolist(), skip_special_tokens=True)
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 24


def test_requests_that_do_not_fit_are_refused_by_name(engine):
    with pytest.raises(ValueError, match="max_tokens .* max_model_len"):
        engine.generate([[0] * 500], SamplingParams(max_tokens=13))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[0, 129280]])
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.generate([[0, 5]], SamplingParams(stop_token_ids=[10**6]))


def test_a_small_cache_budget_makes_requests_wait_not_fail(engine):
    rng = np.random.default_rng(1)
    batch = [rng.integers(3, 129280, n).tolist() for n in (40, 300, 90, 200, 10, 120)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want, _ = engine.generate(batch, params)
    spec = engine.cache_spec
    budget = 2 * spec.request_bytes(512) + spec.block_bytes()  # two full-length requests
    small = Engine(engine.model, EngineConfig(max_num_batched_tokens=256, max_model_len=512,
                                              max_cache_mib=budget / 2**20), engine.tokenizer)
    got, stats = small.generate(batch, params)
    assert stats.peak_waiting > 0 and 0 < stats.peak_cache_bytes <= stats.cache_capacity_bytes <= budget
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
    with pytest.raises(ValueError, match="cannot hold one request"):
        Engine(engine.model, EngineConfig(max_model_len=512, max_cache_mib=spec.slot_bytes() / 2**20)).generate(
            [[0, 1]])
