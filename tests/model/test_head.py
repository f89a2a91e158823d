"""The head's details against a full-vocabulary log-softmax computed independently."""

import copy
import pickle

import numpy as np
import pytest
import torch

from dsv4batch.model.head import VOCAB_TILE, PackedHead, exp_, tiled_details, tiled_logprobs, vocab_tiles
from tests.ties import assert_greedy_match, assert_top_ids_match


def test_details_match_a_full_log_softmax_and_the_scoring_head():
    gen = torch.Generator().manual_seed(0)
    n, hidden, vocab = 19, 32, 5000  # vocab not a multiple of the tile
    x = torch.randn(n, hidden, generator=gen)
    weight = torch.randn(vocab, hidden, generator=gen)
    full = torch.log_softmax(x @ weight.t(), -1)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    targets[:4] = full[:4].argmax(1)  # some greedy positions
    lp, greedy, ids, top = tiled_details(x, weight, targets, top_k=5, tile=1024)
    want = full.gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(lp, want, atol=1e-4, rtol=0)
    ref_v, ref_i = full.topk(6, dim=1)  # one more: is the 5th near-tied with the next?
    # the tiles and the whole-row GEMM round apart: exact except inside near-ties
    assert_greedy_match(targets == full.argmax(1), greedy, want, ref_v, atol=1e-4)
    assert greedy[:4].all()
    assert_top_ids_match(ref_i, ref_v, ids, top, atol=1e-4)
    torch.testing.assert_close(top, ref_v[:, :5], atol=1e-4, rtol=0)
    assert (top[:, :-1] >= top[:, 1:]).all()
    # bit-identical to the head Engine.score uses, whatever K
    same, *_ = tiled_details(x, weight, targets, top_k=0, tile=VOCAB_TILE)
    assert torch.equal(same, tiled_logprobs(x, weight, targets))


def test_engine_score_details_agree_with_score_and_do_not_depend_on_batch_mates(engine):
    from dsv4batch.model import TokenScores

    reqs = [[0, 5, 9, 200, 17, 3], [0], [0, 44, 45] * 30, [0, 7, 7]]
    plain, _ = engine.score(reqs)
    details, stats = engine.score_details(reqs, top_k=3)
    assert stats.model_calls == 1 and all(isinstance(d, TokenScores) for d in details)
    for p, d, r in zip(plain, details, reqs):
        assert (d.logprobs == p).all() and d.logprobs.dtype == np.float32
        assert d.is_greedy.shape == p.shape and d.top_ids.shape == (len(r) - 1, 3)
        # the target is greedy exactly when it is the first of the top-K: is_greedy comes from
        # the fused head, the top-K from the tiles, which round apart (near-ties aside)
        assert_greedy_match(d.top_ids[:, 0] == np.asarray(r[1:]), d.is_greedy, p, d.top_logprobs,
                            atol=2e-5)
        assert np.allclose(d.top_logprobs[:, 0] >= p, True)
    alone, _ = engine.score_details([reqs[2]], top_k=3)
    for a, b in zip(alone[0], details[2]):
        assert (a == b).all()


def test_targets_far_below_the_max_are_exact():
    # the fused head sums exp(logit) unshifted: logits in the hundreds overflow that sum, and
    # those rows (only) are redone with a running max
    gen = torch.Generator().manual_seed(1)
    n, hidden, vocab = 6, 8, 3000
    x = torch.randn(n, hidden, generator=gen)
    weight = torch.randn(vocab, hidden, generator=gen)
    x[:3] *= 60.0  # logits in the hundreds: rows 0-2 overflow unless the target is near the max
    targets = torch.randint(0, vocab, (n,), generator=gen)
    full = torch.log_softmax((x.double() @ weight.double().t()), -1)
    want = full.gather(1, targets[:, None]).squeeze(1)
    assert (want[:3] < -100).all()  # the case this test is about
    for tile in (1024, VOCAB_TILE):
        got = tiled_logprobs(x, weight, targets, tile=tile)
        assert torch.isfinite(got).all() and (got <= 0).all()
        torch.testing.assert_close(got.double(), want, atol=1e-3, rtol=1e-5)
        same, *_ = tiled_details(x, weight, targets, top_k=2, tile=tile)
        assert torch.equal(same, got)


def test_rows_whose_logits_are_all_very_negative_are_exact():
    # every logit near -200: exp underflows to 0 in fp32, the plain sum is 0 (or denormal), and
    # those rows are redone with a running max; the other rows keep the plain sum
    gen = torch.Generator().manual_seed(2)
    n, hidden, vocab = 5, 8, 3000
    x = torch.randn(n, hidden, generator=gen)
    weight = torch.randn(vocab, hidden, generator=gen)
    weight[:, 0] = 1.0
    x[:2, 0] = -200.0  # rows 0-1: logits in [-215, -185]
    x[2, 0] = -75.0  # row 2: sum of exp around 1e-30, denormal terms
    targets = torch.randint(0, vocab, (n,), generator=gen)
    full = torch.log_softmax((x.double() @ weight.double().t()), -1)
    want = full.gather(1, targets[:, None]).squeeze(1)
    for tile in (1024, VOCAB_TILE):
        got = tiled_logprobs(x, weight, targets, tile=tile)
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
        same, *_ = tiled_details(x, weight, targets, top_k=2, tile=tile)
        assert torch.equal(same, got)


def test_a_rows_logprob_has_the_same_bits_wherever_it_sits():
    """exp runs as exp2, whose scalar tail rounds apart from its vector body: rows are padded so no
    element lands on the tail. Odd widths (vocab 1005, a last tile of 333) and an odd row count;
    the GEMM keeps one shape (13 rows: BLAS and oneDNN pick their kernel by shape, hence the
    engine's fixed slices), each row visits every position."""
    gen = torch.Generator().manual_seed(5)
    n, hidden = 13, 16
    x = torch.randn(n, hidden, generator=gen) * 3
    for vocab, tile in ((1005, VOCAB_TILE), (1357, 1024)):
        weight = torch.randn(vocab, hidden, generator=gen)
        targets = torch.randint(0, vocab, (n,), generator=gen)
        together = tiled_logprobs(x, weight, targets, tile=tile)
        exps = [exp_(t).clone() for _, _, t in vocab_tiles(x, weight, tile)]
        for shift in range(1, n):
            moved = tiled_logprobs(x.roll(shift, 0), weight, targets.roll(shift, 0), tile=tile)
            assert torch.equal(moved.roll(-shift, 0), together), (vocab, shift)
            for want, (_, _, t) in zip(exps, vocab_tiles(x.roll(shift, 0), weight, tile)):
                assert torch.equal(exp_(t).roll(-shift, 0), want), (vocab, shift)  # every element's bits
        full = torch.log_softmax(x.double() @ weight.double().t(), 1).gather(1, targets[:, None])[:, 0]
        torch.testing.assert_close(together.double(), full, rtol=0, atol=2e-5)
    with pytest.raises(ValueError, match="padded"):  # unpadded rows: the spare columns are the next row's
        exp_(torch.zeros(3, 1005))
    with pytest.raises(ValueError, match="padded"):
        exp_(torch.zeros(1, 1005))


def test_packed_tiles_give_the_same_bits_and_follow_the_weight():
    gen = torch.Generator().manual_seed(6)
    n, hidden, vocab, tile = 64, 32, 5000, 1024
    x = torch.randn(n, hidden, generator=gen)
    weight = torch.randn(vocab, hidden, generator=gen)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    packed = PackedHead()
    tiles = packed.tiles(weight, tile, n)
    assert tiles is not None and len(tiles.weights) == 5 and not tiles.is_bf16
    assert packed.tiles(weight, tile, n).weights is tiles.weights  # kept
    plain = tiled_logprobs(x, weight, targets, tile)
    assert torch.equal(tiled_logprobs(x, weight, targets, tile, tiles), plain)
    for got, want in zip(tiled_details(x, weight, targets, 3, tile, packed=tiles),
                         tiled_details(x, weight, targets, 3, tile)):
        assert torch.equal(got, want)
    weight.mul_(0.5)  # an in-place write: the packed copy is stale and is rebuilt
    fresh = packed.tiles(weight, tile, n)
    assert fresh.weights is not tiles.weights
    assert torch.equal(tiled_logprobs(x, weight, targets, tile, fresh), tiled_logprobs(x, weight, targets, tile))
    assert not torch.equal(tiled_logprobs(x, weight, targets, tile, fresh), plain)
    with pytest.raises(ValueError, match="tiles"):  # 5 tiles of 1024, where VOCAB_TILE makes 3
        list(vocab_tiles(x, weight, VOCAB_TILE, fresh))
    assert PackedHead().tiles(weight.bfloat16(), tile, n) is None  # only fp32 runs on oneDNN
    for clone in (pickle.loads(pickle.dumps(packed)), copy.deepcopy(packed)):  # a copy starts empty
        assert clone._tiles is None and clone.tiles(weight, tile, n) is not None


def test_engine_scores_on_packed_tiles_as_blas_does(engine, monkeypatch):
    reqs = [[0, 5, 9, 200, 17, 3] * 20, [0, 44, 45]]
    monkeypatch.setattr(engine, "kernels", engine.kernels.replace(gemm="onednn"))  # the tiles (auto: the fused head)
    model = engine.model
    model.packed_head = PackedHead()
    packed, _ = engine.score(reqs)
    assert model.packed_head._tiles is not None  # built by the call above (CPU, fp32, oneDNN)
    monkeypatch.setattr(engine, "kernels", engine.kernels.replace(gemm="blas"))
    blas, _ = engine.score(reqs)
    for a, b in zip(packed, blas):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)


def test_a_bf16_head_stays_near_fp32_keeps_its_invariants_and_is_opt_in(engine):
    import dataclasses

    import dsv4batch.kernels.dense as dense
    from dsv4batch.model import Engine, EngineConfig

    with pytest.raises(ValueError, match="head_precision"):
        EngineConfig(head_precision="fp16")
    with pytest.raises(ValueError, match="precision"):
        engine.model.packed_head.tiles(engine.model.head.weight, VOCAB_TILE, 512, "int8")
    low = Engine(engine.model, dataclasses.replace(engine.config, head_precision="bf16"))
    reqs = [[0, 5, 9, 200, 17, 3] * 20, [0, 44, 45], [0, 7, 7] * 9]
    exact, _ = engine.score(reqs)
    got, _ = low.score(reqs)
    for a, b in zip(got, exact):  # bf16 inputs and logits, fp32 sums: measured max ~0.01 on tiny
        np.testing.assert_allclose(a, b, rtol=0, atol=0.05)
    details, _ = low.score_details(reqs, top_k=2)
    alone, _ = low.score([reqs[2]])
    for g, d in zip(got, details):
        assert (d.logprobs == g).all()  # score and score_details: the same bits in bf16 too
    assert (alone[0] == got[2]).all()  # and a row's logprob does not depend on its batch-mates
    tiles = engine.model.packed_head.tiles(engine.model.head.weight, VOCAB_TILE, 512, "bf16")
    assert tiles.is_bf16 == dense.bf16_available()  # bf16 where the CPU has it, else fp32
    assert engine.head_precision == "fp32" and low.head_precision == ("bf16" if tiles.is_bf16 else "fp32")
    if tiles.is_bf16:
        assert tiles.weights[0].dtype == torch.bfloat16
        assert any(not np.array_equal(a, b) for a, b in zip(got, exact))  # it did run in bf16
    else:
        assert all(np.array_equal(a, b) for a, b in zip(got, exact))


def test_a_bf16_head_without_bf16_units_warns_and_computes_fp32(engine, monkeypatch):
    import dataclasses

    import dsv4batch.kernels.dense as dense
    from dsv4batch.model import Engine

    monkeypatch.setattr(dense, "_bf16_ok", False)  # as on a CPU without AVX512-BF16 or AMX
    with pytest.warns(RuntimeWarning, match="fp32"):
        low = Engine(engine.model, dataclasses.replace(engine.config, head_precision="bf16"))
    reqs = [[0, 5, 9, 200, 17, 3] * 4, [0, 44, 45]]
    for a, b in zip(low.score(reqs)[0], engine.score(reqs)[0]):
        assert np.array_equal(a, b)
    assert low.head_precision == "fp32"  # what the actors report into _metrics.json


def test_the_head_precision_of_a_bf16_model_is_its_weights(engine):
    import copy

    from dsv4batch.model import Engine, EngineConfig

    model = copy.deepcopy(engine.model).to(torch.bfloat16)
    assert Engine(model, EngineConfig(head_precision="fp32")).head_precision == "bf16"
