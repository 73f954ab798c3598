"""`python -m train diagnose RUN [--plot FILE.png] [--compare RUN2] [--json]`:
plateau, cliffs, the LR against the run's config, the loss distribution and
epoch boundaries of a run's train_log.jsonl; a plain-language verdict first.
Exit 1 when a problem is found."""

from __future__ import annotations


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "diagnose", help="diagnose a run's train_log.jsonl (plateau, cliffs, LR, loss)", description=__doc__
    )
    p.add_argument(
        "run_dir", metavar="RUN", help="run directory (with train_log.jsonl and config.yaml) or a train_log.jsonl"
    )
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw loss (training and held-out), accuracy, tau, DDTree and LR against step, with the verdict",
    )
    p.add_argument("--compare", metavar="RUN2", help="a second run: overlaid on the plot, compared at common steps")
    p.add_argument(
        "--config", metavar="FILE", help="run config (YAML) to check the LR against (default: RUN/config.yaml)"
    )
    p.add_argument("--window", type=int, help="improvement window in steps (default: about 4-8 windows)")
    p.add_argument("--cliff-drop", type=float, default=0.08, help="accuracy drop that counts as a cliff (0.08)")
    p.add_argument("--cliff-window", type=int, default=20, help="records averaged on each side of a cliff (20)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    p.set_defaults(handler="train.commands.diagnose:run")
