"""Where everything lives in a store on object storage (keys relative to the store's URL).

    zarr.json  dflash_store.json  shards/zarr.json  plan/...   as in a directory store
    plan/commit.json                  created last, create-only: the plan is committed
    attempts/NAME/ATTEMPT/...         one try at shard NAME, written once, never rewritten
    shards/NAME/commit.json           the shard's commit marker, created once (If-None-Match: *):
                                      the ShardCommit record + the attempt holding its files
    fence/RUN/NAME.N                  claim or revoke of attempt N of RUN, create-only
    lease.json                        the job lease: create-only, renewed with If-Match
    reports/NAME.json                 job reports

A shard is committed exactly when its marker exists (`shard_marker`); the plan names every
shard, so readers find markers by key and never depend on LIST."""

from __future__ import annotations

from .. import layout

ATTEMPTS_DIR = "attempts"
FENCE_DIR = "fence"
LEASE_KEY = "lease.json"
PLAN_RECORD = f"{layout.PLAN_DIR}/{layout.COMMIT_RECORD}"
MARKER_ATTEMPT = "attempt"  # the marker's field naming the attempt that holds the shard's files
MARKER_ETAGS = "stored_etags"  # the marker's {file: ETag the service answered its upload with}


def shard_marker(name: str) -> str:
    return f"{layout.SHARDS_DIR}/{name}/{layout.COMMIT_RECORD}"


def attempt_prefix(name: str, token: str) -> str:
    return f"{ATTEMPTS_DIR}/{name}/{token}"


def fence_key(run: str, name: str, number: int) -> str:
    return f"{FENCE_DIR}/{run}/{name}.{number}"


def attempt_of_key(key: str) -> tuple[str, str] | None:
    """(shard, attempt token) of a key under `attempts/`, or None."""
    parts = key.split("/")
    return (parts[1], parts[2]) if len(parts) > 3 and parts[0] == ATTEMPTS_DIR else None
