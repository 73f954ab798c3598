"""The store root's attributes (`zarr.json` -> attributes["dflash_store"]): schema
version, fingerprint and its hash, codec (v1 stores' settings read too). `create_store` writes them with
`root_attributes` (`write_root`: the root's files); the reader and a reopened writer
read them with `read_root`, so both accept and refuse the same roots."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import zarr

from . import layout
from .codecs.encoding import CodecConfig
from .commit.records import describe_files, write_record
from .dtypes import store_dtype
from .fingerprint import Fingerprint
from .projection import Projection


@dataclass(frozen=True)
class StoreRoot:
    attrs: dict  # the raw attribute dict, as written
    fingerprint: Fingerprint
    codec: CodecConfig


def root_attributes(fingerprint: Fingerprint, codec: CodecConfig) -> dict:
    return {
        "schema_version": layout.SCHEMA_VERSION,
        "fingerprint": fingerprint.to_json(),
        "fingerprint_sha256": fingerprint.sha256(),
        "codec": codec.to_json(),
    }


def read_root(path) -> StoreRoot:
    """FileNotFoundError where `path` holds no zarr group (a wrong path); ValueError
    where it is not a dflash store of this schema version (a wrong or damaged store)."""
    path = Path(path)
    metadata = path / layout.ZARR_METADATA
    if not metadata.is_file():
        if not path.exists():
            raise FileNotFoundError(f"{path}: does not exist")
        raise FileNotFoundError(f"{path}: not a zarr store (no {layout.ZARR_METADATA})")
    return parse_root(metadata.read_bytes(), path, metadata)


def parse_root(raw: bytes, store, metadata) -> StoreRoot:
    """`read_root` on the root metadata's bytes (`store`, `metadata`: how errors name them)."""
    try:
        attrs = json.loads(raw)["attributes"][layout.ROOT_ATTR]
        version = attrs.get("schema_version")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{metadata}: not a dflash store root ({exc!r})") from None
    if version != layout.SCHEMA_VERSION:
        raise ValueError(f"{store}: schema version {version!r}, this code reads {layout.SCHEMA_VERSION}")
    try:
        return StoreRoot(attrs, Fingerprint.from_json(attrs["fingerprint"]), CodecConfig.from_json(attrs["codec"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{metadata}: root attributes lack or mistype a field ({exc!r})") from None


def write_root(
    path, fingerprint: Fingerprint, codec: CodecConfig | None = None, projection: Projection | None = None
) -> None:
    """Write a store's root files into the directory `path` (emptied first by the caller):
    `zarr.json` with the root attributes, the `shards/` group, a projected store's
    directions, and the root record listing them. A bucket store writes them here in a
    temporary directory and uploads them (`objstore.commit.create_bucket_store`). The
    codec is the store dtype's default unless given."""
    path = Path(path)
    codec = codec or CodecConfig(name=store_dtype(fingerprint.dtype).default_codec)
    # Mode "a" on the emptied directory, never "w": zarr's "w" deletes everything in
    # it, the held `.lock` included, and a second job could then lock a fresh file.
    root = zarr.open_group(str(path), mode="a")
    root_files = [layout.ZARR_METADATA, f"{layout.SHARDS_DIR}/{layout.ZARR_METADATA}"]
    if projection is not None:
        (path / layout.PROJECTION_FILE).write_bytes(projection.to_bytes())
        root_files.append(layout.PROJECTION_FILE)
    root.attrs[layout.ROOT_ATTR] = root_attributes(fingerprint, codec)
    root.create_group(layout.SHARDS_DIR)
    write_record(
        path / layout.ROOT_RECORD,
        {
            "schema_version": layout.SCHEMA_VERSION,
            "fingerprint_sha256": fingerprint.sha256(),
            "files": {rel: meta for rel, meta in describe_files(path).items() if rel in root_files},
        },
    )
