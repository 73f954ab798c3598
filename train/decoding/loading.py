"""What `speculate` and `serve-check` both decode: their shared flags as a typed
request, and everything loaded from it (the target checked against the store, the
drafter, the prompts, the stop tokens), plus the per-group figures both report."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from torch import nn
from transformers import AutoTokenizer, PreTrainedModel

from store_schema.runtime.host import resolve_device
from store_schema.runtime.target_config import read_config_json, read_target_config
from store_schema.runtime.target_model import compute_dtype, load_target_model
from store_schema.runtime.target_weights import check_target_weights
from store_schema.stores import open_store
from train.compatibility import check_drafter_against_target, check_store_against_target
from train.data.prompt_sets import prompt_sources
from train.data.prompts import jsonl_prompts, record_prompts, store_prompts
from train.decoding.target_decode import stop_token_ids
from train.dtypes import torch_dtype
from train.export.drafter_dir import heldout_fraction, load_drafter, resolve_drafter_dir
from train.families.family import Drafter
from train.target_check import check_target


@dataclass(frozen=True)
class DecodingRequest:
    """The flags `speculate` and `serve-check` share, parsed (train/cli/speculate.py)."""

    drafter: str
    target: str
    store: str | None  # a store's prompts, or
    prompts: str | None  # prompt sets (`train.data.prompt_sets`)
    limit: int | None = None
    split: str = "heldout"
    heldout_fraction: float | None = None  # None: the export's record, else the default
    thinking: str | None = None
    ignore_eos: bool = False
    device: str | None = None
    dtype: str | None = None  # a `train.dtypes` name; None: the device's compute dtype
    allow_other_target: bool = False
    full_weights_check: bool = False


@dataclass
class Decoding:
    """What `speculate` and `serve-check` decode with: the drafter and the whole target
    on one device and dtype, the prompts, and the stop tokens."""

    drafter_dir: Path
    drafter: Drafter  # eval mode, of any family
    model: PreTrainedModel  # the target (transformers), whole
    prompts: list
    stops: list[int]
    device: torch.device
    dtype: torch.dtype
    other_target: dict  # what `--allow-other-target` let through, recorded in the output


def grouped(prompts, results, key) -> dict:
    """{key(prompt): prompts, lossless and tau of that group}, prompts whose key is None left out."""
    groups: dict = {}
    for prompt, result in zip(prompts, results):
        if key(prompt) is not None:
            groups.setdefault(key(prompt), []).append(result)
    return {
        name: {
            "prompts": len(rows),
            "lossless": all(r.lossless for r in rows),
            "tau": mean_or_none([r.tau for r in rows if r.tau is not None]),
        }
        for name, rows in groups.items()
    }


def by_thinking(prompts, results) -> dict:
    """{"on"/"off": ...} of the prompts rendered with the thinking switch set; else empty."""
    return grouped(prompts, results, lambda p: None if p.thinking is None else "on" if p.thinking else "off")


def by_set(prompts, results) -> dict:
    """Per prompt set and per category (a `--prompts` record's `category`, else its set's
    name): the figures the field publishes per benchmark. Empty for a store's prompts."""
    if not any(p.source for p in prompts):
        return {}
    return {
        "by_set": grouped(prompts, results, lambda p: p.source),
        "by_category": grouped(prompts, results, lambda p: p.category),
    }


def mean_or_none(values):
    """The mean rounded to 4 places, None for no values."""
    return round(sum(values) / len(values), 4) if values else None


def open_prompt_source(request: DecodingRequest):
    """The store (or None for --prompts), opened before any model loads, so a wrong
    path is refused at once."""
    if request.prompts:
        prompt_sources(request.prompts)  # refuses a missing file or an unknown set, naming it
        return None
    return open_store(request.store)


def load_prompts(request: DecodingRequest, store, drafter_dir, model, tokenizer) -> list:
    vocab = model.get_input_embeddings().weight.shape[0]
    if request.prompts:  # --limit applies to each set
        return [
            prompt
            for source in prompt_sources(request.prompts)
            for prompt in (
                record_prompts(
                    source.records(), source.name, source.name, tokenizer, vocab, request.limit, request.thinking
                )
                if source.format or source.path is None
                else jsonl_prompts(
                    source.path, tokenizer, vocab_size=vocab, limit=request.limit, thinking=request.thinking
                )
            )
        ]
    if request.thinking:
        raise ValueError("--thinking renders --prompts chats; a store's prompts were rendered when it was extracted")
    check_store_against_target(store, read_target_config(request.target))
    return store_prompts(
        store,
        heldout_fraction(request.split, request.heldout_fraction, drafter_dir),
        split=request.split,
        limit=request.limit,
    )


def load_decoding(request: DecodingRequest, command: str) -> Decoding:
    """The target checked against the store (`train.target_check`), then the drafter,
    the target and the prompts loaded; a prompt source that gives none is refused."""
    device = resolve_device(request.device)
    dtype = torch_dtype(request.dtype) if request.dtype else compute_dtype(device)
    drafter_dir = resolve_drafter_dir(request.drafter)
    store = open_prompt_source(request)
    check_target_weights(request.target, "--target")  # not "another checkpoint" when it has no weights at all
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    other_target = (
        {}
        if store is None
        else check_target(
            store,
            request.target,
            allow_other_target=request.allow_other_target,
            full=request.full_weights_check,
            log=say,
        )
    )
    drafter = load_drafter(drafter_dir, dtype=dtype, device=device).eval()
    read_config_json(request.target)  # a wrong path is refused before the line below
    say(f"{command}: loading the target {request.target} on {device} ({str(dtype).removeprefix('torch.')})")
    model = load_target_model(request.target, device, dtype).model
    embedding = cast(nn.Embedding, model.get_input_embeddings())  # transformers types it as any Module
    vocab_size, hidden_size = embedding.weight.shape
    layers = model.config.get_text_config().num_hidden_layers
    check_drafter_against_target(drafter.config, hidden_size, vocab_size, layers, drafter_dir / "config.json")
    tokenizer = _tokenizer(request.target)
    prompts = load_prompts(request, store, drafter_dir, model, tokenizer)
    if not prompts:
        raise ValueError(f"no prompt to decode in {request.prompts or request.store}")
    stops = [] if request.ignore_eos else stop_token_ids(model, tokenizer)
    return Decoding(drafter_dir, drafter, model, prompts, stops, device, dtype, other_target)


def _tokenizer(target: str):
    try:
        return AutoTokenizer.from_pretrained(str(target), trust_remote_code=False)
    except (OSError, ValueError):
        return None  # token-id prompts still work; chat prompts are refused by name
