"""Worked examples from the reference (vllm#45061 unit test, PR text, computed table)."""


import pytest

from dsv4batch.planner import (PLANNER_NAMES, PLANNERS, fixed_prefill_chunks, plan_cost, plan_prefill_chunks,
                               plan_step, workspace_bytes)

SEED = dict(seq_lens=[80, 96, 112, 128, 144], query_lens=[4] * 5)
SEED_KW = dict(window_size=64, max_model_len=1024, max_num_batched_tokens=128, prefill_chunk_size=4)
PR = dict(seq_lens=[256, 320, 448, 640, 1024, 1536, 3072, 4096, 6144, 8192],
          query_lens=[4, 8, 8, 8, 16, 16, 32, 32, 32, 32])
PR_KW = dict(window_size=64, max_model_len=16384, max_num_batched_tokens=4096, prefill_chunk_size=4)


@pytest.mark.parametrize("ratio, expected", [
    (4, [(0, 5, 36, 103)]), (1, [(0, 5, 0, 67)]), (0, [(0, 5, 0, 67)]), (128, [(0, 5, 1, 68)])])
def test_seed_unit_case(ratio, expected):
    assert plan_prefill_chunks(**SEED, compress_ratio=ratio, **SEED_KW) == expected


def test_pr_example_adaptive_vs_fixed():
    assert plan_prefill_chunks(**PR, compress_ratio=4, **PR_KW) == [(0, 10, 2048, 2143)]
    fixed = fixed_prefill_chunks(**PR, compress_ratio=4, **PR_KW)
    assert fixed == [(0, 4, 4096, 8256), (4, 8, 4096, 8256), (8, 10, 4096, 8256)]
    # reference arithmetic (bf16, head_dim 512): 3 x 4x8256 rows -> 1 x 10x2143 rows
    assert plan_cost(fixed) == {"num_chunks": 3, "workspace_rows": 10 * 8256, "peak_rows": 4 * 8256}
    ws = workspace_bytes([(0, 10, 2048, 2143)], head_dim=512, dtype_bytes=2)
    assert ws["peak_bytes"] == ws["total_bytes"] == 10 * 2143 * 512 * 2


@pytest.mark.parametrize("inputs, kw, expected", [
    (PR, PR_KW, {1: [(0, 10, 0, 95)], 4: [(0, 10, 2048, 2143)], 128: [(0, 10, 64, 159)]}),
    (dict(seq_lens=[8192, 16384, 600, 16384, 16384, 16384, 16384, 700], query_lens=[512] * 8), PR_KW,
     {1: [(0, 8, 0, 575)], 4: [(0, 7, 4096, 4671), (7, 8, 175, 750)], 128: [(0, 8, 128, 703)]}),
])
def test_reference_table(inputs, kw, expected):
    assert plan_step(**inputs, compress_ratios=[1, 4, 128, 4], **kw) == expected


def test_batch_invariant_single():
    seq = [40, 2400, 6, 512]
    plans = plan_step(seq, seq, compress_ratios=[1, 4, 128], window_size=128, max_model_len=8192,
                      max_num_batched_tokens=8192, prefill_chunk_size=64, planner="single")
    for plan in plans.values():
        assert [(s, e) for s, e, _, _ in plan] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert plans[4][1] == (1, 2, 600, 600 + 2400)  # gather = q + clamp(0, 0, W-1)


def test_empty_and_validation():
    assert plan_prefill_chunks([], [], compress_ratio=4, **SEED_KW) == []
    assert plan_step([], [], compress_ratios=[4], planner="dp", **SEED_KW) == {4: []}
    bad = [([10, 20], [1], "entries"), ([10], [11], "query_len > seq_len"), ([10], [0], "query_len < 1"),
           ([2000], [4], "max_model_len"), ([1000], [500], "does not fit")]
    for seq, q, msg in bad:
        with pytest.raises(ValueError, match=msg):
            plan_prefill_chunks(seq, q, compress_ratio=4, **SEED_KW)
    with pytest.raises(ValueError, match="compress_ratio"):
        plan_prefill_chunks([10], [1], compress_ratio=-1, **SEED_KW)
    with pytest.raises(ValueError, match="planner"):
        plan_step([10], [1], compress_ratios=[4], planner="nope", **SEED_KW)


def test_planner_names_are_the_planners():
    assert PLANNER_NAMES == ("adaptive", "fixed", "dp", "single") == tuple(PLANNERS)
    seq = [300, 40]
    for name in PLANNER_NAMES:
        plans = plan_step(seq, seq, compress_ratios=[4], planner=name, **SEED_KW)
        assert plans[4][0][0] == 0 and plans[4][-1][1] == 2  # every planner covers both requests


def test_import_does_not_pull_torch(run_python):
    code = "import sys, dsv4batch.planner; assert 'torch' not in sys.modules, 'torch imported'"
    run_python(code, check=True)
