"""The one door for operations that take a store path or URL: a directory goes to
the POSIX code (`reader`, `writer`, `repair`), a `s3://` / `gs://` URL to
`objstore` (`store_schema.location` tells them apart). Dispatching here, above
both, keeps the bucket code free to build on the directory code without either
importing the other back."""

from __future__ import annotations

from pathlib import Path

from .location import StoreURL, classify_store
from .encoding import CodecConfig
from .fingerprint import Fingerprint


def open_store(arg):
    """The reader (`reader.Store`, or `objstore.reader.BucketStore`) of a store path or URL."""
    location = classify_store(arg)
    if isinstance(location, StoreURL):
        from .objstore.reader import BucketStore  # obstore only where a bucket is used

        return BucketStore(location)
    from .reader import Store

    return Store(location)


def create_store(path, fingerprint: Fingerprint, codec: CodecConfig | None = None, overwrite: bool = False,
                 keep_plan: bool = False):
    """An empty store in a directory (`writer.create_store_dir`, whose arguments these
    are) or under an object-store URL (`objstore.commit.create_bucket_store`: never
    overwritten in place, and its plan is its own)."""
    location = classify_store(path)
    if isinstance(location, StoreURL):
        if overwrite:
            raise ValueError(f"{path}: a store on object storage is never overwritten in place; use a new prefix")
        from .objstore.commit import create_bucket_store  # obstore only where a bucket is used

        return create_bucket_store(location, fingerprint, codec)
    from .writer import create_store_dir

    return create_store_dir(Path(location), fingerprint, codec, overwrite=overwrite, keep_plan=keep_plan)


def repair_store(store, report):
    """Set aside every planned shard `report` (`verify.verify_store`'s) names a problem
    of (`repair.repair_dir`; a bucket's markers are deleted, `objstore.repair`)."""
    location = classify_store(store)
    if isinstance(location, StoreURL):
        from .objstore.repair import repair_bucket

        return repair_bucket(location, report)
    from .repair import repair_dir

    return repair_dir(location, report)


def clean_store(store, commitless: bool = True) -> tuple[list[str], list[str]]:
    """`verify --clean`: a dead job's leftovers removed (`repair.clean_dir`, or
    `objstore.repair.clean_bucket`); returns (removed, set aside)."""
    location = classify_store(store)
    if isinstance(location, StoreURL):
        from .objstore.repair import clean_bucket

        return clean_bucket(location), []
    from .repair import clean_dir

    return clean_dir(location, commitless)
