"""`python -m train eval`'s handler (its parser: train/cli/eval.py). Imported only
when the command runs, so it imports at the top."""

from __future__ import annotations

import json
import math
import sys

from store_schema.runtime.cli import fail
from store_schema.runtime.host import resolve_device
from store_schema.runtime.progress import Progress, default_mode
from store_schema.runtime.target_weights import check_target_weights
from store_schema.stores import open_store
from train.dtypes import torch_dtype
from train.evaluation.config import EvalConfig
from train.evaluation.evaluate import evaluate
from train.evaluation.stands_for import describe
from train.export.drafter_dir import heldout_fraction, load_drafter, resolve_drafter_dir
from train.target_check import check_target
from train.target_head import load_target_head


def eval_config(args) -> EvalConfig:
    """The `eval` section the flags describe."""
    return EvalConfig(
        samples=args.max_samples,
        ddtree_budgets=tuple(args.ddtree_budgets),
        labels=args.labels,
        anchor_stride=args.anchor_stride,
        max_blocks_per_sample=args.max_blocks_per_sample,
        batch_blocks=args.batch_blocks,
    ).validate()


def run(args) -> int:
    config = eval_config(args)
    store = open_store(args.store)
    check_target_weights(args.target, "--target")  # not "another checkpoint" when it has no weights at all
    other_target = check_target(
        store,
        args.target,
        allow_other_target=args.allow_other_target,
        full=args.full_weights_check,
        log=lambda line: print(line, file=sys.stderr),
    )
    device = resolve_device(args.device)
    dtype = torch_dtype(args.dtype) if args.dtype else None
    drafter_dir = resolve_drafter_dir(args.drafter)
    fraction = heldout_fraction(args.split, args.heldout_fraction, drafter_dir)
    drafter = load_drafter(drafter_dir, dtype=dtype, device=device)
    head = load_target_head(args.target, dtype=dtype or drafter.fc.weight.dtype, device=device)

    def progress(total: int) -> Progress:
        print(f"eval: {total} {args.split} sample(s) of {args.store} on {device}", file=sys.stderr, flush=True)
        return Progress("eval", total, "sample", mode=default_mode(), interval=10.0)

    result = evaluate(
        drafter,
        head,
        store,
        config,
        split=args.split,
        heldout_fraction=fraction,
        progress=progress,
        cache_dir=args.cache_dir,
    )
    result["drafter"] = str(drafter_dir)
    result.update(other_target)
    if result["samples"] == 0:
        return fail(f"no {args.split} sample with a scoreable block in {args.store}")
    if config.samples is not None and result["split_samples"] > config.samples:
        print(
            f"note: evaluated the first {config.samples} of {result['split_samples']} {args.split} samples "
            "(--max-samples; 'all' for every one)",
            file=sys.stderr,
        )
    print(to_json(result) if args.json else f"drafter {drafter_dir}\n" + render_table(result))
    return 0


# -- presentation --------------------------------------------------------------------------
def to_json(result: dict) -> str:
    """One JSON object on one line; ddtree budgets become string keys, nan becomes null."""

    def clean(value):
        if isinstance(value, float) and math.isnan(value):
            return None
        if isinstance(value, dict):
            return {str(k): clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    return json.dumps(clean(result))  # one line: `tail -1 | jq` works


def _fmt(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def render_table(result: dict) -> str:
    """A readable summary: headline acceptance, accuracies, per-position accuracy."""
    block = result.get("block_size", len(result["per_position_acc"]) + 1)
    split = result.get("split", "?")
    if result.get("heldout_fraction") is not None:
        split += f" (held-out fraction {result['heldout_fraction']})"
    lines = [
        f"split {split}, labels {result.get('labels', '?')}: "
        f"{result['samples']} samples, {result['rounds']} decoding rounds, {result['blocks']} per-position "
        f"blocks of {block} (anchor stride {result.get('anchor_stride', 1)})",
        "",
        f"{'metric':<34}{'value':>10}",
        f"{'-' * 44}",
        f"{'tau (decode-time, ' + result.get('path', 'argmax chain') + ')':<34}{_fmt(result['tau']):>10}",
    ]
    if result.get("path", "argmax chain") != "argmax chain":
        lines.append(f"{'tau along the argmax chain':<34}{_fmt(result['tau_unary']):>10}")
    for budget, value in sorted(result["ddtree"].items(), key=lambda kv: int(kv[0])):
        lines.append(f"{f'DDTree acceptance @ {budget} (decode)':<34}{_fmt(value):>10}")
    if result.get("stands_for"):
        lines.append(describe(result["stands_for"]))
    lines += [
        f"{'tau per position (estimate)':<34}{_fmt(result['tau_per_position']):>10}",
        f"{'top-1 accuracy':<34}{_fmt(result['top1_acc']):>10}",
        f"{'top-4 accuracy':<34}{_fmt(result['top4_acc']):>10}",
        f"{'top-8 accuracy':<34}{_fmt(result['top8_acc']):>10}",
        "",
        "per-position top-1 accuracy (slot: acc)",
    ]
    per_position = result["per_position_acc"]
    for row in range(0, len(per_position), 5):
        cells = [f"{row + i + 1:>2}: {_fmt(v)}" for i, v in enumerate(per_position[row : row + 5])]
        lines.append("  " + "   ".join(cells))
    histogram = result.get("acceptance_histogram")
    if histogram:
        lines += ["", "decoding rounds by acceptance length (length: share)"]
        for row in range(0, len(histogram), 8):
            cells = [f"{row + i + 1:>2}: {_fmt(v, 2)}" for i, v in enumerate(histogram[row : row + 8])]
            lines.append("  " + "   ".join(cells))
    return "\n".join(lines)
