"""`verify --clean` and `verify --repair` for a store on object storage, under the lease.

Repair deletes the marker of each damaged shard: readers stop seeing it at once, and
the next `extract run` commits it again under a new attempt (same plan, same bytes).
Clean removes attempts that can never be read: those of a shard whose marker names
another attempt, and unfinished ones whose fence the cleaner wins by revoking them. An
attempt that claimed its fence but has no marker may be committing right now: it is
kept (named as a leftover) until its shard has a marker."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from .. import layout
from ..commit.journal import entry_key
from ..repair import Repair, plan_repair
from .bucket import PARALLEL_REQUESTS, Bucket
from .commit import REVOKED, attempt_of_token, take_fence
from .keys import fence_key, shard_marker
from .lease import StoreLease
from .reader import BucketStore


def clean_bucket(url) -> list[str]:
    """Delete the attempts no reader can ever see; returns them as `SHARD.ATTEMPT`."""
    store = BucketStore(url)
    with StoreLease(store.bucket, job="verify --clean"):
        return remove_dead_attempts(store)


def remove_dead_attempts(store: BucketStore) -> list[str]:
    """Delete every attempt no marker names and no live writer may still commit. The
    markers are listed once and the attempted shards' read in parallel: one request
    after another per shard made a finished job's rerun take ~25 ms a shard."""
    attempts = store.attempts()
    marked = sorted(set(store.shard_entries()) & {shard for shard, _ in attempts})
    with ThreadPoolExecutor(PARALLEL_REQUESTS) as pool:
        named = dict(zip(marked, pool.map(store.attempt, marked)))
    removed = []
    for (shard, token), keys in sorted(attempts.items()):
        if shard in named:
            if named[shard] == token:
                continue
        elif not _revoked(store.bucket, shard, token):
            continue  # claimed: its writer may be creating the marker now
        store.bucket.delete_many(keys)
        removed.append(f"{shard}.{token}")
    return removed


def _revoked(bucket: Bucket, shard: str, token: str) -> bool:
    """Revoke the attempt (or find it revoked): True when it can never commit."""
    attempt = attempt_of_token(token)
    if take_fence(bucket, shard, attempt, REVOKED):
        return True
    try:
        return bucket.get(fence_key(attempt.run, shard, attempt.number)).startswith(REVOKED.encode())
    except FileNotFoundError:
        return False


def repair_bucket(url, report) -> Repair:
    """Delete the marker of every planned shard `report` names a problem of."""
    store = BucketStore(url)
    plan_damaged = any(not p["shard"] and p["file"].startswith(layout.PLAN_DIR) for p in report.problems)
    repair, shards = plan_repair(None if plan_damaged else store.plan(), report)
    if shards:
        with StoreLease(store.bucket, job="verify --repair"):
            journal = store.journaled_shards() or set()
            for name in shards:
                marked = store.bucket.exists(shard_marker(name))
                if marked:
                    store.bucket.delete(shard_marker(name))
                if marked or name in journal:  # a journaled shard whose marker vanished: forgotten too
                    store.bucket.delete(entry_key(name))
                    repair.moved.append(name)
    return repair
