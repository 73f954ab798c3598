"""Issue 26's extraction and store findings that need no Ray (each failed on the code
before it): the plan survives a failure after planning, ``--device cuda`` without CUDA
is refused before planning, the free-space check, ``verify --clean`` / ``--repair``
bookkeeping, readable refusals and help texts; and issue 23's light ``import store_schema``
without an import cycle."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys

import pytest
from builders import coding_chats, random_store, write_chat_jsonl
from paths import REPO


def _run_argv(model, corpus, store, *extra) -> list[str]:
    return [
        "run",
        "--model",
        str(model),
        "--corpus",
        str(corpus),
        "--store",
        str(store),
        "--layers",
        "1,3",
        "--shard-tokens",
        "600",
        "--plan-workers",
        "1",
        "--no-progress",
        *extra,
    ]


# --------------------------------------------------------------------------- the plan survives (26.5, 26.6)


def test_device_cuda_without_cuda_is_refused_before_planning(qwen3_dir, tmp_path, capsys):
    import torch

    from extract.__main__ import main

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    corpus = write_chat_jsonl(tmp_path / "c.jsonl", coding_chats(4))
    store = tmp_path / "store"
    assert main(_run_argv(qwen3_dir, corpus, store, "--device", "cuda")) == 1
    err = capsys.readouterr().err
    assert "--device cuda" in err and "use cpu" in err and "planning" not in err, err
    assert not store.exists()  # nothing planned, nothing written
    assert (
        main(
            [
                "generate",
                "--model",
                str(qwen3_dir),
                "--corpus",
                str(corpus),
                "--out",
                str(tmp_path / "gen"),
                "--device",
                "cuda",
                "--no-progress",
            ]
        )
        == 1
    )
    assert "--device cuda" in capsys.readouterr().err and not (tmp_path / "gen").exists()


def test_a_job_refused_for_free_space_keeps_its_plan_and_the_rerun_does_not_replan(
    qwen3_dir, tmp_path, monkeypatch, capsys
):
    """A failure after planning (here: not enough free space, faked through the one
    function that reads statvfs) leaves the committed plan; the rerun reuses it,
    nothing re-tokenized, and the refusal names both figures and the override."""
    from extract.__main__ import main
    from store_schema.plan_io import read_committed_plan

    monkeypatch.setattr("store_schema.runtime.host.free_bytes", lambda path: 4096)
    corpus = write_chat_jsonl(tmp_path / "c.jsonl", coding_chats(12))
    store = tmp_path / "store"
    assert main(_run_argv(qwen3_dir, corpus, store)) == 1
    err = capsys.readouterr().err
    assert "the 9 shard(s) left need about" in err and "its filesystem has 4.10 kB free" in err, err
    assert "--skip-space-check" in err
    plan = read_committed_plan(store)
    assert plan is not None and plan.shards and not (store / "zarr.json").exists()

    assert main(_run_argv(qwen3_dir, corpus, store, "--progress-interval", "0.01")) == 1
    err = capsys.readouterr().err
    assert "reusing the store's plan" in err and "nothing re-tokenized" in err, err
    assert read_committed_plan(store).digest() == plan.digest()


def test_a_resumed_store_keeps_its_plans_settings_unless_a_flag_names_one(qwen3_dir, tmp_path, monkeypatch, capsys):
    """A plan flag left out means the stored plan's value, so a store planned for one
    DFlash block (`--block-size`, every plan before the store forgot the drafter)
    resumes after the default changed; a flag given that differs is refused, named."""
    from extract.__main__ import main
    from store_schema.plan_io import read_committed_plan

    monkeypatch.setattr("store_schema.runtime.host.free_bytes", lambda path: 4096)  # stop after planning
    corpus = write_chat_jsonl(tmp_path / "c.jsonl", coding_chats(12))
    store = tmp_path / "store"
    assert main(_run_argv(qwen3_dir, corpus, store, "--block-size", "4", "--seed", "3")) == 1
    plan = read_committed_plan(store)
    assert (plan.settings["block_size"], plan.settings["min_loss_tokens"], plan.settings["seed"]) == (4, 8, 3)
    capsys.readouterr()

    assert main(_run_argv(qwen3_dir, corpus, store)) == 1  # only the space check refuses
    err = capsys.readouterr().err
    assert "reusing the store's plan" in err and "the 9 shard(s) left need about" in err, err
    assert main(_run_argv(qwen3_dir, corpus, store, "--min-loss-tokens", "1")) == 1
    err = capsys.readouterr().err
    assert "holds a different plan (block_size: 4 -> None, min_loss_tokens: 8 -> 1)" in err, err
    assert main(_run_argv(qwen3_dir, corpus, store, "--block-size", "4", "--min-loss-tokens", "8")) == 2
    assert "--block-size B sets --min-loss-tokens to 2 x B: give one of them" in capsys.readouterr().err
    assert read_committed_plan(store).digest() == plan.digest()


def test_run_checks_free_space_against_the_figure_plan_prints(qwen3_dir, tmp_path, monkeypatch, capsys):
    """One set of sizes: `plan --dry-run` prints the expected size and the free space
    `run` asks for (the size plus the stated headroom); `run` refuses one byte under
    that figure, naming it, though the expected size alone would fit."""
    from extract.__main__ import main
    from store_schema.dtypes import SPACE_HEADROOM
    from store_schema.runtime.units import human_bytes

    corpus = write_chat_jsonl(tmp_path / "c.jsonl", coding_chats(12))
    planning = ["--model", str(qwen3_dir), "--corpus", str(corpus), "--layers", "1,3", "--shard-tokens", "600"]
    assert main(["plan", "--dry-run", "--json", "--tokenizer-workers", "1", *planning]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    needed = report["space_needed_bytes"]["bfloat16"]
    assert needed == round(report["estimated_compressed_bytes"] * (1 + SPACE_HEADROOM))
    assert report["estimated_compressed_bytes"] == round(report["estimated_raw_bytes"] * report["compression_ratio"])

    assert report["store_dtypes"]["bfloat16"]["fits"] is None, "no --store: no filesystem to ask"

    monkeypatch.setattr("store_schema.runtime.host.free_bytes", lambda path: needed - 1)
    assert needed - 1 > report["estimated_compressed_bytes"]
    store = ["--store", str(tmp_path / "store")]
    assert main(["plan", "--dry-run", "--json", "--tokenizer-workers", "1", *store, *planning]) == 0
    sizes = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["store_dtypes"]
    assert {name: entry["fits"] for name, entry in sizes.items()} == {
        "bfloat16": False,
        "fp8_e4m3": True,
        "fp4_e2m1": True,
    }
    assert sizes["fp4_e2m1"]["bytes"] == round(report["estimated_raw_bytes"] * sizes["fp4_e2m1"]["size_ratio"])
    hidden = report["hidden_size"]
    projected = report["projected_store_bytes"]  # --project-rank K: each dtype's store times K / H
    assert projected and all(int(rank) % 32 == 0 and int(rank) < hidden for rank in projected)
    for rank, by_dtype in projected.items():
        assert by_dtype["fp4_e2m1"] == round(sizes["fp4_e2m1"]["bytes"] * int(rank) / hidden)
    assert main(["plan", "--dry-run", "--tokenizer-workers", "1", *store, *planning]) == 0
    assert f"asks {human_bytes(needed)} of {human_bytes(needed - 1)} free, does NOT fit" in capsys.readouterr().out
    assert main(["run", *store, "--plan-workers", "1", "--no-progress", *planning]) == 1
    assert f"need about {human_bytes(needed)}" in capsys.readouterr().err


def test_generate_is_refused_for_free_space_naming_both_figures(qwen3_dir, tmp_path, monkeypatch):
    from extract.errors import ExtractError
    from extract.generate.config import GenerateConfig
    from extract.generate.job import run_generate
    from extract.generated_corpus import is_generated_corpus

    monkeypatch.setattr("store_schema.runtime.host.free_bytes", lambda path: 1000)
    corpus = write_chat_jsonl(tmp_path / "c.jsonl", coding_chats(3))
    out = tmp_path / "gen"
    with pytest.raises(ExtractError, match=r"need about .*filesystem has 1.00 kB free.*--skip-space-check"):
        run_generate(GenerateConfig(model=str(qwen3_dir), corpus=str(corpus), out=str(out)), log=lambda m: None)
    assert is_generated_corpus(out)  # its plan (the manifest) is kept for the rerun


def test_plan_dry_run_exits_1_on_a_corpus_giving_no_samples(qwen3_dir, tmp_path, capsys):
    from extract.__main__ import main

    corpus = write_chat_jsonl(tmp_path / "c.jsonl", [{"id": "a", "messages": [{"role": "user", "content": "hi"}]}])
    assert (
        main(
            [
                "plan",
                "--dry-run",
                "--model",
                str(qwen3_dir),
                "--corpus",
                str(corpus),
                "--tokenizer-workers",
                "1",
                "--layers",
                "1,3",
            ]
        )
        == 1
    )
    assert "no samples (1 record(s) quarantined (no_assistant_turn 1))" in capsys.readouterr().err


# --------------------------------------------------------------------------- verify --clean / --repair (26.3)


def test_verify_clean_removes_what_it_names(tmp_path, capsys):
    from store_schema.__main__ import main

    store = tmp_path / "s"
    random_store(store, num_shards=2, samples_per_shard=2)
    leftover = store / ".staging" / "shard-000000.dead.abc"
    leftover.mkdir(parents=True)
    (leftover / "x").write_bytes(b"half")
    (store / "shards" / "shard-000001" / "commit.json").unlink()  # uncommitted, but where readers look
    (store / "commits" / "shard-000001.json").unlink()  # (a committed one would be damage: the journal says so)
    assert main(["verify", str(store), "--clean"]) == 1  # the shard is missing until extract run redoes it
    out = capsys.readouterr().out
    assert "removed 1 uncommitted leftover(s): shard-000000.dead.abc" in out and "--clean removes" not in out, out
    assert "moved 1 shard directory(ies) without a commit record to" in out and "shard-000001" in out, out
    assert not any((store / ".staging").iterdir()) and not (store / "shards" / "shard-000001").exists()
    assert main(["verify", str(store), "--json"]) == 3  # intact: only incomplete
    report = json.loads(capsys.readouterr().out)
    assert report["leftovers"] == [] and [p["shard"] for p in report["problems"]] == ["shard-000001"]


def test_verify_repair_moves_damaged_and_commitless_shards_aside_and_names_the_next_step(tmp_path, capsys):
    from store_schema import Store
    from store_schema.__main__ import main

    store = tmp_path / "s"
    random_store(store, num_shards=3, samples_per_shard=2)
    layer = next(p for p in (store / "shards" / "shard-000001" / "layer_1" / "c").rglob("*") if p.is_file())
    data = bytearray(layer.read_bytes())
    data[len(data) // 2] ^= 0xFF
    layer.write_bytes(bytes(data))
    (store / "shards" / "shard-000002" / "commit.json").unlink()

    assert main(["verify", str(store), "--repair"]) == 3  # intact now, incomplete until extract run redoes them
    captured = capsys.readouterr()
    assert "moved 2 damaged shard(s)" in captured.out and "shard-000001, shard-000002" in captured.out
    assert "rerun the same `python -m extract run` command" in captured.out
    assert "verified 3/3 shards" in captured.err  # progress on stderr
    assert sorted(p.name.split(".")[0] for p in (store / "damaged").iterdir()) == ["shard-000001", "shard-000002"]
    assert Store(store).committed_shards() == ["shard-000000"]
    assert main(["verify", str(store), "--json"]) == 3
    report = json.loads(capsys.readouterr().out)
    assert {p["what"] for p in report["problems"]} == {"planned shard missing (not committed, or deleted)"}
    assert report["status"] == "incomplete"


# --------------------------------------------------------------------------- messages and help (26.12)


def test_the_second_job_refusal_is_a_sentence(tmp_path):
    from store_schema import StoreLock, StoreLockedError

    with StoreLock(tmp_path / "s", job="extract run --store s"):
        with pytest.raises(StoreLockedError) as refused:
            StoreLock(tmp_path / "s").acquire()
    message = str(refused.value)
    assert "held by another live job, `extract run --store s` (pid " in message, message
    assert " UTC)" in message and "{" not in message and '"since"' not in message


def test_run_reports_quarantine_reasons():
    from extract.extraction.report import summary_line

    report = dict(
        status="complete",
        shards_written=2,
        samples_written=9,
        tokens_written=900,
        shards_skipped=0,
        quarantined=3,
        quarantined_by_reason={"unsafe_id": 1, "no_assistant_turn": 2},
        tokens_per_s=10.0,
        bytes_per_s=100,
        workers=1,
        padded_token_ratio=1.1,
    )
    assert "3 record(s) quarantined (no_assistant_turn 2, unsafe_id 1)" in summary_line(report)
    report.update(store="/s", quarantined_first="c.jsonl:2: unsafe_id: '../x'")  # issue 62.5: where they are
    assert (
        "3 record(s) quarantined (no_assistant_turn 2, unsafe_id 1) (first: c.jsonl:2: unsafe_id: '../x'; "
        "all: python -m store_schema info /s --quarantined)"
    ) in summary_line(report)


def test_help_shows_defaults_and_only_the_flags_each_command_uses(capsys):
    from extract.__main__ import build_parser
    from store_schema.__main__ import build_parser as store_parser
    from store_schema.tools.recompute import MIN_COSINE

    run = build_parser()._subparsers._group_actions[0].choices["run"]
    actions = {a.option_strings[0]: a for a in run._actions if a.option_strings}
    for flag, default in (
        ("--device", "auto"),
        ("--workers", "1"),
        ("--max-length", "3072"),
        ("--shard-tokens", "32768"),
        ("--min-loss-tokens", "1"),
        ("--seed", "0"),
        ("--batch-tokens", "16384"),
    ):
        action = actions[flag]
        assert re.search(rf"default {default}\b", action.help % dict(vars(action), prog=run.prog)), (flag, action.help)
    assert "a resumed store: its plan's" in actions["--seed"].help
    text = run.format_help()
    assert "--compression-ratio" not in text
    verify = " ".join(store_parser()._subparsers._group_actions[0].choices["verify"].format_help().split())
    assert f">= {MIN_COSINE['fp8_e4m3']}" in verify and f">= {MIN_COSINE['bfloat16']}" in verify


def test_no_statement_of_the_command_line_is_a_stray_tuple():
    """A trailing comma after a call makes an expression statement a tuple (issue 23.6)."""
    for path in (REPO / "extract" / "__main__.py", REPO / "store_schema" / "__main__.py"):
        tree = ast.parse(path.read_text())
        stray = [
            node.lineno for node in ast.walk(tree) if isinstance(node, ast.Expr) and isinstance(node.value, ast.Tuple)
        ]
        assert not stray, (path, stray)


# --------------------------------------------------------------------------- imports (23.1)


@pytest.mark.slow  # child processes
def test_import_store_schema_alone_imports_no_zarr_and_provenance_not_the_fingerprint():
    code = (
        "import sys, store_schema, store_schema.plan, store_schema.fingerprint, store_schema.codecs.fp8\n"
        "assert 'zarr' not in sys.modules, 'zarr imported'\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "for name in [m for m in sys.modules if m.startswith('store_schema.')]: del sys.modules[name]\n"
        "import store_schema.provenance\n"
        "assert 'store_schema.fingerprint' not in sys.modules, 'provenance imports the fingerprint'\n"
        "from store_schema import Store\n"
        "import zarr, numpy as np\n"
        "from zarr.core.dtype import parse_data_type\n"
        "assert parse_data_type('bfloat16', zarr_format=3) is not None  # registered once a store is opened\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
