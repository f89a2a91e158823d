"""Hypothesis properties of the adaptive, fixed, dp and single planners and the length order."""

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4batch.planner import (chunk_budget, dp_prefill_chunks, fixed_prefill_chunks,
                               inverse_permutation, length_order, plan_cost, plan_prefill_chunks,
                               request_lengths, single_prefill_chunks)


@st.composite
def batches(draw):
    """(seq_lens, query_lens, kwargs) with every request fitting its budget."""
    max_model_len = draw(st.integers(1, 4096))
    mnbt = draw(st.integers(1, 1024))
    n = draw(st.integers(0, 40))
    seq = draw(st.lists(st.integers(1, max_model_len), min_size=n, max_size=n))
    q = [draw(st.integers(1, min(s, mnbt))) for s in seq]
    kw = dict(compress_ratio=draw(st.sampled_from([0, 1, 2, 4, 128])), window_size=draw(st.integers(1, 256)),
              max_model_len=max_model_len, max_num_batched_tokens=mnbt,
              prefill_chunk_size=draw(st.integers(1, 8)))
    return seq, q, kw


def check_plan(plan, seq, q, kw):
    """Partition, order, N/M as defined, budget unless a single request. Returns the budget."""
    c, g = request_lengths(seq, q, **{k: v for k, v in kw.items() if k != "prefill_chunk_size"})
    budget = chunk_budget(kw["compress_ratio"], kw["window_size"], kw["max_model_len"],
                          kw["max_num_batched_tokens"], kw["prefill_chunk_size"])
    assert [s for s, _, _, _ in plan] == ([0] + [e for _, e, _, _ in plan])[:len(plan)]
    assert sum(e - s for s, e, _, _ in plan) == len(seq) and (not plan or plan[-1][1] == len(seq))
    for s, e, n, m in plan:
        assert e > s and n == c[s:e].max() and m == n + g[s:e].max()
        assert (e - s) * m <= budget or e - s == 1
    return c, g, budget


@settings(max_examples=150, deadline=None)
@given(batches())
def test_adaptive_properties_and_maximality(batch):
    seq, q, kw = batch
    plan = plan_prefill_chunks(seq, q, **kw)
    c, g, budget = check_plan(plan, seq, q, kw)
    for s, e, _, _ in plan:
        if e < len(seq):  # adding the next request would break the budget
            assert (e + 1 - s) * (c[s:e + 1].max() + g[s:e + 1].max()) > budget


@settings(max_examples=150, deadline=None)
@given(batches())
def test_dp_never_worse_than_adaptive(batch):
    seq, q, kw = batch
    dp = dp_prefill_chunks(seq, q, **kw)
    check_plan(dp, seq, q, kw)
    greedy = plan_cost(plan_prefill_chunks(seq, q, **kw))
    assert plan_cost(dp)["workspace_rows"] <= greedy["workspace_rows"]


@settings(max_examples=100, deadline=None)
@given(batches())
def test_fixed_and_single(batch):
    seq, q, kw = batch
    check_plan(single_prefill_chunks(seq, q, **kw), seq, q, kw)
    fixed = fixed_prefill_chunks(seq, q, **kw)
    n = 0 if kw["compress_ratio"] <= 1 else math.ceil(kw["max_model_len"] / kw["compress_ratio"])
    assert [(s, e) for s, e, _, _ in fixed] == [
        (s, min(s + kw["prefill_chunk_size"], len(seq))) for s in range(0, len(seq), kw["prefill_chunk_size"])]
    assert all((nn, m) == (n, n + kw["window_size"] + kw["max_num_batched_tokens"]) for _, _, nn, m in fixed)


@settings(max_examples=100, deadline=None)
@given(batches())
def test_length_order_round_trip(batch):
    seq, q, kw = batch
    perm = length_order(seq, q, kw["compress_ratio"], kw["window_size"])
    inv = inverse_permutation(perm)
    assert sorted(perm.tolist()) == list(range(len(seq)))
    assert np.array_equal(perm[inv], np.arange(len(seq))) and np.array_equal(inv[perm], np.arange(len(seq)))
    c, g = request_lengths(seq, q, **{k: v for k, v in kw.items() if k != "prefill_chunk_size"})
    key = (c + g)[perm]
    assert np.all(np.diff(key) >= 0)
    check_plan(plan_prefill_chunks(np.asarray(seq)[perm], np.asarray(q)[perm], **kw),
               np.asarray(seq)[perm], np.asarray(q)[perm], kw)


def brute_force(c, g, budget, overhead):
    """Min (cost, chunks) over all contiguous partitions of a short batch."""
    n, best = len(c), {0: (0, 0)}
    for end in range(1, n + 1):
        cands = []
        for start in range(end):
            area = (end - start) * (max(c[start:end]) + max(g[start:end]))
            if area <= budget or end - start == 1:
                cands.append((best[start][0] + area + overhead, best[start][1] + 1))
        best[end] = min(cands)
    return best[n]


@settings(max_examples=100, deadline=None)
@given(batches(), st.sampled_from([0, 1, 50, 10**9]))
def test_dp_matches_brute_force(batch, overhead):
    seq, q, kw = batch
    seq, q = seq[:9], q[:9]
    c, g, budget = check_plan(dp := dp_prefill_chunks(seq, q, chunk_overhead_rows=overhead, **kw), seq, q, kw)
    cost = plan_cost(dp)
    got = (cost["workspace_rows"] + overhead * cost["num_chunks"], cost["num_chunks"])
    assert got == brute_force(c.tolist(), g.tolist(), budget, overhead)


@settings(max_examples=100, deadline=None)
@given(batches())
def test_dp_with_launch_price_dominates_adaptive(batch):
    """A huge per-chunk price gives the greedy's (minimal) chunk count with no more area."""
    seq, q, kw = batch
    dp = plan_cost(dp_prefill_chunks(seq, q, chunk_overhead_rows=10**12, **kw))
    greedy = plan_cost(plan_prefill_chunks(seq, q, **kw))
    assert dp["num_chunks"] == greedy["num_chunks"] and dp["workspace_rows"] <= greedy["workspace_rows"]
