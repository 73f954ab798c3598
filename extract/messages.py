"""The shape of a chat record's messages, checked once for planning and generate.

Roles: ``system``, ``user``, ``assistant`` and ``tool`` (a tool's reply, OpenAI
format; never scored: the target does not say it). An assistant message may carry
``reasoning_content`` and OpenAI-format ``tool_calls``
(``[{"id", "type": "function", "function": {"name", "arguments"}}]``, or the flat
``{"name", "arguments"}`` some datasets use); its ``content`` may then be empty or
null. ``arguments`` given as a JSON string is parsed into an object, as servers do
before they render the chat template (vLLM: tool-use templates expect a mapping),
so a string and the equal object render, tokenize and score the same.
"""

from __future__ import annotations

import json

from .errors import QuarantineError

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT-style records (`conversations` of {"from", "value"}: SpecForge's and EAGLE's
# corpora, Vicuna, ShareGPT, Glaive) read as chats: each speaker's name -> its role.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "function_response": "tool",
    "observation": "tool",
    "ipython": "tool",
}
ACCEPTED_FORMATS = (
    '{"messages": [{"role", "content"}, ...]} (OpenAI chat), '
    '{"conversations": [{"from": "human"|"gpt"|"system"|"tool", "value"}, ...]} (ShareGPT), '
    'or {"input_ids": [...], "loss_mask": [...]} (pre-tokenized)'
)


def chat_of(record: dict):
    """A record's chat messages: its `messages`, or its ShareGPT `conversations` turned into
    messages (None: neither). A speaker with no role here is quarantined by name."""
    if record.get("messages") is not None:
        return record["messages"]
    turns = record.get("conversations")
    if turns is None:
        return None
    if not isinstance(turns, list):
        raise QuarantineError("wrong_type", f"conversations is a {type(turns).__name__}, not a list")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise QuarantineError("wrong_type", f"conversations[{i}] is a {type(turn).__name__}, not an object")
        speaker = turn.get("from", turn.get("role"))
        role = SHAREGPT_ROLES.get(str(speaker).lower())
        if role is None:
            raise QuarantineError(
                "unknown_role", f"conversations[{i}] is from {speaker!r} (known: {', '.join(SHAREGPT_ROLES)})"
            )
        messages.append({"role": role, "content": turn.get("value", turn.get("content"))})
    return messages


def _drop_none(value: dict) -> dict:
    return {k: v for k, v in value.items() if v is not None}  # Arrow fills absent struct fields with None


def _arguments(value, where: str):
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise QuarantineError("bad_tool_call", f"{where} is not JSON ({error.msg}, column {error.colno})") from None
    if not isinstance(value, dict):
        raise QuarantineError("bad_tool_call", f"{where} is a {type(value).__name__}, not an object")
    return value


def clean_tool_calls(calls, where: str) -> list[dict]:
    """Each call checked (a function name; arguments a JSON object or its text) with
    its arguments as an object; None-valued keys dropped."""
    if not isinstance(calls, (list, tuple)):
        raise QuarantineError("wrong_type", f"{where} is a {type(calls).__name__}, not a list")
    clean = []
    for k, call in enumerate(calls):
        at = f"{where}[{k}]"
        if not isinstance(call, dict):
            raise QuarantineError("wrong_type", f"{at} is a {type(call).__name__}, not an object")
        call = _drop_none(call)
        nested = "function" in call
        function = _drop_none(call["function"]) if nested and isinstance(call["function"], dict) else call
        if nested and not isinstance(call["function"], dict):
            raise QuarantineError(
                "bad_tool_call", f"{at}.function is a {type(call['function']).__name__}, not an object"
            )
        prefix = f"{at}.function" if nested else at
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise QuarantineError("bad_tool_call", f"{prefix} has no name")
        function = dict(function, arguments=_arguments(function.get("arguments"), f"{prefix}.arguments"))
        clean.append(dict(call, function=function) if nested else function)
    return clean


def clean_messages(messages) -> list[dict]:
    """Check each message's shape (role, content, reasoning, tool calls); messages
    with None-valued keys dropped, tool-call arguments as objects, an assistant's
    null content beside tool calls as ``""``."""
    if not isinstance(messages, list):
        raise QuarantineError("wrong_type", f"messages is a {type(messages).__name__}, not a list")
    if not messages:
        raise QuarantineError("no_assistant_turn", "messages is empty")
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise QuarantineError("wrong_type", f"messages[{i}] is a {type(message).__name__}, not an object")
        message = _drop_none(message)
        if message.get("role") is None:
            raise QuarantineError("missing_field", f"messages[{i}] has no role")
        if not isinstance(message["role"], str):
            raise QuarantineError("wrong_type", f"messages[{i}].role is a {type(message['role']).__name__}")
        if message["role"] == "assistant" and "tool_calls" in message:
            message["tool_calls"] = clean_tool_calls(message["tool_calls"], f"messages[{i}].tool_calls")
            if not message["tool_calls"]:
                del message["tool_calls"]  # an empty list: a plain turn, as servers treat it
            elif "content" not in message:
                message["content"] = ""
        if message.get("content") is None:
            raise QuarantineError("missing_field", f"messages[{i}] has no content")
        for key in ("content", "reasoning_content"):
            if key in message and not isinstance(message[key], str):
                raise QuarantineError("wrong_type", f"messages[{i}].{key} is a {type(message[key]).__name__}")
        if message["role"] not in ROLES:
            raise QuarantineError("unknown_role", f"messages[{i}].role is {message['role']!r}, not one of {ROLES}")
        try:
            message["content"].encode("utf-8")
        except UnicodeEncodeError:
            raise QuarantineError("invalid_utf8", f"messages[{i}].content has unpaired surrogates") from None
        clean.append(message)
    return clean


def has_reply(message: dict) -> bool:
    """An assistant message that says something: content, or a tool call."""
    return message["role"] == "assistant" and bool(message["content"].strip() or message.get("tool_calls"))


def validate_messages(messages) -> list[dict]:
    """`clean_messages`, and at least one assistant turn that says something."""
    clean = clean_messages(messages)
    assistant = [m for m in clean if m["role"] == "assistant"]
    if not assistant:
        raise QuarantineError("no_assistant_turn", f"{len(clean)} messages, none from the assistant")
    if not any(has_reply(m) for m in assistant):
        raise QuarantineError("empty_response", "every assistant turn is empty")
    return clean
