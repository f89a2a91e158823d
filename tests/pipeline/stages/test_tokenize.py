"""The tokenize stage called directly: rows in order, targets, truncation, bytes and invalid UTF-8."""

import pyarrow as pa
import pytest

from dsv4batch.jobspec import schema as S
from dsv4batch.jobspec.config import ScoreConfig
from dsv4batch.model.tokenizer import load_tokenizer
from dsv4batch.pipeline.stages.tokenize import Tokenize


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)



def enc(tok, text):
    return tok.encode(text, add_special_tokens=False).ids



def test_tokenize_prompt_rows_in_order_with_errors(tok):
    cfg = ScoreConfig(max_model_len=12, keep_columns=("src",))
    long = "one two three four five six seven eight nine ten eleven twelve"
    batch = pa.table({"id": [5, 6, 7, 8], "prompt": ["Hello world", None, "", long],
                      "src": list("abcd"), "unused": [1, 2, 3, 4]})
    out = Tokenize(cfg)(batch)
    assert out.column_names == ["id", "src", S.INPUT_IDS, S.NUM_SCORED, S.NUM_TRUNCATED, S.ERROR]
    rows = out.to_pylist()
    assert [r["id"] for r in rows] == [5, 6, 7, 8] and [r["src"] for r in rows] == list("abcd")
    assert rows[0][S.INPUT_IDS] == [0, *enc(tok, "Hello world")]
    assert rows[0][S.NUM_SCORED] == len(enc(tok, "Hello world")) and rows[0]["error"] is None
    assert rows[1]["error"] == "null text" and rows[1][S.INPUT_IDS] == []
    assert rows[2] == {"id": 7, "src": "c", S.INPUT_IDS: [0], S.NUM_SCORED: 0,
                       S.NUM_TRUNCATED: 0, "error": None}
    assert rows[3]["error"].startswith("too long:") and rows[3][S.INPUT_IDS] == []



def test_tokenize_target_scores_only_target_and_renames_id(tok):
    cfg = ScoreConfig(target_column="answer", id_column="key")
    batch = pa.table({"key": ["a", "b"], "prompt": ["The capital of France is", "x"],
                      "answer": [" Paris", None]})
    rows = Tokenize(cfg)(batch).to_pylist()
    p, t = enc(tok, "The capital of France is"), enc(tok, " Paris")
    assert rows[0]["id"] == "a" and rows[0][S.INPUT_IDS] == [0, *p, *t]
    assert rows[0][S.NUM_SCORED] == len(t)
    assert rows[1]["error"] == "null target"



@pytest.mark.parametrize("side, ids, scored, truncated", [
    ("left", lambda p, t: [0, *(p + t)[-7:]], 3, 2),  # keeps the end: the whole target
    ("right", lambda p, t: [0, *(p + t)[:7]], 1, 2),  # keeps the start: the target's first token
])
def test_tokenize_truncate_with_target(tok, side, ids, scored, truncated):
    p, t = enc(tok, "one two three four five six"), enc(tok, " seven eight nine")
    assert (len(p), len(t)) == (6, 3)
    cfg = ScoreConfig(target_column="answer", max_model_len=8, truncate=side)
    batch = pa.table({"id": [1, 2], "prompt": ["one two three four five six", "one " * 20],
                      "answer": [" seven eight nine", " x"]})
    rows = Tokenize(cfg)(batch).to_pylist()
    assert rows[0][S.INPUT_IDS] == ids(p, t) and rows[0]["error"] is None
    assert rows[0][S.NUM_SCORED] == scored and rows[0][S.NUM_TRUNCATED] == truncated
    if side == "right":  # the prompt alone fills max_model_len: no target token would be scored
        assert rows[1]["error"].endswith("truncating right leaves no target token")
    else:
        assert rows[1][S.NUM_SCORED] == len(enc(tok, " x")) and rows[1]["error"] is None



def test_tokenize_binary_and_invalid_utf8_text(tok):
    raw = [b"caf\xe9 ok", None, b"\x00\x1b[1m bold", b"plain"]
    cfg = ScoreConfig()
    for col in (pa.array(raw, pa.binary()), pa.array(raw, pa.binary()).view(pa.string())):
        rows = Tokenize(cfg)(pa.table({"id": [1, 2, 3, 4], "prompt": col})).to_pylist()
        assert rows[0][S.INPUT_IDS] == [0, *enc(tok, "caf\ufffd ok")]  # U+FFFD for bad bytes
        assert rows[1]["error"] == "null text"
        assert rows[2][S.INPUT_IDS] == [0, *enc(tok, "\x00\x1b[1m bold")]
        assert rows[3][S.INPUT_IDS] == [0, *enc(tok, "plain")]


def test_conversations_render_with_the_chat_encoding(tok):
    from dsv4batch.jobspec.config import GenerateConfig
    from dsv4batch.model.chat import render, split_last

    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    batch = pa.table({"id": [1, 2, 3], "conv": [chat, chat[:1], [{"role": "bot", "content": "x"}]]})
    gen = Tokenize(GenerateConfig(messages_column="conv", thinking=True))(batch).to_pylist()
    assert gen[1][S.INPUT_IDS] == enc(tok, render(chat[:1], thinking=True)) and gen[1]["error"] is None
    assert gen[2]["error"].startswith("messages: message 0 has role 'bot'")
    score = Tokenize(ScoreConfig(messages_column="conv"))(batch).to_pylist()
    prompt, reply = split_last(chat)
    assert score[0][S.INPUT_IDS] == enc(tok, prompt) + enc(tok, reply)  # bos first, once
    assert score[0][S.NUM_SCORED] == len(enc(tok, reply)) and score[0][S.INPUT_IDS][0] == 0
    assert score[1]["error"].startswith("messages: the last message must be the assistant")
    as_json = pa.table({"id": [1], "conv": ['[{"role": "user", "content": "Hi"}]']})
    assert Tokenize(GenerateConfig(messages_column="conv"))(as_json).to_pylist()[0][S.INPUT_IDS] == \
        enc(tok, render(chat[:1]))
