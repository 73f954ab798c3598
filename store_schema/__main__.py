"""python -m store_schema {info,verify} STORE
(STORE: a directory, or s3://bucket/prefix, gs://bucket/prefix)

Exit codes and error lines follow `store_schema.runtime.cli`. The handlers import the
reader (torch, zarr) themselves, so `--help` and usage errors answer at once."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter

from .runtime.cli import (
    EXIT_INCOMPLETE,
    EXIT_OK,
    EXIT_PROBLEM,
    EXIT_USAGE,
    CommandParser,
    UsageError,
    run_command,
    show_defaults,
)


def cmd_info(args) -> int:
    from .codecs.encoding import CodecConfig
    from .runtime.units import human_bytes
    from .stores import backend

    store = backend(args.store).metadata()
    if args.quarantined:
        for record in quarantined_records(store.plan()):
            print(json.dumps(record))
        return EXIT_OK
    summary = _info_summary(store)
    if args.json:
        print(json.dumps(summary))
        return EXIT_OK
    fp = summary["fingerprint"]
    planned = f" of {summary['planned_shards']} planned" if summary["planned_shards"] is not None else ""
    print(f"store        {summary['store']}")
    print(f"shards       {summary['shards']} committed{planned}")
    print(f"samples      {summary['samples']}")
    quarantined = summary["quarantined"]
    if quarantined:
        reasons = ", ".join(f"{reason} {count}" for reason, count in quarantined.items())
        print(f"quarantined  {sum(quarantined.values())} record(s) left out by the plan: {reasons}")
        for row in first_per_reason(quarantined_records(store.plan())):
            print(f"             record {row['record']}: {row['reason']}: {row['detail']}")
        print(f"             (all of them: python -m store_schema info {args.store} --quarantined)")
    print(f"tokens       {summary['tokens']}")
    print(f"layers       {fp['layer_ids']} ({fp['layer_id_convention']})")
    print(
        f"dtype        {fp['dtype']}"
        + (" (float8 e4m3 + a float32 scale per token)" if fp["dtype"] != "bfloat16" else "")
    )
    print(f"codec        {CodecConfig.from_json(summary['codec']).describe()}")
    print(f"raw bytes    {human_bytes(summary['raw_bytes'])} (as bf16)")
    print(f"on disk      {human_bytes(summary['disk_bytes'])} (ratio {summary['ratio']})")
    print(
        f"target       {fp['target_model']} (hidden {fp['hidden_size']}, vocab {fp['vocab_size']}, "
        f"{fp['num_target_layers']} layers)"
    )
    print(f"kernels      {fp['kernels']}")
    print(f"responses    {summary['response_provenance']} (where the corpus's responses came from)")
    return EXIT_OK


def _info_summary(store) -> dict:
    from .layout import layer_array, raw_bytes_per_token

    fp = store.fingerprint
    tokens = store.num_tokens()
    raw = tokens * raw_bytes_per_token(fp.hidden_size, len(fp.layer_ids))
    disk = store.stored_bytes()
    plan = store.plan()
    return {
        "store": str(store.path),
        "shards": len(store.committed_shards()),
        "planned_shards": None if plan is None else len(plan.shards),
        "quarantined": quarantined_by_reason(plan),
        "response_provenance": fp.response_provenance,
        "samples": store.num_samples(),
        "tokens": tokens,
        "layers": [layer_array(i) for i in fp.layer_ids],
        "raw_bytes": raw,
        "disk_bytes": disk,
        "ratio": round(disk / raw, 4) if raw else None,
        "dtype": fp.dtype,
        "codec": store.codec.to_json(),
        "fingerprint": fp.to_json(),
    }


def quarantined_records(plan) -> list[dict]:
    """Every record the plan left out: its 1-based record number in the corpus, sample id, reason and detail."""
    if plan is None:
        return []
    return [
        {"record": q.record_index + 1, "sample_id": q.sample_id, "reason": q.reason, "detail": q.detail}
        for q in plan.quarantined
    ]


def first_per_reason(records: list[dict], per_reason: int = 2) -> list[dict]:
    """The first `per_reason` of each reason, in corpus order."""
    seen: Counter = Counter()
    first = []
    for record in records:
        seen[record["reason"]] += 1
        if seen[record["reason"]] <= per_reason:
            first.append(record)
    return first


def quarantined_by_reason(plan) -> dict[str, int]:
    """Records the plan left out, counted by reason, most frequent first."""
    counts = Counter(q.reason for q in plan.quarantined) if plan is not None else Counter()
    return dict(counts.most_common())


def check_verify_flags(args) -> None:
    """The verify flags that exclude each other or need another, refused (exit 2) before
    the store is read; with --recompute, a model or device this machine lacks too."""
    if args.recompute and not args.model:
        raise UsageError("--recompute needs --model PATH")
    if args.workers is not None and args.workers < 1:
        raise UsageError(f"--workers must be >= 1, got {args.workers}")
    depths = [
        flag
        for flag, on in (
            ("--checksums-only", args.checksums_only),
            ("--sizes-only", args.sizes_only),
            ("--recompute", args.recompute),
        )
        if on
    ]
    if len(depths) > 1:
        raise UsageError(f"{' and '.join(depths)} exclude each other")
    if args.repair and args.recompute:
        raise UsageError("--repair and --recompute exclude each other: a recompute mismatch is not a damaged file")
    if args.recompute:  # a model or device this machine lacks is refused before the store is read
        from .runtime.host import resolve_device
        from .runtime.target_weights import check_target_weights

        check_target_weights(args.model, "--model")
        resolve_device(args.device)


def cmd_verify(args) -> int:
    """A store that cannot be opened at all is a usage error (exit 2); anything
    wrong inside one, its root included, is a problem in the report (exit 1); an
    intact store with planned shards not yet extracted is incomplete (exit 3, also
    after a --repair that moved every damaged shard aside: `extract run` finishes it)."""
    from .stores import backend
    from .tools.verify import verify_store
    from .tools.verify_report import format_report

    check_verify_flags(args)
    store = backend(args.store)  # a directory or a bucket, decided once for the command
    # Progress on stderr in both forms: stdout carries the report (one JSON object with --json).
    report = verify_store(
        store,
        progress=ProgressLines(),
        workers=args.workers,
        checksums_only=args.checksums_only,
        sizes_only=args.sizes_only,
        ray_address=args.ray,
    )
    if args.recompute and report.ok:
        from .tools.recompute import recompute_check

        print(
            f"recomputing {args.recompute} sample(s) with {args.model} on {args.device}...", file=sys.stderr, flush=True
        )
        report.recomputed, problems = recompute_check(store.open(), args.model, args.recompute, device=args.device)
        report.problems.extend(problems)
    done: dict = {}
    if args.clean or args.repair:
        removed, done["set_aside"] = store.clean(commitless=not args.repair)
        report.leftovers = [name for name in report.leftovers if name not in removed]
        done["removed_leftovers"] = removed
    after = report
    if args.repair:
        done["repair"] = store.repair(report).to_json()
        after = report.after_repair(done["repair"]["moved"])
        done["status_after_repair"] = after.status
    if args.json:
        print(json.dumps(dict(report.to_json(), **done)))
    else:
        print(format_report(report, repair_advice=not args.repair))
        for line in _done_lines(store, done):
            print(line)
        if after is not report and after.status == "incomplete":
            print(f"now {after.incomplete_line()}")
    return {"intact": EXIT_OK, "incomplete": EXIT_INCOMPLETE}.get(after.status, EXIT_PROBLEM)


def _done_lines(store, done: dict) -> list[str]:
    """What --clean / --repair did, and what to run next."""
    lines = []
    if "removed_leftovers" in done:
        removed = done["removed_leftovers"]
        lines.append(f"removed {len(removed)} uncommitted leftover(s)" + (f": {', '.join(removed)}" if removed else ""))
    from .layout import DAMAGED_DIR
    from .location import is_object_store

    if done.get("set_aside"):
        lines.append(
            f"moved {len(done['set_aside'])} shard directory(ies) without a commit record to {store}/"
            f"{DAMAGED_DIR}/: {', '.join(done['set_aside'])}"
        )
    repair = done.get("repair")
    if repair:
        moved = repair["moved"]
        if moved and is_object_store(store.location):
            lines.append(f"deleted the commit markers of {len(moved)} damaged shard(s): {', '.join(moved)}")
            lines.append(
                "next: rerun the same `python -m extract run` command (it extracts exactly those shards "
                "again, byte-identical); `verify --clean` then deletes their old objects"
            )
        elif moved:
            lines.append(f"moved {len(moved)} damaged shard(s) to {store}/{DAMAGED_DIR}/: {', '.join(moved)}")
            lines.append(
                "next: rerun the same `python -m extract run` command (it extracts exactly those shards "
                f"again, byte-identical); it deletes {DAMAGED_DIR}/ once the store is complete"
            )
        for p in repair["unrepairable"]:
            lines.append(
                f"not repaired (re-extraction cannot mend it): {p['shard'] or 'store'}/"
                f"{p['file'] or p['array']}: {p['what']}"
            )
    return lines


class ProgressLines:
    """verify's progress on stderr, with an ETA from the bytes read so far: one line
    rewritten in place on a terminal; a new line every `every` seconds (and the last)
    otherwise, so a log file gets readable lines."""

    def __init__(self, stream=None, every: float = 10.0):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every = every
        self.start = self.last = time.monotonic()

    def __call__(self, done: int, total: int, done_bytes: int, total_bytes: int) -> None:
        from .runtime.units import human_bytes, human_duration

        now = time.monotonic()
        final = done == total
        if not (self.tty or final or now - self.last >= self.every):
            return
        self.last = now
        rate = done_bytes / max(now - self.start, 1e-9)
        eta = (total_bytes - done_bytes) / rate if rate > 0 else float("nan")
        line = (
            f"verified {done}/{total} shards, {human_bytes(done_bytes)} of {human_bytes(total_bytes)}, "
            f"{human_bytes(rate)}/s, ETA {human_duration(eta)}"
        )
        if self.tty:
            print(f"\r{line}", end="\n" if final else "", file=self.stream, flush=True)
        else:
            print(line, file=self.stream, flush=True)


def add_verify_parser(sub) -> None:
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
    p_verify.set_defaults(handler=cmd_verify)


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="python -m store_schema", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="what a store holds")
    p_info.add_argument("store", help="a store directory, or s3://bucket/prefix (gs:// too)")
    p_info.add_argument("--json", action="store_true")
    p_info.add_argument(
        "--quarantined", action="store_true", help="list every record the plan left out (JSON lines) and nothing else"
    )
    p_info.set_defaults(handler=cmd_info)
    add_verify_parser(sub)
    show_defaults(parser)
    return parser


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else EXIT_OK
    from obstore.exceptions import BaseError as ObjectStoreError

    from .errors import StoreError
    from .runtime.startup import preload

    if args.command == "verify":
        preload("store_schema.tools.verify")  # torch, through the reader
    return run_command(args.handler, args, refusals=(StoreError, ObjectStoreError))


if __name__ == "__main__":
    sys.exit(main())
