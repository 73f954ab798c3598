"""A directory store's writer: the shared shard writing (`writer.ShardWriter`), committed
the directory's way (`commit.staging.write_and_commit`: staged under `.staging/`, records
of every file's size and crc32c, fsync, the rename into `shards/` that is the commit, and
the journal entry)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .. import layout
from ..commit.lock import Attempt
from ..commit.staging import write_and_commit
from ..plan import Plan
from ..plan_io import commit_plan, read_committed_plan
from ..projection import Projection
from ..root import read_root
from ..writer import ShardWriter, Upload


class StoreWriter(ShardWriter):
    """Writes one directory store. Create with `create_store`, reopen with `StoreWriter(path)`."""

    def __init__(self, path):
        self.path: Path = Path(path)
        super().__init__(self.path, read_root(self.path))

    def write_plan(self, plan: Plan) -> None:
        """Write the plan once (`commit_plan`); a second, different plan is refused."""
        commit_plan(self.path, plan)
        self._plan = plan

    def plan(self) -> Plan | None:
        if self._plan is None:
            self._plan = read_committed_plan(self.path)
        return self._plan

    def is_committed(self, name: str) -> bool:
        return layout.is_committed(self.path, name)

    def commit_written(
        self, name: str, write, make_record, attempt: Attempt | None, check, need: int = 0
    ) -> dict | None:
        """Staged and renamed in place (`staging.write_and_commit`); nothing to reserve."""
        return write_and_commit(self.path, name, write, make_record, attempt, check, journal=True)

    def upload_of(self, name: str) -> Upload:
        """Nothing is uploaded into a directory."""
        return Upload()

    def projection(self) -> Projection | None:
        if self._projection is None and self.fingerprint.projection:
            raw = (self.path / layout.PROJECTION_FILE).read_bytes()
            self._projection = Projection.from_bytes(raw, str(self.path / layout.PROJECTION_FILE))
        return self._projection

    def write_report(self, name: str, report: dict) -> Path:
        reports = self.path / layout.REPORTS_DIR
        reports.mkdir(exist_ok=True)
        path = reports / f"{name}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
        return path
