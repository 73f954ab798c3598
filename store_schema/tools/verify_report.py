"""`verify`'s report: what a check found, the verdict it adds up to, and its text.

A problem is a dict {shard, array, file, what}; `Report.status` tells an intact store
that is only unfinished (a disk-full stop, Ctrl-C) from a damaged one."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .. import layout

MISSING_SHARD = "planned shard missing (not committed, or deleted)"
NOT_CHECKED = "not checked: the cluster task that held it failed ({error}); run verify again"
VANISHED = "committed shard gone: the store's journal records its commit, its directory is missing"
RERUN = "rerun `python -m extract run ...` to finish"  # the same command: it extracts only what is missing


@dataclass
class Report:
    """`problems` holds damage and the planned shards that are missing; `status`
    tells an intact store that is only unfinished (a disk-full stop, Ctrl-C) from a
    damaged one."""

    problems: list[dict] = field(default_factory=list)
    planned_shards: int | None = None
    leftovers: list[str] = field(default_factory=list)
    recomputed: list[dict] = field(default_factory=list)  # per-sample cosines from --recompute
    shards_checked: int = 0
    samples: int = 0
    tokens: int = 0
    bytes_read: int = 0
    checksums_only: bool = False
    sizes_only: bool = False
    shards_by_node: dict[str, int] = field(default_factory=dict)  # `--ray`: shards each node checked
    kept_checksum_shards: int = 0  # `--checksums-only` on object storage: shards checked by their kept ETags

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def missing(self) -> list[str]:
        return [p["shard"] for p in self.problems if p["what"] == MISSING_SHARD]

    @property
    def damage(self) -> list[dict]:
        return [p for p in self.problems if p["what"] != MISSING_SHARD]

    @property
    def status(self) -> str:
        """intact | incomplete (intact, planned shards not yet extracted) | damaged"""
        return "intact" if self.ok else "damaged" if self.damage else "incomplete"

    def incomplete_line(self) -> str:
        committed = (self.planned_shards or 0) - len(self.missing)
        return f"incomplete: {committed} of {self.planned_shards} shards committed; {RERUN}"

    def after_repair(self, moved) -> Report:
        """The store as `repair_store` left it: the shards it moved aside are missing, not damaged."""
        moved = set(moved)
        kept = [p for p in self.problems if p["shard"] not in moved]
        missing = set(self.missing)
        kept += [problem(MISSING_SHARD, shard=name) for name in sorted(moved - missing)]
        return replace(self, problems=kept)

    def add(self, what: str, shard: str = "", array: str = "", file: str = "") -> None:
        self.problems.append(problem(what, shard, array, file))

    def to_json(self) -> dict:
        return {
            "ok": self.ok,
            "status": self.status,
            "planned_shards": self.planned_shards,
            "missing_shards": len(self.missing),
            "problems": self.problems,
            "leftovers": self.leftovers,
            "recomputed": self.recomputed,
            "shards_checked": self.shards_checked,
            "samples": self.samples,
            "tokens": self.tokens,
            "bytes_read": self.bytes_read,
            "checksums_only": self.checksums_only,
            "sizes_only": self.sizes_only,
            "shards_by_node": self.shards_by_node,
            "kept_checksum_shards": self.kept_checksum_shards,
        }


def problem(what: str, shard: str = "", array: str = "", file: str = "") -> dict:
    return {"shard": shard, "array": array, "file": file, "what": what}


def format_report(report: Report, repair_advice: bool = True) -> str:
    """The text report: a PROBLEM line per damage, one line for the planned shards
    not yet extracted (what finishes them), the verdict last."""
    lines = [
        f"shards checked: {report.shards_checked}, samples: {report.samples}, tokens: {report.tokens}"
        + (" (--checksums-only: sizes and crc32c, contents not decoded)" if report.checksums_only else "")
        + (" (--sizes-only: commit records and file sizes, nothing read)" if report.sizes_only else "")
    ]
    if report.checksums_only and report.kept_checksum_shards:
        streamed = report.shards_checked - report.kept_checksum_shards
        lines.append(
            f"{report.kept_checksum_shards} shard(s) checked by the object store's kept checksums (ETags "
            f"against those answered at upload; nothing read)"
            + (f"; {streamed} read and checked by crc32c: their markers recorded no ETags" if streamed else "")
        )
    if report.shards_by_node:
        lines.append(
            f"checked on {len(report.shards_by_node)} Ray node(s): "
            + ", ".join(f"{node[:12]} {count}" for node, count in sorted(report.shards_by_node.items()))
        )
    for entry in report.recomputed:
        lines.append(f"recomputed {entry['shard']}/{entry['sample']}: min cosine per layer {entry['min_cosine']}")
    for p in report.damage:
        where = "/".join(x for x in (p["shard"], p["file"] or p["array"]) if x) or "store"
        lines.append(f"PROBLEM {where}: {p['what']}")
    if report.leftovers:
        lines.append(
            f"uncommitted leftovers in {layout.STAGING_DIR}/: {', '.join(report.leftovers)} (--clean removes them)"
        )
    if repair_advice and any(p["shard"] for p in report.damage):
        lines.append("--repair moves the damaged shards aside; the same `extract run` then extracts them again")
    if report.status == "intact":
        lines.append("OK: store is intact")
    elif report.status == "incomplete":
        lines.append(report.incomplete_line())
    else:
        missing = f", and {len(report.missing)} planned shard(s) missing" if report.missing else ""
        lines.append(f"FAILED: {len(report.damage)} problem(s){missing}")
    return "\n".join(lines)
