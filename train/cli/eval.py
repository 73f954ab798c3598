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
the run config's `eval` section (train.evaluation.config.EvalConfig); unlike the training
loop, the command rolls out whole responses, and evaluates at most 256 samples
of the split unless told otherwise (`--max-samples all`), reading only their
rows. Prints a table, or one JSON object with --json."""

from __future__ import annotations

from store_schema.runtime.hub import model_dir_arg
from train.cli import add_target_flags, budgets_arg, dtype_arg, fraction_arg, positive_int
from train.data.config import SPLITS, DataConfig
from train.dtypes import NAMES
from train.evaluation.config import EVAL_CLI_SAMPLES, LABELS, EvalConfig


def add_parser(subparsers) -> None:
    defaults = EvalConfig()
    p = subparsers.add_parser(
        "eval",
        help="acceptance (tau, DDTree) and accuracy of a drafter on a store",
        description=__doc__.split("\n\n")[1],
    )
    p.add_argument(
        "--store", required=True, help="hidden-state store extracted from the target: a directory or s3://bucket/prefix"
    )
    p.add_argument(
        "--drafter",
        required=True,
        type=model_dir_arg,
        help="exported drafter directory, a run directory holding one, or a cached hub id",
    )
    p.add_argument(
        "--target",
        required=True,
        type=model_dir_arg,
        help="target model directory (its embed_tokens/lm_head are read), or a cached hub id",
    )
    p.add_argument("--split", choices=SPLITS, default="heldout", help="samples to evaluate (default heldout)")
    p.add_argument(
        "--heldout-fraction",
        type=fraction_arg,
        help="share of samples in the held-out split (default: the training run's, as the export "
        f"records it; {DataConfig.heldout_fraction} for a drafter without that record)",
    )
    add_measure_flags(p, defaults)
    p.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    p.add_argument(
        "--dtype", type=dtype_arg, choices=NAMES, help="compute dtype, bf16/fp16/fp32 accepted too (default: as stored)"
    )
    p.add_argument(
        "--batch-blocks",
        type=positive_int,
        default=defaults.batch_blocks,
        help=f"blocks per drafter forward (default {defaults.batch_blocks})",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="read the evaluated samples' shards whole through this local directory (fit's "
        "data.cache_dir works; shards there are reused after a check): for object storage, where "
        "reading row by row is a request per row",
    )
    add_target_flags(p)
    p.set_defaults(handler="train.commands.eval:run")


def add_measure_flags(p, defaults: EvalConfig) -> None:
    """What is measured: the tree budgets, the reference labels, which samples and anchors."""
    p.add_argument(
        "--ddtree-budgets",
        type=budgets_arg,
        default=defaults.ddtree_budgets,
        help=f"DDTree node budgets, comma-separated (default {','.join(map(str, defaults.ddtree_budgets))})",
    )
    p.add_argument(
        "--labels",
        choices=LABELS,
        default=defaults.labels,
        help="reference: stored tokens, or the target's top-1 (needs a store with top-k)",
    )
    p.add_argument(
        "--max-samples",
        type=samples_arg,
        default=EVAL_CLI_SAMPLES,
        help=f"evaluate at most this many samples of the split (default {EVAL_CLI_SAMPLES}; 'all': every one)",
    )
    p.add_argument(
        "--anchor-stride",
        type=positive_int,
        default=defaults.anchor_stride,
        help=f"tau_per_position and accuracies: every k-th anchor position (default {defaults.anchor_stride}: all)",
    )
    p.add_argument(
        "--max-blocks-per-sample",
        type=positive_int,
        help="roll out only the first this many response positions of a sample (default: all)",
    )


def samples_arg(text: str) -> int | None:
    """A positive sample count, or 'all' (None: no cap)."""
    return None if text == "all" else positive_int(text)
