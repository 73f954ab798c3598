"""`python -m train fit`'s handler (its parser: train/cli/fit.py). Imported only
when the command runs, so it imports at the top."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from store_schema import provenance_warning
from store_schema.runtime.cli import SKIP_SPACE_CHECK_FLAG, UsageError, fail, interrupted
from store_schema.runtime.host import is_disk_full
from store_schema.runtime.target_config import read_target_config
from store_schema.runtime.target_weights import check_target_weights
from store_schema.stores import open_store
from train.config import CONFIG_FILE
from train.config_error import ConfigError
from train.config_loading import check_override, load_config
from train.data.lanes import check_world
from train.data.loader import check_lanes
from train.families.kinds import family_named
from train.fitting.checkpoint import Checkpointer, latest_checkpoint, read_state
from train.fitting.distributed import (
    DEFAULT_MASTER_PORT,
    LAUNCHED_BY_FIT,
    Nodes,
    close_process_group,
    is_peer_loss,
    launch,
)
from train.fitting.estimate import Sizing, estimate_lines, fit_estimate
from train.fitting.interrupts import DataStopped, TrainingInterrupted
from train.fitting.preflight import REPAIR_COMMAND, FitChecks
from train.fitting.runlog import LOG_FILE
from train.fitting.trainer import Trainer
from train.target_check import ALLOW_FLAG, FULL_FLAG


@dataclass(frozen=True)
class FitRequest:
    """What `fit` was asked, read from its flags once at the handler's top (train/cli/fit.py
    says what each means); everything below the handler takes this, never argparse's namespace."""

    out: str | None
    store: str | None
    target: str | None
    config: str | None
    max_steps: int | None
    init_from: str | None
    progress_interval: float | None
    resume: bool
    overrides: tuple[str, ...]
    allow_other_target: bool
    require_complete: bool
    skip_verify: bool
    verify_first: bool
    skip_space_check: bool
    full_weights_check: bool
    nproc: int | None
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int | None
    dry_run: bool
    sizing: Sizing  # --dry-run's: GPUs, --samples, and one GPU's rate, peak, utilisation, memory

    @classmethod
    def from_args(cls, args) -> "FitRequest":
        names = {field.name for field in dataclasses.fields(cls)} - {"overrides", "sizing"}
        sizing = Sizing(
            gpus=args.nproc or 1,
            samples=args.samples,
            tokens_per_s=args.tokens_per_s,
            gpu_tflops=args.gpu_tflops,
            mfu=args.mfu,
            gpu_memory_gib=args.gpu_memory,
        )
        return cls(**{name: getattr(args, name) for name in names}, overrides=tuple(args.overrides), sizing=sizing)

    def checks(self) -> FitChecks:
        return FitChecks(
            allow_other_target=self.allow_other_target,
            require_complete=self.require_complete,
            verify=not self.skip_verify,
            verify_first=self.verify_first,
            space=not self.skip_space_check,
            full_weights=self.full_weights_check,
        )

    @property
    def run_dir(self) -> str:
        """--out: every run has it, only the dry run goes without."""
        if not self.out:
            raise UsageError("fit needs --out RUN (the run directory; only --dry-run goes without)")
        return self.out

    def nodes(self) -> Nodes:
        return Nodes(self.nnodes, self.node_rank, self.master_addr, self.master_port or DEFAULT_MASTER_PORT)


FLAGS = (
    ("allow_other_target", ALLOW_FLAG),
    ("require_complete", "--require-complete"),
    ("skip_verify", "--skip-verify"),
    ("verify_first", "--verify-first"),
    ("skip_space_check", SKIP_SPACE_CHECK_FLAG),
    ("full_weights_check", FULL_FLAG),
)


def fit_argv(request: FitRequest) -> list[str]:
    """The command line of one process of a `--nproc` job: these arguments without the launch flags."""
    argv = ["--out", request.run_dir]
    for flag, value in (
        ("--store", request.store),
        ("--target", request.target),
        ("--config", request.config),
        ("--max-steps", request.max_steps),
        ("--init-from", request.init_from),
        ("--progress-interval", request.progress_interval),
    ):
        if value is not None:
            argv += [flag, str(value)]
    if request.resume:
        argv.append("--resume")
    argv += [flag for name, flag in FLAGS if getattr(request, name)]
    for override in request.overrides:
        argv += ["--set", override]
    return argv


def resume_commands(request: FitRequest) -> tuple[str, str]:
    """The command that continues the run in --out, and the one that also leaves corrupt shards out."""
    flags = "".join(f" {flag}" for name, flag in FLAGS[:2] if getattr(request, name))
    command = f"python -m train fit --out {request.run_dir} --resume{flags}"
    return command, f"{command} --set data.skip_corrupt_shards=true"


def run(args) -> int:
    request = FitRequest.from_args(args)
    if request.dry_run:
        return dry_run(request)
    run_dir = request.run_dir  # without --out: a usage error, before any other
    if request.verify_first and request.skip_verify:
        raise UsageError("--verify-first and --skip-verify exclude each other")
    latest = Checkpointer(run_dir).resume_point(request.resume)  # before the config is read: one line if wrong
    config = resolve_config(request)
    check_target_weights(config.target, "--target")  # before torch or torchrun start: one line naming it
    nodes = request.nodes()
    if "WORLD_SIZE" not in os.environ and (request.nproc or 1) * nodes.count > 1:
        return launch_job(request, config, nodes)
    return train(request, config, latest)


def launch_job(request: FitRequest, config, nodes: Nodes) -> int:
    """`--nproc N` (and `--nnodes`): start torchrun's launcher, which runs this command in each process."""
    # Refused here, once, before any process starts (each would refuse it on its own).
    world_size = (request.nproc or 1) * nodes.count
    lanes = config.data.lanes_for(world_size)
    if not request.resume:  # a resumed run's lanes are its checkpoint's, checked by each process
        check_lanes(config.store, lanes, len(open_store(config.store).committed_shards()))
    check_world(world_size, world_size if request.resume else lanes, config.train.sequences_per_step, resumed=False)
    return launch(request.nproc or 1, fit_argv(request), Path(request.run_dir), nodes)


def train(request: FitRequest, config, latest: Path | None) -> int:
    """This process's part of the run: build it (continuing `latest`, the checkpoint
    `run` chose), train it, say how it ended."""
    try:
        trainer = Trainer.from_start(
            config, latest, log=lambda line: print(line, file=sys.stderr), checks=request.checks()
        )
    except KeyboardInterrupt:
        return interrupted("before the first step, no new checkpoint", "rerun the same command")
    if trainer.step >= trainer.total_steps:  # a resume whose --max-steps the run has already reached
        if trainer.world.is_main:
            print(
                f"fit: nothing to train: {request.run_dir} is already at step {trainer.step} of {trainer.total_steps} "
                "planned (raise --max-steps to train further)",
                file=sys.stderr,
            )
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
        return stopped(request, config, trainer, error)
    trainer.release_replica()
    close_process_group()
    if trainer.world.is_main:
        for line in finished_lines(trainer.step, last, request.run_dir, config):
            print(line, file=sys.stderr)
        print(json.dumps({"step": trainer.step, **{k: v for k, v in last.items() if not isinstance(v, list)}}))
    return 0


def announce(trainer) -> None:
    """Rank 0's lines before step 1: the corpus's provenance warning, the run's size."""
    warning = provenance_warning(trainer.store.fingerprint.response_provenance)
    if warning:
        print(warning, file=sys.stderr)
    print(
        f"fit: {trainer.total_steps} steps, drafter {sum(p.numel() for p in trainer.drafter.parameters()):,} "
        f"parameters, context layers {trainer.drafter.config.context_layer_ids}, device {trainer.device}, "
        f"{trainer.world.size} process(es), {trainer.feed.lanes} lane(s)",
        file=sys.stderr,
    )


def stopped(request: FitRequest, config, trainer, error: BaseException) -> int:
    """The exit of a run that stopped early: Ctrl-C (130), a corrupt shard or a lost
    peer (1), each said in one line; anything else is raised."""
    distributed = trainer.world.distributed
    if isinstance(error, TrainingInterrupted):
        if not trainer.world.is_main:
            return 130  # rank 0 says what was kept
        if error.checkpoint is None:
            return interrupted("no checkpoint yet", "rerun the same command")
        kept = (
            f"checkpoint of step {error.step} saved in {error.checkpoint}"
            if not distributed
            else f"the last checkpoint is {error.checkpoint}"
        )
        return interrupted(kept, f"resume with: {resume_commands(request)[0]}")
    if isinstance(error, DataStopped):
        shard = error.error
        kept = (
            f"checkpoint of step {error.step} saved in {error.checkpoint}"
            if error.checkpoint
            else "no checkpoint was written"
        )
        resume, skipping = resume_commands(request)
        return fail(
            f"shard {shard.shard}: {shard.file}: {shard.what}; {kept}; repair the store with "
            f"`{REPAIR_COMMAND.format(store=config.store)}` and `python -m extract run`, then resume with "
            f"`{resume}`, or resume leaving the shard out: `{skipping}`"
        )
    if is_disk_full(error):
        return disk_full(request, error)
    if not distributed or not is_peer_loss(error):
        raise error
    # A collective failed: another process of the job is gone. Under --nproc the launcher
    # names it in its one line; under torchrun this rank says what it saw.
    if os.environ.get(LAUNCHED_BY_FIT):
        return 1
    return fail(
        f"rank {trainer.world.rank}: another process of the job stopped "
        f"({str(error).splitlines()[0] if str(error) else type(error).__name__}); "
        "the job cannot continue; the same command with --resume continues from the last checkpoint"
    )


def disk_full(request: FitRequest, error: BaseException) -> int:
    """A disk that filled mid-run: one line naming what failed, the last good
    checkpoint (the steps after it are lost) and how to go on (exit 1)."""
    out = request.run_dir
    latest = latest_checkpoint(out)
    filename = getattr(error, "filename", None)
    what = " ".join(str(error).split()) if filename is None else f"disk full writing {filename}"
    if latest is None:
        return fail(f"{what}; no checkpoint was written; free space in {out} and rerun the same command")
    return fail(
        f"{what}; the last good checkpoint is {latest} (step {read_state(latest)['step']}), the steps "
        f"after it are lost; free space in {out} and resume with `{resume_commands(request)[0]}`"
    )


def finished_lines(step: int, last: dict, out: str, config) -> list[str]:
    """What a finished run says before its JSON line: where it ended and the next commands."""
    figures = [
        f"{name} {last[key]:{form}}"
        for key, name, form in (("loss", "loss", ".4f"), ("acc", "top-1", ".1%"), ("eval_tau", "eval tau", ".2f"))
        if isinstance(last.get(key), (int, float))
    ]
    checkpoint = latest_checkpoint(out)
    drafter = Path(out) / "drafter"
    return [
        f"fit: done at step {step}"
        + "".join(f", {figure}" for figure in figures)
        + (f"; checkpoint {checkpoint}" if checkpoint else "")
        + f"; run log {Path(out) / LOG_FILE}",
        f"next: python -m train export {out} --out {drafter}",
        f"      python -m train eval --store {config.store} --drafter {drafter} --target {config.target}",
        f"      python -m train diagnose {out}",
    ]


def resolve_config(request: FitRequest):
    """The run's config (defaults <- --config <- flags <- --set). A --set that is not
    KEY=VALUE of a known key, or a run without --store / --target, is a usage error (exit 2)."""
    for override in request.overrides:
        try:
            check_override(override)
        except ConfigError as error:
            raise UsageError(f"--set {override}: {error}") from None
    config_file = request.config
    if request.resume and config_file is None and (Path(request.run_dir) / CONFIG_FILE).is_file():
        config_file = str(Path(request.run_dir) / CONFIG_FILE)
    config = load_config(
        config_file,
        list(request.overrides),
        store=request.store,
        target=request.target,
        out=request.out,
        require_paths=False,
        **{
            "train.max_steps": request.max_steps,
            "model.init_from": request.init_from,
            "train.progress_interval": request.progress_interval,
        },
    )
    for name in ("store", "target"):
        if not getattr(config, name):
            raise UsageError(f"fit: --{name} is required (or a --config that sets {name})")
    return config


def dry_run(request: FitRequest) -> int:
    """`fit --dry-run`: the run's config (file, flags, --set) sized for --target, the
    store's samples and layers when --store is given, else --samples and the default
    layers; prints the figures and their JSON as the last line."""
    if not request.target:
        raise ValueError("fit --dry-run needs --target (a directory with config.json; no weights are read)")
    config = load_config(
        request.config,
        list(request.overrides),
        require_paths=False,
        store=request.store,
        target=request.target,
        out=request.out,
        **{"train.max_steps": request.max_steps},
    )
    target = read_target_config(request.target)
    sizing, layer_ids = request.sizing, None
    if request.store:
        store = open_store(request.store)
        plan = store.plan()
        sizing = dataclasses.replace(sizing, samples=plan.num_samples, tokens=plan.num_tokens)
        layer_ids = list(store.fingerprint.layer_ids)
    model = dataclasses.replace(config.model, init_from=None)  # on paper: sized for the target, never loaded
    plan = family_named(model.architecture).plan(model, request.target, target, layer_ids, None, None, print)
    figures = dict(fit_estimate(config, target, plan.config, sizing), **plan.run_info)
    for line in estimate_lines(figures):
        print(line)
    print("dry run: nothing trained or written")
    print(json.dumps(figures, sort_keys=True))
    return 0
