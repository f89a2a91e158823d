"""`--tp T` replicas on one local Ray (gloo on CPU): T rank workers in a placement group score
what one unsplit engine scores, hold 1/T of the split weights, and survive a killed rank."""

import os
import signal

import numpy as np
import pytest

from dsv4batch.actors.shards import ShardedEngine, release_groups
from dsv4batch.jobspec.config import ScoreConfig
from dsv4batch.jobspec.errors import ReplicaLost
from dsv4batch.model import Engine, EngineConfig
from dsv4batch.model.loader import meta_model
from dsv4batch.model.model import model_tensors
from dsv4batch.model.parallel import split_of
from tests.model_factory import make_hf_checkpoint
from tests.ties import assert_greedy_match, assert_top_ids_match

PLANNERS = ("adaptive", "fixed", "dp", "single")
# logprobs: fp32 rounding of the split sums (wo_b, MoE) and of the vocab combination; 1e-6
# relative leaves room for another CPU's BLAS rounding (~8 ulps of a logprob near -12)
ATOL, RTOL = 1e-5, 1e-6
# split 2 and 4 ways, a rank's vocabulary is a whole head tile (VOCAB_TILE 2048) and a part; the
# ranks never see text, so the real tokenizer's 129280 (a head 10x the cost) is not needed
VOCAB = 12_000


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The transformers-saved checkpoint (HF names) and the same weights with native names,
    4 heads in 4 output groups so that T = 2 and 4 both split it."""
    from dsv4batch.model.loader import load_model, save_checkpoint

    hf = str(tmp_path_factory.mktemp("hf"))
    make_hf_checkpoint(hf, seed=5, vocab_size=VOCAB, o_groups=4)
    native = str(tmp_path_factory.mktemp("native"))
    save_checkpoint(load_model(hf), native)
    return {"hf": hf, "native": native}


@pytest.fixture(scope="module")
def references(checkpoints):
    """The unsplit engine over each checkpoint, loaded once (each test step gets its own
    `EngineConfig` over the same model)."""
    return {kind: Engine.from_pretrained(path) for kind, path in checkpoints.items()}


def requests(seed=0):
    rng = np.random.default_rng(seed)  # short and long (pruned by the indexer, several steps)
    return [rng.integers(0, VOCAB, n).tolist() for n in (2, 9, 40, 130, 300, 1)]


def sharded(path, tp, **kw):
    config = ScoreConfig(model=path, tp=tp, batch_timeout_s=300, collective_timeout_s=60,
                         max_batched_tokens=128, **kw)
    return ShardedEngine(config, num_gpus=0.0, num_cpus=0.25)


def check_equal(ref, got):
    """The split's scores are the unsplit engine's to fp32 rounding; ids and greedy flags are
    exact except inside near-ties, which that rounding may reorder (`ref` lists one top id more
    than `got`: whether the last one has a near-tie below it)."""
    for a, b in zip(ref, got, strict=True):
        k = b.top_ids.shape[1]
        np.testing.assert_allclose(b.logprobs, a.logprobs, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(b.top_logprobs, a.top_logprobs[:, :k], rtol=RTOL, atol=ATOL)
        assert_top_ids_match(a.top_ids, a.top_logprobs, b.top_ids, b.top_logprobs, ATOL, RTOL)
        assert_greedy_match(a.is_greedy, b.is_greedy, a.logprobs, a.top_logprobs, ATOL, RTOL)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_ranks_score_like_one_engine(local_ray, checkpoints, references, tp):
    batch = requests(tp)
    for kind, path in checkpoints.items():
        engine = sharded(path, tp)
        try:
            assert len(engine.ranks) == tp and len({r["pid"] for r in engine.ranks}) == tp
            # every rank holds the replicated tensors plus exactly 1/T of the split ones
            whole = model_tensors(meta_model(engine.model_config))
            split = sum(t.numel() * t.element_size() for n, t in whole.items() if split_of(n))
            replicated = sum(t.numel() * t.element_size() for n, t in whole.items() if not split_of(n))
            assert {r["resident_bytes"] for r in engine.ranks} == {replicated + split // tp}
            for planner in PLANNERS if kind == "hf" else ("adaptive",):
                config = EngineConfig(max_num_batched_tokens=128, planner=planner)
                ref = Engine(references[kind].model, config)
                engine.configure(config)
                got, stats = engine.score_details(batch, top_k=3)
                want, ref_stats = ref.score_details(batch, top_k=4)
                check_equal(want, got)
                assert stats.num_steps == ref_stats.num_steps > 1  # multi-step requests
                assert stats.num_chunks == ref_stats.num_chunks  # the same plan on every rank
                assert stats.collective_s > 0
            with pytest.raises(ValueError, match="outside the vocabulary"):
                engine.score_details([[1, 2, VOCAB]])
        finally:
            engine.close()


def test_a_killed_rank_fails_the_batch_then_the_replica_recovers(local_ray, checkpoints):
    engine = sharded(checkpoints["hf"], 2)
    try:
        want, _ = engine.score_details(requests(), top_k=0)
        os.kill(engine.ranks[1]["pid"], signal.SIGKILL)
        with pytest.raises(ReplicaLost, match="ranks were restarted"):
            engine.score_details(requests(), top_k=0)
        assert engine.restarts == 1
        got, _ = engine.score_details(requests(), top_k=0)
        for a, b in zip(want, got):
            np.testing.assert_array_equal(a.logprobs, b.logprobs)  # same ranks, same bits
    finally:
        engine.close()


def test_a_stopped_rank_times_out_instead_of_hanging(local_ray, checkpoints):
    engine = sharded(checkpoints["native"], 2)
    engine.config = engine.config.replace(batch_timeout_s=20)
    try:
        pid = engine.ranks[0]["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(ReplicaLost, match="did not answer within 18 s"):
                engine.score_details(requests(), top_k=0)
            # recovering is not what is timed: starting ranks on a loaded 2-core machine can
            # take longer than the 20 s that made the stopped rank fail fast
            engine.config = engine.config.replace(batch_timeout_s=300)
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:  # killed by the restart
                pass
        got, _ = engine.score_details(requests()[:2], top_k=0)
        assert len(got) == 2
    finally:
        engine.close()
    assert release_groups() == 0  # direct use: `close` removed its own group
