"""`python -m train eval --store STORE --drafter RUN_OR_EXPORT --target PATH
[--split heldout] [--ddtree-budgets 8,32,128] [--labels tokens|target] [--json]`.

`add_parser(subparsers)` registers the subcommand on train/__main__.py's parser;
`main(argv)` runs it standalone (also `python -m train.cli_eval ...`)."""

from __future__ import annotations

import argparse
import sys

import torch

from train import evaluate as ev

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _budgets(text: str) -> list[int]:
    try:
        budgets = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"budgets must be comma-separated integers, got {text!r}") from None
    if not budgets or any(b < 1 for b in budgets):
        raise argparse.ArgumentTypeError(f"budgets must be positive integers, got {text!r}")
    return budgets


def configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--store", required=True, help="hidden-state store (Zarr) extracted from the target")
    parser.add_argument("--drafter", required=True, help="exported drafter directory, or a run directory holding one")
    parser.add_argument("--target", required=True, help="target model directory (its embed_tokens/lm_head are read)")
    parser.add_argument("--split", choices=ev.SPLITS, default="heldout", help="samples to evaluate (default heldout)")
    parser.add_argument("--heldout-fraction", type=float, default=ev.DEFAULT_HELDOUT_FRACTION,
                        help=f"share of samples in the held-out split (default {ev.DEFAULT_HELDOUT_FRACTION})")
    parser.add_argument("--ddtree-budgets", type=_budgets, default=list(ev.DEFAULT_BUDGETS),
                        help="DDTree node budgets, comma-separated (default 8,32,128)")
    parser.add_argument("--labels", choices=("tokens", "target"), default="tokens",
                        help="reference: stored tokens, or the target's top-1 (needs a store with top-k)")
    parser.add_argument("--max-samples", type=int, help="stop after this many samples of the split")
    parser.add_argument("--anchor-stride", type=int, default=1, help="every k-th anchor position (default 1: all)")
    parser.add_argument("--max-blocks-per-sample", type=int, help="at most this many blocks per sample, spread evenly")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="compute dtype (default: as stored)")
    parser.add_argument("--batch-blocks", type=int, default=256, help="blocks per drafter forward (default 256)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.set_defaults(handler=run)  # train/__main__.py dispatches on args.handler
    return parser


def add_parser(subparsers) -> argparse.ArgumentParser:
    return configure(subparsers.add_parser("eval", help="acceptance (tau, DDTree) and accuracy of a drafter on a store"))


def run(args) -> int:
    from store_schema import Store
    from train.export import load_drafter
    from train.target_head import load_target_head

    dtype = DTYPES[args.dtype] if args.dtype else None
    try:
        drafter_dir = ev.resolve_drafter_dir(args.drafter)
        drafter = load_drafter(drafter_dir, dtype=dtype, device=args.device)
        head = load_target_head(args.target, dtype=dtype or drafter.fc.weight.dtype, device=args.device)
        store = Store(args.store)
        result = ev.evaluate(
            drafter, head, store, split=args.split, ddtree_budgets=args.ddtree_budgets, labels=args.labels,
            max_samples=args.max_samples, anchor_stride=args.anchor_stride,
            max_blocks_per_sample=args.max_blocks_per_sample, heldout_fraction=args.heldout_fraction,
            batch_blocks=args.batch_blocks,
        )
    except (FileNotFoundError, KeyError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result["drafter"] = str(drafter_dir)
    if result["samples"] == 0:
        print(f"error: no {args.split} sample with a scoreable block in {args.store}", file=sys.stderr)
        return 1
    print(ev.to_json(result) if args.json else f"drafter {drafter_dir}\n" + ev.render_table(result))
    return 0


def main(argv=None) -> int:
    parser = configure(argparse.ArgumentParser(prog="python -m train eval", description=__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
