"""python -m store_schema {info,verify,lossy,project} STORE
(STORE: a directory, or s3://bucket/prefix, gs://bucket/prefix)

One parser module per command (store_schema/cli/info.py, verify.py, lossy.py, project.py), each naming its
handler as "module:function" (store_schema/commands/: `run(args) -> int`), imported when
it runs: the handlers import the reader (torch, zarr), so `--help` and usage errors
answer at once. Exit codes and error lines follow `store_schema.runtime.cli`."""

from __future__ import annotations

import argparse
import importlib

from ..runtime.cli import EXIT_OK, EXIT_USAGE, CommandParser, run_command, show_defaults
from . import info, lossy, project, verify


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="python -m store_schema", description=(__doc__ or "").split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    info.add_parser(sub)
    verify.add_parser(sub)
    lossy.add_parser(sub)
    project.add_parser(sub)
    show_defaults(parser)
    return parser


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else EXIT_OK
    # here, not at the top: `--help` and usage errors load none of obstore, zarr or torch
    from obstore.exceptions import BaseError as ObjectStoreError

    from ..errors import StoreError
    from ..runtime.startup import preload

    if args.command == "verify":
        preload("store_schema.tools.verify")  # torch, through the reader
    module, _, function = args.handler.partition(":")  # the handler, imported now that its command runs
    return run_command(
        getattr(importlib.import_module(module), function), args, refusals=(StoreError, ObjectStoreError)
    )
