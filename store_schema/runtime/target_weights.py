"""Does a target directory hold readable weights? The one check every command that
runs the target makes before Ray or torch start (`extract run`, `extract generate`,
`train fit`, `eval`, `speculate`, `store_schema verify --recompute`):

    files = check_target_weights("/models/Qwen3.6-27B", "--model")

A directory without weights (a config-only directory written for `--dry-run`, a
download that stopped before its safetensors) otherwise fails late and far from
its cause: a Ray traceback after the cluster started, or `fit` calling it "not the
checkpoint". Here it is one line naming the directory. Cheap: only the safetensors
headers are read (the 8-byte length and the JSON that follows), never a tensor, and
plain Python (no torch), so the refusal comes before anything heavy is imported.

`target_model.load_target_model` refuses what only loading can find (a tensor
missing from, or of the wrong shape for, the architecture): same error type."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from .target_config import read_config_json

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on its JSON header


class TargetWeightsError(ValueError):
    """The target's weights are missing, unreadable, or do not fill the model (exit 1 in a command)."""


def check_target_weights(model_dir: str | Path, flag: str = "--model") -> list[Path]:
    """The safetensors files of `model_dir`, each with a readable header that its
    size agrees with; TargetWeightsError (one line naming `flag` and the directory)
    otherwise. A path that is not a model directory is FileNotFoundError (exit 2)."""
    path = Path(model_dir)
    read_config_json(path)
    files = weight_files(path, flag)
    for file in files:
        problem = header_problem(file)
        if problem:
            raise TargetWeightsError(f"{flag} {path}: weights file {file.name} {problem}; the target cannot be loaded")
    return files


def weight_files(path: Path, flag: str = "--model") -> list[Path]:
    """The files the checkpoint's index lists, or its single `model.safetensors`."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map") or {}
        except (ValueError, AttributeError, OSError) as error:
            raise TargetWeightsError(f"{flag} {path}: {INDEX_FILE} is not a readable index ({error})") from None
        files = [path / name for name in dict.fromkeys(weight_map.values())]
        if not files:
            raise TargetWeightsError(f"{flag} {path}: {INDEX_FILE} lists no weights")
        missing = [file.name for file in files if not file.is_file()]
        if missing:
            raise TargetWeightsError(
                f"{flag} {path}: {len(missing)} of the {len(files)} weights files its "
                f"{INDEX_FILE} lists are missing ({', '.join(missing[:3])}"
                f"{' ...' if len(missing) > 3 else ''}); the download is incomplete"
            )
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    raise TargetWeightsError(
        f"{flag} {path}: no weights ({SINGLE_FILE} or {INDEX_FILE}); a config-only directory "
        "sizes a job (--dry-run) but cannot run the target"
    )


def header_problem(file: Path) -> str:
    """'' when `file` opens as safetensors and its size covers every tensor its header
    places; else what is wrong (unreadable, not safetensors, truncated)."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
                return "is not a safetensors file (no header)"
            header = json.loads(f.read(length))
        if not isinstance(header, dict):
            raise ValueError(file)
    except PermissionError:
        return "cannot be read (permission denied)"
    except OSError as error:
        return f"cannot be read ({error.strerror or error})"
    except ValueError:
        return "is not a safetensors file (its header is not JSON)"
    ends = [
        entry["data_offsets"][1]
        for name, entry in header.items()
        if name != "__metadata__" and isinstance(entry, dict) and len(entry.get("data_offsets") or ()) == 2
    ]
    needed = 8 + length + max(ends, default=0)
    if size < needed:
        return f"is truncated ({size} of {needed} bytes)"
    return ""
