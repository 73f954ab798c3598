"""The few object-store operations the commit protocol needs, over obstore.

A create (`If-None-Match: *`) or a replace (`If-Match: ETAG`) that another writer beat
returns False / None instead of raising: servers answer a lost race with 412, or 404
where the object to match is gone (moto, some S3 clones), and obstore raises
AlreadyExistsError, PreconditionError or NotFoundError for those; all three mean
"another writer got there first". zarr's `ObjectStore.set_if_not_exists` swallows that
answer, so commits never go through it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import obstore
from obstore.exceptions import AlreadyExistsError, NotFoundError, PreconditionError
from obstore.store import from_url

from ..location import StoreURL
from .errors import MissingBucketError, explained, missing_bucket, refuse_plain_http

LOST_RACE = (AlreadyExistsError, PreconditionError, NotFoundError)
PARALLEL_REQUESTS = 16


def _tag(e_tag: str | None, where: str) -> str:
    """An answer's ETag: every conditional write of the commit protocol matches on it."""
    if not e_tag:
        raise OSError(
            f"{where}: the server answered without an ETag; the store needs an S3-compatible one that returns them"
        )
    return e_tag


class Bucket:
    """The objects under one store URL; keys are paths relative to the store. Every
    request's failure is one line (`errors.explained`)."""

    def __init__(self, url: StoreURL):
        self.url = url
        refuse_plain_http(url)
        with explained(url):
            self.store = from_url(str(url))  # credentials and endpoint from the provider's environment

    def where(self, key: str) -> str:
        return f"{self.url}/{key}"

    def get(self, key: str) -> bytes:
        """The object's bytes; FileNotFoundError naming its URL if there is none."""
        with explained(self.url):
            try:
                return obstore.get(self.store, key).bytes().to_bytes()
            except FileNotFoundError as error:
                if missing_bucket(error):
                    raise
                raise FileNotFoundError(f"{self.where(key)}: no such object") from None

    def get_many(self, keys) -> dict[str, bytes]:
        """Several objects at once, fetched in parallel."""
        keys = list(keys)
        with ThreadPoolExecutor(min(PARALLEL_REQUESTS, max(1, len(keys)))) as pool:
            return dict(zip(keys, pool.map(self.get, keys)))

    def get_versioned(self, key: str) -> tuple[bytes, str] | None:
        """(bytes, ETag) of the object, or None if there is none."""
        with explained(self.url):
            try:
                result = obstore.get(self.store, key)
            except FileNotFoundError as error:
                if missing_bucket(error):
                    raise
                return None
            return result.bytes().to_bytes(), _tag(result.meta["e_tag"], self.where(key))

    def exists(self, key: str) -> bool:
        with explained(self.url):
            try:
                obstore.head(self.store, key)
            except FileNotFoundError as error:
                if missing_bucket(error):
                    raise
                return False
            return True

    def put(self, key: str, data: bytes) -> str:
        with explained(self.url):
            return _tag(obstore.put(self.store, key, data)["e_tag"], self.where(key))

    def create(self, key: str, data: bytes) -> str | None:
        """PUT with `If-None-Match: *`: the ETag if this call created the object, None if it existed."""
        return self._conditional_put(key, data, "create")

    def replace(self, key: str, data: bytes, e_tag: str) -> str | None:
        """PUT with `If-Match: e_tag`: the new ETag, or None if the object changed or went."""
        return self._conditional_put(key, data, {"e_tag": e_tag})

    def _conditional_put(self, key: str, data: bytes, mode) -> str | None:
        with explained(self.url):
            try:
                return _tag(obstore.put(self.store, key, data, mode=mode)["e_tag"], self.where(key))
            except LOST_RACE as error:
                if missing_bucket(error):
                    raise
                return None

    def delete(self, key: str) -> None:
        with explained(self.url):
            obstore.delete(self.store, key)

    def delete_many(self, keys) -> None:
        keys = list(keys)
        if keys:
            with explained(self.url):
                obstore.delete(self.store, keys)

    def require_bucket(self) -> None:
        """MissingBucketError if the URL's bucket does not exist. For when an object
        was not found: a HEAD or GET answer does not say whether the bucket is missing,
        a list does (a server that refuses to list is taken to have the bucket)."""
        try:
            with explained(self.url):
                next(iter(obstore.list(self.store, self.url.prefix or None, chunk_size=1)), None)
        except MissingBucketError:
            raise
        except OSError:
            pass

    def list(self, prefix: str) -> dict[str, int]:
        """{key: size} of every object under `prefix` (a folder, no trailing slash; "" for all)."""
        return {key: size for key, (size, _) in self.list_tagged(prefix).items()}

    def list_tagged(self, prefix: str) -> dict[str, tuple[int, str | None]]:
        """{key: (size, ETag)} of every object under `prefix`: the listing carries the
        checksum the service keeps of each object, so nothing is read."""
        found = {}
        with explained(self.url):
            for batch in obstore.list(self.store, prefix.rstrip("/") + "/" if prefix else None):
                for meta in batch:
                    found[meta["path"]] = (int(meta["size"]), meta.get("e_tag"))
        return found
