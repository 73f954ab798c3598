"""Where a store lives: a directory, or a prefix in an object store.

    classify_store("/data/store")             -> Path("/data/store")
    classify_store("s3://bucket/jobs/store")  -> StoreURL("s3", "bucket", "jobs/store")

The one rule for telling a store argument's kind, called by every command that takes
a store (`store_schema info|verify`, and `extract` / `train` through `store_schema.stores`).
Credentials and the endpoint are never part of a URL: they come from each provider's
standard variables and files (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, profiles ...)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

OBJECT_STORE_SCHEMES = ("s3", "gs")


@dataclass(frozen=True)
class StoreURL:
    """`scheme://bucket/prefix`: a store under `prefix` of `bucket` (no trailing slash)."""

    scheme: str
    bucket: str
    prefix: str

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}" if self.prefix else f"{self.scheme}://{self.bucket}"

    def key(self, rel: str) -> str:
        """The object key of `rel` (a path relative to the store), as the bucket names it."""
        return f"{self.prefix}/{rel}" if self.prefix else rel


def classify_store(arg) -> Path | StoreURL:
    """A local path (`Path`), or a `StoreURL` for `s3://` / `gs://`. Any other
    `scheme://` is refused naming the schemes that are served."""
    if isinstance(arg, (Path, StoreURL)):
        return arg
    text = str(arg)
    scheme, sep, rest = text.partition("://")
    if not sep:
        return Path(text)
    if scheme not in OBJECT_STORE_SCHEMES:
        raise ValueError(
            f"{text}: unknown store URL scheme {scheme!r}; a store is a directory or "
            f"{' / '.join(s + '://bucket/prefix' for s in OBJECT_STORE_SCHEMES)}"
        )
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    if not bucket or any(part in ("", ".", "..") for part in prefix.split("/") if prefix):
        raise ValueError(f"{text}: a store URL is {scheme}://bucket/prefix (no empty, '.' or '..' parts)")
    return StoreURL(scheme, bucket, prefix)


def is_object_store(arg) -> bool:
    return isinstance(classify_store(arg), StoreURL)
