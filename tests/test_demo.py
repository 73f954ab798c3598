"""`make demo` shortened (issue 12.5): the embedded target regenerates its corpus,
the pipeline extracts and trains, and `speculate` decodes held-out prompts
losslessly with a drafter that really drafts (decode tau clearly above 1). A rerun
finds the finished run and completes (issue 16.2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from paths import REPO

# ~2 minutes on 2 idle cores (the stages' own timings are in the summary's `stage_s`):
# a hidden-128 target pretrained on batches of 4 (its replies are repetitive: easy to
# draft), 120 records of 32 new tokens, 200 drafter steps.
SMALL_TARGET = ["--target-set", "hidden_size=128", "--target-set", "num_heads=4", "--target-set", "pretrain_batch=4"]
SHORT = [
    "--records",
    "120",
    "--pretrain-steps",
    "150",
    *SMALL_TARGET,
    "--train-steps",
    "200",
    "--prompts",
    "3",
    "--max-new-tokens",
    "32",
]


def _demo(out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "scripts/demo.py", "--out", str(out), *SHORT],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # child processes
def test_shortened_demo_drafts_losslessly(tmp_path):
    summary = _demo(tmp_path / "demo")
    assert summary["lossless"] is True
    assert summary["decode_tau"] >= 1.3, summary  # a drafter that guesses nothing scores exactly 1.0
    assert summary["decode_tau_sampled"] > 1.0 and summary["decode_tau_tree"] >= 1.3, summary
    assert summary["tree_verify"] in {"tree_attention", "chains"}
    assert summary["offline_tau"] > 1.0 and summary["samples"] > 0 and summary["store_disk_bytes"] > 0
    assert set(summary["stage_s"]) == {
        "target",
        "regenerate",
        "extract",
        "verify",
        "fit",
        "export",
        "eval",
        "speculate",
        "diagnose",
        "serve",
    }
    # The demo trains the default drafter, DFlash 2, which vLLM's CPU build cannot serve:
    # serve-check says so (in its first line) and checks speculate alone.
    assert summary["served_tau"] is None and summary["served_note"].startswith("skipped: the drafter is DFlash 2")


def test_target_settings_name_the_bad_override():
    import embedded

    assert embedded.target_settings(["hidden_size=128", "lr=0.01"]) == {"hidden_size": 128, "lr": 0.01}
    with pytest.raises(ValueError, match="'width=3'.*hidden_size"):
        embedded.target_settings(["width=3"])
    with pytest.raises(ValueError, match="'num_layers=six'.*int"):
        embedded.target_settings(["num_layers=six"])


def test_demo_resumes_only_from_a_checkpoint(tmp_path):
    """Issue 16.2: a first demo stopped (Ctrl-C) after `fit` wrote config.yaml but before
    its first checkpoint used to make every later demo fail with `--resume: no
    checkpoint`; it now starts that run afresh, and resumes one that has a checkpoint."""
    from demo import fit_args

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model: {}\n")
    (run / "train_log.jsonl").write_text("")
    assert fit_args(run) == [] and not run.exists()
    assert fit_args(run) == []  # no run at all
    state = run / "checkpoints" / "step-00000200"
    state.mkdir(parents=True)
    (state / "state.json").write_text("{}")
    assert fit_args(run) == ["--resume"] and state.exists()


def test_the_summary_says_what_happened_to_the_served_check():
    """Issue 35.2: no vLLM environment, a failed engine (serve-check's own line: vLLM's
    cause and its log), a layout it cannot serve, and figures, each said as it is."""
    from demo import NO_VLLM_LINE, served_failure, served_row

    assert served_row({"served_tau": None, "served_note": NO_VLLM_LINE}).startswith(
        "served by vLLM: skipped, no vLLM environment"
    )
    failed = served_failure(
        [
            "vLLM 0.32.0 from /x/.venv-vllm/bin/python",
            "error: vLLM exited 1: ValueError: Available memory on node 0 (8.78/10.46 GiB) on kv cache "
            "allocation is less "
            "than requested memory for kv (-0.13/0.52 GiB)., log: /d/drafter/serve-check/vllm.log",
        ]
    )
    assert failed == (
        "failed: vLLM exited 1: ValueError: Available memory on node 0 (8.78/10.46 GiB) on kv cache "
        "allocation is less than requested memory for kv (-0.13/0.52 GiB)., "
        "log: /d/drafter/serve-check/vllm.log"
    )
    assert served_row({"served_tau": None, "served_note": failed}) == failed
    assert "no vLLM environment" not in failed
    assert served_failure(["Traceback (most recent call last):", "KeyError: 'x'"]).startswith(
        "failed: serve-check gave no result"
    )
    figures = {
        "served_tau": 4.93,
        "served_lossless": True,
        "served_tokens_per_round": 4.92,
        "speculate_tokens_per_round": 4.92,
        "vllm_version": "0.32.0",
        "served_within_tolerance": True,
    }
    assert served_row(figures) == (
        "served_tau 4.93, served_lossless yes; tokens per round 4.92 vs speculate 4.92 (vLLM 0.32.0)"
    )
    assert served_row(dict(figures, served_lossless=False, served_within_tolerance=False)).endswith(
        "served_lossless NO; tokens per round 4.92 vs speculate 4.92 (vLLM 0.32.0) - outside the 5 % tolerance"
    )


def test_the_demo_corpus_is_pinned_not_read_from_this_python():
    """Issue 35.3: the corpus came from the running Python's standard library, so each
    Python version (and the libraries imported beside it) made another demo; it is now
    the pinned copy in scripts/, whatever the Python."""
    import hashlib

    import embedded

    assert hashlib.sha256(embedded.PINNED_FUNCTIONS.read_bytes()).hexdigest()[:12] == PINNED_SHA256
    functions = embedded.stdlib_functions()
    assert len(functions) == 598 and all(len(f) == 3 for f in functions)
    assert {module for module, _, _ in functions} <= set(embedded.CORPUS_MODULES)
    records = embedded.coding_chats(phrasings=3)[:600]
    sources = {source for _, _, source in functions}
    assert len(records) == 600 and all(r["messages"][1]["content"] in sources for r in records)
    assert records[0]["id"] == "sample-00000-0" and records[0]["messages"][0]["content"] == PINNED_FIRST_PROMPT


PINNED_SHA256 = "9e9fbb841419"
PINNED_FIRST_PROMPT = "Write `print_exception` from the `traceback` module."


def test_echoed_commands_can_be_pasted(capsys):
    """Issue 35.10: `$ python -m extract ...`, not `$ -m extract ...`."""
    import demo

    assert demo.shown_command(["-m", "train", "fit", "--out", Path("/tmp/a run")]) == (
        "python -m train fit --out '/tmp/a run'"
    )
    demo.run(["-m", "store_schema", "--help"], capture_json=False)
    assert capsys.readouterr().out.splitlines()[0] == "$ python -m store_schema --help"


def test_a_rerun_reads_the_first_extraction_report_of_a_relative_store(tmp_path, monkeypatch):
    """Bug: a rerun on a relative `--out` (`demo_out`) joined the store path twice
    (demo_out/store/demo_out/store/reports/...) and failed with FileNotFoundError."""
    from demo import first_extraction_report

    reports = tmp_path / "out" / "store" / "reports"
    reports.mkdir(parents=True)
    (reports / "extract-2.json").write_text('{"tokens_per_s": 2}')
    (reports / "extract-1.json").write_text('{"tokens_per_s": 1}')
    monkeypatch.chdir(tmp_path)
    assert first_extraction_report(Path("out") / "store") == {"tokens_per_s": 1}
