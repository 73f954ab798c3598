"""One record's conversation as generate sees it: where the target speaks, the
prompt of each turn, and the target's reply parsed back into a message. Pure (a
tokenizer, no model), so planning and workers apply the same rules.

The target speaks at every assistant message, and after a final user or tool
message (a prompt-only record gets one reply); ``tool`` replies are the record's,
kept as they are (a regenerated turn that called a tool keeps the record's reply
to it, and its own call stays in its text as the target wrote it). Turn k's prompt is the conversation before
it, with the earlier assistant turns replaced by the target's own replies,
rendered by the target's chat template with ``add_generation_prompt``."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from ..errors import QuarantineError
from ..messages import chat_of, clean_messages

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Conversation:
    messages: tuple[dict, ...]  # the record's messages, checked, None-valued keys dropped
    turns: tuple[int, ...]  # message positions where the target speaks (len(messages): a reply appended)

    def prompt(self, turn: int, replies: list[dict]) -> list[dict]:
        """The messages before `turn`, earlier assistant turns replaced by `replies`."""
        return self._with_replies(replies, stop=self.turns[turn])

    def result(self, replies: list[dict]) -> list[dict]:
        """The conversation with the target's replies; it ends before the first turn
        without one (a turn whose prompt did not fit)."""
        stop = len(self.messages) + 1 if len(replies) == len(self.turns) else self.turns[len(replies)]
        return self._with_replies(replies, stop=stop)

    def _with_replies(self, replies: list[dict], stop: int) -> list[dict]:
        out, reply = [], 0
        for position in range(min(stop, len(self.messages) + 1)):
            if reply < len(self.turns) and self.turns[reply] == position:
                out.append(replies[reply])
                reply += 1
            elif position < len(self.messages):
                out.append(dict(self.messages[position]))
        return out


def conversation(record: dict) -> Conversation:
    """The record's conversation, or `QuarantineError` with the quarantine reason."""
    if not isinstance(record, dict):
        raise QuarantineError("wrong_type", f"record is a {type(record).__name__}, not an object")
    chat = chat_of(record)
    if chat is None:
        raise QuarantineError("missing_field", "record has no messages (generate needs chat records)")
    messages = clean_messages(chat)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if messages[-1]["role"] in ("user", "tool"):  # the target answers the last request or tool reply
        turns.append(len(messages))
    if not turns:
        raise QuarantineError(
            "no_turn_to_generate", "no assistant turn, and the last message is not from the user or a tool"
        )
    if not any(m["role"] == "user" for m in messages[: turns[0]]):
        raise QuarantineError("no_user_turn", f"no user message before the first assistant turn (message {turns[0]})")
    return Conversation(tuple(messages), tuple(turns))


def conversation_digest(conv: Conversation) -> str:
    """What a worker re-reading the record checks against the plan."""
    return hashlib.sha256(json.dumps(list(conv.messages), sort_keys=True).encode()).hexdigest()


def render_prompt(tokenizer, messages: list[dict], thinking: str) -> tuple[str, list[int]]:
    """The prompt's text and token ids. ``thinking``: "on"/"off" pass
    ``enable_thinking``; "keep" leaves the template's default."""
    options = {} if thinking == "keep" else {"enable_thinking": thinking == "on"}
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **options)
    except Exception as error:
        raise QuarantineError(
            "template_error", f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
        ) from None
    return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])


def reply_text(tokenizer, ids: list[int]) -> str:
    """A generated reply's text, the one rule of every engine: its ids (without the
    end-of-turn token) decoded whole by the target's own tokenizer, special tokens
    kept. A byte-level token that is no UTF-8 on its own becomes U+FFFD where it
    stands, as `extract run` will read it; a server's incremental text may differ."""
    return tokenizer.decode(ids, skip_special_tokens=False)


def reply_message(prompt_text: str, text: str) -> dict:
    """The target's reply as an assistant message: reasoning the template puts in
    ``<think>...</think>`` (opened by the prompt or by the reply) becomes
    ``reasoning_content``, the rest ``content``. A think block never closed (the
    reply hit its token limit) is all reasoning."""
    opened = prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)
    if opened:
        text = THINK_OPEN + text
    reasoning, content = None, text
    if THINK_CLOSE in text:
        before, _, after = text.partition(THINK_CLOSE)
        reasoning, content = before.split(THINK_OPEN)[-1].strip("\n"), after.lstrip("\n")
    elif opened:
        reasoning, content = text[len(THINK_OPEN) :].strip("\n"), ""
    message = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


def end_of_turn_ids(tokenizer, generation_config) -> list[int]:
    """Tokens that end the target's turn: the tokenizer's eos and the model's
    generation config's eos (Qwen: ``<|im_end|>``, and ``<|endoftext|>``)."""
    ids = set()
    for value in (tokenizer.eos_token_id, getattr(generation_config, "eos_token_id", None)):
        if value is not None:
            ids.update([value] if isinstance(value, int) else list(value))
    if not ids:
        raise ValueError("neither the tokenizer nor the model's generation config names an end-of-turn (eos) token")
    return sorted(int(i) for i in ids)
