"""`project`'s arguments (the handler: store_schema/commands/project.py)."""

from __future__ import annotations

STORE_DTYPES = ("bfloat16", "fp8_e4m3", "fp4_e2m1")  # as store_schema.dtypes names them (no torch here)


def add_parser(sub) -> None:
    p_project = sub.add_parser("project", help="write a bf16 store again as a projected (and lossy) one")
    p_project.add_argument("store", help="the bf16 store to read (a directory, or s3://bucket/prefix)")
    p_project.add_argument("--out", required=True, help="the projected store's directory (new)")
    keep = p_project.add_mutually_exclusive_group(required=True)
    keep.add_argument("--energy", type=float, help="keep the fewest directions holding this share, e.g. 0.999")
    keep.add_argument("--rank", type=int, help="keep this many directions a layer (rounded up to 32)")
    p_project.add_argument(
        "--store-dtype", choices=STORE_DTYPES, default="bfloat16", help="the coordinates as (default %(default)s)"
    )
    p_project.add_argument(
        "--fit-tokens", type=int, default=65_536, help="states a layer the directions are fit on (default %(default)s)"
    )
    p_project.add_argument("--json", action="store_true", help="print one JSON line at the end")
    p_project.set_defaults(handler="store_schema.commands.project:run")
