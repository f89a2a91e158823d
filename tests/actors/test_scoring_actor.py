"""ScoringActor called in-process (no Ray): scores, target-only scoring, error isolation, stats."""

import numpy as np
import pyarrow as pa
import pytest

from dsv4batch.actors.scoring import ScoringActor
from dsv4batch.pipeline import schema as S
from dsv4batch.pipeline.config import ScoreConfig
from dsv4batch.pipeline.tokenize import Tokenize

TEXTS = ["The quick brown fox jumps over the lazy dog.", "", None, "Ray Data streams blocks.",
         "A slightly longer sentence, so that two requests differ in length by a few tokens."]


class FakeStats:
    """Stands in for the StatsCollector actor handle (`.method.remote(...)`)."""

    def __init__(self):
        self.calls = []
        for name in ("register_actor", "record_batch", "record_tokenize"):
            setattr(self, name, type("M", (), {"remote": lambda s, *a, n=name: self.calls.append((n, a))})())


@pytest.fixture(scope="module")
def model(checkpoint):
    from dsv4batch.model import DSv4Model

    return DSv4Model.from_pretrained(checkpoint)


def run(cfg, table, stats=None):
    return ScoringActor(cfg, stats=stats)(Tokenize(cfg)(table))


def test_scores_match_model_and_keep_row_order(checkpoint, model):
    cfg = ScoreConfig(model=checkpoint, token_logprobs=True, keep_columns=("n",))
    table = pa.table({"id": [10, 11, 12, 13, 14], "prompt": TEXTS, "n": [1, 2, 3, 4, 5]})
    stats = FakeStats()
    out = run(cfg, table, stats)
    assert out.schema.equals(S.output_schema(pa.int64(), True, [table.schema.field("n")]))
    rows = out.to_pylist()
    assert [r["id"] for r in rows] == [10, 11, 12, 13, 14] and [r["n"] for r in rows] == [1, 2, 3, 4, 5]
    for r, text in zip(rows, TEXTS):
        if text is None:
            assert r["error"] == "null text" and r["logprob_sum"] is None and r["num_tokens"] == 0
            continue
        ids = [0, *model.tokenizer.encode(text, add_special_tokens=False).ids]
        ref = model.score_tokens([ids])[0]
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
    assert kinds == ["register_actor", "record_batch"]
    batch_stats = stats.calls[1][1][1]
    assert batch_stats["rows"] == 5 and batch_stats["rows_scored"] == 4 and batch_stats["rows_errored"] == 1
    assert batch_stats["scored_tokens"] == sum(r["num_scored_tokens"] for r in rows)
    assert batch_stats["num_steps"] >= 1 and batch_stats["forward_s"] > 0


def test_target_column_scores_only_target_tokens(checkpoint, model):
    cfg = ScoreConfig(model=checkpoint, target_column="answer", token_logprobs=True)
    table = pa.table({"id": ["a", "b"], "prompt": ["The capital of France is", ""],
                      "answer": [" Paris.", " Hello there"]})
    rows = run(cfg, table).to_pylist()
    for r, p, t in zip(rows, table["prompt"].to_pylist(), table["answer"].to_pylist()):
        pi = model.tokenizer.encode(p, add_special_tokens=False).ids
        ti = model.tokenizer.encode(t, add_special_tokens=False).ids
        ref = model.score_tokens([[0, *pi, *ti]])[0][-len(ti):]
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
