"""The one exit-code and error rule of every command (store_schema.runtime.cli; issue 16
items 5, 6, 10): a path that does not exist is a usage error (exit 2) in every
command, a device this machine lacks and a config file that does not parse are
refusals (exit 1); each is one `error:` line naming what is wrong, never a
traceback. `--help` answers without importing torch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import builders
import pytest
import tiny
import torch
from paths import REPO

from extract.__main__ import main as extract_main
from store_schema.__main__ import main as store_main
from train.cli import main as train_main

MISSING = "/nonexistent/dflash-missing"
TINY = tiny.drafter_sets("train.grad_accumulation=1", "eval.every=0", heads=True)


@pytest.fixture(scope="module")
def world(tmp_path_factory, qwen3_dir) -> dict[str, str]:
    """Everything the commands take, real: a store matching the tiny Qwen3 target, a
    run of 2 steps on it, its export, a corpus, a prompts file, a copy of the target without weights."""
    root = tmp_path_factory.mktemp("cli")
    builders.random_store(
        root / "store", num_shards=2, samples_per_shard=4, num_target_layers=6, hidden_size=64, vocab_size=512
    )
    assert (
        train_main(
            [
                "fit",
                "--store",
                str(root / "store"),
                "--target",
                str(qwen3_dir),
                "--out",
                str(root / "run"),
                "--max-steps",
                "2",
                *tiny.cli_sets(TINY),
            ]
        )
        == 0
    )
    assert train_main(["export", str(root / "run"), "--out", str(root / "export")]) == 0
    builders.write_chat_jsonl(root / "chats.jsonl", builders.coding_chats(4))
    (root / "prompts.jsonl").write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    weightless = root / "weightless"  # the target's config and tokenizer, its safetensors never downloaded
    weightless.mkdir()
    for file in Path(qwen3_dir).iterdir():
        if not file.name.startswith("model.safetensors"):
            shutil.copy(file, weightless / file.name)
    return {
        "S": str(root / "store"),
        "T": str(qwen3_dir),
        "RUN": str(root / "run"),
        "E": str(root / "export"),
        "C": str(root / "chats.jsonl"),
        "P": str(root / "prompts.jsonl"),
        "NEW": str(root / "new"),
        "M": MISSING,
        "W": str(weightless),
    }


COMMANDS = {  # every command, with one path that does not exist (M)
    "fit --store": "train fit --store M --target T --out NEW",
    "fit --target": "train fit --store S --target M --out NEW",
    "fit --config": "train fit --store S --target T --out NEW --config M",
    "fit --init-from": "train fit --store S --target T --out NEW --init-from M",
    "fit --resume --out": "train fit --out M --resume",
    "export RUN": "train export M --out NEW",
    "export --checkpoint": "train export RUN --checkpoint M --out NEW",
    "eval --store": "train eval --store M --drafter E --target T",
    "eval --drafter": "train eval --store S --drafter M --target T",
    "eval --target": "train eval --store S --drafter E --target M",
    "diagnose RUN": "train diagnose M",
    "diagnose --compare": "train diagnose RUN --compare M",
    "diagnose --config": "train diagnose RUN --config M",
    "speculate --drafter": "train speculate --drafter M --target T --store S",
    "speculate --target": "train speculate --drafter E --target M --store S",
    "speculate --store": "train speculate --drafter E --target T --store M",
    "speculate --prompts": "train speculate --drafter E --target T --prompts M",
    "serve-check --drafter": "train serve-check --drafter M --target T --prompts P",
    "serve-check --target": "train serve-check --drafter E --target M --prompts P",
    "serve-check --prompts": "train serve-check --drafter E --target T --prompts M",
    "info": "store_schema info M",
    "verify": "store_schema verify M",
    "verify --model": "store_schema verify S --recompute 1 --model M",
    "config-only-target --tokenizer": "extract config-only-target NEW --tokenizer M",
    "plan --model": "extract plan --dry-run --model M --corpus C --layers 1,3",
    "plan --corpus": "extract plan --dry-run --model T --corpus M --layers 1,3",
    "plan --tokenizer": "extract plan --dry-run --model T --tokenizer M --corpus C --layers 1,3",
    "run --model": "extract run --model M --corpus C --store NEW --layers 1,3",
    "run --corpus": "extract run --model T --corpus M --store NEW --layers 1,3",
}
MAINS = {"train": train_main, "store_schema": store_main, "extract": extract_main}


def run_in_process(command: str, world: dict[str, str]) -> int:
    program, *argv = command.split()
    return MAINS[program]([world.get(word, word) for word in argv])


@pytest.mark.parametrize("command", COMMANDS.values(), ids=COMMANDS.keys())
def test_a_missing_path_is_a_usage_error_in_every_command(command, world, capsys):
    capsys.readouterr()
    assert run_in_process(command, world) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and MISSING in err, err
    assert not Path(world["NEW"]).exists()  # a refused command leaves nothing behind


WEIGHTLESS = {  # every command that runs the target, given a model directory without weights (W)
    "extract run": ("extract run --model W --corpus C --store NEW --layers 1,3", "--model"),
    "extract generate": ("extract generate --model W --corpus C --out NEW", "--model"),
    "fit": ("train fit --store S --target W --out NEW", "--target"),
    "eval": ("train eval --store S --drafter E --target W", "--target"),
    "speculate": ("train speculate --drafter E --target W --store S", "--target"),
    "verify --recompute": ("store_schema verify S --recompute 1 --model W", "--model"),
}


@pytest.mark.parametrize("command,flag", WEIGHTLESS.values(), ids=WEIGHTLESS.keys())
def test_a_target_without_weights_is_refused_in_one_line_naming_it(command, flag, world, capsys):
    """Not a Ray traceback after the cluster started, not "another checkpoint": the
    directory named, before anything runs or is written."""
    capsys.readouterr()
    assert run_in_process(command, world) == 1
    err = capsys.readouterr().err
    assert err == (
        f"error: {flag} {world['W']}: no weights (model.safetensors or model.safetensors.index.json); "
        "a config-only directory sizes a job (--dry-run) but cannot run the target\n"
    ), err
    assert not Path(world["NEW"]).exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize(
    "command",
    [
        "train eval --store S --drafter E --target T --device cuda",
        "train speculate --drafter E --target T --store S --device cuda:0",
        "store_schema verify S --recompute 1 --model T --device cuda",
        "train fit --store S --target T --out NEW --set train.device=cuda",
    ],
    ids=["eval", "speculate", "verify --recompute", "fit"],
)
def test_cuda_on_a_machine_without_it_is_one_line(command, world, capsys):
    capsys.readouterr()
    assert run_in_process(command, world) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "cuda" in err and "use cpu" in err, err
    assert not Path(world["NEW"]).exists()


def test_a_device_that_is_not_one_is_one_line(world, capsys):
    capsys.readouterr()
    assert run_in_process("train eval --store S --drafter E --target T --device gpu0", world) == 1
    assert capsys.readouterr().err == "error: --device gpu0: not a device (cpu, cuda or cuda:N)\n"


@pytest.mark.parametrize(
    "text,where",
    [
        ("optim:\n  lr: [1, 2\nseed: 3\n", "line 3, column 5"),
        ("optim:\n\tlr: 1\n", "line 2, column 1"),
        ("train: {seed: 1\n", "line 2, column 1"),
    ],
)
def test_a_config_that_does_not_parse_is_named_with_its_line(text, where, world, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(text)
    for command in (
        f"train fit --store S --target T --out NEW --config {config}",
        f"train diagnose RUN --config {config}",
    ):
        capsys.readouterr()
        assert run_in_process(command, world) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: {config} {where}: not valid YAML: ") and err.count("\n") == 1, err


@pytest.mark.slow  # child processes
def test_help_imports_nothing_heavy():
    """`--help` of every command line answers without torch, transformers or Ray."""
    script = (
        "import sys\n"
        "from extract.__main__ import main as e\nfrom store_schema.__main__ import main as s\n"
        "from train.cli import main as t\n"
        "codes = [t(['--help']), t(['fit', '--help']), s(['--help']), s(['verify', '--help'])]\n"
        "try:\n    e(['run', '--help'])\nexcept SystemExit as exit_:\n    codes.append(exit_.code)\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'ray', 'safetensors') if m in sys.modules)\n"
        "print(codes, heavy)"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.stdout.strip().splitlines()[-1] == "[0, 0, 0, 0, 0] []", result.stdout[-2000:] + result.stderr


def test_fit_needs_out_except_for_a_dry_run(world, capsys):
    capsys.readouterr()
    assert run_in_process("train fit --store S --target T", world) == 2
    assert capsys.readouterr().err == "error: fit needs --out RUN (the run directory; only --dry-run goes without)\n"


@pytest.mark.parametrize("program", MAINS)
def test_every_option_with_a_default_shows_it_in_help(program):
    """Issue 35.10: `--help` of every subcommand shows each option's default, once
    (issue 48.10: not `(default 1) (default 1)`)."""
    import importlib

    from store_schema.runtime.cli import parsers_of, shown_default

    module = importlib.import_module("train.cli" if program == "train" else f"{program}.__main__")
    checked = 0
    for parser in parsers_of(module.build_parser()):
        for action in parser._actions:
            if shown_default(action):
                shown = (action.help or "") % dict(vars(action), prog=parser.prog)
                spellings = {str(action.default)}
                if isinstance(action.default, float):
                    spellings.add(f"{action.default:g}")
                if isinstance(action.default, (tuple, list)):
                    spellings.add(",".join(map(str, action.default)))
                after = shown[shown.index("default") :] if "default" in shown else ""
                assert any(spelling in after for spelling in spellings), (
                    f"{parser.prog} {action.option_strings[0]}: {shown!r}"
                )
                assert shown.count("(default") <= 1, f"{parser.prog} {action.option_strings[0]}: {shown!r}"
                checked += 1
    assert checked >= 1


def test_fit_ends_with_a_summary_and_the_next_commands(world, tmp_path, capsys):
    """Issue 35.10: not a JSON line only; the JSON stays the last line of stdout."""
    out = tmp_path / "run"
    capsys.readouterr()
    assert (
        train_main(
            [
                "fit",
                "--store",
                world["S"],
                "--target",
                world["T"],
                "--out",
                str(out),
                "--max-steps",
                "2",
                *tiny.cli_sets(TINY),
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1])["step"] == 2
    end = captured.err.strip().splitlines()[-4:]
    assert end[0].startswith("fit: done at step 2, loss ") and ", top-1 " in end[0], end
    assert f"; checkpoint {out / 'checkpoints'}" in end[0] and end[0].endswith(f"; run log {out / 'train_log.jsonl'}")
    drafter = out / "drafter"
    assert end[1:] == [
        f"next: python -m train export {out} --out {drafter}",
        f"      python -m train eval --store {world['S']} --drafter {drafter} --target {world['T']}",
        f"      python -m train diagnose {out}",
    ]
    assert train_main(end[1].split()[4:]) == 0  # the next commands run: export, then eval up to the data
    assert train_main(end[2].split()[3:]) == 1  # the random store holds no held-out sample to score
    assert "no heldout sample with a scoreable block" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command, wrong, meant",
    [
        (["train", "eval", "--store", "S", "--drafter", "D", "--target", "T"], "--jsn", "--json"),
        (["store_schema", "info", "S"], "--jsn", "--json"),
        (["extract", "plan", "--model", "M", "--corpus", "C", "--store", "S"], "--dry-rn", "--dry-run"),
    ],
)
def test_a_typo_is_refused_by_its_subcommand_with_the_option_it_meant(command, wrong, meant, capsys):
    """Issue 48.10: the subcommand's usage (not the top-level one) and "did you mean"."""
    program, *argv = command
    capsys.readouterr()
    try:
        code = MAINS[program]([*argv, wrong])
    except SystemExit as exit_:  # extract's main lets argparse exit
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    assert f"usage: python -m {program} {argv[0]} " in err
    assert f"unrecognized arguments: {wrong} (did you mean {meant}?)" in err


def test_an_abbreviated_option_is_not_taken_for_the_whole_one(capsys):
    """Issue 48.10: `--stor` was accepted as `--store`."""
    capsys.readouterr()
    assert store_main(["verify", "S", "--checksums"]) == 2
    assert "unrecognized arguments: --checksums (did you mean --checksums-only?)" in capsys.readouterr().err
