"""Command line: ``python -m extract {plan,run,generate,config-only-target} ...``.

``plan --dry-run`` answers "what would this job be?" before any GPU time is
spent: samples, tokens, quarantine reasons and the store's estimated size.
``run`` plans the same way, then extracts on Ray workers into the store (or
resumes it) and prints the job's JSON report as its last line. ``generate`` has
the target regenerate every assistant turn of a corpus into a generated corpus
(Parquet shards + manifest) that ``run`` takes as its ``--corpus``.
``config-only-target`` writes the 27B target's config.json (no weights) for
dry-runs at its shape.

One parser module per command here (extract/cli/), each naming its handler as
"module:function" (extract/commands/: `run(args) -> int`), imported when the command
runs: the handlers pull numpy, transformers and torch, which `--help` and a usage
error should not wait for. Exit codes follow `store_schema.runtime.cli`: 0 done,
1 refused (a store made with other settings or held by a live job, a bad layer id,
a worker failure), 2 usage (bad arguments, a model or corpus path that does not
exist), 130 interrupted (Ctrl-C: one line says how to resume).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from store_schema.errors import StoreError
from store_schema.runtime.cli import CommandParser, run_command, show_defaults
from store_schema.runtime.host import set_torch_threads
from store_schema.runtime.startup import preload
from store_schema.runtime.target_weights import check_target_weights

from ..errors import ExtractError

COMMANDS = ("plan", "run", "generate", "config-only-target")
RAY_COMMANDS = ("run", "generate")  # the driver tokenizes; its workers set their own threads


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="python -m extract",
        description="Extract a target's hidden states into a store: plan, run, generate, config-only-target.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"extract.cli.{name.replace('-', '_')}").add_parser(commands)
    show_defaults(parser)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(dispatch, args, refusals=(ExtractError, StoreError))


def dispatch(args) -> int:
    """Import the command's handler (and what its job runs on, kept until exit), then run it."""
    if args.command == "run":  # the job's one weights check: before Ray or torch, one line, not a traceback
        check_target_weights(args.model, "--model")
    module, _, function = args.handler.partition(":")
    preload(module)
    if args.command in RAY_COMMANDS:
        set_torch_threads()
    return getattr(sys.modules[module], function)(args)
