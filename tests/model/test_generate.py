"""`Engine.generate` against transformers' own `generate()` (fp32 eager, greedy, one request at a
time: it refuses left padding), and its invariances: packed, stepped and batched runs give the
same tokens, and the logprobs of what it generated equal `score` of prompt + generation."""

import numpy as np
import pytest
import torch

from dsv4batch.model import Engine, EngineConfig
from dsv4batch.model.sampling import SamplingParams
from tests.model_factory import make_hf_checkpoint

NEW = 48
CONFIGS = {
    # S, CSA, HCA, CSA, window 128, index_topk 8: the indexer prunes once a request passes 32 tokens
    "base": {},
    # window 32 (the ring wraps every 32 decode tokens), index_topk 4, HCA first, hc 4
    "small_window": dict(layer_types=["heavily_compressed_attention", "compressed_sparse_attention",
                                      "sliding_attention", "compressed_sparse_attention"],
                         mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], hc_mult=4, sliding_window=32,
                         index_topk=4),
}
# decoding crosses a ratio-128 window (100 -> 148, 230 -> 278), ratio-4 windows in every request,
# and every request ends beyond 4 x index_topk tokens (the indexer selects)
LENGTHS = [100, 21, 230, 7]
NEAR_TIE = 1e-4


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    hf = make_hf_checkpoint(path, seed=11 + len(request.param), **CONFIGS[request.param])
    ours = Engine.from_pretrained(path, config=EngineConfig(max_num_batched_tokens=512, max_model_len=1024))
    return hf, ours


def prompts(vocab, lengths=LENGTHS, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, vocab, size=n).tolist() for n in lengths]


@torch.no_grad()
def hf_greedy(hf, ids):
    """transformers' greedy generation of NEW tokens and the logits it chose them from."""
    out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                      pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    return out.sequences[0, len(ids):].tolist(), torch.stack(out.logits)[:, 0].float()


def assert_same_or_near_tie(got, want, logits, what):
    """Tokens equal, except where transformers' own top-2 logits are within NEAR_TIE (then the
    continuations may differ from there on)."""
    for t, (a, b) in enumerate(zip(got, want)):
        if a != b:
            top2 = torch.topk(logits[t], 2).values
            gap = float(top2[0] - top2[1])
            assert gap < NEAR_TIE, f"{what}: token {t} is {a}, transformers {b}, not a near-tie (gap {gap:.2e})"
            return
    assert len(got) == len(want)


def test_greedy_equals_transformers_generate(pair):
    hf, ours = pair
    batch = prompts(hf.config.vocab_size)
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    packed, stats = ours.generate(batch, params)
    assert stats.num_generated == NEW * len(batch) and stats.peak_running == len(batch)
    stepped = Engine(ours.model, EngineConfig(max_num_batched_tokens=16, max_model_len=1024)).generate(batch, params)[0]
    for i, ids in enumerate(batch):
        want, logits = hf_greedy(hf, ids)
        assert_same_or_near_tie(packed[i].token_ids.tolist(), want, logits, f"request {i} (length {len(ids)})")
        assert packed[i].finish_reason == "length" and packed[i].num_prompt_tokens == len(ids)
        np.testing.assert_array_equal(stepped[i].token_ids, packed[i].token_ids)  # 16-token steps


def test_generated_logprobs_equal_score(pair):
    _, ours = pair
    batch = prompts(ours.model.config.vocab_size, seed=3)
    outs, _ = ours.generate(batch, SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=1.0, seed=5))
    full = [ids + o.token_ids.tolist() for ids, o in zip(batch, outs)]
    for ids, o, lp in zip(batch, outs, ours.score_tokens(full)):
        np.testing.assert_allclose(o.logprobs, lp[len(ids) - 1:], atol=1e-5, rtol=0)


def test_sampled_first_tokens_follow_the_softmax(pair):
    """Temperature 1 at the first generated position: frequencies over 2,000 seeds against
    transformers' softmax, in 20 bins of equal expected mass (chi-square, 19 degrees of freedom,
    fixed seeds: the statistic is deterministic; 43.8 is the 0.999 quantile)."""
    hf, ours = pair
    ids = prompts(hf.config.vocab_size, [6], seed=9)[0]
    with torch.no_grad():
        probs = torch.softmax(hf(input_ids=torch.tensor([ids])).logits[0, -1].double(), -1).numpy()
    n = 2000
    outs, _ = ours.generate([ids] * n, [SamplingParams(max_tokens=1, temperature=1.0, seed=s) for s in range(n)])
    order = np.argsort(-probs)
    bins = np.minimum((np.cumsum(probs[order]) - probs[order] / 2) * 20, 19).astype(int)
    bin_of = np.empty_like(bins)
    bin_of[order] = bins
    expected = np.bincount(bin_of, weights=probs, minlength=20) * n
    observed = np.bincount(bin_of[[o.token_ids[0] for o in outs]], minlength=20)
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 43.8, (chi2, observed, expected.round(1))


def test_every_row_is_the_same_alone_batched_and_stepped(pair):
    """Greedy and seeded-sampled rows: bit-identical tokens alone, in a batch of 32 and with
    another step size."""
    _, ours = pair
    rng = np.random.default_rng(4)
    batch = prompts(ours.model.config.vocab_size, rng.integers(1, 200, 32).tolist(), seed=4)
    params = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0 if i % 2 else 0.8,
                             top_p=0.9, seed=i) for i in range(32)]
    together, stats = ours.generate(batch, params)
    assert stats.peak_running == 32
    small = Engine(ours.model, EngineConfig(max_num_batched_tokens=24, max_model_len=1024, max_num_seqs=5))
    stepped, small_stats = small.generate(batch, params)
    assert small_stats.peak_running == 5 and small_stats.peak_waiting > 0
    for i in (0, 1, 7, 30):
        alone, _ = ours.generate([batch[i]], [params[i]])
        np.testing.assert_array_equal(alone[0].token_ids, together[i].token_ids)
    for a, b in zip(together, stepped):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
