"""What a tokenizer is, computed once per process, not once per record.

At Qwen3.6's 248K vocabulary, `tokenizer.get_vocab()` builds a 248K-entry dict
(~230 ms); asking it for every record made planning ~30x slower than encoding
(7.9 records/s on 2 cores). The facts here are read once per tokenizer object and
kept while its vocabulary size, EOS and chat template stay the same (a test or a
caller that edits them gets fresh facts)."""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass

# Tokens that end an assistant turn in the common chat formats, besides the tokenizer's EOS.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class TokenizerFacts:
    vocab_size: int  # len(tokenizer): ids 0..vocab_size-1 are tokens
    end_of_turn_strings: tuple[str, ...]  # the EOS first, then the chat formats' end-of-turn tokens it has
    end_of_turn_ids: tuple[int, ...]
    special_ids: frozenset[int]  # every special (added) token's id
    generation_tags: bool | None  # the default template has {% generation %}; None: no chat template


def default_template(tokenizer) -> str | None:
    template = tokenizer.chat_template
    if isinstance(template, dict):  # several named templates: the default one renders chats
        template = template.get("default")
    return template if isinstance(template, str) and template else None


def _compute(tokenizer) -> TokenizerFacts:
    vocab = tokenizer.get_vocab()
    ends = [token for token in END_OF_TURN_TOKENS if token in vocab]
    if tokenizer.eos_token and tokenizer.eos_token not in ends:
        ends.insert(0, tokenizer.eos_token)
    special = {vocab[t] for t in tokenizer.all_special_tokens if t in vocab}
    special |= {i for i, added in getattr(tokenizer, "added_tokens_decoder", {}).items() if added.special}
    template = default_template(tokenizer)
    return TokenizerFacts(
        vocab_size=len(tokenizer),
        end_of_turn_strings=tuple(ends),
        end_of_turn_ids=tuple(vocab[t] for t in ends if t in vocab),
        special_ids=frozenset(int(i) for i in special),
        generation_tags=None if template is None else bool(_GENERATION_TAG.search(template)),
    )


_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tokenizer_facts(tokenizer) -> TokenizerFacts:
    """The tokenizer's facts, computed on first use and reused."""
    stamp = (len(tokenizer), tokenizer.eos_token, default_template(tokenizer))
    try:
        cached = _cache.get(tokenizer)
    except TypeError:  # not weak-referenceable or hashable: compute every time
        return _compute(tokenizer)
    if cached is None or cached[0] != stamp:
        cached = _cache[tokenizer] = (stamp, _compute(tokenizer))
    return cached[1]
