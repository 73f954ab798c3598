"""Prompts to decode: a store's held-out samples, or a JSONL file.

From a store (`store_prompts`): the samples of the run's held-out split
(`train.data.heldout.is_heldout` at the run's fraction, the same samples `train eval`
scores), in store order. A sample's prompt is its tokens before its first
response token, the first position with `loss_mask == 1` (for a chat rendered
with the chat template: the conversation up to and including the assistant
header); the stored response is kept as `reference`. Samples without a response
token, or whose response starts at position 0, have no prompt and are skipped.

From a JSONL file (`jsonl_prompts`), one object per line, either
`{"messages": [{"role": ..., "content": ...}, ...]}` (rendered with the target
tokenizer's chat template and its generation prompt; a trailing assistant turn
is dropped, so a training-format chat asks for its own answer) or
`{"input_ids": [...]}` (used as is); an optional `"id"` names the prompt.

Thinking (`THINKING`): a chat is rendered with the template's own default, or with
its thinking switch (`enable_thinking`, as Qwen3's templates read it) on, off, or
both ways (each chat twice, ids suffixed `:thinking-on` / `:thinking-off`): engines
have diverged from the target with thinking on and matched with it off, so
losslessness is checked both ways. A template without the switch is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from train.data.heldout import store_samples


@dataclass
class Prompt:
    id: str
    input_ids: torch.Tensor  # [n] int64
    reference: torch.Tensor | None = None  # the stored response, when from a store
    thinking: bool | None = None  # the chat's thinking switch as rendered (None: the template's default)
    source: str = ""  # the prompt set it came from: a named set (`humaneval`) or a file's name
    category: str = ""  # the record's `category`, else its set's name


def thinking_settings(thinking: str | None) -> list[bool | None]:
    """The `enable_thinking` values a `--thinking` choice renders each chat with."""
    settings: dict[str | None, list[bool | None]] = {None: [None], "on": [True], "off": [False], "both": [True, False]}
    return settings[thinking]


def response_start(loss_mask: torch.Tensor) -> int | None:
    """Index of the first response token (`loss_mask == 1`), or None."""
    hits = torch.nonzero(loss_mask.reshape(-1) == 1)
    return int(hits[0]) if hits.numel() else None


def store_prompts(
    store, heldout_fraction: float | None, split: str = "heldout", limit: int | None = None
) -> list[Prompt]:
    """Prompts of the `split` samples of `store` (a path or `store_schema.Store`),
    at most `limit`. The one rule for which stored samples are decoded."""
    prompts = []
    for sample in store_samples(store, [], split=split, heldout_fraction=heldout_fraction):
        start = response_start(sample.loss_mask)
        if not start:  # None (no response) or 0 (no prompt)
            continue
        ids = sample.input_ids.long()
        prompts.append(Prompt(sample.sample_id, ids[:start].clone(), ids[start:].clone()))
        if limit is not None and len(prompts) >= limit:
            break
    return prompts


def jsonl_prompts(
    path: str | Path,
    tokenizer=None,
    vocab_size: int | None = None,
    limit: int | None = None,
    thinking: str | None = None,
) -> list[Prompt]:
    """Prompts of a JSONL file (see the module docstring), each chat rendered once per
    `thinking_settings(thinking)`. A bad line is refused naming the file, the line and
    the field; `thinking` with a template that has no thinking switch, naming the file."""
    path = Path(path)
    return record_prompts(_jsonl_records(path), path.stem, path, tokenizer, vocab_size, limit, thinking)


def _jsonl_records(path: Path):
    """(where, record) for each non-blank line of a JSONL file."""
    with path.open() as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except ValueError as error:
                raise ValueError(f"{where}: not a JSON object ({error})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: not a JSON object")
            yield where, dict(record, id=str(record.get("id", f"line-{number}")))


def record_prompts(
    records,
    source: str,
    origin,
    tokenizer=None,
    vocab_size: int | None = None,
    limit: int | None = None,
    thinking: str | None = None,
) -> list[Prompt]:
    """Prompts of (where, record) pairs of one set named `source` (`origin` names it in
    errors), at most `limit` of them."""
    if thinking is not None:
        _require_thinking_switch(origin, tokenizer)
    prompts = []
    for where, record in records:
        category = str(record.get("category") or source)
        for setting in thinking_settings(thinking) if "messages" in record else [None]:
            ids = _record_ids(record, where, tokenizer, setting)
            if vocab_size is not None and max(ids) >= vocab_size:
                raise ValueError(
                    f"{where}: input_ids holds token {max(ids)}, outside the target vocabulary [0, {vocab_size})"
                )
            suffix = "" if thinking != "both" else f":thinking-{'on' if setting else 'off'}"
            prompts.append(
                Prompt(
                    record["id"] + suffix,
                    torch.tensor(ids, dtype=torch.long),
                    thinking=setting,
                    source=source,
                    category=category,
                )
            )
        if limit is not None and len(prompts) >= limit:
            break
    return prompts[:limit]


def _require_thinking_switch(path: Path, tokenizer) -> None:
    """Refuse `--thinking` when the chat template renders a prompt the same either way."""
    probe = [{"role": "user", "content": "hi"}]
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{path}: --thinking needs the target tokenizer's chat template, and the target has none")
    renders = [
        tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True, enable_thinking=on)
        for on in (True, False)
    ]
    if renders[0] == renders[1]:
        raise ValueError(
            f"{path}: --thinking: the target's chat template has no thinking switch "
            "(it renders the same with enable_thinking on and off)"
        )


def _record_ids(record: dict, where: str, tokenizer, thinking: bool | None = None) -> list[int]:
    if "input_ids" in record:
        ids = record["input_ids"]
        if (
            not isinstance(ids, list)
            or not ids
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
        ):
            raise ValueError(f"{where}: input_ids must be a non-empty list of non-negative integers")
        return ids
    if "messages" not in record:
        raise ValueError(f"{where}: a prompt needs `messages` (a chat) or `input_ids`")
    messages = record["messages"]
    if (
        not isinstance(messages, list)
        or not messages
        or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise ValueError(f"{where}: messages must be a non-empty list of {{role, content}} strings")
    if messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    if not messages:
        raise ValueError(f"{where}: messages holds only an assistant turn; nothing to answer")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{where}: messages need the target tokenizer's chat template, and the target has none")
    switch = {} if thinking is None else {"enable_thinking": thinking}
    rendered = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=True, **switch
    )
    return list(rendered["input_ids"])
