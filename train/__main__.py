"""Command line of the trainer.

    python -m train fit --store STORE --target PATH --out RUN [--config FILE]
                        [--max-steps N] [--resume] [--set key=value ...]
    python -m train export RUN --out DIR [--dtype bfloat16|float32] [--checkpoint PATH]
    python -m train eval --store STORE --drafter RUN_OR_EXPORT --target PATH [--json] ...
    python -m train diagnose RUN [--plot FILE.png] [--compare RUN2] [--json]

`fit` resolves the config (defaults <- --config YAML <- explicit flags <- --set),
saves it into RUN, and trains. `--resume` continues RUN from its newest
checkpoint with RUN's saved config (flags and --set still override it, e.g. a
larger --max-steps). `export` writes the newest checkpoint's drafter in z-lab's
DFlash format (config.json + model.safetensors, no target tensors).

Each command is a subparser with its own handler; `eval` and `diagnose` live in
train/cli_eval.py and train/cli_diagnose.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from train import cli_diagnose, cli_eval


def add_fit(subparsers) -> None:
    p = subparsers.add_parser("fit", help="train a drafter on a hidden-state store")
    p.add_argument("--store", help="hidden-state store directory")
    p.add_argument("--target", help="target model directory (config.json, safetensors, tokenizer)")
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--config", help="YAML (or JSON) config file")
    p.add_argument("--max-steps", type=int, help="optimizer steps (default: epochs over the store)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its newest checkpoint")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set optim.lr=3e-4 --set num_anchors=256")
    p.set_defaults(handler=run_fit)


def run_fit(args) -> int:
    from train.config import load_config
    from train.trainer import Trainer

    config_file = args.config
    if args.resume and config_file is None and (Path(args.out) / "config.yaml").is_file():
        config_file = str(Path(args.out) / "config.yaml")
    config = load_config(
        config_file, args.overrides, store=args.store, target=args.target, out=args.out,
        **{"train.max_steps": args.max_steps},
    )
    trainer = Trainer.from_config(config, resume=args.resume)
    print(f"fit: {trainer.total_steps} steps, drafter {sum(p.numel() for p in trainer.drafter.parameters()):,} "
          f"parameters, context layers {trainer.drafter.config.context_layer_ids}, device {trainer.device}",
          file=sys.stderr)
    last = trainer.fit()
    print(json.dumps({"step": trainer.step, **{k: v for k, v in last.items() if not isinstance(v, list)}}))
    return 0


def add_export(subparsers) -> None:
    p = subparsers.add_parser("export", help="write a run's drafter in z-lab's DFlash format")
    p.add_argument("run", help="run directory")
    p.add_argument("--out", required=True, help="directory to write config.json + model.safetensors into")
    p.add_argument("--checkpoint", help="checkpoint directory (default: the run's newest)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="dtype of the exported weights (published drafters are bf16)")
    p.set_defaults(handler=run_export)


def run_export(args) -> int:
    from train import checkpoint as ckpt
    from train.export import export_drafter
    from train.model import DFlashDrafter, DrafterConfig

    path = Path(args.checkpoint) if args.checkpoint else ckpt.latest_checkpoint(args.run)
    if path is None:
        raise FileNotFoundError(f"{args.run}: no checkpoint to export")
    state = ckpt.read_state(path)
    drafter = DFlashDrafter(DrafterConfig.from_dict(state["drafter_config"]))
    drafter.load_state_dict(ckpt.load_model_weights(path), strict=True)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    out = export_drafter(drafter, args.out, dtype=dtype)
    print(json.dumps({"exported": str(out), "checkpoint": str(path), "step": state["step"], "dtype": args.dtype}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train", description="DFlash drafter trainer")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_fit(subparsers)
    add_export(subparsers)
    cli_eval.add_parser(subparsers)
    cli_diagnose.add_parser(subparsers)
    args = parser.parse_args(argv)
    from store_schema import CorruptShardError, StoreLockedError

    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError, FileExistsError, CorruptShardError, StoreLockedError) as error:
        # A refusal meant for the user (store from another target -- FingerprintMismatch
        # names the field --, corrupt shard, bad config key, missing path): say what, no traceback.
        print(f"error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
