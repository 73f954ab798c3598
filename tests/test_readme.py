"""What the README promises a newcomer on its first screen and in its guide (issue 35.10):
a plain install block, TensorBoard, and the config-only target's CLI, each spelled as
the code takes it."""

from __future__ import annotations

import re

import pytest
from paths import REPO

README = (REPO / "README.md").read_text()


def test_the_first_screen_has_a_plain_install_block():
    first_screen = "\n".join(README.splitlines()[:40])
    blocks = re.findall(r"```bash\n(.*?)```", first_screen, flags=re.S)
    assert any("python -m venv" in block and "pip install -e ." in block for block in blocks), first_screen


def test_tensorboard_and_the_config_only_target_are_documented_as_the_code_spells_them():
    from extract.__main__ import build_parser
    from train.config import RunConfig

    assert "--set log.tensorboard=true" in README and RunConfig().log.tensorboard is False
    assert "python -m extract config-only-target OUT --tokenizer DIR" in " ".join(README.split())
    build_parser().parse_args(["config-only-target", "OUT", "--tokenizer", "DIR"])  # the command as written parses


def by_hand_commands() -> list[list[str]]:
    """The README's by-hand block, one command per entry (continuations joined), $W set."""
    import shlex

    section = README.split("## By hand, on something small", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1).replace("\\\n", " ")
    lines = [line.split("#")[0].strip() for line in block.splitlines()]
    return [shlex.split(line.replace("$W", "/tmp/w")) for line in lines if line and not line.startswith("export")]


def test_the_readme_is_short_and_its_first_screen_runs_a_job_by_hand():
    """Issue 48.9: <= 350 lines; the first 60 hold what it is, install, test, the demo and
    the by-hand block, which runs extract -> verify -> fit -> eval -> speculate."""
    assert len(README.splitlines()) <= 350, len(README.splitlines())
    first_screen = "\n".join(README.splitlines()[:62])
    for needed in (
        "runs the target **once**",
        "pip install -e .",
        "make test",
        "make demo",
        "## By hand, on something small",
    ):
        assert needed in first_screen, needed
    steps = [" ".join(words[:4]) for words in by_hand_commands()]
    assert steps == [
        "python scripts/embedded.py --target /tmp/w/target",
        "python -m extract generate",
        "python -m extract run",
        "python -m store_schema verify",
        "python -m train fit",
        "python -m train export",
        "python -m train eval",
        "python -m train speculate",
    ], steps
    assert "DFlashDraftModel`)," not in README  # the export names both kinds


def test_the_by_hand_commands_parse_and_the_cpu_recipe_loads():
    """Each command of the block as its parser takes it; the recipe is a valid config
    that trains the default drafter."""

    import embedded
    import real_vocab  # noqa: F401  its CLI is named in the README beside the block

    from extract.__main__ import build_parser as extract_parser
    from store_schema.__main__ import build_parser as store_parser
    from train.cli import build_parser as train_parser
    from train.config import RunConfig
    from train.config_loading import load_config

    parsers = {"extract": extract_parser(), "store_schema": store_parser(), "train": train_parser()}
    for words in by_hand_commands():
        if words[1] == "scripts/embedded.py":
            with pytest.raises(SystemExit) as done:
                embedded.main([*words[2:], "--help"])
            assert done.value.code == 0
            continue
        args = parsers[words[2]].parse_args(words[3:])
        if words[3] == "fit":
            config = load_config(REPO / args.config, store="s", target="t", out="o")
            assert config.model.architecture == RunConfig().model.architecture == "dflash2"
            assert config.loss.position_weights == RunConfig().loss.position_weights
