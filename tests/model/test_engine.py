"""Engine: construction, per-call StepStats (hand-counted), stats addition, torch-free import."""


import numpy as np
import pytest

from dsv4batch.kernels import KernelConfig, use_kernels
from dsv4batch.model import TINY, Engine, EngineConfig, StepStats
from dsv4batch.model.step import RequestState


@pytest.fixture(scope="module")
def tiny():
    return Engine.from_pretrained(TINY)


def test_engine_parts(tiny):
    assert tiny.config == EngineConfig() and tiny.device.type == "cpu"
    assert tiny.tokenizer.get_vocab_size() == tiny.model.config.vocab_size
    bare = Engine(tiny.model)
    assert bare.tokenizer is None and bare.pool is not tiny.pool and bare.model is tiny.model


def test_stats_are_per_call_and_hand_counted(tiny):
    # one step, one chunk per request and layer ("single"); tiny: 6 layers, ratios 1, 4, 128, 4, 128, 1
    engine = Engine(tiny.model, EngineConfig(planner="single"))
    batch = [[0] * 5, [1] * 9, [2] * 3, [3]]  # feeds 4, 8, 2, 0 positions
    out, stats = engine.score(batch)
    assert [len(x) for x in out] == [4, 8, 2, 0]
    assert isinstance(stats, StepStats) and stats.model_calls == 1
    assert (stats.num_tokens, stats.num_steps, stats.num_chunks) == (14, 1, 3 * 6)
    # workspace rows per request q = len - 1: M = q (ratio 1 and 128: no entries yet) or q // 4 + q
    rows = 2 * 14 + 2 * (14 + 1 + 2 + 0) + 2 * 14
    head_dim = tiny.model.config.head_dim
    assert stats.workspace_elements == rows * head_dim
    assert stats.peak_workspace_bytes == (8 // 4 + 8) * head_dim * 4  # fp32
    assert stats.forward_s > 0 and 0 < stats.planner_s < stats.forward_s
    again, stats2 = engine.score(batch)  # nothing accumulates between calls
    assert stats2.model_calls == 1 and stats2.num_chunks == stats.num_chunks
    for a, b in zip(out, again):
        np.testing.assert_array_equal(a, b)


def test_num_steps_matches_schedule(tiny):
    config = EngineConfig(max_num_batched_tokens=64)
    engine = Engine(tiny.model, config)
    batch = [list(range(3, 3 + n)) for n in (150, 10, 70)]
    _, stats = engine.score(batch)
    steps = list(engine.schedule([RequestState(np.asarray(ids)) for ids in sorted(batch, key=len)]))
    assert stats.num_steps == len(steps) == 4  # 227 positions in steps of 64
    assert stats.num_tokens == 227 and engine.score_tokens(batch)[1].shape == (9,)


def test_attn_kernel_names_the_backend_that_runs(tiny, monkeypatch):
    """auto on the CPU: the fused cpu kernel (torch where it cannot be built); forced ones as asked,
    a forced one that cannot run refused; the config's names are the kernels' backends."""
    from dsv4batch.kernels import _BACKENDS
    from dsv4batch.kernels import build as build_mod
    from dsv4batch.kernels import cpu as cpu_mod
    from dsv4batch.model.config import ATTN_BACKENDS

    assert tiny.attn_kernel == "cpu" and tiny.kernels == KernelConfig()
    assert Engine(tiny.model, EngineConfig(attn_backend="torch")).attn_kernel == "torch"
    assert Engine(tiny.model, EngineConfig(attn_backend="flashmla")).attn_kernel == "flashmla (unavailable)"
    # the engine's kernels: resolved from its config when made (and when the config is replaced)
    with use_kernels(gemm="blas", attention="cpu"):
        engine = Engine(tiny.model, EngineConfig(attn_backend="torch"))
    assert engine.kernels == KernelConfig(attention="torch", gemm="blas") and engine.attn_kernel == "torch"
    engine.config = EngineConfig(attn_backend="auto")
    assert engine.kernels == KernelConfig(gemm="blas") and engine.attn_kernel == "cpu"
    monkeypatch.setitem(build_mod._state, cpu_mod.isa(), "RuntimeError: no C++ compiler")
    assert tiny.attn_kernel == "torch"
    assert ATTN_BACKENDS == _BACKENDS
    with pytest.raises(ValueError, match="attn_backend"):
        EngineConfig(attn_backend="bogus")


def test_stats_add_sums_and_keeps_peaks():
    a = StepStats(num_tokens=3, num_steps=1, num_chunks=6, workspace_elements=10, model_calls=1,
                  planner_s=0.5, forward_s=1.0, peak_workspace_bytes=100)
    b = StepStats(num_tokens=4, num_steps=2, num_chunks=1, workspace_elements=5, model_calls=1,
                  planner_s=0.25, forward_s=0.5, peak_workspace_bytes=70)
    assert a + b == StepStats(num_tokens=7, num_steps=3, num_chunks=7, workspace_elements=15, model_calls=2,
                              planner_s=0.75, forward_s=1.5, peak_workspace_bytes=100)
    assert StepStats.from_dict({**a.to_dict(), "rows": 9}) == a


def test_model_package_import_is_torch_free(run_python):
    code = ("import sys, dsv4batch.model as m; m.EngineConfig(planner='dp'); m.StepStats(); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    run_python(code, check=True)
