"""The store's layout and metadata: the one contract between extraction and training.

Only this package knows where arrays live; `extract` writes through `StoreWriter`,
`train` reads through `Store`."""

from . import bf16  # noqa: F401  (registers the zarr bfloat16 data type)
from .fingerprint import Fingerprint, FingerprintMismatch, file_sha256, package_versions
from .layout import LAYER_ID_CONVENTION, CodecConfig
from .lock import StoreLock, StoreLockedError
from .plan import Plan, PlannedSample, PlannedShard, QuarantinedRecord, is_safe_id, sample_digest, shard_name
from .reader import CorruptShardError, Sample, ShardData, Store, on_disk_bytes, open_store, read_plan
from .writer import SampleArrays, StoreExistsError, StoreWriter, create_store

__all__ = [
    "LAYER_ID_CONVENTION",
    "CodecConfig",
    "CorruptShardError",
    "Fingerprint",
    "FingerprintMismatch",
    "Plan",
    "PlannedSample",
    "PlannedShard",
    "QuarantinedRecord",
    "Sample",
    "SampleArrays",
    "ShardData",
    "Store",
    "StoreExistsError",
    "StoreLock",
    "StoreLockedError",
    "StoreWriter",
    "create_store",
    "file_sha256",
    "is_safe_id",
    "on_disk_bytes",
    "open_store",
    "package_versions",
    "read_plan",
    "sample_digest",
    "shard_name",
]
