"""Corpus readers: JSONL, Parquet, or a `datasets` directory (`save_to_disk`).

Records are numbered 0..n-1 in file order. That ``record_index`` is the only
link between the plan and the corpus, so every reader can both stream all
records (planning) and fetch a few by index cheaply (a worker re-reading one
shard's records): JSONL keeps a byte-offset index of its lines, Parquet keeps the
row groups it decoded (up to a memory budget) and turns only the wanted rows into
Python, a `datasets` directory is memory-mapped Arrow.

A record that cannot be parsed is not an exception: it comes back as a
`BadRecord` with a reason, so one broken line never stops a 900K-record job.

A corpus path is one file (``.jsonl``/``.json``/``.parquet``), a directory
saved by ``Dataset.save_to_disk``, a generated corpus (`extract.generated_corpus`:
the Parquet shards its manifest lists, in that order, all committed), or a directory
of ``.jsonl`` or ``.parquet`` files read in sorted name order.
"""

from __future__ import annotations

import hashlib
import json
import threading
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from store_schema.plan import is_safe_id

from .errors import QuarantineError
from .generated_corpus import committed_shard_files, is_generated_corpus

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)


@dataclass(frozen=True)
class BadRecord:
    """A record the reader could not turn into a dict (reason as in the plan)."""

    reason: str  # "malformed_json" | "invalid_utf8" | "wrong_type"
    detail: str = ""


Record = dict  # a parsed record; fields are validated by `extract.tokenization`


class Corpus:
    """A numbered, re-readable sequence of records. Open with `open_corpus`."""

    format: str
    path: Path
    files: tuple[Path, ...]

    def __len__(self) -> int:
        raise NotImplementedError

    def iter_records(self, start: int = 0, stop: int | None = None) -> Iterator[tuple[int, Record | BadRecord]]:
        """Yield ``(record_index, record or BadRecord)`` for ``start <= index < stop`` in order."""
        raise NotImplementedError

    def read(self, indices: Iterable[int]) -> list[Record | BadRecord]:
        """Records at ``indices``, in the order given (duplicates allowed)."""
        raise NotImplementedError

    def where(self, index: int) -> str:
        """Where record `index` (0-based, as plans number records) is, as a person finds
        it: its file and 1-based line (JSONL) or row (Parquet, datasets)."""
        return f"{self.path.name} row {index + 1}"

    def content_hash(self) -> str:
        """sha256 over the data files' names (relative) and bytes, in read order.

        Names are included so that moving bytes between files changes the hash;
        the same data in two formats hashes differently (it is a different file)."""
        digest = hashlib.sha256()
        for file in self.files:
            name = str(file.relative_to(self.path)) if file != self.path else file.name
            digest.update(name.encode() + b"\0" + str(file.stat().st_size).encode() + b"\0")
            with file.open("rb") as f:
                while block := f.read(1 << 22):
                    digest.update(block)
        return digest.hexdigest()

    def _check_range(self, start: int, stop: int | None) -> tuple[int, int]:
        n = len(self)
        stop = n if stop is None else min(stop, n)
        if start < 0 or start > stop:
            raise IndexError(f"record range {start}..{stop} is outside 0..{n}")
        return start, stop

    def _check_index(self, index: int) -> int:
        if not 0 <= index < len(self):
            raise IndexError(f"record index {index} is outside 0..{len(self) - 1} of {self.path}")
        return index


def _parse_json_line(raw: bytes) -> Record | BadRecord:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        return BadRecord("invalid_utf8", f"byte {error.start}: {error.reason}")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        return BadRecord("malformed_json", f"{error.msg} (column {error.colno})")
    except RecursionError:
        return BadRecord("malformed_json", "nesting too deep")
    if not isinstance(value, dict):
        return BadRecord("wrong_type", f"record is a JSON {type(value).__name__}, not an object")
    return value


class JsonlCorpus(Corpus):
    """One record per non-blank line. Blank lines are not records (not numbered),
    so a trailing newline or a spacer line never shifts indices."""

    format = "jsonl"

    def __init__(self, path: Path, files: list[Path]):
        self.path, self.files = path, tuple(files)
        file_ids, offsets, lines = [], [], []
        for file_id, file in enumerate(self.files):
            with file.open("rb") as f:
                position = 0
                for number, line in enumerate(f, start=1):
                    if line.strip():
                        file_ids.append(file_id)
                        offsets.append(position)
                        lines.append(number)
                    position += len(line)
        self._file_ids = np.asarray(file_ids, dtype=np.int32)
        self._offsets = np.asarray(offsets, dtype=np.int64)
        self._lines = np.asarray(lines, dtype=np.int64)  # 1-based, blank lines counted as an editor does

    def where(self, index: int) -> str:
        index = self._check_index(int(index))
        return f"{self.files[int(self._file_ids[index])].name} line {int(self._lines[index])}"

    def __len__(self) -> int:
        return len(self._offsets)

    @staticmethod
    def _clean(line: bytes, offset: int) -> bytes:
        line = line.rstrip(b"\r\n")
        if offset == 0 and line.startswith(b"\xef\xbb\xbf"):  # UTF-8 byte-order mark
            line = line[3:]
        return line

    def iter_records(self, start=0, stop=None):
        start, stop = self._check_range(start, stop)
        index = start
        while index < stop:
            file_id = int(self._file_ids[index])
            with self.files[file_id].open("rb") as f:
                f.seek(int(self._offsets[index]))
                while index < stop and self._file_ids[index] == file_id:
                    offset = f.tell()
                    line = f.readline()
                    if not line.strip():
                        continue
                    yield index, _parse_json_line(self._clean(line, offset))
                    index += 1

    def read(self, indices):
        indices = [self._check_index(int(i)) for i in indices]
        by_index = {}
        handles = {}
        try:
            for index in sorted(set(indices)):
                file_id = int(self._file_ids[index])
                if file_id not in handles:
                    handles[file_id] = self.files[file_id].open("rb")
                f = handles[file_id]
                offset = int(self._offsets[index])
                f.seek(offset)
                by_index[index] = _parse_json_line(self._clean(f.readline(), offset))
        finally:
            for f in handles.values():
                f.close()
        return [by_index[i] for i in indices]


def _arrow_rows(table) -> list[Record]:
    return table.to_pylist()


class ParquetCorpus(Corpus):
    """Rows in file order, row group by row group.

    Parquet cannot seek to a row: a row group's pages are decoded from its start
    (pyarrow has no page-index row ranges). So a reader keeps the row groups it
    decoded, as Arrow, up to `DECODED_BYTES`, and takes a shard's few rows from
    them; only those rows become Python. A file written as one big row group
    (common) is decoded once per worker, not once per shard, and never turned into
    Python whole (before: 8.1 s per shard read on a 604 MB file). A row group over
    the budget is streamed in record batches up to the last wanted row. Random
    access to a Parquet corpus bigger than the budget decoded stays slow: JSONL
    reads any record in well under a millisecond."""

    format = "parquet"
    BATCH_ROWS = 1024
    DECODED_BYTES = 4 << 30  # decoded row groups a reader keeps (per worker process)

    def __init__(self, path: Path, files: list[Path]):
        import pyarrow.parquet as pq  # the Parquet reader only: a JSONL corpus never loads pyarrow

        self.path, self.files = path, tuple(files)
        self._groups = []  # (file_id, row_group, first_index, decoded bytes)
        total = 0
        for file_id, file in enumerate(self.files):
            meta = pq.ParquetFile(file).metadata
            for group in range(meta.num_row_groups):
                self._groups.append((file_id, group, total, meta.row_group(group).total_byte_size))
                total += meta.row_group(group).num_rows
        self._starts = [g[2] for g in self._groups]
        self._len = total
        self._decoded: OrderedDict = OrderedDict()  # group position -> pyarrow Table, least recently used first
        self._decoded_lock = threading.Lock()

    def __len__(self):
        return self._len

    def _group_of(self, index: int) -> int:
        return bisect_right(self._starts, index) - 1

    def where(self, index: int) -> str:
        file_id = self._groups[self._group_of(index)][0]
        first = next(start for group_file, _, start, _ in self._groups if group_file == file_id)
        return f"{self.files[file_id].name} row {index - first + 1}"

    def _parquet(self, group_pos: int):
        import pyarrow.parquet as pq  # pyarrow only for Parquet corpora

        return pq.ParquetFile(self.files[self._groups[group_pos][0]])

    def _batches(self, group_pos: int, first_row: int = 0):
        """(first row of the batch within its group, record batch), from the batch
        holding `first_row` on; batches before it are decoded but never converted."""
        position = 0
        group = self._groups[group_pos][1]
        for batch in self._parquet(group_pos).iter_batches(batch_size=self.BATCH_ROWS, row_groups=[group]):
            if position + batch.num_rows > first_row:
                yield position, batch
            position += batch.num_rows

    def _table(self, group_pos: int):
        """The decoded row group if it fits the budget (kept for the next reads), else None."""
        size = self._groups[group_pos][3]
        if size > self.DECODED_BYTES:
            return None
        with self._decoded_lock:
            table = self._decoded.get(group_pos)
            if table is not None:
                self._decoded.move_to_end(group_pos)
                return table
        table = self._parquet(group_pos).read_row_group(self._groups[group_pos][1])
        with self._decoded_lock:
            self._decoded[group_pos] = table
            while sum(self._groups[g][3] for g in self._decoded) > self.DECODED_BYTES:
                self._decoded.popitem(last=False)
        return table

    def iter_records(self, start=0, stop=None):
        start, stop = self._check_range(start, stop)
        index = start
        while index < stop:
            group_pos = self._group_of(index)
            first = self._starts[group_pos]
            for position, batch in self._batches(group_pos, index - first):
                lo, hi = index - first - position, min(batch.num_rows, stop - first - position)
                for record in _arrow_rows(batch.slice(lo, hi - lo)):
                    yield index, record
                    index += 1
                if index >= stop:
                    return

    def read(self, indices):
        import pyarrow as pa  # pyarrow only for Parquet corpora

        indices = [self._check_index(int(i)) for i in indices]
        wanted: dict[int, list[int]] = {}  # group -> sorted rows within it
        for index in sorted(set(indices)):
            group_pos = self._group_of(index)
            wanted.setdefault(group_pos, []).append(index - self._starts[group_pos])
        by_index = {}
        for group_pos, rows in wanted.items():
            first = self._starts[group_pos]
            table = self._table(group_pos)
            if table is not None:
                by_index.update(zip((first + r for r in rows), _arrow_rows(table.take(pa.array(rows)))))
                continue
            taken = 0
            for position, batch in self._batches(group_pos, rows[0]):
                here = [r for r in rows[taken:] if r < position + batch.num_rows]
                if here:
                    records = _arrow_rows(batch.take(pa.array([r - position for r in here])))
                    by_index.update({first + r: record for r, record in zip(here, records)})
                    taken += len(here)
                if taken == len(rows):
                    break
        return [by_index[i] for i in indices]


class DatasetsCorpus(Corpus):
    """A `datasets.Dataset` saved with ``save_to_disk`` (memory-mapped Arrow)."""

    format = "datasets"
    _BATCH = 512

    def __init__(self, path: Path):
        import datasets  # a datasets directory only: the library takes seconds to import

        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if len(loaded) != 1:
                raise ValueError(
                    f"{path} holds a DatasetDict with splits {sorted(loaded)}; point the corpus at one split's "
                    f"directory (e.g. {path}/train)"
                )
            (split,) = loaded
            path = path / split
            loaded = loaded[split]
        self.path = path
        self._dataset = loaded.with_format(None)
        state = json.loads((path / "state.json").read_text())
        self.files = tuple(path / entry["filename"] for entry in state["_data_files"])

    def __len__(self):
        return len(self._dataset)

    def _rows(self, batch: dict) -> list[Record]:
        columns = list(batch)
        count = len(batch[columns[0]]) if columns else 0
        return [{c: batch[c][i] for c in columns} for i in range(count)]

    def iter_records(self, start=0, stop=None):
        start, stop = self._check_range(start, stop)
        for first in range(start, stop, self._BATCH):
            rows = self._rows(self._dataset[first : min(first + self._BATCH, stop)])
            yield from enumerate(rows, start=first)

    def read(self, indices):
        indices = [self._check_index(int(i)) for i in indices]
        if not indices:
            return []
        return self._rows(self._dataset[indices])


def require_corpus(path: str | Path) -> Path:
    """`path`, refused (a usage error, one line) when nothing is there: a job checks
    it before anything starts."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"corpus {path} does not exist")
    return path


def open_corpus(path: str | Path) -> Corpus:
    """Open a corpus, choosing the reader from what is on disk."""
    path = require_corpus(path)
    if path.is_file():
        if path.name.endswith(PARQUET_SUFFIXES):
            return ParquetCorpus(path, [path])
        if path.name.endswith(JSONL_SUFFIXES):
            return JsonlCorpus(path, [path])
        raise ValueError(f"corpus file {path} is neither JSONL ({', '.join(JSONL_SUFFIXES)}) nor Parquet")
    if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
        return DatasetsCorpus(path)
    if is_generated_corpus(path):
        return ParquetCorpus(path, committed_shard_files(path))
    files = sorted(p for p in path.iterdir() if p.is_file())
    jsonl = [p for p in files if p.name.endswith(JSONL_SUFFIXES)]
    parquet = [p for p in files if p.name.endswith(PARQUET_SUFFIXES)]
    if jsonl and parquet:
        raise ValueError(f"corpus directory {path} mixes JSONL and Parquet files; keep one format")
    if parquet:
        return ParquetCorpus(path, parquet)
    if jsonl:
        return JsonlCorpus(path, jsonl)
    raise ValueError(f"corpus directory {path} has no JSONL or Parquet files and is not a datasets directory")


def sample_id_for(record: dict, record_index: int) -> str:
    """The record's ``id`` (a string, or an int written in decimal) if it has one,
    else ``rec-{record_index:09d}``. Ids name store entries, so an unsafe one
    (``../../x``) is refused, never sanitised into something else."""
    raw = record.get("id") if isinstance(record, dict) else None
    if raw is None:
        return f"rec-{record_index:09d}"
    if isinstance(raw, int) and not isinstance(raw, bool):
        raw = str(raw)
    if not isinstance(raw, str):
        raise QuarantineError("wrong_type", f"id is a {type(raw).__name__}")
    if not is_safe_id(raw):
        raise QuarantineError("unsafe_id", f"id {raw[:80]!r} is not 1-128 chars of [A-Za-z0-9._-] (no leading '.')")
    return raw
