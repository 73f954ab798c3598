"""python -m store_schema {info,verify} STORE"""

from __future__ import annotations

import argparse
import json
import sys

from .layout import layer_array, raw_bytes_per_token
from .units import human_bytes
from .reader import Store
from .records import on_disk_bytes
from .verify import clean_leftovers, format_report, verify_store


def info(store: Store) -> dict:
    shards = store.committed_shards()
    samples = sum(store.commit(n).num_samples for n in shards)
    tokens = sum(store.commit(n).num_tokens for n in shards)
    fp = store.fingerprint
    raw = tokens * raw_bytes_per_token(fp.hidden_size, len(fp.layer_ids))
    disk = on_disk_bytes(store.path)
    plan = store.plan()
    return {
        "store": str(store.path),
        "shards": len(shards),
        "planned_shards": None if plan is None else len(plan.shards),
        "samples": samples,
        "tokens": tokens,
        "layers": [layer_array(i) for i in fp.layer_ids],
        "raw_bytes": raw,
        "disk_bytes": disk,
        "ratio": round(disk / raw, 4) if raw else None,
        "fingerprint": fp.to_json(),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m store_schema", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="what a store holds")
    p_info.add_argument("store")
    p_info.add_argument("--json", action="store_true")
    p_verify = sub.add_parser("verify", help="re-read every committed file; exit 0 intact, 1 problems, 2 usage")
    p_verify.add_argument("store")
    p_verify.add_argument("--json", action="store_true", help="print one JSON object {ok, problems, ...}")
    p_verify.add_argument("--clean", action="store_true", help="remove uncommitted leftovers")
    p_verify.add_argument("--recompute", type=int, default=0, metavar="N",
                          help="re-extract N random committed samples with --model and compare (cosine >= 0.999)")
    p_verify.add_argument("--model", help="target model path for --recompute")
    p_verify.add_argument("--device", default="cpu", help="device for --recompute (cpu, cuda)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return 2 if exc.code else 0

    if args.command == "info":
        try:
            summary = info(Store(args.store))
        except (OSError, ValueError, KeyError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps(summary))
        else:
            fp = summary["fingerprint"]
            print(f"store        {summary['store']}")
            print(f"shards       {summary['shards']} committed" + (f" of {summary['planned_shards']} planned" if summary["planned_shards"] is not None else ""))
            print(f"samples      {summary['samples']}")
            print(f"tokens       {summary['tokens']}")
            print(f"layers       {fp['layer_ids']} ({fp['layer_id_convention']})")
            print(f"raw bytes    {human_bytes(summary['raw_bytes'])}")
            print(f"on disk      {human_bytes(summary['disk_bytes'])} (ratio {summary['ratio']})")
            print(f"target       {fp['target_model']} (hidden {fp['hidden_size']}, vocab {fp['vocab_size']}, {fp['num_target_layers']} layers)")
            print(f"kernels      {fp['kernels']}")
        return 0

    if args.recompute and not args.model:
        print("error: --recompute needs --model PATH", file=sys.stderr)
        return 2
    try:
        store = Store(args.store)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {args.store}: {exc}", file=sys.stderr)
        return 2
    report = verify_store(args.store, progress=None if args.json else _progress)
    if args.recompute and report.ok:
        from .recompute import recompute_check

        report.recomputed, problems = recompute_check(store, args.model, args.recompute, device=args.device)
        report.problems.extend(problems)
    if args.clean:
        removed = clean_leftovers(args.store)
        report.leftovers = []
        if not args.json:
            print(f"removed {len(removed)} uncommitted leftover(s)")
    print(json.dumps(report.to_json()) if args.json else format_report(report))
    return 0 if report.ok else 1


def _progress(done: int, total: int) -> None:
    print(f"\rverified {done}/{total} shards", end="\n" if done == total else "", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
