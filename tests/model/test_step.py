"""StepContext on hand-made segments, carried state across steps, and Engine.schedule."""

import numpy as np
import pytest
import torch

from dsv4batch.model import Engine, EngineConfig, StepStats
from dsv4batch.model.attention import WorkspacePool
from dsv4batch.model.cache import CachePool, CacheSpec
from dsv4batch.model.layers import Rope
from dsv4batch.model.step import RequestState, StepContext

W = 4
ROPES = {name: Rope(torch.tensor([1.0, 0.25]), 1.0) for name in ("main", "compress")}
CONFIG = EngineConfig(max_num_batched_tokens=16, max_model_len=64, prefill_chunk_size=2)


def context(segs, stats):
    return StepContext(segs, ratios=[1, 4], window=W, config=CONFIG, ropes=ROPES, pool=WorkspacePool(),
                       stats=stats, device="cpu")


@pytest.fixture()
def two():
    """Request a (12 ids, positions 6..8 this step, more after) and b (5 ids, all of 0..3 now)."""
    a, b = RequestState(np.arange(100, 112)), RequestState(np.arange(200, 205))
    return a, b


def test_step_tensors_and_stats(two):
    a, b = two
    stats = StepStats()
    ctx = context([(a, 6, 9), (b, 0, 4)], stats)
    assert ctx.cu.tolist() == [0, 3, 7]
    assert ctx.positions.tolist() == [6, 7, 8, 0, 1, 2, 3] and ctx.positions.dtype == torch.int64
    assert ctx.input_ids.tolist() == [106, 107, 108, 200, 201, 202, 203]
    assert ctx.continuing == []  # no request holds a cache
    assert sorted(ctx.layouts) == [1, 4]
    assert ctx.rope_for(1) is ctx.cos_sin["main"] and ctx.rope_for(4) is ctx.cos_sin["compress"]
    assert (stats.num_steps, stats.num_tokens, stats.num_chunks) == (1, 7, 0) and stats.planner_s > 0
    ctx.count_chunk(torch.zeros(2, 3, 4))
    ctx.count_chunk(torch.zeros(1, 5, 4))
    assert (stats.num_chunks, stats.workspace_elements) == (2, 24 + 20)


def small_pool(num_slots=2, num_blocks=8):
    """A pool for layers of ratio 1 and 4 (window 4, width 1: a row's value names it)."""
    return CachePool(CacheSpec(ratios=(1, 4), window=W, head_dim=1, idx_dim=1, dtype_bytes=4), num_slots,
                     num_blocks, torch.float32, "cpu")


def test_prefill_writes_what_the_next_step_reads(two):
    a, b = two
    cache = small_pool()
    a.cache = cache.allocate(len(a.ids))
    stats = StepStats()
    ctx = StepContext([(a, 0, 9), (b, 0, 4)], ratios=[1, 4], window=W, config=CONFIG, ropes=ROPES,
                      pool=WorkspacePool(), stats=stats, device="cpu", cache=cache)
    assert ctx.continuing == [0]  # a feeds up to position 10 (11 is only a target); b is done
    lay = ctx.layouts[4]
    # table of this layout: [a's 2 entries | b's entry | step rows (9 + 4) | zero]; src rows: 13 + pad
    table = torch.arange(17.0).unsqueeze(1)
    src = (torch.arange(14.0).unsqueeze(1).repeat(1, 2), -torch.arange(14.0).unsqueeze(1).repeat(1, 2))
    for layer, r in ((0, 1), (1, 4)):
        ctx.prefill_io[r].write(cache, layer, table, 10 * table, src, src)
    assert ctx.prefill_io[4].read(cache, 1) == {}  # nothing was carried into this step
    nxt = StepContext([(a, 9, 11)], ratios=[1, 4], window=W, config=CONFIG, ropes=ROPES, pool=WorkspacePool(),
                      stats=stats, device="cpu", cache=cache)
    got = nxt.prefill_io[4].read(cache, 1)
    assert sorted(got) == ["comp", "entries", "idx", "idx_entries", "window"]
    assert got["window"][:, 0].tolist() == [3 + 6, 3 + 7, 3 + 8]  # a's last W - 1 positions (step rows)
    assert got["entries"][:, 0].tolist() == [0, 1] and got["idx_entries"][:, 0].tolist() == [0, 10]
    assert got["comp"][0][:, 0].tolist() == [4, 5, 6, 7, 8]  # last full window (pos 4..7) + pos 8
    assert got["idx"][1][:, 0].tolist() == [-4, -5, -6, -7, -8]
    assert nxt.prefill_io[1].read(cache, 0)["window"][:, 0].tolist() == [6, 7, 8]  # no entries before them
    # the next step's layout expects exactly the rows carried
    lay = nxt.layouts[4]
    assert lay.comp.num_carried == 5 and int(lay.prior.sum()) == 3 and int(lay.old.sum()) == 2
    assert nxt.continuing == [] and (stats.num_steps, stats.num_tokens) == (2, 15)


def test_schedule_splits_long_requests_continuing_first():
    engine = Engine(model=None, config=EngineConfig(max_num_batched_tokens=4))  # schedule needs no model
    states = [RequestState(np.zeros(n, np.int64)) for n in (7, 2, 1, 4)]  # feeds 6, 1, 0, 3 positions
    index = {id(st): i for i, st in enumerate(states)}
    steps = [[(index[id(st)], s, e) for st, s, e in segs] for segs in engine.schedule(states)]
    assert steps == [[(0, 0, 4)],
                     [(0, 4, 6), (1, 0, 1), (3, 0, 1)],  # 0 continues first, 3 starts in the spare token
                     [(3, 1, 3)]]
    assert [st.done for st in states] == [6, 1, 0, 3]
    assert list(engine.schedule([RequestState(np.zeros(1, np.int64))])) == []  # bos only: nothing to feed
