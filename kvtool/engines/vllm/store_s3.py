"""The prefix store on an S3-compatible object store (``s3://bucket/prefix``), through boto3.

Why boto3 (the ``s3`` extra) rather than fsspec/s3fs or obstore:

* **maturity and configuration**: the AWS SDK itself; endpoint, region and credentials come
  from the standard chain (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``/``..._SECRET_...``,
  ``AWS_PROFILE``, ``~/.aws/config``, instance and container roles, SSO) exactly as for the AWS
  CLI, and it talks to every S3-compatible server (MinIO, Ceph RGW, R2, moto);
* **threads**: a boto3 client is thread-safe, which fits the connector (scheduler lookups,
  worker loads, a saver thread) without s3fs's event-loop thread or async code;
* **atomic writes**: one ``PutObject`` of the whole chunk (never multipart), so readers see
  the old state or the whole object, never a partial one; ``If-None-Match: *`` makes "never
  replace an existing chunk" atomic too, and ``If-Match`` makes a quarantine delete only the
  object that was judged;
* **listing cost**: ``ListObjectsV2`` returns sizes and times with the keys (1000 per request),
  so ``kvtool store ls/stats/prune`` need no request per object, and nothing is cached between
  calls (s3fs caches listings, which a shared, changing store would have to defeat);
* **dependency weight**: boto3, botocore, s3transfer, jmespath (pure Python, ~15 MB);
  s3fs adds aiobotocore and aiohttp on top of botocore; obstore is lighter (one Rust wheel) but
  pre-1.0, and its credential chain is not the AWS CLI's.

Rules as on a directory (:mod:`~kvtool.engines.vllm.store`): a read error is never a delete;
a damaged chunk is copied to ``quarantine/`` and then deleted only if its ETag is unchanged
(``If-Match``); objects of a newer format are skipped and left alone. A chunk being read is
downloaded whole into an anonymous in-memory file, so the reader checks and decodes exactly
the bytes it judged. There are no temp objects in the bucket (see below for local temp dirs).

**Last hits (LRU).** S3 has no access time. A load served from chunk ``<model>/<xx>/<key>.kvz``
PUTs an empty marker ``hits/<model>/<key>``, whose ``LastModified`` is the hit time; at most
one marker PUT per chunk per :data:`HIT_INTERVAL` seconds per process, and none from a
read-only store (``kv_consumer``). ``kvtool store`` lists ``hits/`` together with the chunks
(one listing) and takes a chunk's last hit as the later of its write and its marker; pruning
removes the marker with the chunk. Times are the server's, at one-second resolution.

**Timeouts and retries.** Every request has a connect timeout (:data:`CONNECT_TIMEOUT`, 2 s),
a read timeout (:data:`READ_TIMEOUT`, 5 s: the longest wait for the next bytes of an answer)
and at most :data:`MAX_ATTEMPTS` (2) attempts, botocore's ``standard`` retry mode. Override
them with the storage options ``connect_timeout``, ``read_timeout`` (seconds) and
``max_attempts``; any other option must be a keyword of ``boto3.client`` (``endpoint_url``,
``region_name``, ``aws_access_key_id``, ``aws_secret_access_key``, ``aws_session_token``,
``verify``, ...), and an unknown one is refused by name. :attr:`S3Backend.worst_case_seconds`
bounds one request (its attempts, the backoff between them, and its body) against an endpoint
that stops answering: with the defaults 2 × (2 + 5) + 1 + 5 = 20 s. Most calls make one
request; twice that for those that make two (``write_new``: a HEAD, then the PUT; a HEAD's
404 checked against the bucket, at most once a minute). Not bounded: a server that trickles
bytes, a DNS lookup, and the first credential lookup from instance metadata.

**Errors** are one-line ``OSError`` exceptions naming the object and what failed:
``FileNotFoundError`` for a missing object (a miss), and :class:`StoreError` subclasses for
the store itself: :class:`MissingBucketError` (``ENXIO``; not a ``FileNotFoundError``), the
``PermissionError`` subclasses :class:`AccessDeniedError` (a permission is missing) and
:class:`CredentialsError` (credentials rejected, or none found), and
:class:`EndpointUnavailableError` (a ``ConnectionError``; ``ETIMEDOUT``, ``ECONNREFUSED`` or
``ECONNRESET``) when the endpoint cannot be reached, times out or drops the connection. A HEAD
carries no error code: a 404 is checked against the bucket (a ``HeadBucket`` at most once a
minute), a 403 is explained by a one-byte GET. Without ``s3:ListBucket`` S3 answers a missing
object with 403, which then reads as access denied.

**Local temp dirs.** A chunk is encoded into ``<tmp>/kvtool-s3-<host>.<pid>.<random>/`` and
uploaded from there; :func:`collect_local_temps` (run by :meth:`S3Backend.collect_garbage`:
at the connector's startup and by ``kvtool store prune``) removes those of dead writers on this
host, and any older than :data:`~kvtool.fileio.STALE_TEMP_SECONDS`.

**Downloads.** The last bodies downloaded are kept in memory (:data:`BODY_CACHE_BYTES` in all,
each for :data:`BODY_CACHE_SECONDS` since its last use), and a later pin of the same object is
a GET with ``If-None-Match`` on its ETag: a ``304`` serves the kept bytes, so the chunk that a
lookup judged is not downloaded again by the load that follows, nor a hot chunk by each load.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from kvtool.engines.vllm.safeio import Stamp, pinned
from kvtool.engines.vllm.store_backend import MODEL_DIR, QUARANTINE_DIR, SHARD_DIR, Entry
from kvtool.errors import KvtoolError
from kvtool.fileio import STALE_TEMP_SECONDS, host_name, pid_alive

HITS_DIR = "hits"
HIT_INTERVAL = 300.0  # seconds between two hit marks of one chunk by one process
CONNECT_TIMEOUT = 2.0  # seconds to open a connection
READ_TIMEOUT = 5.0  # seconds to wait for the next bytes of an answer
MAX_ATTEMPTS = 2  # tries of one request, the first included
MAX_BACKOFF = 20.0  # botocore's cap on the pause between two attempts
BUCKET_CHECK_INTERVAL = 60.0  # seconds between two checks that a HEAD's 404 is not the bucket's
BODY_CACHE_BYTES = 64 << 20  # downloaded bodies kept for revalidation (If-None-Match)
BODY_CACHE_SECONDS = 60.0  # ... each for this long since its last use
TEMP_DIR_PREFIX = "kvtool-s3-"
TIMEOUT_OPTIONS = ("connect_timeout", "read_timeout", "max_attempts")
_TEMP_DIR_RE = re.compile(r"^kvtool-s3-(?:(?P<host>[A-Za-z0-9_-]{1,64})\.(?P<pid>\d{1,10})\.)?"
                          r"[a-z0-9_]+$")
_UNSUPPORTED = {"NotImplemented", "InvalidArgument", "InvalidRequest"}  # conditional headers
_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}
_DENIED = {"AccessDenied", "403", "Forbidden", "AllAccessDisabled"}
_CREDENTIALS = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
                "TokenRefreshRequired", "InvalidClientTokenId", "ExpiredTokenException"}


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


class _Body(NamedTuple):
    """A downloaded object kept for revalidation."""

    used: float  # time.monotonic() of its last use
    etag: str
    stamp: Stamp
    data: bytes


def worst_case_seconds(connect_timeout: float, read_timeout: float, max_attempts: int) -> float:
    """The longest one request can block on an endpoint that stops answering: each attempt's
    connect and read timeouts, botocore's backoff between attempts (at most 1, 2, 4, ... s),
    and one more read timeout for the body."""
    backoff = sum(min(2.0 ** i, MAX_BACKOFF) for i in range(max_attempts - 1))
    return max_attempts * (connect_timeout + read_timeout) + backoff + read_timeout


def _client_options(url: str, options: dict[str, Any], session: Any
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


class S3Backend:
    """A prefix store under ``s3://bucket/prefix``; see the module docstring.
    ``storage_options``: keyword arguments of ``boto3.client("s3", ...)`` (``endpoint_url``,
    ``region_name``, ``aws_access_key_id``, ...), over the standard environment, and
    ``connect_timeout``, ``read_timeout`` (seconds) and ``max_attempts``.
    :attr:`worst_case_seconds`: the longest one request blocks on an endpoint that stops
    answering (see :func:`worst_case_seconds`)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *,
                 writable: bool = True):
        try:
            import boto3
            from botocore.config import Config
            from botocore.exceptions import BotoCoreError
        except ImportError:
            raise KvtoolError(f"{url}: an S3 store needs boto3: pip install 'kvtool[s3]'"
                              ) from None
        bucket, _, prefix = url[len("s3://"):].partition("/")
        if not bucket:
            raise KvtoolError(f"{url}: no bucket name (expected s3://bucket/prefix)")
        self.location = url.rstrip("/")
        self.bucket, self.prefix = bucket, (prefix.strip("/") + "/" if prefix.strip("/") else "")
        self.writable = writable
        session = boto3.session.Session()
        options, self.connect_timeout, self.read_timeout, self.max_attempts = _client_options(
            url, storage_options or {}, session)
        self.worst_case_seconds = worst_case_seconds(self.connect_timeout, self.read_timeout,
                                                     self.max_attempts)
        config = Config(connect_timeout=self.connect_timeout, read_timeout=self.read_timeout,
                        retries={"total_max_attempts": self.max_attempts, "mode": "standard"},
                        max_pool_connections=16)
        try:
            self.client = session.client("s3", config=config, **options)
        except (BotoCoreError, ValueError) as e:  # partial credentials, a bad endpoint URL
            raise KvtoolError(f"{url}: {e}") from None
        self._etags: dict[str, tuple[Stamp, str]] = {}  # name → (stamp, ETag) as last pinned
        self._hits: dict[str, float] = {}  # name → when this process last marked a hit
        self._bodies: OrderedDict[str, _Body] = OrderedDict()  # least recently used first
        self._body_bytes = 0
        self._bucket_missing = False
        self._bucket_checked = -BUCKET_CHECK_INTERVAL  # time.monotonic() of the last check
        self._lock = threading.Lock()

    # -- names ---------------------------------------------------------------------------------
    def path(self, name: str) -> str:
        return f"{self.location}/{name}"

    def _key(self, name: str) -> str:
        return self.prefix + name

    # -- errors --------------------------------------------------------------------------------
    def _error(self, e: Exception, name: str, action: str) -> OSError:
        """The one-line ``OSError`` for a failed request (see the module docstring)."""
        from botocore import exceptions as bx

        where = self.path(name) if name else self.location
        if isinstance(e, bx.ClientError):
            error = e.response.get("Error", {})
            code, message = str(error.get("Code", "")), str(error.get("Message") or "")
            if code in _NOT_FOUND:
                return FileNotFoundError(errno.ENOENT, f"{where}: no such object")
            if code == "NoSuchBucket":
                self._bucket_missing = True
                return MissingBucketError(errno.ENXIO, f"cannot {action} {where}: bucket "
                                          f"{self.bucket} does not exist")
            if code in _CREDENTIALS:
                return CredentialsError(errno.EACCES, f"cannot {action} {where}: credentials "
                                        f"rejected ({code}: {message.rstrip('.')})")
            if code in _DENIED:
                return AccessDeniedError(errno.EACCES, f"cannot {action} {where}: access "
                                         "denied (check the credentials' permissions on "
                                         f"bucket {self.bucket})")
            return OSError(errno.EIO, f"cannot {action} {where}: {code}: {message or e}")
        if isinstance(e, (bx.NoCredentialsError, bx.PartialCredentialsError,
                          bx.CredentialRetrievalError)):
            return CredentialsError(errno.EACCES, f"cannot {action} {where}: no usable "
                                    f"credentials ({e}; set AWS_ACCESS_KEY_ID and "
                                    "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)")
        endpoint = self.client.meta.endpoint_url
        tries = f"{self.max_attempts} attempt{'s' if self.max_attempts > 1 else ''}"
        if isinstance(e, bx.ConnectTimeoutError):
            return EndpointUnavailableError(
                errno.ETIMEDOUT, f"cannot {action} {where}: endpoint {endpoint} unreachable: "
                f"connect timed out after {self.connect_timeout:g} s (up to {tries})")
        if isinstance(e, bx.ReadTimeoutError):
            return EndpointUnavailableError(
                errno.ETIMEDOUT, f"cannot {action} {where}: endpoint {endpoint} did not answer: "
                f"timed out after {self.read_timeout:g} s (up to {tries})")
        if isinstance(e, (bx.ConnectionClosedError, bx.ResponseStreamingError)):
            return EndpointUnavailableError(
                errno.ECONNRESET, f"cannot {action} {where}: endpoint {endpoint} dropped the "
                "connection")
        if isinstance(e, bx.ConnectionError):
            return EndpointUnavailableError(
                errno.ECONNREFUSED, f"cannot {action} {where}: endpoint {endpoint} unreachable "
                f"({_cause(e)})")
        return OSError(errno.EIO, f"cannot {action} {where}: {type(e).__name__}: {e}")

    def _not_found(self, name: str, action: str) -> OSError:
        """The error for a HEAD's 404: ``FileNotFoundError``, or :class:`MissingBucketError`
        when the bucket is gone (asked at most every :data:`BUCKET_CHECK_INTERVAL` s)."""
        from botocore.exceptions import BotoCoreError, ClientError

        now = time.monotonic()
        with self._lock:
            due = now - self._bucket_checked >= BUCKET_CHECK_INTERVAL
            if due:
                self._bucket_checked = now
        if due:
            try:
                self.client.head_bucket(Bucket=self.bucket)
                self._bucket_missing = False
            except ClientError as e:
                self._bucket_missing = _code(e) in ("404", "NoSuchBucket", "NotFound")
            except BotoCoreError:
                pass  # cannot tell: as before
        if self._bucket_missing:
            return MissingBucketError(errno.ENXIO, f"cannot {action} {self.path(name)}: bucket "
                                      f"{self.bucket} does not exist")
        return FileNotFoundError(errno.ENOENT, f"{self.path(name)}: no such object")

    def _bucket_found(self) -> None:
        """A request on the bucket succeeded: it exists."""
        if self._bucket_missing:
            self._bucket_missing = False
        self._bucket_checked = time.monotonic()

    def _head(self, name: str, action: str = "read") -> dict[str, Any]:
        """HEAD the object; the mapped ``OSError`` if that fails (a HEAD has no error code:
        a 404 is checked against the bucket, a 403 explained by a one-byte GET)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(name))
        except (BotoCoreError, ClientError) as e:
            code = _code(e)
            if code in _NOT_FOUND:
                raise self._not_found(name, action) from None
            if code in ("403", "Forbidden"):
                try:
                    self.client.get_object(Bucket=self.bucket, Key=self._key(name),
                                           Range="bytes=0-0")["Body"].close()
                except (BotoCoreError, ClientError) as e2:
                    why = self._error(e2, name, action)
                    if isinstance(why, PermissionError):
                        raise why from None
            raise self._error(e, name, action) from None
        self._bucket_found()
        return head

    # -- reading -------------------------------------------------------------------------------
    def pin(self, name: str) -> contextlib.AbstractContextManager[tuple[str, Stamp]]:
        """Download the object whole into an anonymous file; ``(path to read it, stamp)``.
        A body kept from an earlier download is revalidated (``If-None-Match``), not fetched."""
        from botocore.exceptions import BotoCoreError, ClientError

        kept = self._kept(name)
        args = {"Bucket": self.bucket, "Key": self._key(name)}
        try:
            got = self.client.get_object(**args, **({"IfNoneMatch": kept.etag} if kept else {}))
            data = got["Body"].read()
        except (BotoCoreError, ClientError) as e:
            if kept is None or _code(e) not in ("304", "NotModified"):
                error = self._error(e, name, "read")
                if isinstance(error, FileNotFoundError):
                    self._forget(name)
                raise error from None
            etag, stamp, data = kept.etag, kept.stamp, kept.data  # unchanged: the kept bytes
        else:
            etag = got["ETag"]
            stamp = _stamp(etag, len(data), got["LastModified"].timestamp())
            self._keep(name, etag, stamp, data)
        self._bucket_found()
        with self._lock:
            self._etags[name] = (stamp, etag)
        return self._pinned(data, name, stamp)

    def _kept(self, name: str) -> _Body | None:
        """The kept body of ``name`` (expired ones dropped), marked as used."""
        now = time.monotonic()
        with self._lock:
            while self._bodies:
                oldest = next(iter(self._bodies.values()))
                if now - oldest.used <= BODY_CACHE_SECONDS:
                    break
                self._body_bytes -= len(self._bodies.popitem(last=False)[1].data)
            kept = self._bodies.get(name)
            if kept is not None:
                self._bodies[name] = kept._replace(used=now)
                self._bodies.move_to_end(name)
            return kept

    def _keep(self, name: str, etag: str, stamp: Stamp, data: bytes) -> None:
        """Keep a downloaded body, evicting the least recently used past the budget."""
        with self._lock:
            old = self._bodies.pop(name, None)
            if old is not None:
                self._body_bytes -= len(old.data)
            if len(data) > BODY_CACHE_BYTES:
                return
            self._bodies[name] = _Body(time.monotonic(), etag, stamp, data)
            self._body_bytes += len(data)
            while self._body_bytes > BODY_CACHE_BYTES:
                self._body_bytes -= len(self._bodies.popitem(last=False)[1].data)

    def _forget(self, name: str) -> None:
        with self._lock:
            old = self._bodies.pop(name, None)
            if old is not None:
                self._body_bytes -= len(old.data)

    @contextlib.contextmanager
    def _pinned(self, data: bytes, name: str, stamp: Stamp) -> Iterator[tuple[str, Stamp]]:
        fd = _anonymous_file()
        try:
            _write_all(fd, data)
            os.lseek(fd, 0, os.SEEK_SET)
        except BaseException:
            os.close(fd)
            raise
        with pinned(fd, self.path(name)) as (path, _):
            yield path, stamp

    def peek(self, name: str) -> Stamp | None:
        """The object's stamp from a HEAD. ``FileNotFoundError`` when absent; the errors of
        the store itself (unreachable, missing bucket, access or credentials refused) are
        raised; any other failure gives None (then it is pinned)."""
        try:
            head = self._head(name)
        except (FileNotFoundError, StoreError):
            raise
        except OSError:
            return None
        return _stamp(head["ETag"], int(head["ContentLength"]),
                      head["LastModified"].timestamp())

    def exists(self, name: str) -> bool:
        """Whether the object exists; a failure other than "not found" is raised (it says
        nothing about the object)."""
        try:
            self._head(name)
        except FileNotFoundError:
            return False
        return True

    def read_small(self, name: str) -> bytes | None:
        """The object's bytes; None if it does not exist (any other failure is raised)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            data = self.client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"].read()
        except (BotoCoreError, ClientError) as e:
            error = self._error(e, name, "read")
            if isinstance(error, FileNotFoundError):
                return None
            raise error from None
        self._bucket_found()
        return data

    # -- writing -------------------------------------------------------------------------------
    def write_new(self, name: str, encode: Callable[[str], int]) -> int:
        """Encode into a local temp dir (named for this process, see
        :func:`collect_local_temps`), then one ``PutObject`` with ``If-None-Match: *``;
        0 if the object exists already (checked first, to skip the encoding)."""
        if self.exists(name):
            return 0
        tmp = tempfile.mkdtemp(prefix=f"{TEMP_DIR_PREFIX}{host_name()}.{os.getpid()}.")
        try:
            path = os.path.join(tmp, name.rsplit("/", 1)[-1])
            encode(path)
            with open(path, "rb") as f:
                data = f.read()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return len(data) if self._put(name, data, create=True) else 0

    def write_small(self, name: str, data: bytes) -> None:
        self._put(name, data)

    def _put(self, name: str, data: bytes, *, create: bool = False) -> bool:
        """One PUT of the whole object; False if ``create`` and it exists already."""
        from botocore.exceptions import BotoCoreError, ClientError, ParamValidationError

        args = {"Bucket": self.bucket, "Key": self._key(name), "Body": data}
        try:
            self.client.put_object(**args, **({"IfNoneMatch": "*"} if create else {}))
        except (ClientError, ParamValidationError) as e:
            code = _code(e)
            if code in ("PreconditionFailed", "ConditionalRequestConflict"):
                return False
            if not create or (isinstance(e, ClientError) and code not in _UNSUPPORTED):
                raise self._error(e, name, "write") from None
            try:  # a server without conditional writes: the exists() check above stands
                self.client.put_object(**args)
            except (BotoCoreError, ClientError) as e2:
                raise self._error(e2, name, "write") from None
        except BotoCoreError as e:
            raise self._error(e, name, "write") from None
        return True

    def quarantine(self, name: str, dest: str, stamp: Stamp | None) -> bool:
        """Copy to ``quarantine/dest`` (if the ETag still matches), then delete the original
        only if its ETag is still the one judged: a rewritten object is left alone."""
        from botocore.exceptions import BotoCoreError, ClientError, ParamValidationError

        with self._lock:
            known = self._etags.get(name)
        etag = known[1] if known is not None and (stamp is None or known[0] == stamp) else None
        if etag is None:
            return False  # not the object this process judged
        qname = f"{QUARANTINE_DIR}/{dest}"
        try:
            self.client.copy_object(Bucket=self.bucket, Key=self._key(qname),
                                    CopySource={"Bucket": self.bucket, "Key": self._key(name)},
                                    CopySourceIfMatch=etag)
        except (BotoCoreError, ClientError) as e:
            raise self._error(e, name, "quarantine") from None
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(name), IfMatch=etag)
        except (ClientError, ParamValidationError) as e:
            code = _code(e)
            if code in ("PreconditionFailed", "NoSuchKey"):
                return False  # rewritten (or removed) meanwhile: judge the new one afresh
            if code not in _UNSUPPORTED and isinstance(e, ClientError):
                raise self._error(e, name, "quarantine") from None
            try:  # a server (or botocore) without conditional deletes
                self.client.delete_object(Bucket=self.bucket, Key=self._key(name))
            except (BotoCoreError, ClientError) as e2:
                raise self._error(e2, name, "quarantine") from None
        except BotoCoreError as e:
            raise self._error(e, name, "quarantine") from None
        with self._lock:
            self._etags.pop(name, None)
        self._forget(name)
        return True

    def mark_hit(self, name: str, path: str, stamp: Stamp) -> None:
        """PUT the chunk's empty hit marker (throttled; never from a read-only store)."""
        if not self.writable:
            return
        now = time.monotonic()
        with self._lock:
            if now - self._hits.get(name, -HIT_INTERVAL) < HIT_INTERVAL:
                return
            self._hits[name] = now
        with contextlib.suppress(Exception):  # a lost mark only makes LRU less exact
            self._put(_hit_name(name), b"")

    # -- listing and removal ---------------------------------------------------------------------
    def _list(self, under: str) -> Iterator[dict[str, Any]]:
        from botocore.exceptions import BotoCoreError, ClientError

        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self._key(under))
        try:
            for page in pages:
                yield from page.get("Contents", ())
        except (BotoCoreError, ClientError) as e:
            raise self._error(e, under, "list") from None

    def list_names(self, under: str) -> Iterator[tuple[str, int]]:
        """(name, size) of every object whose name starts with ``under``."""
        for obj in self._list(under):
            yield obj["Key"][len(self.prefix):], int(obj["Size"])

    def walk(self, model: str | None = None) -> Iterator[Entry]:
        """Chunk objects (of one model, or all) with their last hits, and for the whole store
        the quarantine: one listing of the store (two for one model)."""
        chunks: list[Entry] = []
        hits: dict[str, float] = {}
        quarantined: list[Entry] = []
        listings = [f"{model}/", f"{HITS_DIR}/{model}/"] if model else [""]
        for under in listings:
            for obj in self._list(under):
                name = obj["Key"][len(self.prefix):]
                parts = name.split("/")
                when = obj["LastModified"].timestamp()
                if len(parts) == 3 and MODEL_DIR.match(parts[0]) and SHARD_DIR.match(parts[1]):
                    chunks.append(Entry(name, int(obj["Size"]), when, when))
                elif len(parts) == 3 and parts[0] == HITS_DIR:
                    hits[f"{parts[1]}/{parts[2]}"] = when
                elif len(parts) == 2 and parts[0] == QUARANTINE_DIR:
                    quarantined.append(Entry(name, int(obj["Size"]), when, when))
        for e in chunks:
            mark = hits.get(_chunk_id(e.name), 0.0)
            yield Entry(e.name, e.size, e.mtime, max(e.mtime, mark))
        yield from quarantined

    def remove(self, name: str) -> int | None:
        """Delete a chunk and its hit marker; its size, or None if it was not there (any other
        failure is raised)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            head = self._head(name, "remove")
        except FileNotFoundError:
            return None
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(name))
        except (BotoCoreError, ClientError) as e:
            raise self._error(e, name, "remove") from None
        self._forget(name)
        with contextlib.suppress(BotoCoreError, ClientError):
            self.client.delete_object(Bucket=self.bucket, Key=self._key(_hit_name(name)))
        return int(head["ContentLength"])

    def collect_garbage(self, model: str) -> tuple[int, int]:
        """No temp objects in the bucket (single PUTs); the local temp dirs of dead writers
        (:func:`collect_local_temps`). (files, bytes) removed."""
        return collect_local_temps()

    def check(self) -> None:
        """A one-line :class:`KvtoolError` unless the store can be listed (a missing bucket,
        refused credentials or access, an unreachable endpoint)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:  # a listing, not a HEAD: its errors carry their codes
            self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix, MaxKeys=1)
        except (BotoCoreError, ClientError) as e:
            error = self._error(e, "", "list")
            if isinstance(error, MissingBucketError):
                raise KvtoolError(f"no store at {self.location}: the bucket {self.bucket} "
                                  "does not exist") from None
            raise KvtoolError(error.strerror or str(error)) from None
        self._bucket_found()


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


def _code(e: Exception) -> str:
    """The error code of a botocore error ("" if none)."""
    response = getattr(e, "response", None)
    return str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""


def _cause(e: Exception) -> str:
    """The low-level reason of a botocore connection error, short (``[Errno 111] ...``)."""
    text = str(getattr(e, "kwargs", {}).get("error") or e)
    return text[text.index("[Errno"):].rstrip(")'\"") if "[Errno" in text else text


def _chunk_id(name: str) -> str:
    """``<model>/<key>`` of a chunk name ``<model>/<xx>/<key>.kvz``."""
    parts = name.split("/")
    return f"{parts[0]}/{parts[-1].removesuffix('.kvz')}"


def _hit_name(name: str) -> str:
    return f"{HITS_DIR}/{_chunk_id(name)}"


def _stamp(etag: str, size: int, mtime: float) -> Stamp:
    digest = hashlib.sha256(etag.encode()).digest()
    return int.from_bytes(digest[:8], "little"), int(size), int(mtime * 1e9)


def _anonymous_file() -> int:
    """An fd of a file with no name: in memory where the OS can (Linux), else a temp file."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("kvtool-chunk", getattr(os, "MFD_CLOEXEC", 0))
    f = tempfile.TemporaryFile()
    fd = os.dup(f.fileno())
    f.close()
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]

