"""`python -m train {fit,export,eval,diagnose,speculate,serve-check}`: the commands are train/cli/."""

import sys

from train.cli import main

if __name__ == "__main__":
    sys.exit(main())
