"""The DSv4 chat encoding against strings written out by hand from DeepSeek's published rules,
and its token ids against the packaged tokenizer's special tokens."""

import pytest

from dsv4batch.model.chat import ChatError, render, split_last
from dsv4batch.model.tokenizer import load_tokenizer, packaged_tokenizer_path

B, E, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"


def test_one_user_turn_in_chat_and_thinking_mode():
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    assert render(msgs) == B + U + "What is 2 + 2?" + A + "</think>"
    assert render(msgs, thinking=True) == B + U + "What is 2 + 2?" + A + "<think>"


def test_a_system_message_goes_in_as_it_is():
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
    assert render(msgs) == B + "You are terse." + U + "Hi" + A + "</think>"


def test_three_turns_drop_earlier_reasoning_and_keep_the_last_in_thinking_mode():
    msgs = [{"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "A2", "reasoning_content": "R2"}]
    assert render(msgs, thinking=True, add_generation_prompt=False) == (
        B + U + "Q1" + A + "</think>" + "A1" + E + U + "Q2" + A + "<think>" + "R2</think>A2" + E)
    assert render(msgs, add_generation_prompt=False) == (  # chat mode never shows reasoning
        B + U + "Q1" + A + "</think>A1" + E + U + "Q2" + A + "</think>A2" + E)
    assert render(msgs[:3], thinking=True) == B + U + "Q1" + A + "</think>A1" + E + U + "Q2" + A + "<think>"
    prompt, reply = split_last(msgs, thinking=True)
    assert (prompt, reply) == (B + U + "Q1" + A + "</think>A1" + E + U + "Q2" + A + "<think>", "R2</think>A2" + E)
    assert split_last(msgs) == (B + U + "Q1" + A + "</think>A1" + E + U + "Q2" + A + "</think>", "A2" + E)


def test_tool_results_go_into_the_user_turn():
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Let me check."},
            {"role": "tool", "content": "18 C, sunny"},
            {"role": "tool", "content": "wind 5 km/h"},
            {"role": "user", "content": "Summarise."}]
    assert render(msgs) == (B + U + "Weather in Paris?" + A + "</think>Let me check." + E + U
                            + "<tool_result>18 C, sunny</tool_result>\n\n<tool_result>wind 5 km/h</tool_result>"
                            "\n\nSummarise." + A + "</think>")


def test_token_ids_of_the_special_tokens():
    tok = load_tokenizer(packaged_tokenizer_path())
    ids = tok.encode(render([{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}], thinking=True),
                     add_special_tokens=False).ids
    assert ids[0] == 0 and ids[-2:] == [128804, 128821]  # bos ... <｜Assistant｜> <think>
    assert 128803 in ids  # <｜User｜>
    ids = tok.encode(render([{"role": "user", "content": "hi"}]), add_special_tokens=False).ids
    assert ids[-1] == 128822 and tok.encode(E, add_special_tokens=False).ids == [1]


@pytest.mark.parametrize("messages, match", [
    ("not json", "not JSON"),
    ({"role": "user"}, "non-empty list"),
    ([], "non-empty list"),
    ([{"role": "wizard", "content": "x"}], "role 'wizard'"),
    ([{"role": "user"}], "no content"),
    ([{"role": "system", "content": "x"}], "no user message"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}], "only text content"),
    ([{"role": "user", "content": "q", "tools": [{"type": "function"}]}], "tool definitions"),
])
def test_malformed_conversations_name_the_problem(messages, match):
    with pytest.raises(ChatError, match=match):
        render(messages)


def test_split_last_needs_an_assistant_reply():
    with pytest.raises(ChatError, match="last message must be the assistant"):
        split_last([{"role": "user", "content": "q"}])
