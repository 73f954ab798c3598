"""`python -m extract`: the command line lives in extract/cli/, its handlers in extract/commands/."""

import sys

from extract.cli import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
