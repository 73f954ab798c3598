"""Hub ids as the ecosystem types them (`Qwen/Qwen3-8B`), resolved from the local
Hugging Face cache only: nothing is ever downloaded (extraction and training run on
hosts that may have no network, and a 27B download is the user's decision).

`model_dir_arg` is the argparse `type` of every flag that names a model or drafter
directory (`--model`, `--target`, `--drafter`): a path that exists is kept as given; a
hub id found in the cache becomes its snapshot directory; one that is not cached is
refused in one line with the `hf download` command that fetches it."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name, as the hub spells repository ids


def cached_snapshot(repo_id: str) -> Path | None:
    """The local snapshot of hub repository `repo_id` (its main revision), or None."""
    # huggingface_hub ships with transformers; imported here so --help stays light
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, cache_dir=constants.HF_HUB_CACHE, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError):
        return None


def model_dir_arg(value: str) -> str:
    """A local model directory for a flag: `value` itself when it exists (or does not
    look like a hub id: the command says what is wrong with the path), else the
    cached snapshot of hub id `value`; argparse.ArgumentTypeError (usage, exit 2)
    when the id is not in the cache."""
    if Path(value).expanduser().exists() or not HUB_ID.match(value):
        return value
    snapshot = cached_snapshot(value)
    if snapshot is not None:
        return str(snapshot)
    # huggingface_hub ships with transformers; read here so --help stays light
    from huggingface_hub import constants

    raise argparse.ArgumentTypeError(
        f"{value} is not a directory here, and hub id {value} is not in the local Hugging Face cache "
        f"({constants.HF_HUB_CACHE}); nothing is downloaded: fetch it with `hf download {value} --local-dir DIR` "
        "and pass DIR"
    )
