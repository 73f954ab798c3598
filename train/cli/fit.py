"""`python -m train fit --store STORE --target PATH --out RUN [--config FILE]
[--max-steps N] [--init-from DIR] [--resume] [--progress-interval S] [--nproc N] [--set key=value ...]
[--nnodes N --node-rank R --master-addr HOST [--master-port P]] [--allow-other-target]
[--require-complete] [--verify-first] [--skip-verify] [--skip-space-check]`

The config resolves as defaults <- --config YAML <- explicit flags <- --set, is
saved into RUN, and the run trains. `--init-from DIR` fine-tunes a z-lab-format
drafter directory (a published one, or an export) instead of starting from
random weights: the run takes its shape and weights after checking them
against the store and the config (`train.fitting.init_from`). `--resume` continues RUN
from its newest checkpoint with RUN's saved config (flags and --set still
override it, e.g. a larger --max-steps). Ctrl-C checkpoints the last completed
step and prints how to resume (exit 130). `--nproc N` trains data-parallel on N
processes (one per GPU; gloo on CPU) by starting torchrun's launcher, as
`torchrun --nproc-per-node N -m train fit ...` does (`train.fitting.distributed`);
with `--nnodes N --node-rank R --master-addr HOST` this host is node R of N (the
same command on every host, --node-rank 0 on the one at HOST), as torchrun's
flags of the same names; the store and RUN must be the same paths on every node.

Before step 1 (`train.fitting.preflight`): the target must be the store's
(config and weights; `--allow-other-target` overrides, recorded in the run), an
incomplete store is named (`--require-complete` refuses it), the start check
reads every shard's commit record and file sizes and re-reads a few shards in
full (`--verify-first`: every committed file's crc32c; `--skip-verify` skips it)
and refuses damaged shards naming the repair command (the loader checks every
file's crc32c as it reads it), and the run's checkpoints must fit in
RUN's free space (`--skip-space-check` starts anyway). `--max-steps` wins over
`train.epochs`. A shard found corrupt mid-run checkpoints the last completed step
and prints the resume commands (exit 1); a disk that fills names the last good
checkpoint and the resume command (exit 1)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from store_schema.runtime.cli import SKIP_SPACE_CHECK_FLAG
from store_schema.runtime.estimate import DEFAULT_MFU
from train.cli import fraction_arg, positive_int
from train.target_check import ALLOW_FLAG, FULL_FLAG, add_target_flags


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("fit", help="train a drafter on a hidden-state store", description=__doc__)
    p.add_argument("--store", help="hidden-state store: a directory or s3://bucket/prefix (credentials and endpoint "
                   "from the standard AWS variables: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, profiles ...)")
    p.add_argument("--target", help="target model directory (config.json, safetensors, tokenizer)")
    p.add_argument("--out", help="run directory (required, except with --dry-run)")
    p.add_argument("--config", help="YAML (or JSON) config file")
    p.add_argument("--max-steps", type=int, help="optimizer steps (default: epochs over the store)")
    p.add_argument("--init-from", metavar="DIR",
                   help="fine-tune this drafter directory (config.json with dflash_config + model.safetensors)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its newest checkpoint")
    p.add_argument("--progress-interval", type=float, metavar="S",
                   help="seconds between progress lines when stderr is not a terminal (train.progress_interval, 30)")
    p.add_argument("--nproc", type=positive_int, metavar="N",
                   help="train data-parallel on N processes (one per GPU), started through torchrun's launcher")
    p.add_argument("--nnodes", type=positive_int, default=1, metavar="N",
                   help="hosts in the job, each running --nproc processes (torchrun's --nnodes; default 1)")
    p.add_argument("--node-rank", type=int, default=0, metavar="R",
                   help="this host's rank among --nnodes, 0 on the --master-addr host (torchrun's --node-rank)")
    p.add_argument("--master-addr", default="127.0.0.1", metavar="HOST",
                   help="address of the node-rank 0 host, reachable from every node (torchrun's --master-addr)")
    p.add_argument("--master-port", type=positive_int, metavar="P",
                   help="a free port on --master-addr (torchrun's --master-port and its default)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set optim.lr=3e-4 --set num_anchors=256")
    p.add_argument("--dry-run", action="store_true",
                   help="print the run's memory per GPU and steps per epoch from --target's config.json; train nothing")
    p.add_argument("--samples", type=int, help="--dry-run without --store: the samples an epoch has")
    p.add_argument("--tokens-per-s", type=float, metavar="N",
                   help="--dry-run: training tokens/s of one GPU, to print the run's hours (checked against "
                        "--gpu-tflops: a rate above the GPU's peak is refused)")
    p.add_argument("--gpu-tflops", type=float, metavar="TFLOPS",
                   help="--dry-run: one GPU's dense bf16 peak (e.g. 989 for an H200), to print the run's hours "
                        "from its FLOPs")
    p.add_argument("--mfu", type=fraction_arg, default=DEFAULT_MFU,
                   help="--dry-run: model FLOPs utilisation with --gpu-tflops (default %(default)s)")
    p.add_argument("--gpu-memory", type=float, metavar="GIB",
                   help="--dry-run: memory of one GPU in GiB, to say whether the run fits (e.g. 96, 141)")
    add_target_flags(p)
    p.add_argument("--require-complete", action="store_true",
                   help="refuse a store holding fewer shards than its plan (default: warn and train on those)")
    p.add_argument("--verify-first", action="store_true",
                   help="re-read every committed file's crc32c before step 1 (default: commit records and sizes of "
                        "every shard, data.verify_sampled_shards re-read; the loader checks each file as it reads it)")
    p.add_argument("--skip-verify", action="store_true",
                   help="skip the start check of the store before step 1")
    p.add_argument(SKIP_SPACE_CHECK_FLAG, action="store_true",
                   help="start even when the run's checkpoints exceed --out's free space")
    p.set_defaults(handler=run)


FLAGS = (("allow_other_target", ALLOW_FLAG), ("require_complete", "--require-complete"), ("skip_verify", "--skip-verify"),
         ("verify_first", "--verify-first"),
         ("skip_space_check", SKIP_SPACE_CHECK_FLAG), ("full_weights_check", FULL_FLAG))


def fit_argv(args) -> list[str]:
    """The command line of one process of a `--nproc` job: these arguments without the launch flags."""
    argv = ["--out", args.out]
    for flag, value in (("--store", args.store), ("--target", args.target), ("--config", args.config),
                        ("--max-steps", args.max_steps), ("--init-from", args.init_from),
                        ("--progress-interval", args.progress_interval)):
        if value is not None:
            argv += [flag, str(value)]
    if args.resume:
        argv.append("--resume")
    argv += [flag for name, flag in FLAGS if getattr(args, name)]
    for override in args.overrides:
        argv += ["--set", override]
    return argv


def resume_commands(args, store) -> tuple[str, str]:
    """The command that continues the run in --out, and the one that also leaves corrupt shards out."""
    flags = "".join(f" {flag}" for name, flag in FLAGS[:2] if getattr(args, name))
    command = f"python -m train fit --out {args.out} --resume{flags}"
    return command, f"{command} --set data.skip_corrupt_shards=true"


def run(args) -> int:
    # here, not at the top: `--help` loads none of torch (tests/test_cli_rules.py)
    from store_schema.runtime.cli import UsageError
    from store_schema.runtime.target_weights import check_target_weights
    from train.fitting.checkpoint import Checkpointer
    from train.fitting.distributed import DEFAULT_MASTER_PORT, Nodes

    if args.dry_run:
        from train.fitting.estimate import dry_run

        return dry_run(args)
    if not args.out:
        raise UsageError("fit needs --out RUN (the run directory; only --dry-run goes without)")
    if args.verify_first and args.skip_verify:
        raise UsageError("--verify-first and --skip-verify exclude each other")
    if args.resume:
        Checkpointer(args.out).resume_point(resume=True)  # before the config is read: one line if there is none
    config = resolve_config(args)
    check_target_weights(config.target, "--target")  # before torch or torchrun start: one line naming it
    nodes = Nodes(args.nnodes, args.node_rank, args.master_addr, args.master_port or DEFAULT_MASTER_PORT)
    if "WORLD_SIZE" not in os.environ and (args.nproc or 1) * nodes.count > 1:
        return launch_job(args, config, nodes)
    return train(args, config)


def launch_job(args, config, nodes) -> int:
    """`--nproc N` (and `--nnodes`): start torchrun's launcher, which runs this command in each process."""
    # here, not at the top: `--help` loads none of torch (tests/test_cli_rules.py)
    from store_schema.stores import open_store
    from train.data.lanes import check_world
    from train.data.loader import check_lanes
    from train.fitting.distributed import launch

    # Refused here, once, before any process starts (each would refuse it on its own).
    world_size = (args.nproc or 1) * nodes.count
    lanes = config.data.lanes or world_size
    if not args.resume:  # a resumed run's lanes are its checkpoint's, checked by each process
        check_lanes(config.store, lanes, len(open_store(config.store).committed_shards()))
    check_world(world_size, world_size if args.resume else lanes, config.train.sequences_per_step, resumed=False)
    return launch(args.nproc or 1, fit_argv(args), Path(args.out), nodes)


def train(args, config) -> int:
    """This process's part of the run: build it, train it, say how it ended."""
    # here, not at the top: `--help` loads none of torch (tests/test_cli_rules.py)
    from store_schema.runtime.cli import interrupted
    from train.fitting.distributed import close_process_group
    from train.fitting.interrupts import TrainingInterrupted
    from train.fitting.preflight import FitChecks
    from train.fitting.trainer import Trainer

    checks = FitChecks(allow_other_target=args.allow_other_target, require_complete=args.require_complete,
                       verify=not args.skip_verify, verify_first=args.verify_first, space=not args.skip_space_check,
                       full_weights=args.full_weights_check)
    try:
        trainer = Trainer.from_config(config, resume=args.resume, log=lambda line: print(line, file=sys.stderr),
                                      checks=checks)
    except KeyboardInterrupt:
        return interrupted("before the first step, no new checkpoint", "rerun the same command")
    if trainer.step >= trainer.total_steps:  # a resume whose --max-steps the run has already reached
        if trainer.world.is_main:
            print(f"fit: nothing to train: {args.out} is already at step {trainer.step} of {trainer.total_steps} "
                  "planned (raise --max-steps to train further)", file=sys.stderr)
            print(json.dumps({"step": trainer.step, "trained_steps": 0}))
        trainer.feed.close()
        trainer.release_replica()
        close_process_group()
        return 0
    if trainer.world.is_main:
        announce(trainer)
    try:
        last = trainer.fit()
    except (TrainingInterrupted, Exception) as error:
        return stopped(args, config, trainer, error)
    trainer.release_replica()
    close_process_group()
    if trainer.world.is_main:
        for line in finished_lines(trainer.step, last, args.out, config):
            print(line, file=sys.stderr)
        print(json.dumps({"step": trainer.step, **{k: v for k, v in last.items() if not isinstance(v, list)}}))
    return 0


def announce(trainer) -> None:
    """Rank 0's lines before step 1: the corpus's provenance warning, the run's size."""
    # here, not at the top: `--help` loads none of torch (tests/test_cli_rules.py)
    from store_schema import provenance_warning

    warning = provenance_warning(trainer.store.fingerprint.response_provenance)
    if warning:
        print(warning, file=sys.stderr)
    print(f"fit: {trainer.total_steps} steps, drafter {sum(p.numel() for p in trainer.drafter.parameters()):,} "
          f"parameters, context layers {trainer.drafter.config.context_layer_ids}, device {trainer.device}, "
          f"{trainer.world.size} process(es), {trainer.feed.lanes} lane(s)", file=sys.stderr)


def stopped(args, config, trainer, error: BaseException) -> int:
    """The exit of a run that stopped early: Ctrl-C (130), a corrupt shard or a lost
    peer (1), each said in one line; anything else is raised."""
    # here, not at the top: `--help` loads none of torch (tests/test_cli_rules.py)
    from store_schema.runtime.cli import fail, interrupted
    from store_schema.runtime.host import is_disk_full
    from train.fitting.distributed import LAUNCHED_BY_FIT, is_peer_loss
    from train.fitting.interrupts import DataStopped, TrainingInterrupted
    from train.fitting.preflight import REPAIR_COMMAND

    distributed = trainer.world.distributed
    if isinstance(error, TrainingInterrupted):
        if not trainer.world.is_main:
            return 130  # rank 0 says what was kept
        if error.checkpoint is None:
            return interrupted("no checkpoint yet", "rerun the same command")
        kept = (f"checkpoint of step {error.step} saved in {error.checkpoint}" if not distributed
                else f"the last checkpoint is {error.checkpoint}")
        return interrupted(kept, f"resume with: {resume_commands(args, config.store)[0]}")
    if isinstance(error, DataStopped):
        shard = error.error
        kept = (f"checkpoint of step {error.step} saved in {error.checkpoint}" if error.checkpoint
                else "no checkpoint was written")
        resume, skipping = resume_commands(args, config.store)
        return fail(f"shard {shard.shard}: {shard.file}: {shard.what}; {kept}; repair the store with "
                    f"`{REPAIR_COMMAND.format(store=config.store)}` and `python -m extract run`, then resume with "
                    f"`{resume}`, or resume leaving the shard out: `{skipping}`")
    if is_disk_full(error):
        return disk_full(args, config.store, error)
    if not distributed or not is_peer_loss(error):
        raise error
    # A collective failed: another process of the job is gone. Under --nproc the launcher
    # names it in its one line; under torchrun this rank says what it saw.
    if os.environ.get(LAUNCHED_BY_FIT):
        return 1
    return fail(f"rank {trainer.world.rank}: another process of the job stopped "
                f"({str(error).splitlines()[0] if str(error) else type(error).__name__}); "
                "the job cannot continue; the same command with --resume continues from the last checkpoint")


def disk_full(args, store, error: OSError) -> int:
    """A disk that filled mid-run: one line naming what failed, the last good
    checkpoint (the steps after it are lost) and how to go on (exit 1)."""
    # here, not at the top: `--help` loads none of torch (tests/test_cli_rules.py)
    from store_schema.runtime.cli import fail
    from train.fitting.checkpoint import latest_checkpoint, read_state

    latest = latest_checkpoint(args.out)
    what = " ".join(str(error).split()) if error.filename is None else f"disk full writing {error.filename}"
    if latest is None:
        return fail(f"{what}; no checkpoint was written; free space in {args.out} and rerun the same command")
    return fail(f"{what}; the last good checkpoint is {latest} (step {read_state(latest)['step']}), the steps "
                f"after it are lost; free space in {args.out} and resume with `{resume_commands(args, store)[0]}`")


def finished_lines(step: int, last: dict, out: str, config) -> list[str]:
    """What a finished run says before its JSON line: where it ended and the next commands."""
    # here, not at the top: `--help` loads none of torch (tests/test_cli_rules.py)
    from train.fitting.checkpoint import latest_checkpoint
    from train.fitting.runlog import LOG_FILE

    figures = [f"{name} {last[key]:{form}}" for key, name, form in
               (("loss", "loss", ".4f"), ("acc", "top-1", ".1%"), ("eval_tau", "eval tau", ".2f"))
               if isinstance(last.get(key), (int, float))]
    checkpoint = latest_checkpoint(out)
    drafter = Path(out) / "drafter"
    return [f"fit: done at step {step}" + "".join(f", {figure}" for figure in figures)
            + (f"; checkpoint {checkpoint}" if checkpoint else "") + f"; run log {Path(out) / LOG_FILE}",
            f"next: python -m train export {out} --out {drafter}",
            f"      python -m train eval --store {config.store} --drafter {drafter} --target {config.target}",
            f"      python -m train diagnose {out}"]


def resolve_config(args):
    """The run's config (defaults <- --config <- flags <- --set). A --set that is not
    KEY=VALUE of a known key, or a run without --store / --target, is a usage error (exit 2)."""
    # here, not at the top: `--help` loads none of torch (tests/test_cli_rules.py)
    from store_schema.runtime.cli import UsageError
    from train.config import CONFIG_FILE
    from train.config_error import ConfigError
    from train.config_loading import check_override, load_config

    for override in args.overrides:
        try:
            check_override(override)
        except ConfigError as error:
            raise UsageError(f"--set {override}: {error}") from None
    config_file = args.config
    if args.resume and config_file is None and (Path(args.out) / CONFIG_FILE).is_file():
        config_file = str(Path(args.out) / CONFIG_FILE)
    config = load_config(
        config_file, args.overrides, store=args.store, target=args.target, out=args.out, require_paths=False,
        **{"train.max_steps": args.max_steps, "model.init_from": args.init_from,
           "train.progress_interval": args.progress_interval},
    )
    for name in ("store", "target"):
        if not getattr(config, name):
            raise UsageError(f"fit: --{name} is required (or a --config that sets {name})")
    return config
