"""The parts of the S3 prefix store (:mod:`~kvtool.engines.vllm.store_s3`) that need no client:
its errors (and the mapping of botocore's onto them), its timeouts and client options, the
downloaded bodies it keeps (:class:`BodyCache`) and its local temp dirs. Re-exported by
:mod:`~kvtool.engines.vllm.store_s3`. Imports neither boto3 (botocore only when an error is
mapped) nor vLLM.

**Timeouts and retries.** Every request has a connect timeout (:data:`CONNECT_TIMEOUT`, 2 s),
a read timeout (:data:`READ_TIMEOUT`, 5 s: the longest wait for the next bytes of an answer)
and at most :data:`MAX_ATTEMPTS` (2) attempts, botocore's ``standard`` retry mode. Override
them with the storage options ``connect_timeout``, ``read_timeout`` (seconds) and
``max_attempts``; any other option must be a keyword of ``boto3.client`` (``endpoint_url``,
``region_name``, ``aws_access_key_id``, ``aws_secret_access_key``, ``aws_session_token``,
``verify``, ...), and an unknown one is refused by name (:func:`client_options`).
:func:`worst_case_seconds` bounds one request (its attempts, the backoff between them, and its
body) against an endpoint that stops answering: with the defaults 2 × (2 + 5) + 1 + 5 = 20 s.
Not bounded: a server that trickles bytes, a DNS lookup, and the first credential lookup from
instance metadata.

**Errors** are one-line ``OSError`` exceptions naming the object and what failed:
``FileNotFoundError`` for a missing object (a miss), and :class:`StoreError` subclasses for
the store itself: :class:`MissingBucketError` (``ENXIO``; not a ``FileNotFoundError``), the
``PermissionError`` subclasses :class:`AccessDeniedError` (a permission is missing) and
:class:`CredentialsError` (credentials rejected, or none found), and
:class:`EndpointUnavailableError` (a ``ConnectionError``; ``ETIMEDOUT``, ``ECONNREFUSED`` or
``ECONNRESET``) when the endpoint cannot be reached, times out or drops the connection
(:func:`request_error`). The S3 error codes behind them: :data:`NOT_FOUND_CODES`,
:data:`DENIED_CODES`, :data:`CREDENTIALS_CODES` (:func:`error_code` reads one from a botocore
error).

**Local temp dirs.** A chunk is encoded into ``<tmp>/kvtool-s3-<host>.<pid>.<random>/``
(:data:`TEMP_DIR_PREFIX`) and uploaded from there; :func:`collect_local_temps` (run by
:meth:`~kvtool.engines.vllm.store_s3.S3Backend.collect_garbage`: at the connector's startup
and by ``kvtool store prune``) removes those of dead writers on this host, and any older than
:data:`~kvtool.fileio.STALE_TEMP_SECONDS`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from collections import OrderedDict
from typing import Any, NamedTuple

from kvtool.engines.vllm.safeio import Stamp
from kvtool.errors import KvtoolError
from kvtool.fileio import STALE_TEMP_SECONDS, host_name, pid_alive

CONNECT_TIMEOUT = 2.0  # seconds to open a connection
READ_TIMEOUT = 5.0  # seconds to wait for the next bytes of an answer
MAX_ATTEMPTS = 2  # tries of one request, the first included
MAX_BACKOFF = 20.0  # botocore's cap on the pause between two attempts
TIMEOUT_OPTIONS = ("connect_timeout", "read_timeout", "max_attempts")
BODY_CACHE_BYTES = 64 << 20  # downloaded bodies kept for revalidation (If-None-Match)
BODY_CACHE_SECONDS = 60.0  # ... each for this long since its last use
TEMP_DIR_PREFIX = "kvtool-s3-"
_TEMP_DIR_RE = re.compile(r"^kvtool-s3-(?:(?P<host>[A-Za-z0-9_-]{1,64})\.(?P<pid>\d{1,10})\.)?"
                          r"[a-z0-9_]+$")
UNSUPPORTED_CODES = {"NotImplemented", "InvalidArgument", "InvalidRequest"}  # conditionals
NOT_FOUND_CODES = {"NoSuchKey", "404", "NotFound"}
DENIED_CODES = {"AccessDenied", "403", "Forbidden", "AllAccessDisabled"}
CREDENTIALS_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                     "InvalidToken", "TokenRefreshRequired", "InvalidClientTokenId",
                     "ExpiredTokenException"}


# -- errors ------------------------------------------------------------------------------------
class StoreError(OSError):
    """A failed request, said in one line: ``str()`` is the message, without ``[Errno n]``."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


class MissingBucketError(StoreError):
    """The store's bucket does not exist (``ENXIO``). Not a ``FileNotFoundError``: that is a
    missing chunk, a plain miss."""


class EndpointUnavailableError(StoreError, ConnectionError):
    """The endpoint cannot be reached (``ECONNREFUSED``), did not answer in time
    (``ETIMEDOUT``) or dropped the connection (``ECONNRESET``)."""


class AccessDeniedError(StoreError, PermissionError):
    """The server refused the request: the credentials lack a permission (``EACCES``)."""


class CredentialsError(StoreError, PermissionError):
    """The server rejected the credentials, or none were found (``EACCES``)."""


def error_code(e: Exception) -> str:
    """The error code of a botocore error ("" if none)."""
    response = getattr(e, "response", None)
    return str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""


def request_error(e: Exception, where: str, action: str, *, bucket: str, endpoint: str,
                  connect_timeout: float, read_timeout: float, max_attempts: int) -> OSError:
    """The one-line ``OSError`` for a request that failed with the botocore error ``e`` (see
    the module docstring): ``cannot <action> <where>: <why>``."""
    from botocore import exceptions as bx

    if isinstance(e, bx.ClientError):
        error = e.response.get("Error", {})
        code, message = str(error.get("Code", "")), str(error.get("Message") or "")
        if code in NOT_FOUND_CODES:
            return FileNotFoundError(errno.ENOENT, f"{where}: no such object")
        if code == "NoSuchBucket":
            return MissingBucketError(errno.ENXIO, f"cannot {action} {where}: bucket "
                                      f"{bucket} does not exist")
        if code in CREDENTIALS_CODES:
            return CredentialsError(errno.EACCES, f"cannot {action} {where}: credentials "
                                    f"rejected ({code}: {message.rstrip('.')})")
        if code in DENIED_CODES:
            return AccessDeniedError(errno.EACCES, f"cannot {action} {where}: access "
                                     "denied (check the credentials' permissions on "
                                     f"bucket {bucket})")
        return OSError(errno.EIO, f"cannot {action} {where}: {code}: {message or e}")
    if isinstance(e, (bx.NoCredentialsError, bx.PartialCredentialsError,
                      bx.CredentialRetrievalError)):
        return CredentialsError(errno.EACCES, f"cannot {action} {where}: no usable "
                                f"credentials ({e}; set AWS_ACCESS_KEY_ID and "
                                "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)")
    tries = f"{max_attempts} attempt{'s' if max_attempts > 1 else ''}"
    if isinstance(e, bx.ConnectTimeoutError):
        return EndpointUnavailableError(
            errno.ETIMEDOUT, f"cannot {action} {where}: endpoint {endpoint} unreachable: "
            f"connect timed out after {connect_timeout:g} s (up to {tries})")
    if isinstance(e, bx.ReadTimeoutError):
        return EndpointUnavailableError(
            errno.ETIMEDOUT, f"cannot {action} {where}: endpoint {endpoint} did not answer: "
            f"timed out after {read_timeout:g} s (up to {tries})")
    if isinstance(e, (bx.ConnectionClosedError, bx.ResponseStreamingError)):
        return EndpointUnavailableError(
            errno.ECONNRESET, f"cannot {action} {where}: endpoint {endpoint} dropped the "
            "connection")
    if isinstance(e, bx.ConnectionError):
        return EndpointUnavailableError(
            errno.ECONNREFUSED, f"cannot {action} {where}: endpoint {endpoint} unreachable "
            f"({_cause(e)})")
    return OSError(errno.EIO, f"cannot {action} {where}: {type(e).__name__}: {e}")


def _cause(e: Exception) -> str:
    """The low-level reason of a botocore connection error, short (``[Errno 111] ...``)."""
    text = str(getattr(e, "kwargs", {}).get("error") or e)
    return text[text.index("[Errno"):].rstrip(")'\"") if "[Errno" in text else text


# -- timeouts and client options -----------------------------------------------------------------
def worst_case_seconds(connect_timeout: float, read_timeout: float, max_attempts: int) -> float:
    """The longest one request can block on an endpoint that stops answering: each attempt's
    connect and read timeouts, botocore's backoff between attempts (at most 1, 2, 4, ... s),
    and one more read timeout for the body."""
    backoff = sum(min(2.0 ** i, MAX_BACKOFF) for i in range(max_attempts - 1))
    return max_attempts * (connect_timeout + read_timeout) + backoff + read_timeout


def client_options(url: str, options: dict[str, Any], session: Any
                   ) -> tuple[dict[str, Any], float, float, int]:
    """``storage_options`` split into ``boto3.client`` keywords and (connect timeout, read
    timeout, attempts); a :class:`KvtoolError` naming any unknown option or bad value."""
    import inspect

    if not isinstance(options, dict):
        raise KvtoolError(f"{url}: storage_options must be a mapping of option names to "
                          f"values, got {type(options).__name__}")
    allowed = set(inspect.signature(session.client).parameters) - {"service_name", "config"}
    options = dict(options)
    for key in options:
        if key not in allowed and key not in TIMEOUT_OPTIONS:
            known = ", ".join(sorted(allowed | set(TIMEOUT_OPTIONS)))
            raise KvtoolError(f"{url}: unknown storage option {key!r} (known: {known})")
    timeouts = []
    for key, default in (("connect_timeout", CONNECT_TIMEOUT), ("read_timeout", READ_TIMEOUT)):
        value = options.pop(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise KvtoolError(f"{url}: storage option {key} must be a positive number of "
                              f"seconds, got {value!r}")
        timeouts.append(float(value))
    attempts = options.pop("max_attempts", MAX_ATTEMPTS)
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise KvtoolError(f"{url}: storage option max_attempts must be a whole number >= 1, "
                          f"got {attempts!r}")
    return options, timeouts[0], timeouts[1], attempts


# -- downloaded bodies --------------------------------------------------------------------------
class Body(NamedTuple):
    """A downloaded object kept for revalidation."""

    used: float  # time.monotonic() of its last use
    etag: str
    stamp: Stamp
    data: bytes


class BodyCache:
    """Downloaded objects kept for revalidation (``If-None-Match``): :data:`BODY_CACHE_BYTES`
    in all, each for :data:`BODY_CACHE_SECONDS` since its last use, the least recently used
    evicted first. Thread-safe."""

    def __init__(self) -> None:
        self._bodies: OrderedDict[str, Body] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, name: str) -> Body | None:
        """The kept body of ``name`` (expired ones dropped), marked as used."""
        now = time.monotonic()
        with self._lock:
            while self._bodies:
                oldest = next(iter(self._bodies.values()))
                if now - oldest.used <= BODY_CACHE_SECONDS:
                    break
                self._bytes -= len(self._bodies.popitem(last=False)[1].data)
            kept = self._bodies.get(name)
            if kept is not None:
                self._bodies[name] = kept._replace(used=now)
                self._bodies.move_to_end(name)
            return kept

    def put(self, name: str, etag: str, stamp: Stamp, data: bytes) -> None:
        """Keep a downloaded body, evicting the least recently used past the budget."""
        with self._lock:
            old = self._bodies.pop(name, None)
            if old is not None:
                self._bytes -= len(old.data)
            if len(data) > BODY_CACHE_BYTES:
                return
            self._bodies[name] = Body(time.monotonic(), etag, stamp, data)
            self._bytes += len(data)
            while self._bytes > BODY_CACHE_BYTES:
                self._bytes -= len(self._bodies.popitem(last=False)[1].data)

    def drop(self, name: str) -> None:
        with self._lock:
            old = self._bodies.pop(name, None)
            if old is not None:
                self._bytes -= len(old.data)


# -- local temp dirs -----------------------------------------------------------------------------
def collect_local_temps(now: float | None = None, directory: str | None = None
                        ) -> tuple[int, int]:
    """Remove the local temp dirs of S3 writers (``kvtool-s3-<host>.<pid>.<random>`` in
    ``directory``, default :func:`tempfile.gettempdir`) whose writer on this host is dead, and
    any older than :data:`~kvtool.fileio.STALE_TEMP_SECONDS` (unowned names included); (files
    removed, bytes freed). Only this user's real directories: a symlink is never followed."""
    root = tempfile.gettempdir() if directory is None else directory
    now = time.time() if now is None else now
    try:
        with os.scandir(root) as it:
            names = [e.name for e in it if e.name.startswith(TEMP_DIR_PREFIX)]
    except OSError:
        return 0, 0
    files = freed = 0
    for dirname in names:
        m = _TEMP_DIR_RE.match(dirname)
        path = os.path.join(root, dirname)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if m is None or not stat.S_ISDIR(st.st_mode) or (
                hasattr(os, "getuid") and st.st_uid != os.getuid()):
            continue
        age = now - st.st_mtime
        pid = int(m["pid"]) if m["pid"] else None
        if pid is not None and m["host"] == host_name() and pid != os.getpid():
            stale = not pid_alive(pid) or age > STALE_TEMP_SECONDS
        else:
            stale = age > STALE_TEMP_SECONDS
        if not stale:
            continue
        n, size = _tree_size(path)
        try:
            shutil.rmtree(path)  # refuses a symlink; never follows one inside
        except OSError:
            continue
        files, freed = files + n, freed + size
    return files, freed


def _tree_size(path: str) -> tuple[int, int]:
    """(entries that are not directories, bytes of regular files) under ``path``."""
    files = size = 0
    for top, _dirs, names in os.walk(path, followlinks=False):
        for n in names:
            files += 1
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(top, n))
                size += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return files, size
