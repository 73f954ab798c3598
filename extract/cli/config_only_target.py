"""`python -m extract config-only-target OUT [--tokenizer DIR]`: the 27B target on paper."""

from __future__ import annotations


def add_parser(commands) -> None:
    target = commands.add_parser(
        "config-only-target",
        help="write Qwen3.6-27B's config.json (no weights) for dry-runs at the 27B shape",
        description="The 27B target as config.json only: sizes a job on paper, loads no weights.",
    )
    target.add_argument("out", metavar="OUT", help="directory to write config.json into (created)")
    target.add_argument(
        "--tokenizer",
        metavar="DIR",
        default=None,
        help="copy this tokenizer's files beside it (default: none; plan --dry-run needs one)",
    )
    target.set_defaults(handler="extract.commands.config_only_target:run")
