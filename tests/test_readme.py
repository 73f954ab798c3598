"""What the README promises a newcomer on its first screen and in its guide (issue 35.10):
a plain install block, TensorBoard, and the config-only target's CLI, each spelled as
the code takes it."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def test_the_first_screen_has_a_plain_install_block():
    first_screen = "\n".join(README.splitlines()[:40])
    blocks = re.findall(r"```bash\n(.*?)```", first_screen, flags=re.S)
    assert any("python -m venv" in block and "pip install -e ." in block for block in blocks), first_screen


def test_tensorboard_and_the_config_only_target_are_documented_as_the_code_spells_them():
    from store_schema.__main__ import build_parser
    from train.config import RunConfig

    assert "--set log.tensorboard=true" in README and RunConfig().log.tensorboard is False
    assert "python -m store_schema config-only-target OUT --tokenizer DIR" in " ".join(README.split())
    build_parser().parse_args(["config-only-target", "OUT", "--tokenizer", "DIR"])  # the command as written parses
