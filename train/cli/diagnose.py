"""`python -m train diagnose RUN [--plot FILE.png] [--compare RUN2] [--json]`:
plateau, cliffs, the LR against the run's config, the loss distribution and
epoch boundaries of a run's train_log.jsonl; a plain-language verdict first.
Exit 1 when a problem is found."""

from __future__ import annotations

import json


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "diagnose", help="diagnose a run's train_log.jsonl (plateau, cliffs, LR, loss)", description=__doc__
    )
    p.add_argument("run_dir", metavar="RUN", help="run directory (with train_log.jsonl and config.yaml) or a train_log.jsonl")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw loss (training and held-out), accuracy, tau, DDTree and LR against step, with the verdict")
    p.add_argument("--compare", metavar="RUN2", help="a second run: overlaid on the plot, compared at common steps")
    p.add_argument("--config", metavar="FILE", help="run config (YAML) to check the LR against (default: RUN/config.yaml)")
    p.add_argument("--window", type=int, help="improvement window in steps (default: about 4-8 windows)")
    p.add_argument("--cliff-drop", type=float, default=0.08, help="accuracy drop that counts as a cliff (0.08)")
    p.add_argument("--cliff-window", type=int, default=20, help="records averaged on each side of a cliff (20)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    p.set_defaults(handler=run)


def run(args) -> int:
    # here, not at the top: `--help` loads none of torch (tests/test_cli_rules.py)
    from train.config_loading import load_config
    from train.diagnose.compare import compare, render_compare
    from train.diagnose.plot import plot
    from train.diagnose.report import diagnose
    from train.fitting.runlog import read_log

    config = load_config(args.config, require_paths=False) if args.config else None
    result = diagnose(args.run_dir, config=config, window=args.window, cliff_drop=args.cliff_drop,
                      cliff_window=args.cliff_window)
    other = diagnose(args.compare) if args.compare else None
    table = compare(read_log(args.run_dir), read_log(args.compare)) if other is not None else None
    if args.plot:
        plot([args.run_dir] + ([args.compare] if args.compare else []), args.plot,
             verdicts=[result.verdict()] + ([other.verdict()] if other is not None else []))
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
            print(render_compare(args.run_dir, args.compare, table))
        if args.plot:
            print(f"\nplot written to {args.plot}")
    return 1 if result.findings else 0
