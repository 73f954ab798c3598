"""Turn one corpus record into ``(input_ids int32, loss_mask uint8)``.

The loss mask is the assistant's *content* only, in every assistant turn: the
drafter learns to predict what the target says, never the prompt or the chat
template's role markers (``<|im_start|>assistant\\n``, ``<|im_end|>``, an
inserted empty ``<think></think>``), which are free at serving time.

Two ways to find the content, which must agree:

* the template has ``{% generation %}`` tags: transformers returns the mask
  (``return_assistant_tokens_mask=True``);
* it has none (real Qwen templates): render the conversation, locate each
  assistant message's content in the rendered text after the prefix the
  template renders for ``messages[:i]`` plus its generation prompt, and mark the
  tokens whose character spans overlap the content (the same overlap rule
  transformers uses).

Named ``tokenization`` rather than ``tokenize`` so that running a file from this
directory never shadows the standard library's ``tokenize`` module.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

import numpy as np
from store_schema.plan import DEFAULT_MAX_LENGTH

ROLES = ("system", "user", "assistant")
MASK_CONVENTION = "assistant_content"  # recorded in the plan settings

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class RecordError(ValueError):
    """A record that cannot become a sample; ``reason`` is the quarantine reason."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class Tokenized:
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T], 1 = scored
    original_length: int  # before truncation

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def has_generation_tags(tokenizer) -> bool:
    return bool(_GENERATION_TAG.search(_template(tokenizer)))


def _template(tokenizer) -> str:
    template = tokenizer.chat_template
    if isinstance(template, dict):  # several named templates: the default one renders chats
        template = template.get("default")
    if not isinstance(template, str) or not template:
        raise ValueError("the tokenizer has no (default) chat template; chat records cannot be rendered")
    return template


def chat_template_hash(tokenizer) -> str:
    template = tokenizer.chat_template
    text = json.dumps(template, sort_keys=True) if not isinstance(template, str) else template
    return hashlib.sha256((text or "").encode()).hexdigest()


def tokenizer_hash(tokenizer) -> str:
    """sha256 of the tokenizer's full serialization, special tokens and chat
    template: equal hashes mean equal token ids for equal records."""
    payload = {
        "backend": tokenizer.backend_tokenizer.to_str(),
        "special_tokens": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
        "chat_template": chat_template_hash(tokenizer),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------- validation


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _present(record: dict, key: str) -> bool:
    return record.get(key) is not None  # Parquet/datasets give None for absent columns


def validate_messages(messages) -> list[dict]:
    """Check the chat shape and return messages with None-valued keys dropped
    (Arrow formats fill absent struct fields with None; JSONL omits them)."""
    clean = clean_messages(messages)
    assistant = [m for m in clean if m["role"] == "assistant"]
    if not assistant:
        raise RecordError("no_assistant_turn", f"{len(clean)} messages, none from the assistant")
    if not any(m["content"].strip() for m in assistant):
        raise RecordError("empty_response", "every assistant turn is empty")
    return clean


def clean_messages(messages) -> list[dict]:
    """Check each message's shape (role, content); messages with None-valued keys dropped."""
    if not isinstance(messages, list):
        raise RecordError("wrong_type", f"messages is a {type(messages).__name__}, not a list")
    if not messages:
        raise RecordError("no_assistant_turn", "messages is empty")
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RecordError("wrong_type", f"messages[{i}] is a {type(message).__name__}, not an object")
        for key in ("role", "content"):
            if message.get(key) is None:
                raise RecordError("missing_field", f"messages[{i}] has no {key}")
            if not isinstance(message[key], str):
                raise RecordError("wrong_type", f"messages[{i}].{key} is a {type(message[key]).__name__}")
        if message["role"] not in ROLES:
            raise RecordError("unknown_role", f"messages[{i}].role is {message['role']!r}, not one of {ROLES}")
        try:
            message["content"].encode("utf-8")
        except UnicodeEncodeError:
            raise RecordError("invalid_utf8", f"messages[{i}].content has unpaired surrogates") from None
        clean.append({k: v for k, v in message.items() if v is not None})
    return clean


# --------------------------------------------------------------------------- chat paths


def mask_with_generation_tags(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Path (a): the template marks assistant content with ``{% generation %}``."""
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


def _common_prefix_length(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on the first difference
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def assistant_content_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Render the chat and return ``(text, [(start, end) of each assistant content])``.

    The search for turn i starts where the template's own rendering of
    ``messages[:i]`` + generation prompt stops agreeing with the full text (and
    never before the previous turn's content), so whatever the template inserts
    between the role marker and the content is skipped, and an assistant reply
    that repeats earlier text is not matched in the prompt."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or not message["content"]:
            continue
        try:
            prefix = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            start_at = max(cursor, _common_prefix_length(prefix, text))
        except Exception:  # some templates refuse a prefix (e.g. one without a user turn)
            start_at = cursor
        content = message["content"]
        start = text.find(content, start_at)
        if start < 0:  # templates commonly strip the content (Qwen: content.strip())
            content = content.strip()
            start = text.find(content, start_at) if content else -1
        if start < 0:
            raise RecordError(
                "template_mismatch",
                f"assistant message {i}'s content does not appear verbatim in the rendered chat template",
            )
        spans.append((start, start + len(content)))
        cursor = start + len(content)
    return text, spans


def mask_with_offsets(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Path (b): no generation tags; find content spans in the rendered text."""
    text, spans = assistant_content_spans(tokenizer, messages)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [0] * len(encoding["input_ids"])
    span_pos = 0
    for token, (start, end) in enumerate(encoding["offset_mapping"]):
        while span_pos < len(spans) and start >= spans[span_pos][1]:
            span_pos += 1
        if span_pos == len(spans):
            break
        if end > spans[span_pos][0] and end > start:
            mask[token] = 1
    return list(encoding["input_ids"]), mask


# --------------------------------------------------------------------------- records


def _pretokenized(record: dict, vocab_size: int) -> tuple[list[int], list[int]]:
    ids, mask = record.get("input_ids"), record.get("loss_mask")
    if mask is None:
        raise RecordError("missing_field", "input_ids without loss_mask")
    for name, value in (("input_ids", ids), ("loss_mask", mask)):
        if not isinstance(value, (list, tuple, np.ndarray)):
            raise RecordError("wrong_type", f"{name} is a {type(value).__name__}, not a list")
        if not all(_is_int(v) for v in value):
            raise RecordError("wrong_type", f"{name} holds non-integers")
    if len(ids) != len(mask):
        raise RecordError("length_mismatch", f"{len(ids)} input_ids but {len(mask)} loss_mask values")
    if not ids:
        raise RecordError("empty_response", "input_ids is empty")
    if any(v not in (0, 1) for v in mask):
        raise RecordError("wrong_type", "loss_mask holds values other than 0 and 1")
    bad = [int(v) for v in ids if not 0 <= v < vocab_size]
    if bad:  # an out-of-range id would crash the embedding lookup on the GPU
        raise RecordError("token_out_of_range", f"ids {bad[:5]} outside 0..{vocab_size - 1}")
    return [int(v) for v in ids], [int(v) for v in mask]


def tokenize_record(
    record: dict,
    tokenizer,
    *,
    max_length: int = DEFAULT_MAX_LENGTH,
    drop_long: bool = False,
    use_generation_tags: bool | None = None,
) -> Tokenized:
    """Tokenize one record or raise `RecordError` with the quarantine reason.

    Longer than ``max_length``: truncated (keep the first ``max_length`` tokens)
    or, with ``drop_long``, rejected as ``too_long``. ``use_generation_tags``
    forces a chat path (None: tags if the template has them)."""
    if not isinstance(record, dict):
        raise RecordError("wrong_type", f"record is a {type(record).__name__}, not an object")
    has_chat, has_tokens = _present(record, "messages"), _present(record, "input_ids")
    if has_chat and has_tokens:
        raise RecordError("ambiguous_record", "record has both messages and input_ids")
    if has_tokens:
        ids, mask = _pretokenized(record, len(tokenizer))
    elif has_chat:
        messages = validate_messages(record["messages"])
        tags = has_generation_tags(tokenizer) if use_generation_tags is None else use_generation_tags
        ids, mask = (mask_with_generation_tags if tags else mask_with_offsets)(tokenizer, messages)
    elif _present(record, "loss_mask"):
        raise RecordError("missing_field", "loss_mask without input_ids")
    else:
        raise RecordError("missing_field", "record has neither messages nor input_ids")
    original = len(ids)
    if original > max_length:
        if drop_long:
            raise RecordError("too_long", f"{original} tokens > max_length {max_length}")
        ids, mask = ids[:max_length], mask[:max_length]
    return Tokenized(np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8), original)
