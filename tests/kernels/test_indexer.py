"""The Lightning Indexer's top-k (`dsv4batch.kernels.indexer_topk`): both backends against the
definition (`kernels/ref.py`), the cpu kernel against the torch path, ties, edges, batch
invariance and the backend rule."""

import pytest
import torch

from dsv4batch.kernels import cpu as cpu_mod
from dsv4batch.kernels import indexer_topk, use_kernels
from dsv4batch.kernels.indexer import indexer_topk_torch, tie_free_keys
from dsv4batch.kernels.ref import indexer_topk_ref
from dsv4batch.kernels.select import chosen
from tests.kernels.isas import fail_build, isa  # noqa: F401 - isa: the fixture the tests below use


@pytest.fixture(autouse=True)
def built():
    assert cpu_mod.available(), cpu_mod.build_error()  # CI has a compiler: a failed build fails


def make_case(lengths, h, d, seed, starts=None):
    """Requests of `lengths` keys, one query per visible count 0..length (so every prefix shows
    up); returns q, w, keys, key_lo, visible and one torch block per request."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(sum(lengths), d, generator=gen)
    key_lo, visible, blocks, row, base = [], [], [], 0, 0
    for n in lengths:
        seen = torch.arange(n + 1) if starts is None else torch.arange(starts, n + 1)
        key_lo += [base] * len(seen)
        visible += seen.tolist()
        blocks.append((row, row + len(seen), base, base + n))
        row, base = row + len(seen), base + n
    s = len(visible)
    q = torch.randn(s, h, d, generator=gen)
    w = torch.randn(s, h, generator=gen) * (h * d) ** -0.5
    return q, w, keys, torch.tensor(key_lo), torch.tensor(visible), blocks


def scores_of(q, w, keys, lo, n):
    return (w[:, None] * (q @ keys[lo:lo + n].t()).relu()).sum(0)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("h,d,width", [(8, 32, 16), (5, 20, 7)])
def test_backends_pick_what_the_definition_picks(backend, h, d, width):
    """Each backend's first min(width, visible) picks: the definition's (fp64 scores, ties to the
    lower id) wherever fp32 rounding leaves no near-tie, else picks of the same scores."""
    q, w, keys, key_lo, visible, blocks = make_case([70, 7, 0, 90], h, d, seed=h + d)
    got = indexer_topk(q, w, keys, key_lo, visible, width, blocks, backend=backend)
    for i, want in enumerate(indexer_topk_ref(q, w, keys, key_lo, visible, width)):
        n, picks = int(visible[i]), got[i, :len(want)]
        s = scores_of(q[i].double(), w[i].double(), keys.double(), int(key_lo[i]), n)
        torch.testing.assert_close(s[picks], s[want], rtol=1e-5, atol=1e-6)
        top = s.sort(descending=True).values
        k = len(want)
        if k and (k == n or (top[:k].diff().abs().min() if k > 1 else 1) > 1e-4 and top[k - 1] - top[k] > 1e-4):
            assert torch.equal(picks, want), i


@pytest.mark.parametrize("h,d,width", [(8, 32, 16), (8, 64, 64), (5, 20, 7), (12, 16, 40)])
@pytest.mark.usefixtures("isa")
def test_cpu_kernel_picks_what_the_definition_picks(h, d, width):
    """Every query's k = min(width, visible) picks: the k best scores, best first, valid ids;
    equal to the torch definition's picks wherever the scores leave no near-tie."""
    q, w, keys, key_lo, visible, blocks = make_case([130, 7, 0, 300], h, d, seed=h * d)
    got = indexer_topk(q, w, keys, key_lo, visible, width, blocks, backend="cpu")
    ref = indexer_topk(q, w, keys, key_lo, visible, width, blocks, backend="torch")
    assert got.shape == ref.shape == (q.shape[0], width) and got.dtype == torch.int64
    for i in range(q.shape[0]):
        n, k = int(visible[i]), min(width, int(visible[i]))
        s = scores_of(q[i].double(), w[i].double(), keys.double(), int(key_lo[i]), n)
        picks = got[i, :k]
        assert sorted(set(picks.tolist())) == sorted(picks.tolist()) and all(0 <= e < n for e in picks.tolist())
        assert torch.allclose(s[picks], s.topk(k).values, rtol=1e-5, atol=1e-6)
        assert (got[i, k:] == 0).all()
        top = s.sort(descending=True).values
        if k and (k == n or (top[:k].diff().abs().min() if k > 1 else 1) > 1e-4 and top[k - 1] - top[k] > 1e-4):
            assert torch.equal(picks, ref[i, :k]), i


@pytest.mark.usefixtures("isa")
def test_ties_go_to_the_lower_id_and_zeros_fill_the_rest():
    """All-zero queries: every score is 0 (ReLU of 0), so the picks are 0..k-1 in order; keys
    that repeat tie exactly and the earlier copy comes first; -0.0 ties +0.0."""
    q, w, keys, key_lo, visible, blocks = make_case([50], 8, 32, seed=1)
    zeros = indexer_topk(torch.zeros_like(q), w, keys, key_lo, visible, 10, blocks, backend="cpu")
    for i, n in enumerate(visible.tolist()):
        assert zeros[i].tolist() == list(range(min(10, n))) + [0] * (10 - min(10, n))
    keys[30:40] = keys[0:10]  # duplicates: each pair scores the same bits
    got = indexer_topk(q, w, keys, key_lo, visible, 50, blocks, backend="cpu")
    ref = indexer_topk(q, w, keys, key_lo, visible, 50, blocks, backend="torch")
    last = got[-1]  # the query that sees all 50 keys
    for e in range(10):
        assert (last == e).nonzero().item() + 1 == (last == e + 30).nonzero().item()
    assert tie_free_keys(torch.tensor([[0.0, -0.0]])).topk(1).indices.item() == 0
    assert torch.equal(got[-1], ref[-1])


@pytest.mark.usefixtures("isa")
def test_a_query_picks_the_same_alone_among_others_and_at_any_offset():
    """Batch invariance: a query's picks depend on its own q, w and keys only, whatever shares
    the call, where its keys sit in `keys` and how many threads run."""
    q, w, keys, key_lo, visible, blocks = make_case([200, 90, 400], 8, 32, seed=5)
    full = indexer_topk(q, w, keys, key_lo, visible, 16, blocks, backend="cpu")
    gen = torch.Generator().manual_seed(9)
    threads = torch.get_num_threads()
    for i in torch.randint(0, q.shape[0], (12,), generator=gen).tolist():
        lo, n = int(key_lo[i]), int(visible[i])
        pad = int(torch.randint(0, 37, (1,), generator=gen))
        own = torch.cat([torch.randn(pad, 32, generator=gen), keys[lo:lo + n], torch.randn(5, 32, generator=gen)])
        try:
            torch.set_num_threads(1 + i % 2)
            alone = indexer_topk(q[i:i + 1], w[i:i + 1], own, torch.tensor([pad]), torch.tensor([n]), 16,
                                 [(0, 1, pad, pad + n)], backend="cpu")
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(alone[0], full[i])


@pytest.mark.usefixtures("isa")
def test_long_rows_and_a_wide_k_exercise_the_running_cut():
    """Thousands of keys per query and k near the buffer's size: the running k-th best is cut
    many times; the picks still equal a full sort's (best first, ties by id)."""
    q, w, keys, key_lo, visible, _ = make_case([3000], 8, 32, seed=11, starts=2990)
    for width in (1, 64, 700):
        got = indexer_topk(q, w, keys, key_lo, visible, width, None, backend="cpu")
        for i in range(q.shape[0]):
            s = scores_of(q[i], w[i], keys, 0, int(visible[i]))
            k = min(width, int(visible[i]))
            assert torch.equal(tie_free_keys(s[None])[0, got[i, :k]], tie_free_keys(s[None])[0].topk(k).values) \
                or torch.allclose(s[got[i, :k]], s.topk(k).values, rtol=1e-5, atol=1e-6)


def test_empty_inputs_bounds_and_the_backend_rule(monkeypatch):
    q, w, keys, key_lo, visible, blocks = make_case([20], 4, 16, seed=2)
    assert indexer_topk(q[:0], w[:0], keys, key_lo[:0], visible[:0], 8, [], backend="cpu").shape == (0, 8)
    assert indexer_topk(q, w, keys, key_lo, visible, 0, blocks, backend="cpu").shape == (q.shape[0], 0)
    with pytest.raises(ValueError, match="outside keys"):
        indexer_topk(q, w, keys[:10], key_lo, visible, 8, blocks, backend="cpu")
    # auto takes the kernel where this ISA's table chooses it; "torch" and KernelConfig(attention="torch")
    # the torch path
    calls = []
    real = cpu_mod.indexer_topk_cpu
    monkeypatch.setattr(cpu_mod, "indexer_topk_cpu", lambda *a: calls.append("cpu") or real(*a))
    indexer_topk(q, w, keys, key_lo, visible, 8, blocks)
    indexer_topk(q, w, keys, key_lo, visible, 8, blocks, backend="torch")
    with use_kernels(attention="torch"):
        indexer_topk(q, w, keys, key_lo, visible, 8, blocks)
    assert calls == (["cpu"] if chosen("indexer") else [])
    # no compiler: auto runs the torch path (the same bits), a forced "cpu" says why
    fail_build(monkeypatch)
    ref = indexer_topk_torch(q, w, keys, key_lo, visible, 8, blocks)
    assert torch.equal(indexer_topk(q, w, keys, key_lo, visible, 8, blocks), ref)
    with pytest.raises(RuntimeError, match="could not be built.*no C\\+\\+ compiler"):
        indexer_topk(q, w, keys, key_lo, visible, 8, blocks, backend="cpu")
