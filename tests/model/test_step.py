"""StepContext on hand-made segments, carried state across steps, and Engine.schedule."""

import numpy as np
import pytest
import torch

from dsv4batch.model import Engine, EngineConfig, StepStats
from dsv4batch.model.attention import WorkspacePool
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
    assert ctx.continuing == [0]  # a feeds up to position 10 (11 is only a target); b is done
    assert sorted(ctx.layouts) == [1, 4]
    assert ctx.rope_for(1) is ctx.cos_sin["main"] and ctx.rope_for(4) is ctx.cos_sin["compress"]
    assert (stats.num_steps, stats.num_tokens, stats.num_chunks) == (1, 7, 0) and stats.planner_s > 0
    ctx.count_chunk(torch.zeros(2, 3, 4))
    ctx.count_chunk(torch.zeros(1, 5, 4))
    assert (stats.num_chunks, stats.workspace_elements) == (2, 24 + 20)
    assert context([(b, 0, 4)], stats).cache_in(0) == {}  # no segment continues an earlier step


def test_cache_in_concatenates_in_segment_order():
    a, b, c = (RequestState(np.arange(20)) for _ in range(3))
    a.layers[2] = {"window": torch.full((3, 2), 1.0), "comp": (torch.full((1, 4), 1.0), torch.full((1, 4), -1.0))}
    c.layers[2] = {"window": torch.full((2, 2), 3.0), "comp": (torch.full((2, 4), 3.0), torch.full((2, 4), -3.0))}
    ctx = context([(a, 5, 6), (b, 0, 3), (c, 4, 7)], StepStats())  # b is fresh: nothing carried
    got = ctx.cache_in(2)
    assert sorted(got) == ["comp", "window"]
    assert got["window"][:, 0].tolist() == [1, 1, 1, 3, 3]
    assert got["comp"][0][:, 0].tolist() == [1, 3, 3] and got["comp"][1][:, 0].tolist() == [-1, -3, -3]


def test_carry_store_then_cache_in_next_step(two):
    a, b = two
    stats = StepStats()
    ctx = context([(a, 6, 9), (b, 0, 4)], stats)
    lay = ctx.layouts[4]
    # compressor source rows: 6 carried (a's previous window pos 0..3 + pending 4, 5), 7 step rows, pad
    src = (torch.arange(14.0).unsqueeze(1), -torch.arange(14.0).unsqueeze(1))
    # table of this layout: [a's old entry | a's new entry | b's new entry | a's window 3..5 | step | zero]
    table = torch.arange(14.0).unsqueeze(1)
    cache_out = {}
    ctx.carry(cache_out, "comp", src, lay.comp)
    ctx.carry_entries(cache_out, table, lay, idx_table=10 * table)
    assert list(cache_out) == [0]  # only a continues
    kept = cache_out[0]
    assert kept["comp"][0][:, 0].tolist() == [4, 5, 6, 7, 8]  # last full window (pos 4..7) + pos 8
    assert kept["comp"][1][:, 0].tolist() == [-4, -5, -6, -7, -8]
    assert kept["window"][:, 0].tolist() == [6, 7, 8]  # a's last W - 1 positions (step rows)
    assert kept["entries"][:, 0].tolist() == [0, 1] and kept["idx_entries"][:, 0].tolist() == [0, 10]
    ctx.store(3, cache_out)
    assert a.layers[3] is kept and b.layers == {}

    nxt = context([(a, 9, 11)], stats)
    got = nxt.cache_in(3)
    assert sorted(got) == ["comp", "entries", "idx_entries", "window"]
    for key in ("window", "entries", "idx_entries"):
        assert torch.equal(got[key], kept[key])
    assert all(torch.equal(x, y) for x, y in zip(got["comp"], kept["comp"]))
    # the next step's layout expects exactly the rows carried
    lay = nxt.layouts[4]
    assert lay.comp.num_carried == 5 and int(lay.prior.sum()) == 3 and int(lay.old.sum()) == 2
    assert nxt.continuing == [] and (stats.num_steps, stats.num_tokens) == (2, 9)


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
