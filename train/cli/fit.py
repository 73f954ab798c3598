"""`python -m train fit --store STORE --target PATH --out RUN [--config FILE]
[--max-steps N] [--init-from DIR] [--resume] [--progress-interval S] [--nproc N] [--set key=value ...]
[--nnodes N --node-rank R --master-addr HOST [--master-port P]] [--allow-other-target]
[--require-complete] [--verify-first] [--skip-verify] [--skip-space-check]`

The config resolves as defaults <- --config YAML <- explicit flags <- --set, is
saved into RUN, and the run trains. `--init-from DIR` fine-tunes a z-lab-format
drafter directory (a published one, or an export) instead of starting from
random weights: the run takes its shape and weights after checking them
against the store and the config (`train.families.dflash.init_from`). `--resume` continues RUN
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
re-reads a few shards in full and checks the commit journal (`--verify-first`:
every committed file's crc32c; `--skip-verify` skips it) and refuses damaged
shards naming the repair command (the loader checks each shard's commit record
and every file's crc32c as it reads it), and the run's checkpoints must fit in
RUN's free space (`--skip-space-check` starts anyway). `--max-steps` wins over
`train.epochs`. A shard found corrupt mid-run checkpoints the last completed step
and prints the resume commands (exit 1); a disk that fills names the last good
checkpoint and the resume command (exit 1)."""

from __future__ import annotations

from store_schema.runtime.cli import SKIP_SPACE_CHECK_FLAG
from store_schema.runtime.estimate import DEFAULT_MFU
from store_schema.runtime.hub import model_dir_arg
from train.cli import add_target_flags, fraction_arg, positive_int


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("fit", help="train a drafter on a hidden-state store", description=__doc__)
    p.add_argument(
        "--store",
        help="hidden-state store: a directory or s3://bucket/prefix (credentials and endpoint "
        "from the standard AWS variables: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, profiles ...)",
    )
    p.add_argument(
        "--target",
        type=model_dir_arg,
        help="target model directory (config.json, safetensors, tokenizer) or cached hub id",
    )
    p.add_argument("--out", help="run directory (required, except with --dry-run)")
    p.add_argument("--config", help="YAML (or JSON) config file")
    p.add_argument("--max-steps", type=int, help="optimizer steps (default: epochs over the store)")
    p.add_argument(
        "--init-from",
        metavar="DIR",
        help="fine-tune this drafter (an export's directory: config.json + model.safetensors; a checkpoint; a run)",
    )
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its newest checkpoint")
    p.add_argument(
        "--progress-interval",
        type=float,
        metavar="S",
        help="seconds between progress lines when stderr is not a terminal (train.progress_interval, 30)",
    )
    add_process_flags(p)
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set optim.lr=3e-4 --set num_anchors=256",
    )
    add_dry_run_flags(p)
    add_target_flags(p)
    add_start_check_flags(p)
    p.set_defaults(handler="train.commands.fit:run")


def add_process_flags(p) -> None:
    """Data-parallel processes and hosts (torchrun's launcher, started by `fit` itself)."""
    p.add_argument(
        "--nproc",
        type=positive_int,
        metavar="N",
        help="train data-parallel on N processes (one per GPU), started through torchrun's launcher",
    )
    p.add_argument(
        "--nnodes",
        type=positive_int,
        default=1,
        metavar="N",
        help="hosts in the job, each running --nproc processes (torchrun's --nnodes; default 1)",
    )
    p.add_argument(
        "--node-rank",
        type=int,
        default=0,
        metavar="R",
        help="this host's rank among --nnodes, 0 on the --master-addr host (torchrun's --node-rank)",
    )
    p.add_argument(
        "--master-addr",
        default="127.0.0.1",
        metavar="HOST",
        help="address of the node-rank 0 host, reachable from every node (torchrun's --master-addr)",
    )
    p.add_argument(
        "--master-port",
        type=positive_int,
        metavar="P",
        help="a free port on --master-addr (torchrun's --master-port and its default)",
    )


def add_dry_run_flags(p) -> None:
    """`--dry-run`: the run on paper, from the target's config.json."""
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the run's memory per GPU and steps per epoch from --target's config.json; train nothing",
    )
    p.add_argument("--samples", type=int, help="--dry-run without --store: the samples an epoch has")
    p.add_argument(
        "--tokens-per-s",
        type=float,
        metavar="N",
        help="--dry-run: training tokens/s of one GPU, to print the run's hours (checked against "
        "--gpu-tflops: a rate above the GPU's peak is refused)",
    )
    p.add_argument(
        "--gpu-tflops",
        type=float,
        metavar="TFLOPS",
        help="--dry-run: one GPU's dense bf16 peak (e.g. 989 for an H200), to print the run's hours from its FLOPs",
    )
    p.add_argument(
        "--mfu",
        type=fraction_arg,
        default=DEFAULT_MFU,
        help="--dry-run: model FLOPs utilisation with --gpu-tflops (default %(default)s)",
    )
    p.add_argument(
        "--gpu-memory",
        type=float,
        metavar="GIB",
        help="--dry-run: memory of one GPU in GiB, to say whether the run fits (e.g. 96, 141)",
    )


def add_start_check_flags(p) -> None:
    """What `fit` checks of the store and --out before step 1, and how to relax it."""
    p.add_argument(
        "--require-complete",
        action="store_true",
        help="refuse a store holding fewer shards than its plan (default: warn and train on those)",
    )
    p.add_argument(
        "--verify-first",
        action="store_true",
        help="re-read every committed file's crc32c before step 1 (default: data.verify_sampled_shards "
        "re-read; the loader checks each shard's commit record and files as it opens it)",
    )
    p.add_argument("--skip-verify", action="store_true", help="skip the start check of the store before step 1")
    p.add_argument(
        SKIP_SPACE_CHECK_FLAG,
        action="store_true",
        help="start even when the run's checkpoints exceed --out's free space",
    )
