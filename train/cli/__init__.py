"""Command line of the trainer: `python -m train {fit,export,eval,diagnose,speculate,serve-check}`.

One parser module per subcommand (train/cli/fit.py, export.py, eval.py, diagnose.py,
speculate.py, serve_check.py), each with `add_parser(subparsers)` naming its handler
as "module:function" (train/commands/: `run(args) -> int`), imported when it runs. Every command runs
under `store_schema.runtime.cli.run_command`, the one exit-code rule of the project:
0 ok; 1 refused or a problem found (a store from another target, a corrupt
shard, a bad config value, diagnose findings); 2 usage (bad arguments, a path
that does not exist). Errors are one line on stderr, never a traceback.

The parser modules import nothing heavy (torch, zarr, the model come with the
handlers), so `python -m train --help` answers at once.
"""

from __future__ import annotations

import argparse
import importlib
import os
import warnings

from store_schema.runtime.cli import CommandParser, show_defaults
from train.dtypes import dtype_name
from train.target_check import ALLOW_FLAG, FULL_FLAG

COMMANDS = ("fit", "export", "eval", "diagnose", "speculate", "serve-check")
TORCH_COMMANDS = ("fit", "export", "eval", "speculate", "serve-check")  # diagnose reads logs with numpy only
# torch and transformers' Qwen3 layers: what every one builds on
TORCH_COMMAND_IMPORTS = ("train.families.dflash.model",)


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="python -m train", description="DFlash drafter trainer")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"train.cli.{name.replace('-', '_')}").add_parser(subparsers)
    show_defaults(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help (0) or bad arguments (2, argparse's message already printed)
        return exit_.code if isinstance(exit_.code, int) else 2
    # here, not at the top: `--help` loads none of torch (tests/test_cli_rules.py)
    from store_schema.errors import StoreError
    from store_schema.runtime.cli import run_command

    if args.command in TORCH_COMMANDS:
        from store_schema.runtime.host import set_torch_threads
        from store_schema.runtime.startup import preload

        quiet_transformers()  # before transformers is first imported: it reads the settings then
        preload(*TORCH_COMMAND_IMPORTS)
        set_torch_threads(processes=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))  # torchrun sets it per host
    module, _, function = args.handler.partition(":")  # the handler, imported now that its command runs
    return run_command(getattr(importlib.import_module(module), function), args, refusals=(StoreError,))


def quiet_transformers() -> None:
    """No "Loading weights" bar and no deprecation chatter (`past_key_values`) from
    transformers on the commands' stderr: read when it is first imported, so set
    before the handlers import it. Errors still show; an explicit setting wins."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)


# -- argument types shared by the commands ------------------------------------------------
def dtype_arg(text: str) -> str:
    """A dtype in either spelling (bf16 / bfloat16, ...) -> its long name."""
    try:
        return dtype_name(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def fraction_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {text!r}")
    return value


def budgets_arg(text: str) -> tuple[int, ...]:
    try:
        budgets = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"budgets must be comma-separated integers, got {text!r}") from None
    if not budgets or any(b < 1 for b in budgets):
        raise argparse.ArgumentTypeError(f"budgets must be positive integers, got {text!r}")
    return budgets


def add_target_flags(parser) -> None:
    """The target check's flags, worded the same on every command that checks."""
    parser.add_argument(
        ALLOW_FLAG,
        action="store_true",
        help="use a --target whose config or weights differ from the store's target (recorded)",
    )
    parser.add_argument(
        FULL_FLAG,
        action="store_true",
        help="compare every byte of --target's weights with the store's digest (read once per host, "
        "then cached by file size and mtime; default: config, weight headers and sampled bytes)",
    )
