"""`python -m train fit --store STORE --target PATH --out RUN [--config FILE]
[--max-steps N] [--init-from DIR] [--resume] [--progress-interval S] [--nproc N] [--set key=value ...]`

The config resolves as defaults <- --config YAML <- explicit flags <- --set, is
saved into RUN, and the run trains. `--init-from DIR` fine-tunes a z-lab-format
drafter directory (a published one, or an export) instead of starting from
random weights: the run takes its shape and weights after checking them
against the store and the config (`train.export.init_from`). `--resume` continues RUN
from its newest checkpoint with RUN's saved config (flags and --set still
override it, e.g. a larger --max-steps). Ctrl-C checkpoints the last completed
step and prints how to resume (exit 130). `--nproc N` trains data-parallel on N
processes (one per GPU; gloo on CPU) by starting torchrun's launcher, as
`torchrun --nproc-per-node N -m train fit ...` does (`train.fitting.distributed`)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from train.cli import positive_int


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("fit", help="train a drafter on a hidden-state store", description=__doc__)
    p.add_argument("--store", help="hidden-state store directory")
    p.add_argument("--target", help="target model directory (config.json, safetensors, tokenizer)")
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--config", help="YAML (or JSON) config file")
    p.add_argument("--max-steps", type=int, help="optimizer steps (default: epochs over the store)")
    p.add_argument("--init-from", metavar="DIR",
                   help="fine-tune this drafter directory (config.json with dflash_config + model.safetensors)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its newest checkpoint")
    p.add_argument("--progress-interval", type=float, metavar="S",
                   help="seconds between progress lines when stderr is not a terminal (train.progress_interval, 30)")
    p.add_argument("--nproc", type=positive_int, metavar="N",
                   help="train data-parallel on N processes (one per GPU), started through torchrun's launcher")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set optim.lr=3e-4 --set num_anchors=256")
    p.add_argument("--dry-run", action="store_true",
                   help="print the run's memory per GPU and steps per epoch from --target's config.json; train nothing")
    p.add_argument("--samples", type=int, help="--dry-run without --store: the samples an epoch has")
    p.set_defaults(handler=run)


def fit_argv(args) -> list[str]:
    """The command line of one process of a `--nproc` job: these arguments without --nproc."""
    argv = ["--out", args.out]
    for flag, value in (("--store", args.store), ("--target", args.target), ("--config", args.config),
                        ("--max-steps", args.max_steps), ("--init-from", args.init_from),
                        ("--progress-interval", args.progress_interval)):
        if value is not None:
            argv += [flag, str(value)]
    if args.resume:
        argv.append("--resume")
    for override in args.overrides:
        argv += ["--set", override]
    return argv


def run(args) -> int:
    from store_schema import Store, provenance_warning
    from store_schema.runtime.cli import fail, interrupted
    from train.fitting.checkpoint import CHECKPOINTS, latest_checkpoint
    from train.fitting.distributed import LAUNCHED_BY_FIT, close_process_group, is_peer_loss, launch

    if args.dry_run:
        from train.fitting.estimate import dry_run

        return dry_run(args)
    if args.nproc and args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return launch(args.nproc, fit_argv(args), Path(args.out))
    from train.config import CONFIG_FILE, load_config
    from train.fitting.progress import TrainingInterrupted
    from train.fitting.trainer import Trainer

    config_file = args.config
    if args.resume and latest_checkpoint(args.out) is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {Path(args.out) / CHECKPOINTS} "
                                "(nothing to continue; without --resume the run starts afresh)")
    if args.resume and config_file is None and (Path(args.out) / CONFIG_FILE).is_file():
        config_file = str(Path(args.out) / CONFIG_FILE)
    config = load_config(
        config_file, args.overrides, store=args.store, target=args.target, out=args.out,
        **{"train.max_steps": args.max_steps, "model.init_from": args.init_from,
           "train.progress_interval": args.progress_interval},
    )
    try:
        trainer = Trainer.from_config(config, resume=args.resume, log=lambda line: print(line, file=sys.stderr))
    except KeyboardInterrupt:
        return interrupted("before the first step, no new checkpoint", "rerun the same command")
    main = trainer.world.is_main
    if main:
        warning = provenance_warning(Store(config.store).fingerprint.response_provenance)
        if warning:
            print(warning, file=sys.stderr)
        print(f"fit: {trainer.total_steps} steps, drafter {sum(p.numel() for p in trainer.drafter.parameters()):,} "
              f"parameters, context layers {trainer.drafter.config.context_layer_ids}, device {trainer.device}, "
              f"{trainer.world.size} process(es), {trainer.feed.lanes} lane(s)", file=sys.stderr)
    try:
        last = trainer.fit()
    except TrainingInterrupted as stop:
        if not main:
            return 130  # rank 0 says what was kept
        if stop.checkpoint is None:
            return interrupted("no checkpoint yet", "rerun the same command")
        kept = (f"checkpoint of step {stop.step} saved in {stop.checkpoint}" if not trainer.world.distributed
                else f"the last checkpoint is {stop.checkpoint}")
        return interrupted(kept, f"resume with: python -m train fit --out {args.out} --resume")
    except Exception as error:
        if not trainer.world.distributed or not is_peer_loss(error):
            raise
        # A collective failed: another process of the job is gone. Under --nproc the launcher
        # names it in its one line; under torchrun this rank says what it saw.
        if os.environ.get(LAUNCHED_BY_FIT):
            return 1
        return fail(f"rank {trainer.world.rank}: another process of the job stopped "
                    f"({str(error).splitlines()[0] if str(error) else type(error).__name__}); "
                    "the job cannot continue; the same command with --resume continues from the last checkpoint")
    trainer.release_replica()
    close_process_group()
    if main:
        print(json.dumps({"step": trainer.step, **{k: v for k, v in last.items() if not isinstance(v, list)}}))
    return 0
