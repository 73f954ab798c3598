"""`python -m store_schema`: the command line lives in store_schema/cli/ (parsers) and
store_schema/commands/ (handlers)."""

from __future__ import annotations

import sys

from .cli import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
