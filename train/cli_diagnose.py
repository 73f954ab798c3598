"""`python -m train diagnose RUN [--plot FILE.png] [--compare RUN2] [--json]`.

`add_parser(subparsers)` registers the subcommand on train/__main__.py's parser;
`main(argv)` runs it standalone (also `python -m train.cli_diagnose ...`)."""

from __future__ import annotations

import argparse
import json
import sys

from train import diagnose as dg


def configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("run_dir", metavar="RUN", help="run directory (with train_log.jsonl and its config) or a train_log.jsonl")
    parser.add_argument("--plot", metavar="FILE.png", help="draw loss, accuracy, tau, DDTree and LR against step")
    parser.add_argument("--compare", metavar="RUN2", help="a second run: overlaid on the plot, compared at common steps")
    parser.add_argument("--config", metavar="FILE", help="config file to check the LR against (default: the run's)")
    parser.add_argument("--window", type=int, help="improvement window in steps (default: about 4-8 windows)")
    parser.add_argument("--cliff-drop", type=float, default=0.08, help="accuracy drop that counts as a cliff (0.08)")
    parser.add_argument("--cliff-window", type=int, default=20, help="records averaged on each side of a cliff (20)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    parser.set_defaults(handler=run)  # train/__main__.py dispatches on args.handler
    return parser


def add_parser(subparsers) -> argparse.ArgumentParser:
    return configure(subparsers.add_parser("diagnose", help="diagnose a run's train_log.jsonl (plateau, cliffs, LR, loss)"))


def run(args) -> int:
    config = None
    if args.config:
        config, _ = dg.read_run_config(args.config)
        if config is None:
            print(f"error: cannot read a config from {args.config}", file=sys.stderr)
            return 2
    try:
        result = dg.diagnose(args.run_dir, config=config, window=args.window, cliff_drop=args.cliff_drop,
                             cliff_window=args.cliff_window)
        other = dg.diagnose(args.compare) if args.compare else None
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    table = None
    if other is not None:
        table = dg.compare(dg.read_log(args.run_dir), dg.read_log(args.compare))
    if args.plot:
        runs = [args.run_dir] + ([args.compare] if args.compare else [])
        dg.plot(runs, args.plot)
    if args.json:
        data = result.to_dict()
        if other is not None:
            data["compare"] = {"run": args.compare, "diagnosis": other.to_dict(), "at_steps": table}
        if args.plot:
            data["plot"] = args.plot
        print(json.dumps(data, indent=2))
    else:
        print(result.render())
        if other is not None:
            print()
            print(f"Compared run {args.compare}: VERDICT: {other.verdict()}")
            for finding in other.findings:
                print(f"  - {finding.message}")
            print()
            print(dg.render_compare(args.run_dir, args.compare, table))
        if args.plot:
            print(f"\nplot written to {args.plot}")
    return 1 if result.findings else 0


def main(argv=None) -> int:
    parser = configure(argparse.ArgumentParser(prog="python -m train diagnose", description=__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
