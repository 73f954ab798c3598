"""`extract config-only-target`: the 27B target as config.json only, for dry-runs."""

from __future__ import annotations

from pathlib import Path

from ..qwen3_6_27b import QWEN3_6_MASK_TOKEN_ID, write_config_only_target


def run(args) -> int:
    """The 27B target as config.json only: sizes a job on paper, loads no weights."""
    if args.tokenizer and not (Path(args.tokenizer) / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"--tokenizer {args.tokenizer}: no tokenizer_config.json there")
    path = write_config_only_target(args.out, args.tokenizer)
    print(f"wrote {path}/config.json: Qwen3.6-27B's architecture, no weights (for dry-runs only)")
    fit = f"python -m train fit --dry-run --target {path} --samples 902000 --nproc 8 --gpu-tflops 989"
    if args.tokenizer:
        print(f"next: python -m extract plan --dry-run --model {path} --corpus CORPUS.jsonl --gpus 8")
        print(f"      {fit}")
        return 0
    # Without a tokenizer `fit` cannot find the mask token (the first unused row) and `plan` cannot tokenize.
    print(
        "no tokenizer copied: `plan --dry-run` needs one; Qwen3.6's, offline: python scripts/real_vocab.py "
        f"--tokenizer TOK && python -m extract config-only-target {path} --tokenizer TOK"
    )
    print(f"next: {fit} --set model.mask_token_id={QWEN3_6_MASK_TOKEN_ID}")
    return 0
