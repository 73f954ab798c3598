"""`verify`'s arguments (the handler: store_schema/commands/verify.py)."""

from __future__ import annotations


def add_parser(sub) -> None:
    p_verify = sub.add_parser(
        "verify",
        help="re-read every committed file; exit 0 intact, 1 damaged, 2 usage, 3 incomplete",
        description="Re-read every committed file of STORE. Exit 0: intact and complete; 1: damaged (a bad "
        "checksum, a missing file, ...: --repair moves those shards aside); 2: usage (no store at "
        "that path); 3: incomplete, intact but planned shards not yet extracted (a disk-full stop, "
        "Ctrl-C): rerun the same `python -m extract run ...` command to finish.",
    )
    p_verify.add_argument("store", help="a store directory, or s3://bucket/prefix (gs:// too)")
    p_verify.add_argument("--json", action="store_true", help="print one JSON object {ok, problems, ...}")
    p_verify.add_argument(
        "--clean",
        action="store_true",
        help="remove uncommitted leftovers (.staging/ entries of a dead job) and move shard "
        "directories without a commit record to damaged/; names each",
    )
    p_verify.add_argument(
        "--repair",
        action="store_true",
        help="also move every damaged or commit-less shard out of shards/ into damaged/ "
        "(kept until the store is complete again); then rerun `extract run`",
    )
    p_verify.add_argument(
        "--workers", type=int, default=None, metavar="N", help="shards checked at once (default: the cores available)"
    )
    p_verify.add_argument(
        "--ray",
        metavar="ADDRESS|auto",
        help="check the shards across a Ray cluster's nodes (the extraction's, cluster.yaml; "
        "`auto`: the cluster this machine belongs to); every node must reach the store at "
        "the same path or URL",
    )
    p_verify.add_argument(
        "--checksums-only",
        action="store_true",
        help="only sizes and crc32c of every committed file: a quick integrity pass",
    )
    p_verify.add_argument(
        "--sizes-only",
        action="store_true",
        help="read no shard file: commit records and file sizes against the listing (a quick pass "
        "over every shard's metadata; a changed byte of the right size is not seen)",
    )
    p_verify.add_argument(
        "--recompute",
        type=int,
        default=0,
        metavar="N",
        help="re-extract N random committed samples with --model and compare (cosine >= 0.999; fp8 stores: >= 0.995)",
    )
    p_verify.add_argument("--model", help="target model path for --recompute")
    p_verify.add_argument("--device", default="cpu", help="device for --recompute (cpu, cuda)")
    p_verify.set_defaults(handler="store_schema.commands.verify:run")
