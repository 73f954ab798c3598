"""A directory store's reader: its metadata as the filesystem answers it
(`directory.metadata`), the state reads every backend shares (`reader.StoreReader`)."""

from __future__ import annotations

from ..reader import StoreReader
from .metadata import DirectoryMetadata


class Store(StoreReader, DirectoryMetadata):
    """A store in a directory, read as torch tensors (`Store(path)`)."""
