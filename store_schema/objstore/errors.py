"""Object-storage failures in one line: `<what> (<where>): <the fix>`.

obstore raises a few generic types whose text is a request log, a Rust debug dump and
the server's XML. Every bucket operation of the project goes through `explained`,
which reads that text once and raises `ObjectStoreError` (an OSError: every command's
error rule prints it as one line, exit 1) or `MissingBucketError` (a path that does
not exist: exit 2). An `http://` endpoint is refused before the first request unless
`AWS_ALLOW_HTTP=true` says plain HTTP is meant."""

from __future__ import annotations

import os
import re
from contextlib import contextmanager

from obstore.exceptions import AlreadyExistsError, BaseError, NotFoundError, PreconditionError

from ..errors import StoreError

ALLOW_HTTP = "AWS_ALLOW_HTTP"
ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT")
CREDENTIALS_FIX = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE with ~/.aws/credentials), "
    "or run where an instance role provides them"
)
_SERVER_CODE = re.compile(r"<Code>([^<]+)</Code>")
_DENIED = ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken")
_THROTTLED = ("SlowDown", "Throttling", "RequestLimitExceeded", "TooManyRequests", "503 Service Unavailable")
_UNREACHABLE = ("error sending request", "Connection refused", "dns error", "timed out", "connection error")


class ObjectStoreError(StoreError, OSError):
    """An object-store request that failed, said as what, where and the fix."""

    def __init__(self, message: str):
        super().__init__(message)

    def __str__(self) -> str:
        return self.args[0]


class MissingBucketError(ObjectStoreError, FileNotFoundError):
    """The URL's bucket does not exist."""


def endpoint() -> str | None:
    """The endpoint the AWS variables point at (None: the provider's own)."""
    return next((os.environ[name] for name in ENDPOINT_VARIABLES if os.environ.get(name)), None)


def where(url) -> str:
    return f"{url} at {endpoint()}" if endpoint() else str(url)


def refuse_plain_http(url) -> None:
    """obstore refuses an http:// endpoint with a `builder error`; say why up front."""
    found = endpoint()
    if found and found.startswith("http://") and os.environ.get(ALLOW_HTTP, "").lower() != "true":
        raise ObjectStoreError(
            f"the endpoint {found} is plain HTTP ({url}): set {ALLOW_HTTP}=true to allow it "
            "(a local or test server), or use an https:// endpoint"
        )


def missing_bucket(error: BaseException) -> bool:
    """Does this not-found answer mean the bucket, not an object, is missing?"""
    return "<Code>NoSuchBucket</Code>" in str(error)


def explain(error: BaseException, url) -> BaseException:
    """The one-line error for a failed request on `url`; `error` itself when it is
    no failure of access (a missing object, a lost conditional write)."""
    text = str(error)
    code = next(iter(_SERVER_CODE.findall(text)), None)
    if missing_bucket(error):
        return MissingBucketError(f"no such bucket ({where(url)}): create bucket {url.bucket} or fix the URL")
    if isinstance(error, (FileNotFoundError, NotFoundError, AlreadyExistsError, PreconditionError)):
        return error
    if not isinstance(error, BaseError):
        return error
    if "/latest/api/token" in text or "169.254.169.254" in text:
        return ObjectStoreError(f"no credentials found ({where(url)}): {CREDENTIALS_FIX}")
    if code in _DENIED or "PermissionDenied" in type(error).__name__ or "Unauthenticated" in type(error).__name__:
        return ObjectStoreError(
            f"access denied{f' ({code})' if code else ''} ({where(url)}): check the credentials "
            "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE) and the bucket's policy"
        )
    if code in _THROTTLED or any(marker in text for marker in _THROTTLED):
        return ObjectStoreError(
            f"the service kept throttling requests after retries ({where(url)}): "
            "rerun later, or lower the job's parallel requests"
        )
    if any(marker in text for marker in _UNREACHABLE):
        return ObjectStoreError(f"cannot reach the endpoint ({where(url)}): check AWS_ENDPOINT_URL and the network")
    first = text.split("\n\nDebug source:")[0].splitlines()[0] if text else type(error).__name__
    return ObjectStoreError(
        f"object storage request failed{f' ({code})' if code else ''} ({where(url)}): {first[:300]}"
    )


@contextmanager
def explained(url):
    """Run bucket requests for `url`, their failures said in one line (`explain`)."""
    try:
        yield
    except (BaseError, FileNotFoundError) as error:
        translated = explain(error, url)
        if translated is error:
            raise
        raise translated from None
