"""OpenAI batch request lines parsed (`pipeline/openai_batch.py`): prompts, parameters, and every
refusal named; the response lines' shapes against the `openai` package's own types."""

import io
import json

import pytest

from dsv4batch.model.chat import BOS, render
from dsv4batch.pipeline.openai_batch import RequestError, parse, response_line, tables

CHAT = {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 7, "stop": "\n",
                 "temperature": 0.5, "seed": 3, "logprobs": True, "top_logprobs": 2}}
TEXT = {"custom_id": "t1", "method": "POST", "url": "/v1/completions",
        "body": {"prompt": "Once upon", "max_tokens": 5, "logprobs": 1, "stop": ["x", "y"]}}


def test_chat_and_completion_requests():
    prompt, params, meta = parse(json.dumps(CHAT))
    assert prompt == render(CHAT["body"]["messages"]).removeprefix(BOS)
    assert params == {"temperature": 0.5, "seed": 3, "max_tokens": 7, "stop": ["\n"]}
    assert meta == {"custom_id": "c1", "model": "m", "kind": "chat", "logprobs": True, "top_logprobs": 2}
    prompt, params, meta = parse(json.dumps(TEXT))
    assert (prompt, params["stop"], meta["kind"], meta["top_logprobs"]) == ("Once upon", ["x", "y"], "text", 1)
    chat = {**CHAT, "body": {**CHAT["body"], "max_completion_tokens": 9}}
    assert parse(json.dumps(chat))[1]["max_tokens"] == 9  # the newer name wins


@pytest.mark.parametrize("change, match", [
    ({"url": "/v1/embeddings"}, "url '/v1/embeddings' is not supported"),
    ({"method": "GET"}, "method must be POST"),
    ({"body": {"messages": [{"role": "user", "content": "x"}], "n": 2}}, "n must be 1"),
    ({"body": {"messages": [{"role": "user", "content": "x"}], "tools": []}}, r"unsupported field\(s\) \['tools'\]"),
    ({"body": {"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 0.5}}, "frequency_penalty"),
    ({"body": {"messages": [{"role": "system", "content": "x"}]}}, "messages: the conversation has no user"),
    ({"body": {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 30}},
     r"top_logprobs must be an integer in \[0, 20\]"),
    ({"url": "/v1/completions", "body": {"prompt": [1, 2, 3]}}, "prompt must be one string"),
    ({"url": "/v1/completions", "body": {"prompt": "x", "echo": True}}, "echo"),
    ({"body": "nope"}, "body must be an object"),
])
def test_refusals_name_the_problem(change, match):
    with pytest.raises(RequestError, match=match):
        parse(json.dumps({**CHAT, **change}))
    with pytest.raises(RequestError, match="not JSON"):
        parse("{bad json")


def test_lines_become_rows_with_ids():
    data = b'\n'.join([json.dumps(CHAT).encode(), b"", b"{not json", json.dumps({**TEXT, "custom_id": None}).encode()])
    table = next(tables(io.BytesIO(data + b"\n"), "f.jsonl"))
    assert table.column("custom_id").to_pylist() == ["c1", "line-3", "line-4"]
    assert table.column("line").to_pylist() == [1, 3, 4]


class Tokens:
    def entry(self, token_id, logprob):
        return {"token": f"t{token_id}", "logprob": float(logprob), "bytes": list(f"t{token_id}".encode())}

    def text(self, token_id):
        return f"t{token_id}"


def row(meta, status=200, error=None):
    return {"id": meta.get("custom_id") or "line-1", "line": 1, "openai_meta": json.dumps(meta),
            "openai_status": status, "generated_text": "ab", "generated_token_ids": [5, 6],
            "generated_logprobs": [-0.5, -1.5], "top_ids": [[5, 7], [6, 8]], "top_logprobs": [[-0.5, -2], [-1.5, -3]],
            "num_prompt_tokens": 4, "num_generated_tokens": 2, "finish_reason": "eos", "error": error}


def test_response_lines_validate_with_the_openai_types():
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    line = response_line(row(parse(json.dumps(CHAT))[2]), Tokens(), "tiny", 1)
    body = ChatCompletion.model_validate(line["response"]["body"])
    assert line["custom_id"] == "c1" and body.choices[0].message.content == "ab"
    assert body.choices[0].finish_reason == "stop" and body.usage.total_tokens == 6
    assert [t.token for t in body.choices[0].logprobs.content[1].top_logprobs] == ["t6", "t8"]
    line = response_line(row(parse(json.dumps(TEXT))[2]), Tokens(), "tiny", 1)
    body = Completion.model_validate(line["response"]["body"])
    assert body.choices[0].text == "ab" and body.choices[0].logprobs.top_logprobs == [{"t5": -0.5}, {"t6": -1.5}]
    bad = response_line(row({"custom_id": None}, 400, "request: n must be 1"), Tokens(), "tiny", 1)
    assert bad["custom_id"] is None and bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"]["message"] == "request: n must be 1"
