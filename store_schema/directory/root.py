"""A store in a directory, as a whole: creating it (`create_store_dir`), and what
`--overwrite` may clear (`looks_like_store`, `clear_store`); the writer
(`store_schema.writer`) writes its shards, `plan_io.commit_plan` its plan."""

from __future__ import annotations

import shutil
from pathlib import Path

from .. import layout
from ..codecs.encoding import CodecConfig
from ..errors import StoreExistsError
from ..fingerprint import Fingerprint
from ..projection import Projection
from ..root import write_root
from .writer import StoreWriter


def clear_store(path, keep=()) -> None:
    """Delete what a store directory holds (`--overwrite`), the held `.lock` and the
    entries named in `keep` aside."""
    for entry in store_entries(path):
        if entry.name in keep:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def store_entries(path) -> list[Path]:
    """What a store directory holds, the job lock (`.lock`) aside: the lock is not
    content, and removing it while held would let a second job lock a fresh inode."""
    path = Path(path)
    return [p for p in path.iterdir() if p.name != layout.LOCK_FILE] if path.is_dir() else []


def looks_like_store(path) -> bool:
    """Whether a non-empty directory holds only what a store holds (so overwriting
    it can't delete anything else)."""
    names = {p.name for p in store_entries(path)}
    return bool(names) and names <= {
        layout.ZARR_METADATA,
        layout.ROOT_RECORD,
        layout.PLAN_DIR,
        layout.SHARDS_DIR,
        layout.STAGING_DIR,
        layout.REPORTS_DIR,
        layout.DAMAGED_DIR,
        layout.COMMITS_DIR,
        layout.PROJECTION_FILE,
    }


def create_store_dir(
    path,
    fingerprint: Fingerprint,
    codec: CodecConfig | None = None,
    overwrite: bool = False,
    keep_plan: bool = False,
    projection: Projection | None = None,
) -> StoreWriter:
    """Create an empty store (`root.write_root`) in a directory (`store_schema.stores.create_store`
    takes a URL too). An existing store is kept unless `overwrite`. With `keep_plan`, a plan committed
    before the root (`plan_io.commit_plan`) stays, and whatever else an earlier creation
    cut short left is removed (without a root record nothing in it was committed).
    A projected store's fingerprint names its `projection`, written beside the root
    and listed in the root record."""
    path = Path(path)
    if bool(fingerprint.projection) != (projection is not None) or (
        projection is not None and projection.summary() != fingerprint.projection
    ):
        raise ValueError(f"{path}: the fingerprint's projection and the one given differ")
    kept = {layout.PLAN_DIR, layout.STAGING_DIR} if keep_plan else set()
    existing = [e for e in store_entries(path) if e.name not in kept]  # a job holds `.lock` before it creates the store
    if existing:
        if not (overwrite or keep_plan):
            raise StoreExistsError(f"{path} exists and is not empty; pass overwrite to start over")
        clear_store(path, keep=kept)
    write_root(path, fingerprint, codec, projection)
    return StoreWriter(path)
