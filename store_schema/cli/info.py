"""`info`'s arguments (the handler: store_schema/commands/info.py)."""

from __future__ import annotations


def add_parser(sub) -> None:
    p_info = sub.add_parser("info", help="what a store holds")
    p_info.add_argument("store", help="a store directory, or s3://bucket/prefix (gs:// too)")
    p_info.add_argument("--json", action="store_true")
    p_info.add_argument(
        "--quarantined", action="store_true", help="list every record the plan left out (JSON lines) and nothing else"
    )
    p_info.set_defaults(handler="store_schema.commands.info:run")
