"""The demo's embedded default: a coding corpus, a tokenizer and a small target
model, all made on this machine from the Python standard library's own source.

- The corpus: requests for standard-library functions answered with their source,
  in chat format (a few hundred to a few thousand records).
- The tokenizer: byte-level BPE trained on that source, ChatML chat template.
- The target: a small Qwen3.5-architecture model (hybrid linear attention) built
  from a config with a fixed seed, then trained briefly on the corpus so that its
  hidden states carry signal and a drafter's acceptance means something. It is
  cached on disk: later runs reuse it."""

from __future__ import annotations

import gzip
import hashlib
import inspect
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

# ChatML, as Qwen's templates render it; `{% generation %}` marks the assistant's
# content so transformers can return the assistant-token mask.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] }}{% endgeneration %}"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
MASK_TOKEN = "<|mask|>"

CORPUS_MODULES = (
    "json",
    "textwrap",
    "inspect",
    "pathlib",
    "shlex",
    "base64",
    "fnmatch",
    "glob",
    "argparse",
    "calendar",
    "csv",
    "difflib",
    "email.utils",
    "ftplib",
    "gettext",
    "gzip",
    "heapq",
    "html",
    "imaplib",
    "ipaddress",
    "locale",
    "logging",
    "mailbox",
    "mimetypes",
    "ntpath",
    "optparse",
    "os",
    "pickletools",
    "platform",
    "posixpath",
    "pprint",
    "quopri",
    "random",
    "shutil",
    "smtplib",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "tokenize",
    "traceback",
    "typing",
    "urllib.parse",
    "uuid",
    "warnings",
    "zipfile",
)


# The corpus as the demo read it on Python 3.11.7 with torch 2.13 and transformers 5.24
# imported (598 functions; standard-library source, PSF licence), kept in the repository.
# Read from the running Python it differed by version (bare 3.10.13, 3.11.7, 3.12.1 and
# 3.13.0: 643, 601, 617 and 638 functions) and by the libraries imported beside it (they
# replace inspect.getfile and two typing helpers), so every setup had another demo.
# `python scripts/embedded.py --pin` rewrites it from the running Python.
PINNED_FUNCTIONS = Path(__file__).with_name("demo_functions.json.gz")
DEFAULT_SIZES = (80, 1500)


def stdlib_functions(
    modules=CORPUS_MODULES, min_chars: int = 80, max_chars: int = 1500, pinned: bool = True
) -> list[tuple[str, str, str]]:
    """(module, function name, source) for plain functions defined in `modules`: the
    pinned copy for the default modules and sizes (unless `pinned` is False), else read
    from the running Python."""
    import importlib

    if pinned and tuple(modules) == CORPUS_MODULES and (min_chars, max_chars) == DEFAULT_SIZES:
        return [tuple(f) for f in json.loads(gzip.decompress(PINNED_FUNCTIONS.read_bytes()))["functions"]]

    found = []
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name, obj in sorted(vars(module).items()):
            if inspect.isfunction(obj) and obj.__module__ == module.__name__:
                try:
                    source = inspect.getsource(obj)
                except (OSError, TypeError):
                    continue
                if min_chars <= len(source) <= max_chars:
                    found.append((module_name, name, source))
    return found


PHRASINGS = (
    "Write `{name}` from the `{module}` module.",
    "Show me how the `{module}` module implements `{name}`.",
    "I need the source of `{module}.{name}`, please.",
)


def coding_chats(count: int | None = None, seed: int = 0, modules=CORPUS_MODULES, phrasings: int = 1) -> list[dict]:
    """Chat records asking for standard-library functions, answered with their source.
    `count` repeats the functions when larger than what exists; None takes each once.
    `phrasings` > 1 asks for each function that many ways (the same answer)."""
    functions = stdlib_functions(modules)
    random.Random(seed).shuffle(functions)
    count = len(functions) if count is None else count
    records = []
    for i in range(count):
        module_name, name, source = functions[i % len(functions)]
        for p in range(phrasings):
            records.append(
                {
                    "id": f"sample-{i:05d}" if phrasings == 1 else f"sample-{i:05d}-{p}",
                    "messages": [
                        {
                            "role": "user",
                            "content": PHRASINGS[p % len(PHRASINGS)].format(name=name, module=module_name),
                        },
                        {"role": "assistant", "content": source},
                    ],
                }
            )
    return records


def write_jsonl(path, records) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return path


def build_tokenizer(path, texts, vocab_size: int = 512, chat_template: str = CHAT_TEMPLATE):
    """Train a byte-level BPE tokenizer on `texts`; save it as a
    `PreTrainedTokenizerFast` with a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", MASK_TOKEN],
    )
    fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    return fast


def _attention_shape(vocab_size: int, hidden_size: int, num_layers: int, num_heads: int, head_dim: int) -> dict:
    """What the dense and the hybrid test targets share: sizes, attention heads (half as
    many KV heads), untied head."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        head_dim=head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


def qwen3_5_config(vocab_size: int, hidden_size: int = 64, num_layers: int = 8, num_heads: int = 4, head_dim: int = 16):
    """Qwen3.5 text config: three linear-attention layers per full-attention layer."""
    from transformers import Qwen3_5TextConfig

    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]
    return Qwen3_5TextConfig(
        **_attention_shape(vocab_size, hidden_size, num_layers, num_heads, head_dim),
        linear_num_key_heads=max(1, num_heads // 2),
        linear_num_value_heads=num_heads,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        layer_types=layer_types,
    )


def qwen3_config(vocab_size: int, hidden_size: int = 64, num_layers: int = 8, num_heads: int = 4, head_dim: int = 16):
    """Dense Qwen3 text config (plain attention: fast on CPU)."""
    from transformers import Qwen3Config

    return Qwen3Config(**_attention_shape(vocab_size, hidden_size, num_layers, num_heads, head_dim))


ARCHITECTURES = {"qwen3_5": qwen3_5_config, "qwen3": qwen3_config}

# The demo target: small enough to train and extract on 2 CPU cores in minutes.
# (head_dim 64 makes the PyTorch linear-attention fallback ~7x slower on CPU than 32.)
DEMO_TARGET = dict(
    vocab_size=2048,
    hidden_size=256,
    num_layers=6,
    num_heads=8,
    head_dim=32,
    pretrain_steps=350,
    pretrain_seq=128,
    pretrain_batch=8,
    lr=3e-3,
    seed=0,
    architecture="qwen3",
)


def target_settings(assignments: list[str]) -> dict:
    """`KEY=VALUE` overrides of DEMO_TARGET (the demo's `--target-set`), each value
    parsed as its default's type; an unknown key or a bad value is a one-line error."""
    settings = {}
    for assignment in assignments:
        key, sep, text = assignment.partition("=")
        if not sep or key not in DEMO_TARGET:
            raise ValueError(
                f"--target-set {assignment!r}: expected KEY=VALUE with KEY one of {', '.join(DEMO_TARGET)}"
            )
        kind = type(DEMO_TARGET[key])
        try:
            settings[key] = kind(text)
        except ValueError:
            raise ValueError(f"--target-set {assignment!r}: {key} takes a {kind.__name__}") from None
    return settings


def ensure_demo_target(cache_root, records, log=print, **overrides) -> Path:
    """Build (once) and return the cached demo target: tokenizer + pretrained
    Qwen3.5 model in one directory, keyed by its settings and the corpus."""
    settings = {**DEMO_TARGET, **overrides}
    key = hashlib.sha256(json.dumps([settings, records], sort_keys=True).encode()).hexdigest()[:12]
    return build_demo_target(Path(cache_root) / f"target-{key}", records, settings, log)


def build_demo_target(target_dir: Path, records, settings: dict, log=print) -> Path:
    """Tokenizer + pretrained model written to `target_dir` (through a `.partial`
    directory renamed when whole); a directory that already holds them is kept."""
    target_dir = Path(target_dir)
    if (target_dir / "config.json").exists() and (target_dir / "tokenizer.json").exists():
        log(f"demo target: already built at {target_dir}")
        return target_dir
    partial = target_dir.with_name(target_dir.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    texts = [m["content"] for r in records for m in r["messages"]]
    tokenizer = build_tokenizer(partial, texts, vocab_size=settings["vocab_size"])
    model = _pretrain(tokenizer, records, settings, log)
    model.save_pretrained(str(partial), safe_serialization=True)
    partial.rename(target_dir)
    return target_dir


def _pretrain(tokenizer, records, settings, log):
    from transformers import AutoModelForCausalLM

    from store_schema.runtime.units import human_duration

    torch.manual_seed(settings["seed"])
    make_config = ARCHITECTURES[settings.get("architecture", "qwen3_5")]  # overrides may pick "qwen3"
    config = make_config(
        len(tokenizer), settings["hidden_size"], settings["num_layers"], settings["num_heads"], settings["head_dim"]
    )
    model = AutoModelForCausalLM.from_config(config)
    stream = []
    for record in records:
        stream.extend(tokenizer.apply_chat_template(record["messages"], tokenize=True, return_dict=True)["input_ids"])
    tokens = torch.tensor(stream, dtype=torch.long)
    seq, batch = settings["pretrain_seq"], settings["pretrain_batch"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings["lr"], weight_decay=0.0)
    steps = settings["pretrain_steps"]
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, settings["lr"], total_steps=steps, pct_start=0.1)
    generator = torch.Generator().manual_seed(settings["seed"])
    model.train()
    start = time.time()
    for step in range(1, steps + 1):
        offsets = torch.randint(0, len(tokens) - seq - 1, (batch,), generator=generator)
        ids = torch.stack([tokens[o : o + seq] for o in offsets])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == steps:
            elapsed = time.time() - start
            log(
                f"demo target pretraining: step {step}/{steps} loss {loss.item():.3f} ({human_duration(elapsed)}, "
                f"ETA {human_duration(elapsed / step * (steps - step))})"
            )
    return model.eval()


def write_pinned_functions(path: Path = PINNED_FUNCTIONS) -> int:
    """The running Python's functions of CORPUS_MODULES, written as the pinned corpus."""
    functions = stdlib_functions(pinned=False)
    data = json.dumps({"python": sys.version.split()[0], "functions": functions}, indent=0).encode()
    path.write_bytes(gzip.compress(data, 9, mtime=0))
    return len(functions)


def main(argv=None) -> int:
    """By hand, what `make demo` builds: the target and the corpus, for the README's block."""
    import argparse

    parser = argparse.ArgumentParser(description="The demo's target and coding corpus, made from the standard library.")
    parser.add_argument(
        "--target",
        metavar="DIR",
        help="write the small pretrained Qwen3 target + tokenizer here "
        f"(~{DEMO_TARGET['pretrain_steps']} CPU steps, a few minutes; kept if already there)",
    )
    parser.add_argument("--corpus", metavar="FILE", help="write the chat corpus here (JSONL, one {messages} per line)")
    parser.add_argument(
        "--records", type=int, default=600, help="corpus records (default 600: 200 functions x 3 phrasings)"
    )
    parser.add_argument("--pin", action="store_true", help=f"re-pin the corpus functions into {PINNED_FUNCTIONS.name}")
    args = parser.parse_args(argv)
    os.environ.setdefault(
        "HF_HUB_DISABLE_PROGRESS_BARS", "1"
    )  # before transformers loads: no "Writing model shards" bar
    if args.pin:
        print(write_pinned_functions(), "functions pinned in", PINNED_FUNCTIONS, file=sys.stderr)
        return 0
    if not (args.target or args.corpus):
        parser.error("nothing to do: give --target DIR and/or --corpus FILE")
    if args.corpus:
        records = coding_chats(phrasings=3)[: args.records]
        print(f"wrote {write_jsonl(args.corpus, records)}: {len(records)} chat records")
    if args.target:
        target = build_demo_target(
            Path(args.target), coding_chats(), DEMO_TARGET, log=lambda line: print(line, file=sys.stderr)
        )
        print(
            f"wrote {target}: a {DEMO_TARGET['architecture']} target, {DEMO_TARGET['num_layers']} layers, "
            f"hidden {DEMO_TARGET['hidden_size']}, vocabulary {DEMO_TARGET['vocab_size']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
