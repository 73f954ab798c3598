"""The store's layout and metadata: the one contract between extraction and training.

Only this package knows where arrays live; `extract` writes through a `ShardWriter`
(a directory's `StoreWriter`, a bucket's `objstore.commit.BucketWriter`), `train`
reads through a `StoreReader` (a directory's `Store`, a bucket's
`objstore.reader.BucketStore`). Names are imported lazily so that light users
(`store_schema.plan`, planning workers, `--help`) don't pay for torch and zarr:
zarr comes with the reader or writer, which register the store's zarr data types
(`store_schema.codecs.zarr_dtypes`) when they are imported."""

from importlib import import_module

_EXPORTS = {
    "LAYER_ID_CONVENTION": "layout",
    "CodecConfig": "codecs.encoding",
    "STORE_DTYPES": "dtypes",
    "StoreDtype": "dtypes",
    "store_dtype": "dtypes",
    "NonFiniteStatesError": "errors",
    "StoreError": "errors",
    "default_layer_ids": "layout",
    "raw_bytes_per_token": "layout",
    "validate_layer_ids": "layout",
    "Fingerprint": "fingerprint",
    "FingerprintMismatch": "fingerprint",
    "TargetFacts": "fingerprint",
    "file_sha256": "fingerprint",
    "package_versions": "fingerprint",
    "target_identity": "fingerprint",
    "response_provenance": "provenance",
    "response_sampling": "provenance",
    "provenance_warning": "provenance",
    "ShardCommit": "commit.records",
    "StoreLock": "commit.lock",
    "StoreLockedError": "errors",
    "Plan": "plan",
    "PlannedSample": "plan",
    "PlannedShard": "plan",
    "QuarantinedRecord": "plan",
    "is_safe_id": "plan",
    "sample_digest": "plan",
    "shard_name": "plan",
    "CorruptShardError": "errors",
    "Sample": "reader",
    "ShardData": "reader",
    "Store": "directory.reader",
    "StoreReader": "reader",
    "on_disk_bytes": "commit.records",
    "read_plan": "plan_io",
    "SampleArrays": "writer",
    "StoreExistsError": "errors",
    "StoreWriter": "directory.writer",
    "ShardWriter": "writer",
    "create_store": "stores",
    "open_store": "stores",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'store_schema' has no attribute {name!r}")
    return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
