"""ScoringActor called in-process (no Ray): scores, target-only scoring, error isolation, stats,
and the batch ledger (attempts, isolation, the failed-row limit) with the real StatsCollector."""

import dataclasses

import numpy as np
import pyarrow as pa
import pytest
import torch

from dsv4batch.actors.guard import batch_key
from dsv4batch.actors.score import ScoringActor
from dsv4batch.jobspec import schema as S
from dsv4batch.jobspec.config import ScoreConfig
from dsv4batch.jobspec.errors import BatchError, TooManyErrors
from dsv4batch.pipeline.metrics import StatsCollector
from dsv4batch.pipeline.stages.tokenize import Tokenize
from tests.ties import ambiguous_greedy, assert_top_ids_match

TEXTS = ["The quick brown fox jumps over the lazy dog.", "", None, "Ray Data streams blocks.",
         "A slightly longer sentence, so that two requests differ in length by a few tokens."]


class LocalCollector:
    """The real `StatsCollector`, called in-process through the actor-handle protocol
    (`handle.method.remote(*args)` returns the result here), recording each call."""

    def __init__(self, max_failed_rows=None):
        self.collector, self.calls = StatsCollector(max_failed_rows), []

    def __getattr__(self, name):
        method, calls = getattr(self.collector, name), self.calls

        class Method:
            @staticmethod
            def remote(*args):
                calls.append((name, args))
                return method(*args)
        return Method


def run(cfg, table, stats=None):
    return ScoringActor(cfg, stats=stats)(Tokenize(cfg)(table))


def test_scores_match_model_and_keep_row_order(checkpoint, engine):
    cfg = ScoreConfig(model=checkpoint, token_logprobs=True, keep_columns=("n",))
    table = pa.table({"id": [10, 11, 12, 13, 14], "prompt": TEXTS, "n": [1, 2, 3, 4, 5]})
    stats = LocalCollector()
    out = run(cfg, table, stats)
    assert out.schema.equals(S.output_schema(pa.int64(), True, [table.schema.field("n")]))
    rows = out.to_pylist()
    assert [r["id"] for r in rows] == [10, 11, 12, 13, 14] and [r["n"] for r in rows] == [1, 2, 3, 4, 5]
    for r, text in zip(rows, TEXTS):
        if text is None:
            assert r["error"] == "null text" and r["logprob_sum"] is None and r["num_tokens"] == 0
            continue
        ids = [0, *engine.tokenizer.encode(text, add_special_tokens=False).ids]
        ref = engine.score_tokens([ids])[0]
        assert r["error"] is None and r["num_tokens"] == len(ids)
        assert r["num_scored_tokens"] == len(ids) - 1
        assert abs(r["logprob_sum"] - float(ref.sum())) <= 1e-4 * max(1, len(ref))
        np.testing.assert_allclose(r["token_logprobs"], ref, atol=1e-4)
        if text:
            assert r["logprob_mean"] == pytest.approx(r["logprob_sum"] / len(ref))
            assert r["perplexity"] == pytest.approx(np.exp(-r["logprob_mean"]))
        else:  # empty text: scored, nothing to score
            assert r["logprob_sum"] == 0.0 and r["logprob_mean"] is None and r["perplexity"] is None
    kinds = [c[0] for c in stats.calls]
    assert kinds == ["register_actor", "begin_batch", "record_batch", "end_batch"]
    batch_stats = stats.calls[2][1][1]
    assert (batch_stats.rows, batch_stats.rows_scored, batch_stats.rows_errored) == (5, 4, 1)
    assert batch_stats.scored_tokens == sum(r["num_scored_tokens"] for r in rows)
    assert batch_stats.num_steps >= 1 and batch_stats.forward_s > 0


def test_target_column_scores_only_target_tokens(checkpoint, engine):
    cfg = ScoreConfig(model=checkpoint, target_column="answer", token_logprobs=True)
    table = pa.table({"id": ["a", "b"], "prompt": ["The capital of France is", ""],
                      "answer": [" Paris.", " Hello there"]})
    rows = run(cfg, table).to_pylist()
    for r, p, t in zip(rows, table["prompt"].to_pylist(), table["answer"].to_pylist()):
        pi = engine.tokenizer.encode(p, add_special_tokens=False).ids
        ti = engine.tokenizer.encode(t, add_special_tokens=False).ids
        ref = engine.score_tokens([[0, *pi, *ti]])[0][-len(ti):]
        assert r["num_scored_tokens"] == len(ti) and r["num_tokens"] == 1 + len(pi) + len(ti)
        assert abs(r["logprob_sum"] - float(ref.sum())) <= 1e-4 * len(ti)


def test_a_rejected_request_becomes_a_row_error(checkpoint):
    cfg = ScoreConfig(model=checkpoint)
    tokenized = Tokenize(cfg)(pa.table({"id": [1, 2, 3], "prompt": ["fine", "bad", "also fine"]}))
    ids = tokenized[S.INPUT_IDS].to_pylist()
    ids[1] = [0, 10**6]  # outside the vocabulary: the engine raises ValueError for the batch
    tokenized = tokenized.set_column(tokenized.schema.get_field_index(S.INPUT_IDS), S.INPUT_IDS,
                                     pa.array(ids, pa.list_(pa.int32())))
    rows = ScoringActor(cfg)(tokenized).to_pylist()
    assert [r["id"] for r in rows] == [1, 2, 3]
    assert rows[0]["error"] is None and rows[2]["error"] is None
    assert rows[1]["error"].startswith("ValueError:") and "vocab" in rows[1]["error"]
    assert rows[1]["logprob_sum"] is None


def broken_engine(actor):
    """Force the FlashMLA backend where it cannot run: every forward raises RuntimeError, as a
    GPU engine in a bad state would (a real failure of the engine, not a stand-in)."""
    actor.engine.config = dataclasses.replace(actor.engine.config, attn_backend="flashmla")


def test_a_batch_that_keeps_failing_is_retried_then_answered_with_errors(checkpoint):
    cfg = ScoreConfig(model=checkpoint, max_batch_attempts=2)
    stats = LocalCollector()
    actor = ScoringActor(cfg, stats=stats)
    broken_engine(actor)
    batch = Tokenize(cfg)(pa.table({"id": [1, 2, 3], "prompt": ["a b c", None, "d e"]}))
    for _ in (1, 2):  # what Ray Data does with a BatchError: run the batch again
        with pytest.raises(BatchError, match="flashmla backend requested but unavailable"):
            actor(batch)
    rows = actor(batch).to_pylist()  # attempt 3 > max_batch_attempts: answered, not scored
    assert [r["id"] for r in rows] == [1, 2, 3]
    assert rows[1]["error"] == "null text"  # an input error keeps its own answer
    for r in (rows[0], rows[2]):
        assert r["error"].startswith("scoring failed 2 time(s): RuntimeError: flashmla backend")
        assert r["logprob_sum"] is None and r["num_tokens"] == 0
    ledger = stats.collector.ledger_snapshot()
    assert ledger["retried_batches"] == 1 and ledger["isolated_batches"] == 1
    assert ledger["failed_rows"] == 2 and ledger["stop"] is None
    assert stats.collector.attempts == {}  # a finished batch leaves nothing in the ledger


def test_a_crashed_attempt_counts_and_is_named(checkpoint):
    cfg = ScoreConfig(model=checkpoint, max_batch_attempts=1)
    stats = LocalCollector()
    batch = Tokenize(cfg)(pa.table({"id": ["x", "y"], "prompt": ["a b c", "d e"]}))
    # an attempt whose actor process died leaves only its begin_batch in the ledger
    stats.collector.begin_batch(batch_key(["x", "y"]))
    rows = ScoringActor(cfg, stats=stats)(batch).to_pylist()
    assert all(r["error"] == "scoring failed 1 time(s): the scoring actor died (or hung past "
               "--batch-timeout-s) while scoring this batch" for r in rows)


def test_failed_rows_past_the_limit_stop_the_job(checkpoint):
    cfg = ScoreConfig(model=checkpoint)
    stats = LocalCollector(max_failed_rows=1)
    actor = ScoringActor(cfg, stats=stats)
    tokenized = Tokenize(cfg)(pa.table({"id": [1, 2, 3], "prompt": ["fine", "bad", "worse"]}))
    ids = tokenized[S.INPUT_IDS].to_pylist()
    ids[1] = ids[2] = [0, 10**6]  # outside the vocabulary: these two rows fail scoring
    tokenized = tokenized.set_column(tokenized.schema.get_field_index(S.INPUT_IDS), S.INPUT_IDS,
                                     pa.array(ids, pa.list_(pa.int32())))
    rows = actor(tokenized).to_pylist()  # answered; the limit is enforced from the next batch on
    assert rows[0]["error"] is None and "vocab" in rows[1]["error"] and "vocab" in rows[2]["error"]
    with pytest.raises(TooManyErrors, match=r"2 rows failed scoring, more than "
                       r"max_errored_rows=1 \(e.g. batch from id 1: ValueError: .*vocab"):
        actor(Tokenize(cfg)(pa.table({"id": [4], "prompt": ["next"]})))


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    """transformers' DeepseekV4ForCausalLM (fp32, eager) on the same checkpoint: the
    independent argmax and top-K."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype="float32",
                                                attn_implementation="eager").eval()


def hf_logits(model, ids):
    """log_softmax of transformers' logits [len(ids) - 1, vocab] predicting ids[1:]."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1].float()
    return torch.log_softmax(logits, -1)


def with_ids(tokenized, rows: list[list[int]], scored: list[int]):
    """`tokenized` with its requests replaced by `rows` (scoring their last `scored` ids)."""
    for name, values, kind in ((S.INPUT_IDS, rows, pa.list_(pa.int32())),
                               (S.NUM_SCORED, scored, pa.int32())):
        tokenized = tokenized.set_column(tokenized.schema.get_field_index(name), name,
                                         pa.array(values, kind))
    return tokenized


def check_row_greedy(is_greedy: bool, ref, targets, ref_top, atol: float) -> None:
    """A row's is_greedy (every scored token the argmax) against transformers' log-probs `ref`
    [n, vocab]: a position whose target is clearly (not) the argmax decides; one near-tied
    at the top may read either way."""
    target_lps = ref.gather(1, torch.tensor(targets)[:, None])[:, 0].numpy()
    flags = (ref.argmax(-1) == torch.tensor(targets)).numpy()
    unsure = ambiguous_greedy(target_lps, ref_top.numpy(), atol)
    if not flags[~unsure].all():
        assert is_greedy is False
    elif not unsure.any():
        assert is_greedy is True


def test_is_greedy_and_top_logprobs_match_transformers_argmax(checkpoint, engine, hf_model):
    k = 5
    cfg = ScoreConfig(model=checkpoint, target_column="answer", token_logprobs=True,
                      top_logprobs=k)
    prompt = [0, *engine.tokenizer.encode("The capital of France is", add_special_tokens=False).ids]
    greedy = list(prompt)
    for _ in range(3):  # three tokens transformers' model picks greedily
        greedy.append(int(hf_logits(hf_model, [*greedy, 0])[-1].argmax()))
    second = int(hf_logits(hf_model, greedy)[-1].topk(2).indices[1])
    text = [0, *engine.tokenizer.encode("Ray Data streams blocks of rows.",
                                        add_special_tokens=False).ids]
    # greedy target; its last token the runner-up; a plain text; nothing scored; a null prompt
    rows, scored = [greedy, [*greedy[:-1], second], text, [0], []], [3, 3, len(text) - 1, 0, 0]
    table = pa.table({"id": [1, 2, 3, 4, 5], "prompt": ["x"] * 4 + [None], "answer": ["y"] * 5})
    out = ScoringActor(cfg)(with_ids(Tokenize(cfg)(table), rows, scored))
    assert out.schema.equals(S.output_schema(pa.int64(), True, top_logprobs=k))
    got = out.to_pylist()
    assert got[3]["is_greedy"] is True  # nothing scored: vacuously greedy
    assert got[4]["error"] == "null text"
    assert got[4]["is_greedy"] is None and got[4]["top_ids"] is None and got[4]["top_logprobs"] is None
    # row 0 (greedy by construction) reads True and row 1 (its runner-up) False, unless a
    # near-tie with transformers' argmax leaves the order to rounding
    for r, ids, n in zip(got[:4], rows, scored):
        assert r["error"] is None and len(r["top_ids"]) == len(r["top_logprobs"]) == n
        if not n:
            continue
        ref = hf_logits(hf_model, ids)[-n:]
        targets = ids[-n:]
        ref_v, ref_i = ref.topk(k + 1)  # one more: is the K-th near-tied with the next?
        check_row_greedy(r["is_greedy"], ref, targets, ref_v, atol=1e-4)
        # the model's top-K are transformers' (exact but inside near-ties, as the paths round apart)
        assert_top_ids_match(ref_i.numpy(), ref_v.numpy(), np.array(r["top_ids"]),
                             np.array(r["top_logprobs"]), atol=1e-4)
        for t, (tid, tlp, lp) in enumerate(zip(r["top_ids"], r["top_logprobs"], r["token_logprobs"])):
            assert len(tid) == len(tlp) == k and tlp == sorted(tlp, reverse=True)
            np.testing.assert_allclose(tlp, ref_v[t, :k].numpy(), atol=1e-4)
            assert lp <= tlp[0] + 1e-5  # no token is likelier than the top one
            if targets[t] in tid:  # the target's own logprob, listed, is token_logprobs'
                assert abs(tlp[tid.index(targets[t])] - lp) <= 1e-4


def test_output_of_errored_rows_keeps_the_schema():
    from dsv4batch.actors.score import build_output

    cfg = ScoreConfig(top_logprobs=2, token_logprobs=True)
    batch = pa.table({"id": [1, 2]})
    out = build_output(batch, [0, 0], [0, 0], [None, None], ["null text", "too long"], cfg)
    assert out.schema.equals(S.output_schema(pa.int64(), True, top_logprobs=2))
    assert out["is_greedy"].to_pylist() == [None, None] == out["top_ids"].to_pylist()
