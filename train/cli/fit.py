"""`python -m train fit --store STORE --target PATH --out RUN [--config FILE]
[--max-steps N] [--resume] [--set key=value ...]`

The config resolves as defaults <- --config YAML <- explicit flags <- --set, is
saved into RUN, and the run trains. `--resume` continues RUN from its newest
checkpoint with RUN's saved config (flags and --set still override it, e.g. a
larger --max-steps)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("fit", help="train a drafter on a hidden-state store", description=__doc__)
    p.add_argument("--store", help="hidden-state store directory")
    p.add_argument("--target", help="target model directory (config.json, safetensors, tokenizer)")
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--config", help="YAML (or JSON) config file")
    p.add_argument("--max-steps", type=int, help="optimizer steps (default: epochs over the store)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its newest checkpoint")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set optim.lr=3e-4 --set num_anchors=256")
    p.set_defaults(handler=run)


def run(args) -> int:
    from train.config import CONFIG_FILE, load_config
    from train.trainer import Trainer

    config_file = args.config
    if args.resume and config_file is None and (Path(args.out) / CONFIG_FILE).is_file():
        config_file = str(Path(args.out) / CONFIG_FILE)
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
