"""DeepSeek-V4 chat encoding: a conversation (OpenAI-style messages) as the model's prompt text.

Our implementation of the rules DeepSeek publishes for V4 (their encoder is Python,
`encoding/encoding_dsv4.py` in the V4 model repositories; V4 has no Jinja template):

- the text starts with BOS `<｜begin▁of▁sentence｜>`;
- a system message is its content as it is;
- a user message is `<｜User｜>` + content; tool results (role "tool") join the user turn they
  follow or open one, each as `<tool_result>{content}</tool_result>`, the parts of one turn
  joined by a blank line;
- an assistant message is `{reasoning}</think>{content}<｜end▁of▁sentence｜>` in thinking mode
  for the turns after the last user turn, else `{content}<｜end▁of▁sentence｜>` (earlier
  reasoning is dropped, and chat mode never shows it); consecutive assistant messages are one turn;
- a user turn followed by an assistant message or by nothing (and a system message that ends the
  conversation or precedes an assistant message) opens the assistant's turn: `<｜Assistant｜>`,
  then `</think>` (chat mode, and thinking mode before the last user turn) or `<think>`
  (thinking mode from the last user turn on).

The text is tokenized without adding special tokens (they are spelled out in it). `render` is
the prompt to generate from; `split_last` is (the conversation before the last assistant
message, that message) for scoring a reply. A malformed conversation raises `ChatError` naming
what is wrong. No torch, no tokenizer here.
"""

from __future__ import annotations

import json
from typing import Any

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
ROLES = ("system", "user", "assistant", "tool")


class ChatError(ValueError):
    """A conversation that cannot be encoded; the message says which message and why."""


def parse(messages: Any) -> list[dict]:
    """Messages as a list of dicts (a JSON text is parsed); `ChatError` for anything else, an
    unknown role, a message without text content, or a conversation without a user message."""
    if isinstance(messages, str):
        try:
            messages = json.loads(messages)
        except json.JSONDecodeError as exc:
            raise ChatError(f"messages: not JSON ({exc.msg})") from None
    if not isinstance(messages, list) or not messages:
        raise ChatError(f"messages must be a non-empty list of messages, got {type(messages).__name__}")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ChatError(f"message {i} must be an object with role and content, got {type(msg).__name__}")
        role = msg.get("role")
        if role not in ROLES:
            raise ChatError(f"message {i} has role {role!r}; known roles: {list(ROLES)}")
        if msg.get("tool_calls") or msg.get("tools"):
            raise ChatError(f"message {i}: tool definitions and tool calls are not supported")
        content = _text(msg.get("content"), i)
        if content is None and not (role == "assistant" and msg.get("reasoning_content")):
            raise ChatError(f"message {i} ({role}) has no content")
        reasoning = msg.get("reasoning_content", msg.get("reasoning"))
        out.append({"role": role, "content": content or "", "reasoning": reasoning or ""})
    if not any(m["role"] == "user" for m in out):
        raise ChatError("the conversation has no user message")
    return out


def _text(content: Any, i: int) -> str | None:
    """A message's content as text: a string, or OpenAI content parts of type text joined."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatError(f"message {i}: only text content parts are supported, got {part!r}"[:200])
            parts.append(part["text"])
        return "".join(parts)
    raise ChatError(f"message {i}: content must be text, got {type(content).__name__}")


def _turns(messages: list[dict]) -> list[dict]:
    """Tool results merged into user turns, consecutive assistant messages into one turn."""
    turns: list[dict] = []
    for m in messages:
        last = turns[-1] if turns else None
        if m["role"] == "tool":
            part = f"<tool_result>{m['content']}</tool_result>"
            if last is not None and last["role"] == "user" and last.get("has_tool"):
                last["parts"].append(part)
            else:
                turns.append({"role": "user", "parts": [part], "has_tool": True})
        elif m["role"] == "user":
            if last is not None and last["role"] == "user" and last.get("has_tool"):
                last["parts"].append(m["content"])
            else:
                turns.append({"role": "user", "parts": [m["content"]]})
        elif m["role"] == "assistant" and last is not None and last["role"] == "assistant":
            last["content"] = "\n\n".join(filter(None, (last["content"], m["content"])))
            last["reasoning"] = "\n\n".join(filter(None, (last["reasoning"], m["reasoning"])))
        else:
            turns.append(dict(m))
    return turns


def render(messages: Any, thinking: bool = False, add_generation_prompt: bool = True) -> str:
    """The prompt text of a conversation (see the module docstring); ends with the opening of
    the assistant's turn when the conversation ends with a user (or system) message."""
    turns = _turns(parse(messages))
    last_user = max(i for i, t in enumerate(turns) if t["role"] == "user")
    text = BOS
    for i, t in enumerate(turns):
        nxt = turns[i + 1]["role"] if i + 1 < len(turns) else None
        if t["role"] == "system":
            text += t["content"]
        elif t["role"] == "user":
            text += USER + "\n\n".join(t["parts"])
        else:
            keep = thinking and i > last_user
            text += (t["reasoning"] + END_THINK if keep else "") + t["content"] + EOS
        opens = nxt == "assistant" or (nxt is None and add_generation_prompt)
        if t["role"] in ("user", "system") and opens:
            text += ASSISTANT + (THINK if thinking and i >= last_user else END_THINK)
    return text


def split_last(messages: Any, thinking: bool = False) -> tuple[str, str]:
    """(prompt, reply) for scoring the last assistant message given the conversation before it:
    the prompt ends with the opening of the assistant's turn, the reply is the turn itself
    (`{reasoning}</think>` in thinking mode, its content, EOS)."""
    msgs = parse(messages)
    if msgs[-1]["role"] != "assistant":
        raise ChatError(f"the last message must be the assistant's reply to score, got {msgs[-1]['role']!r}")
    first = len(msgs) - 1
    while first > 0 and msgs[first - 1]["role"] == "assistant":
        first -= 1  # one assistant turn may be several messages
    whole = render(msgs, thinking, add_generation_prompt=False)
    prompt = render(msgs[:first], thinking)
    if not whole.startswith(prompt):
        raise ChatError("the conversation before the last assistant message does not end with a user turn")
    return prompt, whole[len(prompt):]
