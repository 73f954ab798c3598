"""The whole pipeline on the embedded default, on CPU, in minutes:

    corpus + tokenizer + small Qwen3.5 target (built, pretrained once, cached)
    -> extract with 2 Ray workers -> verify -> info -> fit a drafter
    -> eval (tau, DDTree) -> diagnose (+ PNG) -> export

Every step runs the project's own command line, exactly as a user would, and the
demo ends with a summary table. Usage: `make demo`, or
`python scripts/demo.py [--out demo_out] [--train-steps N]`."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import embedded  # noqa: E402

# A drafter small enough to learn something in a few CPU minutes.
DRAFTER_SETTINGS = [
    "model.num_layers=2",
    "model.num_anchors=64",
    "data.max_length=512",
    "data.heldout_fraction=0.05",
    "optim.lr=2e-3",
    "train.log_every=5",
    "eval.every=200",
    "eval.samples=16",
    "train.checkpoint_every=200",
]


def step(title: str) -> None:
    print(f"\n=== {title} ===", flush=True)


def run(args: list[str], capture_json: bool = True, allow: tuple[int, ...] = (0,)) -> dict:
    """Run one of the project's commands; stream its output; return its last JSON line."""
    print("$ " + " ".join(str(a) for a in args), flush=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    process = subprocess.Popen([sys.executable, *map(str, args)], cwd=REPO, env=env,
                               stdout=subprocess.PIPE, text=True)
    last = None
    for line in process.stdout:
        print(line, end="", flush=True)
        if line.strip():
            last = line
    if process.wait() not in allow:
        raise SystemExit(f"demo: `{' '.join(map(str, args[:3]))}` failed with exit code {process.returncode}")
    if capture_json and last:
        try:
            return json.loads(last)
        except json.JSONDecodeError:
            return {}
    return {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "demo_out"), help="where everything goes (default demo_out/)")
    parser.add_argument("--train-steps", type=int, default=600, help="drafter optimizer steps (default 600)")
    parser.add_argument("--workers", type=int, default=2, help="Ray extraction workers (default 2)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()

    step("1. corpus and target (built once, then cached)")
    functions = embedded.coding_chats()
    records = embedded.coding_chats(phrasings=3)
    corpus = embedded.write_jsonl(out / "corpus.jsonl", records)
    print(f"corpus: {len(records)} chat records ({len(functions)} standard-library functions, each asked for "
          f"3 ways) -> {corpus}")
    target = embedded.ensure_demo_target(out / "cache", functions)

    store, run_dir, export_dir, plot = out / "store", out / "run", out / "drafter", out / "diagnose.png"
    step("2. extract on a local Ray cluster")
    report = run(["-m", "extract", "run", "--model", target, "--corpus", corpus, "--store", store,
                  "--workers", args.workers, "--device", "cpu", "--num-context-layers", "3",
                  "--max-length", "512", "--shard-tokens", "16384", "--no-progress"])

    step("3. verify and info")
    run(["-m", "store_schema", "verify", store], capture_json=False)
    info = run(["-m", "store_schema", "info", store, "--json"])

    step("4. fit the drafter")
    resume = ["--resume"] if (run_dir / "config.yaml").exists() else []
    overrides = [x for setting in DRAFTER_SETTINGS for x in ("--set", setting)]
    run(["-m", "train", "fit", "--store", store, "--target", target, "--out", run_dir,
         "--max-steps", args.train_steps, *resume, *overrides])

    step("5. export")
    run(["-m", "train", "export", run_dir, "--out", export_dir])

    step("6. evaluate on the held-out split (the run's: the export records data.heldout_fraction)")
    evaluation = run(["-m", "train", "eval", "--store", store, "--drafter", export_dir, "--target", target,
                      "--ddtree-budgets", "8,32,128", "--max-blocks-per-sample", "64", "--json"])

    step("7. diagnose the run")
    run(["-m", "train", "diagnose", run_dir, "--plot", plot], capture_json=False, allow=(0, 1))

    summary = {
        "store": str(store),
        "samples": info.get("samples"),
        "tokens": info.get("tokens"),
        "store_disk_bytes": info.get("disk_bytes"),
        "store_ratio": info.get("ratio"),
        "extract_tokens_per_s": report.get("tokens_per_s"),
        "heldout_tau": evaluation.get("tau"),
        "heldout_ddtree": evaluation.get("ddtree"),
        "heldout_top1_acc": evaluation.get("top1_acc"),
        "heldout_samples": evaluation.get("samples"),
        "exported_drafter": str(export_dir),
        "plot": str(plot),
        "wall_s": round(time.time() - started, 1),
    }
    step("summary")
    rows = [
        ("store", f"{summary['store']}"),
        ("samples / tokens", f"{summary['samples']} / {summary['tokens']}"),
        ("store on disk (ratio to raw bf16)", f"{(summary['store_disk_bytes'] or 0) / 1e6:.1f} MB ({summary['store_ratio']})"),
        ("extraction tokens/s (2 CPU workers)", f"{summary['extract_tokens_per_s']}"),
        ("held-out tau (greedy chain, 1..16)", f"{summary['heldout_tau']}"),
        ("held-out DDTree acceptance", f"{summary['heldout_ddtree']}"),
        ("held-out top-1 accuracy", f"{summary['heldout_top1_acc']}"),
        ("exported drafter", summary["exported_drafter"]),
        ("diagnose plot", summary["plot"]),
        ("wall time", f"{summary['wall_s']} s"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
