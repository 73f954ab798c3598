"""`python -m train diagnose`'s handler (its parser: train/cli/diagnose.py). Imported only
when the command runs, so it imports at the top."""

from __future__ import annotations

import json

from train.config_loading import load_config
from train.diagnose.compare import compare, render_compare
from train.diagnose.plot import plot
from train.diagnose.report import diagnose
from train.fitting.runlog import read_log


def run(args) -> int:
    config = load_config(args.config, require_paths=False) if args.config else None
    result = diagnose(
        args.run_dir, config=config, window=args.window, cliff_drop=args.cliff_drop, cliff_window=args.cliff_window
    )
    other = diagnose(args.compare) if args.compare else None
    table = compare(read_log(args.run_dir), read_log(args.compare)) if other is not None else None
    if args.plot:
        plot(
            [args.run_dir] + ([args.compare] if args.compare else []),
            args.plot,
            verdicts=[result.verdict()] + ([other.verdict()] if other is not None else []),
        )
    if args.json:
        data = result.to_dict()
        if other is not None:
            data["compare"] = {"run": args.compare, "diagnosis": other.to_dict(), "at_steps": table}
        if args.plot:
            data["plot"] = args.plot
        print(json.dumps(data, indent=2))
    else:
        print(result.render())
        if other is not None and table is not None:
            print()
            print(f"Compared run {args.compare}: VERDICT: {other.verdict()}")
            for finding in other.findings:
                print(f"  - {finding.message}")
            print()
            print(render_compare(args.run_dir, args.compare, table))
        if args.plot:
            print(f"\nplot written to {args.plot}")
    return 1 if result.findings else 0
