"""OpenAI batch files in and out of `dsv4batch generate` (the OpenAI Batch API / vLLM run-batch).

Input (`--input-format openai-batch`): JSONL, one request per line,
`{"custom_id", "method": "POST", "url", "body"}`, `url` `/v1/chat/completions` (`body.messages`,
rendered with the DSv4 chat encoding) or `/v1/completions` (`body.prompt`, a string). Sampling:
`max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `stop`, `seed` (and vLLM's
`top_k`, `min_p`, `ignore_eos`, `stop_token_ids`); `logprobs` / `top_logprobs` (chat: a flag
and K; completions: K). `n` > 1, tools, and any field that would change the result but is not
supported are the request's error, never ignored; `model`, `user`, `metadata`, `store` and a false
`stream` change nothing. A line is a row: its id is its `custom_id` (duplicates are refused
before the run starts, like duplicate ids), or `line-<n>` for a line without one (its output then
has a null `custom_id`); a line that cannot be parsed is a row with an error (status 400).

Output (`--output-format openai-batch`): besides the part files, `OUTPUT/output.jsonl` (written
when the run is complete, lines in input order), one line per input line:
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}`, the body a
`chat.completion` or `text_completion` (`choices[0].message.content` / `.text`, `finish_reason`,
`logprobs` when asked, `usage`) or, status 400 (a bad request) / 500 (its generation failed),
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

from dsv4batch.jobspec.schema import ID as ROW_ID
from dsv4batch.jobspec.schema import OPENAI_ID as ID
from dsv4batch.jobspec.schema import OPENAI_LINE as LINE
from dsv4batch.jobspec.schema import OPENAI_META as META
from dsv4batch.jobspec.schema import OPENAI_REQUEST as REQUEST
from dsv4batch.jobspec.schema import OPENAI_SAMPLING as SAMPLING
from dsv4batch.jobspec.schema import OPENAI_STATUS as STATUS

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
HARMLESS = {"model", "user", "metadata", "store", "stream", "service_tier"}
SAMPLING_FIELDS = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed", "top_k", "min_p",
                   "ignore_eos", "stop_token_ids", "n", "logprobs", "top_logprobs"}
ACCEPTED = {CHAT: HARMLESS | SAMPLING_FIELDS | {"messages"},
            COMPLETIONS: HARMLESS | SAMPLING_FIELDS | {"prompt", "echo", "best_of", "suffix"}}
MAX_TOP_LOGPROBS = 20  # OpenAI's limit


class RequestError(ValueError):
    """A request line that cannot run; the message is its error body's message (status 400)."""


# -- input: lines -> rows ----------------------------------------------------------------------

def tables(stream, path: str, chunk_bytes: int = 8 << 20) -> Iterator[Any]:
    """pyarrow tables (custom_id string, line int64, request string) of a request file, streamed:
    one row per non-blank line (`custom_id` the line's own, else 'line-<n>')."""
    import pyarrow as pa

    rest, line = b"", 1
    while True:
        data = stream.read(chunk_bytes)
        if not data and not rest:
            return
        buf, rest = rest + data, b""
        if data:
            cut = buf.rfind(b"\n") + 1
            buf, rest = buf[:cut], buf[cut:]
        rows = [(n, text) for n, text in enumerate(buf.split(b"\n"), line) if text.strip()]
        line += buf.count(b"\n")
        if rows:
            texts = [t.decode("utf-8", "replace") for _, t in rows]
            yield pa.table({ID: [custom_id(t) or f"line-{n}" for (n, _), t in zip(rows, texts)],
                            LINE: pa.array([n for n, _ in rows], pa.int64()), REQUEST: texts})
        if not data:
            return


def custom_id(text: str) -> str | None:
    try:
        value = json.loads(text).get("custom_id")
    except (json.JSONDecodeError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


# -- a request -> prompt, sampling parameters, what the response needs --------------------------

def parse(text: str, thinking: bool = False) -> tuple[str, dict, dict]:
    """(prompt text, sampling parameters, meta) of one request line; `RequestError` naming the
    problem. The chat prompt is rendered without its BOS (the tokenizer step puts the model's
    first). meta: {custom_id, kind: "chat" | "text", model, logprobs: bool, top_logprobs: K}."""
    from dsv4batch.model import chat

    try:
        req = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestError(f"the line is not JSON ({exc.msg})") from None
    if not isinstance(req, dict):
        raise RequestError("the line must be a JSON object {custom_id, method, url, body}")
    url, body = req.get("url"), req.get("body")
    if req.get("method", "POST") != "POST":
        raise RequestError(f"method must be POST, got {req.get('method')!r}")
    if url not in ACCEPTED:
        raise RequestError(f"url {url!r} is not supported; use {CHAT} or {COMPLETIONS}")
    if not isinstance(body, dict):
        raise RequestError("body must be an object")
    unknown = sorted(set(body) - ACCEPTED[url])
    if unknown:
        raise RequestError(f"unsupported field(s) {unknown} in body (they would change the result)")
    params, meta = _sampling(body, url), {"custom_id": custom_id(text), "model": body.get("model")}
    if url == CHAT:
        try:
            prompt = chat.render(body.get("messages"), thinking).removeprefix(chat.BOS)
        except chat.ChatError as exc:
            raise RequestError(f"messages: {exc}") from None
        k = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) if body.get("logprobs") else 0
        meta.update(kind="chat", logprobs=bool(body.get("logprobs")), top_logprobs=k)
    else:
        prompt = _prompt(body)
        k = _int(body, "logprobs", 0, MAX_TOP_LOGPROBS) if body.get("logprobs") is not None else None
        meta.update(kind="text", logprobs=k is not None, top_logprobs=k or 0)
    return prompt, params, meta


def _prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise RequestError("prompt must be one string (a list of prompts or token ids is not supported)")
    if body.get("echo") or (body.get("best_of") or 1) != 1 or body.get("suffix") is not None:
        raise RequestError("echo, best_of > 1 and suffix are not supported")
    return prompt


def _sampling(body: dict, url: str) -> dict:
    """The request's `SamplingParams` fields (the run's options fill in the rest)."""
    if (body.get("n") or 1) != 1:
        raise RequestError(f"n must be 1 (one completion per request), got {body.get('n')!r}")
    if body.get("stream"):
        raise RequestError("stream must be false in a batch file")
    out = {k: body[k] for k in ("temperature", "top_p", "seed", "top_k", "min_p", "ignore_eos", "stop_token_ids")
           if body.get(k) is not None}
    tokens = body.get("max_completion_tokens", body.get("max_tokens")) if url == CHAT else body.get("max_tokens")
    if tokens is not None:
        out["max_tokens"] = tokens
    stop = body.get("stop")
    if stop is not None:
        out["stop"] = [stop] if isinstance(stop, str) else stop
    return out


def _int(body: dict, name: str, low: int, high: int) -> int:
    value = body.get(name)
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise RequestError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
    return value


# -- output: a generated row -> a response line -------------------------------------------------

def _digest(*parts) -> str:
    import hashlib

    return hashlib.blake2b(repr(parts).encode(), digest_size=12).hexdigest()


def response_line(row: dict, tokens, model: str, created: int) -> dict:
    """The output line of one generated row (a part file's row: the generation columns, the row's
    `openai_meta` / `openai_status`); `tokens`: a `TokenText` for logprobs."""
    meta = json.loads(row[META]) if row.get(META) else {"custom_id": None, "kind": "text"}
    key = _digest(row[ROW_ID], row[LINE])
    status = row[STATUS] or 500
    if status != 200:
        body = {"error": {"message": row["error"] or "failed", "code": None, "param": None,
                          "type": "invalid_request_error" if status == 400 else "internal_error"}}
    elif meta["kind"] == "chat":
        body = _completion(row, meta, model, created, "chatcmpl-" + key, "chat.completion", tokens)
    else:
        body = _completion(row, meta, model, created, "cmpl-" + key, "text_completion", tokens)
    return {"id": "batch_req_" + key, "custom_id": meta.get("custom_id"),
            "response": {"status_code": status, "request_id": "req_" + key, "body": body}, "error": None}


def _completion(row: dict, meta: dict, model: str, created: int, cid: str, kind: str, tokens) -> dict:
    finish = "length" if row["finish_reason"] == "length" else "stop"
    choice: dict = {"index": 0, "finish_reason": finish, "logprobs": None}
    if meta["kind"] == "chat":
        choice["message"] = {"role": "assistant", "content": row["generated_text"]}
    else:
        choice["text"] = row["generated_text"]
    if meta.get("logprobs"):
        choice["logprobs"] = (_chat_logprobs if meta["kind"] == "chat" else _text_logprobs)(row, meta, tokens)
    n_in, n_out = row["num_prompt_tokens"], row["num_generated_tokens"]
    return {"id": cid, "object": kind, "created": created, "model": meta.get("model") or model,
            "choices": [choice], "usage": {"prompt_tokens": n_in, "completion_tokens": n_out,
                                           "total_tokens": n_in + n_out}}


def _tops(row: dict, t: int, k: int) -> list:
    return list(zip(row["top_ids"][t][:k], row["top_logprobs"][t][:k])) if k and row.get("top_ids") else []


def _chat_logprobs(row: dict, meta: dict, tokens) -> dict:
    k, content = meta["top_logprobs"], []
    for t, (tid, lp) in enumerate(zip(row["generated_token_ids"], row["generated_logprobs"])):
        entry = tokens.entry(tid, lp)
        entry["top_logprobs"] = [tokens.entry(i, v) for i, v in _tops(row, t, k)]
        content.append(entry)
    return {"content": content, "refusal": None}


def _text_logprobs(row: dict, meta: dict, tokens) -> dict:
    ids, k = row["generated_token_ids"], meta["top_logprobs"]
    texts = [tokens.text(i) for i in ids]
    offsets = [sum(len(x) for x in texts[:t]) for t in range(len(texts))]
    tops = [{tokens.text(i): v for i, v in _tops(row, t, k)} for t in range(len(ids))] if k else None
    return {"tokens": texts, "token_logprobs": list(row["generated_logprobs"]), "top_logprobs": tops,
            "text_offset": offsets}


class TokenText:
    """A token id's bytes and text as OpenAI's logprobs show them (byte-level BPE undone)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # GPT-2's byte <-> printable character table, which byte-level BPE vocabularies use
        printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
        chars = printable + [256 + i for i in range(256 - len(printable))]
        spare = [b for b in range(256) if b not in printable]
        self.byte_of = {chr(c): b for c, b in zip(chars, printable + spare)}

    def bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.id_to_token(int(token_id)) or ""
        if all(ch in self.byte_of for ch in piece):
            return bytes(self.byte_of[ch] for ch in piece)
        return piece.encode()  # an added (special) token: its text as it is

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", "replace")

    def entry(self, token_id: int, logprob: float) -> dict:
        raw = self.bytes(token_id)
        return {"token": raw.decode("utf-8", "replace"), "logprob": float(logprob), "bytes": list(raw)}


OUTPUT_COLUMNS = (ROW_ID, LINE, META, STATUS, "generated_text", "generated_token_ids", "num_prompt_tokens",
                  "num_generated_tokens", "finish_reason", "error")


def write_output(output: str, tokenizer, model: str) -> int:
    """Write OUTPUT/output.jsonl from OUTPUT's finished part files, in input line order, through
    a temporary name; returns the lines written."""
    import time

    import pyarrow.dataset as pads

    from dsv4batch.pipeline import output as O
    from dsv4batch.pipeline.fs import open_fs

    fs, _ = open_fs(output)
    data = pads.dataset(O.finished_parts(output).files, filesystem=fs, format="parquet")
    cols = [c for c in (*OUTPUT_COLUMNS, "generated_logprobs", "top_ids", "top_logprobs") if c in data.schema.names]
    table = data.to_table(columns=cols).sort_by(LINE)
    tokens, created = TokenText(tokenizer), int(time.time())
    lines = (json.dumps(response_line(row, tokens, model, created), ensure_ascii=False) + "\n"
             for row in table.to_pylist())
    O.write_text(output, O.RESULTS, lines)
    return table.num_rows
