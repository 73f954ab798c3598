"""`python -m store_schema verify STORE`: re-read every committed file; `--clean` and
`--repair` set damaged shards aside for `extract run` to extract again; `--recompute`
re-extracts a few samples with the target and compares."""

from __future__ import annotations

import json
import sys
import time

from ..layout import DAMAGED_DIR
from ..location import is_object_store
from ..runtime.cli import EXIT_INCOMPLETE, EXIT_OK, EXIT_PROBLEM, UsageError
from ..runtime.host import resolve_device
from ..runtime.target_weights import check_target_weights
from ..runtime.units import human_bytes, human_duration
from ..stores import backend
from ..tools.verify import verify_store
from ..tools.verify_report import format_report


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
        check_target_weights(args.model, "--model")
        resolve_device(args.device)


def run(args) -> int:
    """A store that cannot be opened at all is a usage error (exit 2); anything
    wrong inside one, its root included, is a problem in the report (exit 1); an
    intact store with planned shards not yet extracted is incomplete (exit 3, also
    after a --repair that moved every damaged shard aside: `extract run` finishes it)."""
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
        from ..tools.recompute import recompute_check  # the target model and torch: --recompute only

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
        for line in done_lines(store, done):
            print(line)
        if after is not report and after.status == "incomplete":
            print(f"now {after.incomplete_line()}")
    return {"intact": EXIT_OK, "incomplete": EXIT_INCOMPLETE}.get(after.status, EXIT_PROBLEM)


def done_lines(store, done: dict) -> list[str]:
    """What --clean / --repair did, and what to run next."""
    lines = []
    if "removed_leftovers" in done:
        removed = done["removed_leftovers"]
        lines.append(f"removed {len(removed)} uncommitted leftover(s)" + (f": {', '.join(removed)}" if removed else ""))
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
