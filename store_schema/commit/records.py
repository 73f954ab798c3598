"""Commit records: a canonical JSON file listing size + crc32c of every file it
covers, carrying a hash of its own content. Any changed byte in a covered file or
in the record itself is detectable."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from ..errors import RecordError
from ..layer_stats import LayerStats
from ..runtime.crc32c import crc32c_file
from ..runtime.file_writes import written_crc32c


def _canonical(body: dict) -> bytes:
    return (json.dumps(body, sort_keys=True, indent=1) + "\n").encode()


def _body_hash(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def list_files(directory: Path, exclude: tuple[str, ...] = ()) -> list[str]:
    """Paths (relative, posix) of every file below `directory`, sorted; nothing read."""
    return sorted(file_sizes(directory, exclude))


def file_sizes(directory: Path, exclude: tuple[str, ...] = ()) -> dict[str, int]:
    """{relative posix path: size} of every file below `directory`: stat only, nothing read."""
    found: dict[str, int] = {}
    pending = [(str(directory), "")]
    while pending:  # scandir, not Path: a shard is a dozen files, and fit's start stats every shard's
        path, prefix = pending.pop()
        with os.scandir(path) as entries:
            for entry in entries:
                rel = prefix + entry.name
                if entry.is_dir(follow_symlinks=False):
                    pending.append((entry.path, rel + "/"))
                elif entry.is_file() and rel not in exclude:
                    found[rel] = entry.stat().st_size
    return found


def describe_files(directory: Path, exclude: tuple[str, ...] = ()) -> dict:
    """{relative path: {"size", "crc32c"}} for every file below `directory`; a file
    this process wrote with `runtime.file_writes` is not read back for its crc32c."""
    directory = Path(directory)
    return {
        rel: {
            "size": (directory / rel).stat().st_size,
            "crc32c": written_crc32c(directory / rel) or crc32c_file(directory / rel),
        }
        for rel in list_files(directory, exclude)
    }


def on_disk_bytes(path) -> int:
    """Bytes of every file below `path` (what a store or a copy of it costs on disk)."""
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, files in os.walk(path) for name in files)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: Path) -> None:
    for path in sorted(Path(directory).rglob("*"), reverse=True):
        fsync_path(path)
    fsync_path(directory)


def record_bytes(body: dict) -> bytes:
    """A record's canonical bytes, its self-hash added: what `write_record` writes."""
    body = dict(body)
    body.pop("record_sha256", None)
    body["record_sha256"] = _body_hash(body)
    return _canonical(body)


def write_record(path: Path, body: dict) -> None:
    """Write atomically (tmp + fsync + rename) with a self-hash."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(record_bytes(body))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def read_record(path: Path) -> dict:
    """Parse and check a record: byte-exact canonical form and matching self-hash."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise RecordError(f"{path}: commit record missing") from None
    return parse_record(raw, path)


def parse_record(raw: bytes, where) -> dict:
    """`read_record` on bytes already read (an object's); `where` names it in errors."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(body, dict) or "record_sha256" not in body:
        raise RecordError(f"{where}: not a commit record")
    if raw != _canonical(body):
        raise RecordError(f"{where}: bytes differ from the record's canonical form (edited or corrupted)")
    claimed = body.pop("record_sha256")
    if claimed != _body_hash(body):
        raise RecordError(f"{where}: content does not match its own hash (edited or corrupted)")
    return body


def file_mismatch(expected: Mapping, size: int, crc32c: Callable[[], str]) -> str | None:
    """What is wrong with a file of `size` bytes against its record entry (`size`,
    `crc32c`), or None. `crc32c` is only computed when the size matches."""
    what = size_mismatch(expected, size)
    if what:
        return what
    actual = crc32c()
    if actual != expected["crc32c"]:
        return f"crc32c {actual} != committed {expected['crc32c']} (bytes changed)"
    return None


def size_mismatch(expected: Mapping, size: int) -> str | None:
    """What is wrong with a file of `size` bytes against its record entry's size, or None."""
    return None if size == expected["size"] else f"size {size} != committed {expected['size']} (truncated or extended)"


def check_files(directory: Path, expected: dict) -> list[tuple[str, str]]:
    """Compare files below `directory` with a record's file table.
    Returns (relative path, what is wrong) for each problem."""
    problems = []
    directory = Path(directory)
    for rel, meta in expected.items():
        path = directory / rel
        if not path.is_file():
            problems.append((rel, "file missing"))
            continue
        what = file_mismatch(meta, path.stat().st_size, lambda: crc32c_file(path))
        if what:
            problems.append((rel, what))
    return problems


@dataclass(frozen=True)
class FileEntry:
    size: int
    crc32c: str


@dataclass(frozen=True)
class ShardCommit:
    """A shard's commit record (`shards/NAME/commit.json`): what the shard holds
    and the size + crc32c of every file in it. Written before the rename that
    commits the shard; read back (and self-hash checked) by every reader.
    `layer_stats`: per context layer, what its states look like
    (`store_schema.layer_stats`); empty in shards committed before they were recorded."""

    shard: str
    num_samples: int
    num_tokens: int
    target_topk: int
    fingerprint_sha256: str
    files: Mapping[str, FileEntry]
    layer_stats: Mapping[int, LayerStats] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def from_json(cls, body: dict) -> "ShardCommit":
        try:
            files = {rel: FileEntry(int(meta["size"]), str(meta["crc32c"])) for rel, meta in body["files"].items()}
            stats = {
                int(layer): LayerStats.from_json(entry) for layer, entry in (body.get("layer_stats") or {}).items()
            }
            return cls(
                shard=str(body["shard"]),
                num_samples=int(body["num_samples"]),
                num_tokens=int(body["num_tokens"]),
                target_topk=int(body.get("target_topk") or 0),
                fingerprint_sha256=str(body.get("fingerprint_sha256") or ""),
                files=MappingProxyType(files),
                layer_stats=MappingProxyType(stats),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise RecordError(f"commit record lacks or mistypes a field ({exc!r})") from None

    def to_json(self) -> dict:
        record = {
            "shard": self.shard,
            "num_samples": self.num_samples,
            "num_tokens": self.num_tokens,
            "target_topk": self.target_topk,
            "fingerprint_sha256": self.fingerprint_sha256,
            "files": self.file_table,
        }
        if self.layer_stats:
            record["layer_stats"] = {str(layer): stats.to_json() for layer, stats in sorted(self.layer_stats.items())}
        return record

    @property
    def file_table(self) -> dict:
        """{relative path: {"size", "crc32c"}}, the form `check_files` compares."""
        return {rel: {"size": e.size, "crc32c": e.crc32c} for rel, e in self.files.items()}

    @property
    def disk_bytes(self) -> int:
        return sum(entry.size for entry in self.files.values())
