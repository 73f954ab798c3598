"""`python -m train eval --store STORE --drafter RUN_OR_EXPORT --target PATH
[--split heldout|train|all] [--heldout-fraction F] [--ddtree-budgets 8,32,128]
[--labels tokens|target] [--json] ...`

Acceptance (decode-time tau, DDTree, the per-position estimate) and accuracy of
an exported drafter on a store's samples: each response is decoded round by
round along the stored text (`tau`), the headline; `tau_per_position` averages
over every anchor position instead and reads higher where the drafter has hard
stretches. The held-out split is the one of the run that trained the drafter, as
its export records it (`heldout_split` in config.json), so "held-out" means
exactly the samples that run never trained on; `--heldout-fraction` overrides
it, and a drafter directory without a record (e.g. a published z-lab drafter)
gets the trainer's default fraction, with a note. The flags set the fields of
the run config's `eval` section (train.acceptance.config.EvalConfig); unlike the training
loop, the command rolls out whole responses, and evaluates at most 256 samples
of the split unless told otherwise (`--max-samples all`), reading only their
rows. Prints a table, or one JSON object with --json."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from train.acceptance.config import EVAL_CLI_SAMPLES, EvalConfig
from train.cli import budgets_arg, dtype_arg, fraction_arg, positive_int
from train.data.config import SPLITS, DataConfig
from train.drafter.config import LABELS
from train.dtypes import NAMES, torch_dtype
from train.target_check import add_target_flags, check_target


def add_parser(subparsers) -> None:
    defaults = EvalConfig()
    p = subparsers.add_parser(
        "eval", help="acceptance (tau, DDTree) and accuracy of a drafter on a store", description=__doc__.split("\n\n")[1]
    )
    p.add_argument("--store", required=True, help="hidden-state store extracted from the target: a directory or s3://bucket/prefix")
    p.add_argument("--drafter", required=True, help="exported drafter directory, or a run directory holding one")
    p.add_argument("--target", required=True, help="target model directory (its embed_tokens/lm_head are read)")
    p.add_argument("--split", choices=SPLITS, default="heldout", help="samples to evaluate (default heldout)")
    p.add_argument("--heldout-fraction", type=fraction_arg,
                   help="share of samples in the held-out split (default: the training run's, as the export "
                        f"records it; {DataConfig.heldout_fraction} for a drafter without that record)")
    p.add_argument("--ddtree-budgets", type=budgets_arg, default=defaults.ddtree_budgets,
                   help=f"DDTree node budgets, comma-separated (default {','.join(map(str, defaults.ddtree_budgets))})")
    p.add_argument("--labels", choices=LABELS, default=defaults.labels,
                   help="reference: stored tokens, or the target's top-1 (needs a store with top-k)")
    p.add_argument("--max-samples", type=samples_arg, default=EVAL_CLI_SAMPLES,
                   help=f"evaluate at most this many samples of the split (default {EVAL_CLI_SAMPLES}; 'all': every one)")
    p.add_argument("--anchor-stride", type=positive_int, default=defaults.anchor_stride,
                   help=f"tau_per_position and accuracies: every k-th anchor position (default {defaults.anchor_stride}: all)")
    p.add_argument("--max-blocks-per-sample", type=positive_int,
                   help="roll out only the first this many response positions of a sample (default: all)")
    p.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    p.add_argument("--dtype", type=dtype_arg, choices=NAMES,
                   help="compute dtype, bf16/fp16/fp32 accepted too (default: as stored)")
    p.add_argument("--batch-blocks", type=positive_int, default=defaults.batch_blocks,
                   help=f"blocks per drafter forward (default {defaults.batch_blocks})")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--cache-dir", metavar="DIR",
                   help="read the evaluated samples' shards whole through this local directory (fit's "
                        "data.cache_dir works; shards there are reused after a check): for object storage, where "
                        "reading row by row is a request per row")
    add_target_flags(p)
    p.set_defaults(handler=run)


def samples_arg(text: str) -> int | None:
    """A positive sample count, or 'all' (None: no cap)."""
    return None if text == "all" else positive_int(text)


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


def heldout_fraction(args, drafter_dir: Path) -> float | None:
    """--heldout-fraction, else the export's record, else the default (with a note)."""
    # here, not at the top: `--help` loads none of torch (tests/test_cli_rules.py)
    from train.export.drafter_dir import read_heldout_fraction

    if args.split == "all":
        return None
    if args.heldout_fraction is not None:
        return args.heldout_fraction
    recorded = read_heldout_fraction(drafter_dir)
    if recorded is not None:
        return recorded
    default = DataConfig.heldout_fraction
    print(f"note: {drafter_dir / 'config.json'} records no held-out split (not exported by this trainer); "
          f"using the trainer's default fraction {default}; pass --heldout-fraction to set the training run's",
          file=sys.stderr)
    return default


def run(args) -> int:
    # here, not at the top: `--help` loads none of torch (tests/test_cli_rules.py)
    from store_schema.runtime.cli import fail
    from store_schema.runtime.host import resolve_device
    from store_schema.runtime.progress import Progress, default_mode
    from store_schema.runtime.target_weights import check_target_weights
    from store_schema.stores import open_store
    from train.acceptance.evaluate import evaluate
    from train.export.drafter_dir import load_drafter, resolve_drafter_dir
    from train.fitting.target_head import load_target_head

    config = eval_config(args)
    store = open_store(args.store)
    check_target_weights(args.target, "--target")  # not "another checkpoint" when it has no weights at all
    other_target = check_target(store, args.target, allow_other_target=args.allow_other_target, full=args.full_weights_check,
                                log=lambda line: print(line, file=sys.stderr))
    device = resolve_device(args.device)
    dtype = torch_dtype(args.dtype) if args.dtype else None
    drafter_dir = resolve_drafter_dir(args.drafter)
    fraction = heldout_fraction(args, drafter_dir)
    drafter = load_drafter(drafter_dir, dtype=dtype, device=device)
    head = load_target_head(args.target, dtype=dtype or drafter.fc.weight.dtype, device=device)

    def progress(total: int) -> Progress:
        print(f"eval: {total} {args.split} sample(s) of {args.store} on {device}", file=sys.stderr, flush=True)
        return Progress("eval", total, "sample", mode=default_mode(), interval=10.0)

    result = evaluate(drafter, head, store, config, split=args.split, heldout_fraction=fraction, progress=progress,
                      cache_dir=args.cache_dir)
    result["drafter"] = str(drafter_dir)
    result.update(other_target)
    if result["samples"] == 0:
        return fail(f"no {args.split} sample with a scoreable block in {args.store}")
    if config.samples is not None and result["split_samples"] > config.samples:
        print(f"note: evaluated the first {config.samples} of {result['split_samples']} {args.split} samples "
              "(--max-samples; 'all' for every one)", file=sys.stderr)
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
