"""Where the repository is, for every test and helper under tests/."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
