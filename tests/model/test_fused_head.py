"""The fused CPU head (`head.fused_scores` on `kernels.head_stats`) against an fp64 log-softmax,
its exact redo of rows a plain sum cannot hold, its batch invariance, and when it runs."""

import numpy as np
import pytest
import torch

from dsv4batch.kernels import build as build_mod
from dsv4batch.kernels import cpu as cpu_mod
from dsv4batch.kernels import head_stats, pack_head
from dsv4batch.model.head import PackedHead, fused_scores, tiled_logprobs
from tests.kernels.isas import isa  # noqa: F401 - the fixture the tests below use
from tests.threads import MACHINE, torch_threads
from tests.ties import assert_greedy_match


@pytest.fixture(autouse=True)
def built():
    assert cpu_mod.available(), cpu_mod.build_error()  # CI has a compiler: never skip


def reference(x, weight, targets):
    """fp64: (log p(target), whether the target is the argmax, the two largest log p)."""
    logits = torch.log_softmax(x.double() @ weight.double().t(), -1)
    logprob = logits.gather(1, targets[:, None])[:, 0]
    return logprob, logits.argmax(-1) == targets, logits.topk(2, -1).values


@pytest.mark.parametrize("vocab,hidden", [(1000, 16), (1357, 128), (64, 256), (129, 8)])
@pytest.mark.usefixtures("isa")
def test_matches_a_full_log_softmax(vocab, hidden):
    gen = torch.Generator().manual_seed(vocab)
    n = 23  # 3 blocks of 6 rows and a rest of 5 (one row at a time)
    x = torch.randn(n, hidden, generator=gen) * 2
    weight = torch.randn(vocab, hidden, generator=gen) / hidden ** 0.5
    targets = torch.randint(0, vocab, (n,), generator=gen)
    targets[:4] = (x.double() @ weight.double().t()).argmax(-1)[:4]  # some greedy rows
    logprob, is_max = fused_scores(x, weight, targets, pack_head(weight))
    want, want_max, top2 = reference(x, weight, targets)
    assert logprob.dtype == torch.float32 and is_max.dtype == torch.bool
    torch.testing.assert_close(logprob.double(), want, atol=2e-5, rtol=1e-5)
    assert_greedy_match(want_max, is_max, want, top2, atol=2e-5, rtol=1e-5)
    assert is_max[:4].all()
    torch.testing.assert_close(logprob, tiled_logprobs(x, weight, targets), atol=2e-5, rtol=1e-5)


@pytest.mark.usefixtures("isa")
def test_head_stats_parts_and_bad_panels():
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(7, 32, generator=gen), torch.randn(200, 32, generator=gen)
    targets = torch.tensor([0, 63, 64, 199, 5, -1, 200])  # panel edges, the last id, two outside
    sums, peaks, picked = head_stats(x, pack_head(weight), 200, targets)
    z = x.double() @ weight.double().t()
    torch.testing.assert_close(sums.double(), z.exp2().sum(1), rtol=1e-5, atol=0)
    torch.testing.assert_close(peaks.double(), z.amax(1), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(picked[:5].double(), z.gather(1, targets[:5, None])[:, 0], rtol=1e-6, atol=1e-5)
    assert (picked[5:] == 0).all()  # targets outside [0, vocab): nothing picked
    with pytest.raises(ValueError, match="pack_head"):
        head_stats(x, pack_head(weight), 300, targets)


@pytest.mark.usefixtures("isa")
def test_rows_a_plain_sum_cannot_hold_are_redone_exactly():
    gen = torch.Generator().manual_seed(1)
    n, hidden, vocab = 9, 8, 3000
    x = torch.randn(n, hidden, generator=gen)
    weight = torch.randn(vocab, hidden, generator=gen)
    weight[:, 0] = 1.0
    x[:2] *= 60.0  # logits in the hundreds: 2^z overflows
    x[2:4, 0] = -200.0  # every logit near -200: the sum underflows
    x[4, 0] = -75.0  # a sum of denormal-sized terms
    targets = torch.randint(0, vocab, (n,), generator=gen)
    panels = pack_head(weight)
    sums = head_stats(x * 1.4426950408889634, panels, vocab, targets)[0]
    assert not torch.isfinite(sums[:2]).any() and (sums[2:4] < 2.0 ** -100).all()  # the case at hand
    logprob, is_max = fused_scores(x, weight, targets, panels)
    want, want_max, top2 = reference(x, weight, targets)
    assert torch.isfinite(logprob).all() and (logprob <= 0).all()
    torch.testing.assert_close(logprob.double(), want, atol=1e-3, rtol=1e-5)
    assert_greedy_match(want_max, is_max, want, top2, atol=1e-3, rtol=1e-5)
    for i in range(n):  # a redone row has the same bits alone (its redo slice keeps one shape)
        alone = fused_scores(x[i:i + 1], weight, targets[i:i + 1], panels)
        assert torch.equal(alone[0], logprob[i:i + 1]) and torch.equal(alone[1], is_max[i:i + 1])


@pytest.mark.usefixtures("isa")
def test_a_rows_bits_do_not_depend_on_its_batch_mates():
    gen = torch.Generator().manual_seed(5)
    n, hidden, vocab = 13, 64, 1005
    x = torch.randn(n, hidden, generator=gen) * 3
    weight = torch.randn(vocab, hidden, generator=gen) / 8
    targets = torch.randint(0, vocab, (n,), generator=gen)
    panels = pack_head(weight)
    with torch_threads(max(2, MACHINE)):  # rows split over threads (the session runs on 1)
        together = fused_scores(x, weight, targets, panels)[0]
    for shift in range(1, n):
        moved = fused_scores(x.roll(shift, 0), weight, targets.roll(shift, 0), panels)[0]
        assert torch.equal(moved.roll(-shift, 0), together)
    for a, b in ((0, 1), (2, 9), (5, 13)):
        assert torch.equal(fused_scores(x[a:b], weight, targets[a:b], panels)[0], together[a:b])
    with torch_threads(1):
        assert torch.equal(fused_scores(x, weight, targets, panels)[0], together)  # nor on the thread count


def test_panels_follow_the_weight_and_the_switches(monkeypatch, kernels):
    weight = torch.randn(300, 16)
    x, targets = torch.randn(4, 16), torch.tensor([1, 2, 3, 299])
    head = PackedHead()
    panels = head.panels(weight)
    width = cpu_mod.layout()[1]  # this ISA's panel width
    assert panels is head.panels(weight) and panels.shape == (-(-weight.shape[0] // width), 16, width)  # kept
    before = fused_scores(x, weight, targets, head.panels(weight))[0]
    weight.mul_(2)  # an in-place write: rebuilt
    assert head.panels(weight) is not panels
    assert not torch.equal(fused_scores(x, weight, targets, head.panels(weight))[0], before)
    assert head.panels(weight.bfloat16()) is None  # fp32 only
    kernels(gemm="blas")
    assert head.panels(weight) is None  # the tiles on BLAS, as asked
    kernels(gemm="fused")
    assert head.panels(weight) is not None
    with pytest.raises(RuntimeError, match="fused"):
        head.panels(weight.bfloat16())
    monkeypatch.setitem(build_mod._state, cpu_mod.isa(), "RuntimeError: no C++ compiler")
    with pytest.raises(RuntimeError, match="fused"):
        PackedHead().panels(weight)
    kernels(gemm="auto")
    assert PackedHead().panels(weight) is None  # auto: the tiles


def test_engine_uses_it_and_the_tiles_agree(monkeypatch):
    from dsv4batch.model import TINY, Engine

    engine = Engine.from_pretrained(TINY)
    reqs = [[0, 5, 9, 200, 17, 3] * 20, [0, 44, 45], [0, 7, 7] * 9]
    fused, _ = engine.score(reqs)
    assert engine.model.packed_head._panels is not None and engine.model.packed_head._tiles is None
    greedy = engine.score_details(reqs)[0]
    top = engine.score_details(reqs, top_k=2)[0]
    monkeypatch.setattr(engine, "kernels", engine.kernels.replace(gemm="onednn"))
    tiled, _ = engine.score(reqs)
    tiled_greedy = engine.score_details(reqs)[0]
    for f, g, t, tl, tg in zip(fused, greedy, top, tiled, tiled_greedy):
        assert np.array_equal(g.logprobs, f) and np.array_equal(t.logprobs, f)  # score_details: score's bits
        assert np.array_equal(g.is_greedy, t.is_greedy) and g.top_ids.shape[1] == 0
        np.testing.assert_allclose(f, tl, rtol=0, atol=2e-5)
        # the fused kernel and the tiles round apart: flags agree except at near-ties for the max
        assert_greedy_match(g.is_greedy, tg.is_greedy, f, t.top_logprobs, atol=2e-5)
