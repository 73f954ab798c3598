"""A store in a directory: the POSIX backend (`stores.backend` picks it for a path).

The reader and the writer import torch; this module does not, so that
`store_schema info` (`metadata`) starts without it: each is imported where it is used."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..commit.lock import StoreLock
from ..layout import ROOT_RECORD
from ..plan_io import commit_plan, read_committed_plan
from .metadata import DirectoryMetadata
from .output import DirectoryOutput
from .repair import clean_dir, repair_dir


@dataclass(frozen=True)
class DirectoryBackend:
    location: Path
    overwritable = True  # `--overwrite` deletes the content in place

    def __str__(self) -> str:
        return str(self.location)

    @property
    def address(self) -> str:
        """How workers and reports are told the store: its absolute path."""
        return str(self.location.resolve())

    def open(self):
        from .reader import Store  # torch: see the module docstring

        return Store(self.location)

    def metadata(self) -> DirectoryMetadata:
        return DirectoryMetadata(self.location)

    def open_existing(self):
        return self.open() if (self.location / ROOT_RECORD).is_file() else None

    def create(self, fingerprint, codec=None, overwrite: bool = False, keep_plan: bool = False, projection=None):
        from .root import create_store_dir  # torch, with the writer it returns

        return create_store_dir(
            self.location, fingerprint, codec, overwrite=overwrite, keep_plan=keep_plan, projection=projection
        )

    def writer(self, spool_dir=None, spool_bytes: int | None = None, log=None):
        from .writer import StoreWriter  # torch, as the reader

        return StoreWriter(self.location)  # written in place: no spool

    def read_plan(self):
        return read_committed_plan(self.location) if self.location.is_dir() else None

    def commit_plan(self, plan) -> None:
        commit_plan(self.location, plan)

    def lock(self, job: str, log=None) -> StoreLock:
        return StoreLock(self.location, job=job)

    def job_output(self) -> DirectoryOutput:
        return DirectoryOutput(self.location)

    def repair(self, report):
        return repair_dir(self.location, report)

    def clean(self, commitless: bool = True) -> tuple[list[str], list[str]]:
        return clean_dir(self.location, commitless)
