"""Turn one corpus record into ``(input_ids int32, loss_mask uint8)``.

The loss mask covers what the target says in each assistant turn, never the
prompt or the chat template's role header (``<|im_start|>assistant\\n``), which
are free at serving time. Two scopes (`store_schema.plan.LOSS_MASK_CONVENTIONS`):

* ``turn`` (default): the turn as the target emits it when served: its reasoning
  (``<think>...</think>``, rendered from ``reasoning_content`` or written inline),
  content, tool calls if the template renders them, and the end-of-turn token
  (``<|im_end|>``). A ``<think></think>`` with nothing inside is the template's
  (Qwen3 inserts one when there is no reasoning) and stays unscored;
* ``content``: the message's ``content`` only, no end-of-turn token.

A ``tool`` message (a tool's reply) is the prompt's, never scored; an assistant turn
that only calls tools (empty content) is scored like any other under ``turn``: its
reasoning, its rendered ``<tool_call>`` block and its end-of-turn token
(`extract.messages` checks the messages and turns string arguments into objects).

Two ways to find what the assistant said, which must agree:

* the template has ``{% generation %}`` tags: transformers returns the mask
  (``return_assistant_tokens_mask=True``);
* it has none (real Qwen templates): render the conversation, locate each
  assistant message's content in the rendered text after the prefix the
  template renders for ``messages[:i]`` plus its generation prompt, and mark the
  tokens whose character spans overlap the content (the same overlap rule
  transformers uses). The turn scope starts at the end of that generation prompt.

Named ``tokenization`` rather than ``tokenize`` so that running a file from this
directory never shadows the standard library's ``tokenize`` module.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from store_schema.plan import DEFAULT_LOSS_MASK, DEFAULT_MAX_LENGTH

from .errors import QuarantineError
from .messages import chat_of, validate_messages
from .tokenizer_facts import tokenizer_facts

_EMPTY_THINK = re.compile(r"\s*<think>\s*</think>\s*")  # what a template inserts when there is no reasoning


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


# What a directory holds when transformers' AutoTokenizer can load a tokenizer from it
# (without them it may build one that knows no chat template, or none at all).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def tokenizer_missing(directory: str | Path, flag: str = "--tokenizer") -> str | None:
    """Why `directory` (a model directory standing in for its tokenizer) holds no
    tokenizer, naming `flag`, the way to give one; None when it holds one (or is no
    local directory: transformers says what it is then)."""
    path = Path(directory)
    if not path.is_dir() or any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    return (
        f"{path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); pass {flag} DIR, a directory "
        "with the target's tokenizer"
    )


def has_generation_tags(tokenizer) -> bool:
    tags = tokenizer_facts(tokenizer).generation_tags
    if tags is None:
        raise ValueError(
            f"the tokenizer of {tokenizer.name_or_path} has no (default) chat template; chat records cannot be "
            "rendered (pass --tokenizer DIR with the target's chat template, or pre-tokenized records)"
        )
    return tags


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


# --------------------------------------------------------------------------- chat paths


def mask_with_generation_tags(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Path (a): the template marks assistant content with ``{% generation %}``."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
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


class _Turn(NamedTuple):
    """Where one assistant turn lies in the rendered chat."""

    generation_start: int | None  # end of the template's generation prompt for it (None: not rendered)
    start: int  # its content
    end: int


def _assistant_turns(tokenizer, messages: list[dict], text: str, whole_turn: bool) -> list[_Turn]:
    """Each assistant turn with something to score, located in `text`.

    The search for turn i starts where the template's own rendering of
    ``messages[:i]`` + generation prompt stops agreeing with the full text (and
    never before the previous turn's content), so whatever the template inserts
    between the role marker and the content is skipped, and an assistant reply
    that repeats earlier text is not matched in the prompt. ``whole_turn`` also
    takes turns with only reasoning, and content written after an inline
    ``</think>`` (templates render the part after it as the content)."""
    turns, cursor = [], 0
    for i, message in enumerate(messages):
        says_more = whole_turn and bool(message.get("reasoning_content", "").strip() or message.get("tool_calls"))
        if message["role"] != "assistant" or not (message["content"] or says_more):
            continue
        try:
            prefix = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            generation_start = _common_prefix_length(prefix, text)
            start_at = max(cursor, generation_start)
        except Exception:  # some templates refuse a prefix (e.g. one without a user turn)
            generation_start, start_at = None, cursor
        candidates = [message["content"], message["content"].strip()]
        if whole_turn and "</think>" in message["content"]:
            candidates.append(message["content"].split("</think>")[-1].strip())
        for content in candidates:
            start = text.find(content, start_at) if content or not message["content"] else -1
            if start >= 0:
                break
        else:
            raise QuarantineError(
                "template_mismatch",
                f"assistant message {i}'s content does not appear verbatim in the rendered chat template",
            )
        turns.append(_Turn(generation_start, start, start + len(content)))
        cursor = start + len(content)
    return turns


def assistant_content_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Render the chat and return ``(text, [(start, end) of each assistant content])``."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return text, [(turn.start, turn.end) for turn in _assistant_turns(tokenizer, messages, text, False)]


def end_of_turn_strings(tokenizer) -> list[str]:
    """The tokens that end an assistant turn: the tokenizer's EOS and the common
    chat formats' end-of-turn tokens it has (read once per tokenizer)."""
    return list(tokenizer_facts(tokenizer).end_of_turn_strings)


def _whole_turns(text: str, spans: list[tuple[int, int]], ends: list[str]) -> list[tuple[int, int]]:
    """Each span widened to the turn as served: through the first end-of-turn token
    after it unless it ends with one (tool calls rendered before that token included;
    never into the next span), less a leading empty ``<think></think>`` (the
    template's, not the target's)."""
    whole = []
    for i, (start, end) in enumerate(spans):
        limit = spans[i + 1][0] if i + 1 < len(spans) else len(text)
        closed = any(text.endswith(token, start, end) for token in ends)  # the tags hold the token already
        hits = [] if closed else [(at, len(token)) for token in ends if 0 <= (at := text.find(token, end, limit))]
        if hits:
            at, length = min(hits)
            end = max(end, at + length)
        empty_think = _EMPTY_THINK.match(text, start)
        if empty_think and empty_think.end() <= end:
            start = empty_think.end()
        whole.append((start, end))
    return whole


def _overlap_mask(offsets, spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose character span overlaps one of `spans` (sorted, disjoint)."""
    mask = [0] * len(offsets)
    span_pos = 0
    for token, (start, end) in enumerate(offsets):
        while span_pos < len(spans) and start >= spans[span_pos][1]:
            span_pos += 1
        if span_pos == len(spans):
            break
        if end > spans[span_pos][0] and end > start:
            mask[token] = 1
    return mask


def _encode(tokenizer, text: str):
    return tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)


def mask_with_offsets(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Path (b), content scope: no generation tags; find content spans in the rendered text."""
    text, spans = assistant_content_spans(tokenizer, messages)
    encoding = _encode(tokenizer, text)
    return list(encoding["input_ids"]), _overlap_mask(encoding["offset_mapping"], spans)


def turn_mask_with_offsets(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Path (b), turn scope: from the end of each turn's generation prompt (its
    content, when the template cannot render the prefix) through its end-of-turn token."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = [
        (turn.start if turn.generation_start is None else min(turn.generation_start, turn.start), turn.end)
        for turn in _assistant_turns(tokenizer, messages, text, True)
    ]
    encoding = _encode(tokenizer, text)
    return list(encoding["input_ids"]), _overlap_mask(
        encoding["offset_mapping"], _whole_turns(text, spans, end_of_turn_strings(tokenizer))
    )


def turn_mask_with_generation_tags(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Path (a), turn scope: each ``{% generation %}`` run, through its end-of-turn
    token when the template leaves that outside the tags."""
    ids, tagged = mask_with_generation_tags(tokenizer, messages)
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    encoding = _encode(tokenizer, text)
    if list(encoding["input_ids"]) != ids:
        raise QuarantineError(
            "template_mismatch", "the rendered chat tokenizes differently than the template's own ids"
        )
    offsets, spans = encoding["offset_mapping"], list[tuple[int, int]]()
    for token, scored in enumerate(tagged):
        if not scored:
            continue
        if spans and tagged[token - 1]:
            spans[-1] = (spans[-1][0], offsets[token][1])
        else:
            spans.append(tuple(offsets[token]))
    return ids, _overlap_mask(offsets, _whole_turns(text, spans, end_of_turn_strings(tokenizer)))


# --------------------------------------------------------------------------- records


def _pretokenized(record: dict, vocab_size: int) -> tuple[list[int], list[int]]:
    ids, mask = record["input_ids"], record.get("loss_mask")  # the caller found input_ids
    if mask is None:
        raise QuarantineError("missing_field", "input_ids without loss_mask")
    for name, value in (("input_ids", ids), ("loss_mask", mask)):
        if not isinstance(value, (list, tuple, np.ndarray)):
            raise QuarantineError("wrong_type", f"{name} is a {type(value).__name__}, not a list")
        if not all(_is_int(v) for v in value):
            raise QuarantineError("wrong_type", f"{name} holds non-integers")
    if len(ids) != len(mask):
        raise QuarantineError("length_mismatch", f"{len(ids)} input_ids but {len(mask)} loss_mask values")
    if not ids:
        raise QuarantineError("empty_response", "input_ids is empty")
    if any(v not in (0, 1) for v in mask):
        raise QuarantineError("wrong_type", "loss_mask holds values other than 0 and 1")
    bad = [int(v) for v in ids if not 0 <= v < vocab_size]
    if bad:  # an out-of-range id would crash the embedding lookup on the GPU
        raise QuarantineError("token_out_of_range", f"ids {bad[:5]} outside 0..{vocab_size - 1}")
    return [int(v) for v in ids], [int(v) for v in mask]


_CHAT_PATHS = {  # (scope, template has generation tags) -> the function that masks a chat
    ("turn", True): turn_mask_with_generation_tags,
    ("turn", False): turn_mask_with_offsets,
    ("content", True): mask_with_generation_tags,
    ("content", False): mask_with_offsets,
}


def tokenize_record(
    record: dict,
    tokenizer,
    *,
    max_length: int = DEFAULT_MAX_LENGTH,
    drop_long: bool = False,
    use_generation_tags: bool | None = None,
    loss_mask: str = DEFAULT_LOSS_MASK,
) -> Tokenized:
    """Tokenize one record or raise `QuarantineError` with the quarantine reason.

    Longer than ``max_length``: truncated (keep the first ``max_length`` tokens)
    or, with ``drop_long``, rejected as ``too_long``. ``use_generation_tags``
    forces a chat path (None: tags if the template has them). ``loss_mask``: the
    scope of a chat's mask, ``turn`` or ``content`` (pre-tokenized records bring theirs)."""
    if not isinstance(record, dict):
        raise QuarantineError("wrong_type", f"record is a {type(record).__name__}, not an object")
    chat, has_tokens = chat_of(record), _present(record, "input_ids")
    if chat is not None and has_tokens:
        raise QuarantineError("ambiguous_record", "record has both messages and input_ids")
    if has_tokens:
        ids, mask = _pretokenized(record, tokenizer_facts(tokenizer).vocab_size)
    elif chat is not None:
        messages = validate_messages(chat)
        tags = has_generation_tags(tokenizer) if use_generation_tags is None else use_generation_tags
        ids, mask = _CHAT_PATHS[loss_mask, tags](tokenizer, messages)
    elif _present(record, "loss_mask"):
        raise QuarantineError("missing_field", "loss_mask without input_ids")
    else:
        fields = ", ".join(sorted(map(str, record))[:6]) or "none"
        raise QuarantineError("missing_field", f"record has neither messages nor input_ids (its fields: {fields})")
    original = len(ids)
    if original > max_length:
        if drop_long:
            raise QuarantineError("too_long", f"{original} tokens > max_length {max_length}")
        ids, mask = ids[:max_length], mask[:max_length]
    return Tokenized(np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8), original)
