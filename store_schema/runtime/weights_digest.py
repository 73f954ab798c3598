"""A digest of every byte of a target's weights, for the full weights check.

The fingerprint's sampled hash reads 16 windows of 64 KiB per weight file (~0.02 % of
a 27B's bytes): it tells two checkpoints apart, not one tensor changed. This digest
reads everything: sha256 over each safetensors file's name, size and crc32c (crc32c
runs at memory speed). A file's crc32c is cached under the resolved path, size and
modification time (`DFLASH_CACHE_DIR`, else `$XDG_CACHE_HOME/dflash-store`, else
`~/.cache/dflash-store`), so a host hashes a checkpoint once; a file rewritten in place
changes its mtime and is read again."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .crc32c import crc32c_file

CACHE_ENV = "DFLASH_CACHE_DIR"


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash-store"


def weights_sha256(model_path: str | Path) -> str:
    """sha256 over (name, size, crc32c) of each `*.safetensors` file of the directory."""
    digest = hashlib.sha256()
    for file in sorted(Path(model_path).glob("*.safetensors")):
        digest.update(f"{file.name}\0{file.stat().st_size}\0{cached_crc32c(file)}\0".encode())
    return digest.hexdigest()


def cached_crc32c(file: Path) -> str:
    """The file's crc32c, from the cache when its size and mtime are the cached ones."""
    stat = file.stat()
    resolved = str(file.resolve())
    entry = cache_dir() / "weights" / f"{hashlib.sha256(resolved.encode()).hexdigest()}.json"
    key = {"path": resolved, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    try:
        cached = json.loads(entry.read_text())
        if {name: cached.get(name) for name in key} == key:
            return cached["crc32c"]
    except (OSError, ValueError, KeyError):
        pass
    crc = crc32c_file(file)
    try:  # a cache that cannot be written only costs the next check a read
        entry.parent.mkdir(parents=True, exist_ok=True)
        partial = entry.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({**key, "crc32c": crc}))
        os.replace(partial, entry)
    except OSError:
        pass
    return crc
