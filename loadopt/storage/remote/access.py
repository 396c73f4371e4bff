"""Remote storage helpers: redaction of secrets, opening fsspec URLs, the one line for a storage error,
and retried reads.

Credentials may sit in a URL (`s3://KEY:SECRET@bucket/...`, `https://user:pw@host/...`) or in
storage options (`key`, `secret`, `token`, ...); `redact` removes them from anything that is printed
or written to results. Every command that opens a location goes through `open_url` and reports what
failed there through `storage_errors`/`storage_failure`: the credentials redacted, and the reason a user can
act on (no credentials, access denied, host refused or unknown, not found) before the driver's own words.
Reads of a tier are retried on transient errors (any `OSError` that is not "not found"/"permission
denied"-like, refused and dropped connections, timeouts, HTTP 5xx/408/429 answers) with capped exponential
backoff, waiting what a `Retry-After` asks up to a bound (`RetryPolicy`); a read that keeps failing raises
`StorageError`, one line naming the file, what the storage did, how often and over how long.
"""

from __future__ import annotations

import contextlib
import logging
import random
import re
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import fsspec
from pydantic import BaseModel, ConfigDict, Field

from loadopt.errors import DatasetError, LoadoptError, StorageError

T = TypeVar("T")

# `scheme://user:password@host` -> `scheme://***@host`; the password may hold '/' (AWS secret keys do),
# a user alone (`https://TOKEN@host`) may not.
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?:[^\s/@:]*:[^\s@]*|[^\s/@:]+)@")
# Query parameters that carry secrets: presigned S3 (X-Amz-Signature, X-Amz-Credential, X-Amz-Security-Token),
# Azure SAS (sig), OAuth (access_token), `?password=`, `?api_key=`, ...
_QUERY_SECRETS = re.compile(r"(?P<name>[?&;][^=&\s#]*?(?:secret|token|passw|signature|sig|credential|key|auth)"
                            r"[^=&\s#]*=)[^&\s#]+", re.IGNORECASE)
_SECRET_WORDS = ("secret", "token", "password", "passwd", "credential", "credentials", "signature")
REDACTED = "***"


def is_secret_key(name: str) -> bool:
    """Whether a storage-option key holds a secret (`key`, `secret`, `aws_secret_access_key`, `token`, ...)."""
    lower = name.lower()
    parts = re.split(r"[_\-.]", lower)
    # A word of the key (`aws_secret_access_key`, `session_token`) or its end (`sessiontoken`); not a word
    # inside another (`num_tokens`, the config's `tokens:` section are no secrets).
    return lower in ("key", "access_key", "private_key") or lower.endswith("_key") or \
        any(word in parts or lower.endswith(word) for word in _SECRET_WORDS)


def redact(value: Any) -> Any:
    """`value` with credentials removed: user:password@ in URLs, secret keys' values in mappings.

    Strings, mappings and lists are handled recursively; anything else is returned as it is."""
    if isinstance(value, str):
        value = _URL_CREDENTIALS.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", value)
        return _QUERY_SECRETS.sub(lambda m: f"{m.group('name')}{REDACTED}", value) if "=" in value else value
    if isinstance(value, dict):
        # A secret is a value (a mapping under such a key is searched, not hidden whole).
        return {k: (REDACTED if isinstance(k, str) and is_secret_key(k) and v not in (None, "")
                    and not isinstance(v, (dict, list, tuple)) else redact(v))
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    return value


class RedactingFilter(logging.Filter):
    """A logging filter that redacts credentials from each record's message (and its traceback)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        record.msg, record.args = redact(message), None
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


def is_local_fs(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether `fs` is the local disk (fsspec's `file` protocol), read with plain system calls."""
    protocol = fs.protocol
    return "file" in ((protocol,) if isinstance(protocol, str) else tuple(protocol))


def display_name(fs: fsspec.AbstractFileSystem, name: str) -> str:
    """A file of `fs` named for a message: its path on a local disk, else its URL, credentials redacted."""
    return name if is_local_fs(fs) else redact(fs.unstrip_protocol(name))


def _causes(exc: BaseException) -> list[BaseException]:
    """`exc` and what it was raised from (aiohttp keeps the OS error as `os_error`)."""
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo:
        item = todo.pop()
        if item is None or any(item is s for s in seen):
            continue
        seen.append(item)
        todo += [item.__cause__, item.__context__, getattr(item, "os_error", None)]
    return seen


def why_unreachable(url: str, exc: BaseException) -> str | None:
    """In words, why `url`'s host could not be reached (refused, unknown name, no answer), else None."""
    import socket
    from urllib.parse import urlsplit

    host = urlsplit(redact(url)).netloc.rsplit("@", 1)[-1] or url
    for cause in _causes(exc):  # the host actually dialled: an s3:// URL names a bucket, not its endpoint
        endpoint = (getattr(cause, "kwargs", None) or {}).get("endpoint_url")
        if isinstance(endpoint, str):
            host = urlsplit(endpoint).netloc or host
        elif isinstance(cause_host := getattr(cause, "host", None), str) and (
                cause_port := getattr(cause, "port", None)):
            host = f"{cause_host}:{cause_port}"
    for cause in _causes(exc):
        if isinstance(cause, ConnectionRefusedError):
            return f"the host {host} refused the connection (is the server running, on that port?)"
        if isinstance(cause, socket.gaierror):
            return f"the host name {host.rsplit(':', 1)[0]} cannot be resolved"
        if isinstance(cause, (TimeoutError, socket.timeout)) or "Timeout" in type(cause).__name__:
            return f"the host {host} did not answer in time"
    return None


def why_denied(url: str, exc: BaseException) -> str | None:
    """In words, a credentials problem behind `exc` (none found, refused by the store), else None."""
    scheme = url.split("://", 1)[0] if "://" in url else "file"
    for cause in _causes(exc):
        name = type(cause).__name__
        if name in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
            return (f"no credentials for {scheme}:// ({name}): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                    "AWS_PROFILE, or the tier's storage_options key and secret")
        text = str(cause)
        if any(code in text for code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied",
                                         "ExpiredToken")) or isinstance(cause, PermissionError):
            return f"access denied by the storage ({redact(text.splitlines()[0] if text else name)})"
    return None


def first_words(exc: BaseException) -> str:
    """The first line of `exc`'s message, credentials redacted (with the next line where the first only
    announces it, as botocore's "Parameter validation failed:"); its type's name where it has none."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    text = f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    return redact(text)


def why_missing(fs: fsspec.AbstractFileSystem, path: str, url: str, missing: str = "not found") -> str:
    """Why `fs.exists(path)` said False: remote drivers say so for a host that refused or credentials that
    were refused too, so ask the storage for the reason; `missing` when it is really not there."""
    if not is_local_fs(fs):
        try:
            fs.info(path)
        except Exception as exc:  # noqa: BLE001 - only to find the reason, which the chain holds
            why = why_denied(url, exc) or why_unreachable(url, exc)
            if why is not None:
                return why
    return missing


# Where the storage drivers' own exception types live (botocore's ParamValidationError, aiohttp's
# ClientResponseError, ...): an error of another module inside a storage block is a bug, kept as such.
_DRIVER_MODULES = ("botocore", "aiobotocore", "boto3", "s3fs", "aiohttp", "fsspec", "gcsfs", "adlfs", "requests",
                   "urllib3")


def storage_failure(url: str, exc: BaseException, doing: str) -> DatasetError | None:
    """The one line for `exc`, raised while trying to `doing` ("list the dataset", "read it") at `url`,
    credentials redacted; None for an error that is no storage's (a bug, whose traceback is kept)."""
    shown = redact(url)
    why = why_denied(url, exc) or why_unreachable(url, exc)
    if why is not None:
        return DatasetError(f"{shown}: {why}")
    if isinstance(exc, FileNotFoundError):
        return DatasetError(f"{shown}: not found")
    if isinstance(exc, (OSError, ValueError)):
        return DatasetError(f"{shown}: cannot {doing} ({first_words(exc)})")
    if is_transient(exc) or type(exc).__module__.split(".", 1)[0] in _DRIVER_MODULES:
        return DatasetError(f"{shown}: cannot {doing} ({type(exc).__name__}: {first_words(exc)})")
    return None


@contextlib.contextmanager
def storage_errors(url: str, doing: str) -> Iterator[None]:
    """Any error of the storage at `url` inside the block as `storage_failure`'s one line (a `LoadoptError`
    raised there passes as it is, a bug keeps its traceback)."""
    try:
        yield
    except LoadoptError:
        raise
    except Exception as exc:  # noqa: BLE001 - remote drivers raise their own types (aiohttp, botocore)
        failure = storage_failure(url, exc, doing)
        if failure is None:
            raise
        raise failure from None


def _split_userinfo(url: str, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """`s3://KEY:SECRET@bucket/...`: s3fs takes no credentials in the URL; pass them as its options.
    (A secret key may hold '/', never '@'; a key id holds neither.)"""
    from urllib.parse import unquote

    scheme, sep, rest = url.partition("://")
    userinfo, at, location = rest.partition("@")
    key, colon, secret = userinfo.partition(":")
    if scheme not in ("s3", "s3a") or not at or not colon or "/" in key:
        return url, options
    return f"{scheme}://{location}", {**options, "key": unquote(key), "secret": unquote(secret)}


def open_url(url: str, storage_options: dict[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and in-filesystem path of `url`; a missing driver or a bad URL is a DatasetError.

    s3:// takes its endpoint, credentials and region from the usual AWS environment variables
    (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION) or from
    `storage_options` (s3fs's own keywords: endpoint_url, key, secret, client_kwargs, ...)."""
    url, options = _split_userinfo(url, dict(storage_options or {}))
    try:
        return fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        hint = " (pip install 'loadopt[remote]')" if url.split("://", 1)[0] in ("s3", "s3a", "http", "https") else ""
        raise DatasetError(f"{redact(url)}: no driver for this location{hint}: {exc}") from None
    except (ValueError, TypeError) as exc:
        raise DatasetError(f"{redact(url)}: cannot open this location ({redact(str(exc))})") from None


# ---------------------------------------------------------------------------------------------
# Retries


class RetryPolicy(BaseModel):
    """How a tier's reads are retried: up to `max_attempts` tries in all, waiting
    `base_delay_s * multiplier**k` (at most `max_delay_s`, with +-`jitter` of it at random) before retry k+1, or
    what the server's `Retry-After` asks where that is longer, up to `max_retry_after_s`."""

    model_config = ConfigDict(extra="forbid")

    max_attempts: int = Field(5, ge=1)
    base_delay_s: float = Field(0.05, ge=0)
    multiplier: float = Field(2.0, ge=1)
    max_delay_s: float = Field(2.0, ge=0)
    jitter: float = Field(0.1, ge=0, le=1)
    max_retry_after_s: float = Field(5.0, ge=0)

    def delay(self, retry: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number `retry` (0 for the first retry)."""
        base = min(self.max_delay_s, self.base_delay_s * self.multiplier ** retry)
        spread = (rng or random).uniform(-self.jitter, self.jitter) if self.jitter else 0.0
        return max(0.0, base * (1.0 + spread))


# Errors that retrying cannot fix: the file is not there, or we may not read it.
PERMANENT_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)
# HTTP statuses that say "not now" rather than "no": timeouts, throttling, the server's own failures (5xx).
TRANSIENT_STATUSES = frozenset({408, 425, 429})


def http_status(exc: BaseException) -> tuple[int, str] | None:
    """(status, reason) of an HTTP answer behind `exc` (aiohttp's ClientResponseError, as fsspec's HTTP
    filesystem raises it; botocore's ClientError), else None."""
    for cause in _causes(exc):
        status = getattr(cause, "status", None)
        if isinstance(status, int) and status >= 400:
            return status, str(getattr(cause, "message", "") or "")
        response = getattr(cause, "response", None)
        if isinstance(response, dict):
            code = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if isinstance(code, int) and code >= 400:
                return code, str((response.get("Error") or {}).get("Code") or "")
    return None


def retry_after_s(exc: BaseException) -> float | None:
    """The seconds the server's `Retry-After` header asks for (a number, or an HTTP date), else None."""
    from email.utils import parsedate_to_datetime

    for cause in _causes(exc):
        headers = getattr(cause, "headers", None)
        response = getattr(cause, "response", None)
        if headers is None and isinstance(response, dict):
            headers = (response.get("ResponseMetadata") or {}).get("HTTPHeaders")
        if not headers:
            continue
        value = headers.get("Retry-After") or headers.get("retry-after")
        if not value:
            continue
        try:
            return max(0.0, float(value))
        except ValueError:
            pass
        try:
            return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
        except (TypeError, ValueError):
            return None
    return None


def is_transient(exc: BaseException) -> bool:
    """A read error worth retrying: timeouts, refused or dropped connections, HTTP 5xx/408/429 answers, and I/O
    errors other than not-found/permission ones."""
    if isinstance(exc, PERMANENT_ERRORS):
        return False
    status = http_status(exc)
    if status is not None:
        return status[0] >= 500 or status[0] in TRANSIENT_STATUSES
    if isinstance(exc, (TimeoutError, OSError)):
        return True
    # aiohttp/botocore raise their own types for dropped connections and throttling.
    name = type(exc).__name__
    return any(word in name for word in ("Timeout", "Connection", "ClientPayload", "ServerDisconnected",
                                         "Throttl", "SlowDown"))


def what_the_server_did(url: str, exc: BaseException) -> tuple[str, str]:
    """(what the storage did, in words: "the server answered 503 Service Unavailable", "the host H refused the
    connection", "the read failed"; the end of the line: a hint, the error's own words, or "") for a read of
    `url` that failed with `exc`."""
    status = http_status(exc)
    if status is not None:
        return f"the server answered {status[0]}{' ' + status[1] if status[1] else ''}", ""
    why = why_unreachable(url, exc) if "://" in url else None  # a local file has no host
    if why is not None:
        what, _, hint = why.partition(" (")
        return what, f" ({hint}" if hint else ""
    if any(isinstance(c, ConnectionResetError) or "Disconnected" in type(c).__name__ for c in _causes(exc)):
        return "the server closed the connection", ""
    return "the read failed", f" ({type(exc).__name__}: {first_words(exc)})"


def _seconds(elapsed: float) -> str:
    return f"{elapsed:.1f} s" if elapsed < 10 else f"{elapsed:.0f} s"


def read_with_retries(attempt: Callable[[], T], policy: RetryPolicy, named: str | Callable[[], str],
                      on_retry: Callable[[BaseException], None] | None = None,
                      on_failure: Callable[[BaseException], None] | None = None) -> T:
    """`attempt()`, retried on transient errors per `policy`; `named` names the file (its URL) in the error (or
    gives that name: only asked for when there is an error).

    `on_retry(exc)` is called before each retry, `on_failure(exc)` once when the read gives up (both
    are where a tier counts its retries and failures). Not found and permission errors propagate at once; a
    read that keeps failing, or that the storage refuses for good (a 403), raises `StorageError`, one line
    naming the file and what the storage did, and how often over how long: never the driver's own exception,
    which may not pickle back from a worker process (aiohttp's does not)."""
    began = time.monotonic()
    for number in range(policy.max_attempts):
        try:
            return attempt()
        except Exception as exc:  # noqa: BLE001 - classified just below
            if isinstance(exc, (LoadoptError, *PERMANENT_ERRORS)):
                raise
            what = named() if callable(named) else named
            if not is_transient(exc):
                status = http_status(exc)
                failure = storage_failure(what, exc, "read it") if status is None else \
                    f"{redact(what)}: {what_the_server_did(what, exc)[0]}"
                if failure is None:
                    raise
                raise StorageError(str(failure)) from None
            if number + 1 >= policy.max_attempts:
                if on_failure is not None:
                    on_failure(exc)
                did, hint = what_the_server_did(what, exc)
                times = "once" if policy.max_attempts == 1 else f"{policy.max_attempts} times"
                raise StorageError(f"{redact(what)}: {did} {times} over {_seconds(time.monotonic() - began)}, "
                                   f"giving up{hint}") from None
            if on_retry is not None:
                on_retry(exc)
            asked = retry_after_s(exc)
            wait = policy.delay(number)
            if asked is not None:
                wait = max(wait, min(asked, policy.max_retry_after_s))
            time.sleep(wait)
    raise AssertionError("unreachable")  # max_attempts >= 1
