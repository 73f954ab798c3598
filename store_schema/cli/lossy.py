"""`lossy`'s arguments (the handler: store_schema/commands/lossy.py)."""

from __future__ import annotations

DEFAULT_TOKENS = 65_536  # states per layer the check reads, at most (whole shards)


def add_parser(sub) -> None:
    p_lossy = sub.add_parser(
        "lossy", help="each lossy dtype's error and the states' rank, on a bf16 store's own states"
    )
    p_lossy.add_argument("store", help="a bf16 store directory, or s3://bucket/prefix (gs:// too)")
    p_lossy.add_argument(
        "--tokens", type=int, default=DEFAULT_TOKENS, help="states per layer to check, at most (default %(default)s)"
    )
    p_lossy.add_argument("--json", action="store_true", help="print one JSON line")
    p_lossy.set_defaults(handler="store_schema.commands.lossy:run")
