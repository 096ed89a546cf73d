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
  replace an existing chunk" atomic too, and ``If-Match`` makes a quarantine delete, or a
  lossless writer's overwrite of a lossy chunk, touch only the object that was judged
  (:mod:`~kvtool.engines.vllm.store_s3_conditional`);
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
the bytes it judged. There are no temp objects in the bucket (local temp dirs: see below).

**Last hits (LRU).** S3 has no access time. A load served from chunk ``<model>/<xx>/<key>.kvz``
PUTs an empty marker ``hits/<model>/<key>``, whose ``LastModified`` is the hit time; at most
one marker PUT per chunk per :data:`HIT_INTERVAL` seconds per process, and none from a
read-only store (``kv_consumer``). ``kvtool store`` lists ``hits/`` together with the chunks
(one listing) and takes a chunk's last hit as the later of its write and its marker; pruning
removes the marker with the chunk. Times are the server's, at one-second resolution.

**Timeouts, errors and local temp dirs** are described in
:mod:`~kvtool.engines.vllm.store_s3_common`, whose names (:class:`StoreError` and its
subclasses, :func:`collect_local_temps`, :func:`worst_case_seconds`, the timeout defaults) are
re-exported here. :attr:`S3Backend.worst_case_seconds` bounds one request against an endpoint
that stops answering (20 s with the defaults). Most calls make one request; twice that for
those that make two (``write_new``: a HEAD, then the PUT; a HEAD's 404 checked against the
bucket, at most once a minute). A HEAD carries no error code: a 404 is checked against the
bucket (a ``HeadBucket`` at most once a minute), a 403 is explained by a one-byte GET. Without
``s3:ListBucket`` S3 answers a missing object with 403, which then reads as access denied. A
chunk is encoded into a local temp dir named for its writer and uploaded from there;
:meth:`S3Backend.collect_garbage` removes those of dead writers.

**Downloads.** The last bodies downloaded are kept in memory (:class:`BodyCache`:
:data:`BODY_CACHE_BYTES` in all, each for :data:`BODY_CACHE_SECONDS` since its last use), and a
later pin of the same object is a GET with ``If-None-Match`` on its ETag: a ``304`` serves the
kept bytes, so the chunk that a lookup judged is not downloaded again by the load that follows,
nor a hot chunk by each load.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from kvtool.engines.vllm.safeio import Stamp, in_memory
from kvtool.engines.vllm.store_backend import MODEL_DIR, QUARANTINE_DIR, SHARD_DIR, Entry
from kvtool.engines.vllm.store_s3_common import (  # noqa: F401  (re-exported)
    BODY_CACHE_BYTES,
    BODY_CACHE_SECONDS,
    CONNECT_TIMEOUT,
    MAX_ATTEMPTS,
    MAX_BACKOFF,
    NOT_FOUND_CODES,
    READ_TIMEOUT,
    TEMP_DIR_PREFIX,
    TIMEOUT_OPTIONS,
    UNSUPPORTED_CODES,
    AccessDeniedError,
    BodyCache,
    CredentialsError,
    EndpointUnavailableError,
    MissingBucketError,
    StoreError,
    client_options,
    collect_local_temps,
    error_code,
    request_error,
    worst_case_seconds,
)
from kvtool.engines.vllm.store_s3_conditional import ConditionalRequests
from kvtool.errors import KvtoolError
from kvtool.fileio import host_name

HITS_DIR = "hits"
HIT_INTERVAL = 300.0  # seconds between two hit marks of one chunk by one process
#: the bucket names botocore sends (it refuses others in a multi-line error of its own)
BUCKET_NAME = re.compile(r"^[a-zA-Z0-9.\-_]{1,255}$")
BUCKET_CHECK_INTERVAL = 60.0  # seconds between two checks that a HEAD's 404 is not the bucket's


class S3Backend(ConditionalRequests):
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
        if not BUCKET_NAME.match(bucket):  # botocore's own rule, said before any request
            raise KvtoolError(f"{url}: {bucket[:80]!r} is not a bucket name (letters, digits, "
                              "'.', '-' and '_', up to 255)")
        self.location = url.rstrip("/")
        self.bucket, self.prefix = bucket, (prefix.strip("/") + "/" if prefix.strip("/") else "")
        self.writable = writable
        session = boto3.session.Session()
        options, self.connect_timeout, self.read_timeout, self.max_attempts = client_options(
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
        self._bodies = BodyCache()  # downloaded bodies, for If-None-Match
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
        """The one-line ``OSError`` for a failed request (:func:`request_error`)."""
        error = request_error(e, self.path(name) if name else self.location, action,
                              bucket=self.bucket, endpoint=self.client.meta.endpoint_url,
                              connect_timeout=self.connect_timeout,
                              read_timeout=self.read_timeout, max_attempts=self.max_attempts)
        if isinstance(error, MissingBucketError):
            self._bucket_missing = True
        return error

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
                self._bucket_missing = error_code(e) in ("404", "NoSuchBucket", "NotFound")
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
            code = error_code(e)
            if code in NOT_FOUND_CODES:
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

        kept = self._bodies.get(name)
        args = {"Bucket": self.bucket, "Key": self._key(name)}
        try:
            got = self.client.get_object(**args, **({"IfNoneMatch": kept.etag} if kept else {}))
            data = got["Body"].read()
        except (BotoCoreError, ClientError) as e:
            if kept is None or error_code(e) not in ("304", "NotModified"):
                error = self._error(e, name, "read")
                if isinstance(error, FileNotFoundError):
                    self._bodies.drop(name)
                raise error from None
            etag, stamp, data = kept.etag, kept.stamp, kept.data  # unchanged: the kept bytes
        else:
            etag = got["ETag"]
            stamp = _stamp(etag, len(data), got["LastModified"].timestamp())
            self._bodies.put(name, etag, stamp, data)
        self._bucket_found()
        with self._lock:
            self._etags[name] = (stamp, etag)
        return self._pinned(data, name, stamp)

    @contextlib.contextmanager
    def _pinned(self, data: bytes, name: str, stamp: Stamp) -> Iterator[tuple[str, Stamp]]:
        with in_memory(data, self.path(name)) as path:
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
    def write_new(self, name: str, encode: Callable[[str], int],
                  replace: Stamp | None = None) -> int:
        """Encode into a local temp dir (named for this process, see
        :func:`collect_local_temps`), then one ``PutObject`` with ``If-None-Match: *``;
        0 if the object exists already (checked first, to skip the encoding). ``replace``:
        the stamp of the object this one supersedes, overwritten by a ``PutObject`` with
        ``If-Match`` its ETag (the chunk never goes missing); 0 if the object changed since."""
        etag = None
        if replace is not None:
            with self._lock:
                known = self._etags.get(name)
            if known is None or known[0] != replace:
                return 0  # not the object this process judged
            etag = known[1]
        elif self.exists(name):
            return 0
        tmp = tempfile.mkdtemp(prefix=f"{TEMP_DIR_PREFIX}{host_name()}.{os.getpid()}.")
        try:
            path = os.path.join(tmp, name.rsplit("/", 1)[-1])
            encode(path)
            with open(path, "rb") as f:
                data = f.read()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if etag is None:
            return len(data) if self._put(name, data, create=True) else 0
        if not self._put_over(name, data, etag):
            return 0
        with self._lock:
            self._etags.pop(name, None)
        self._bodies.drop(name)
        return len(data)

    def write_small(self, name: str, data: bytes) -> None:
        self._put(name, data)

    def quarantine(self, name: str, dest: str, stamp: Stamp | None) -> bool:
        """Copy to ``quarantine/dest`` (if the ETag still matches), then delete the original
        only if its ETag is still the one judged: a rewritten object is left alone."""
        from botocore.exceptions import BotoCoreError, ClientError

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
        if not self._delete_if_match(name, etag, "quarantine"):
            return False  # rewritten (or removed) meanwhile: judge the new one afresh
        with self._lock:
            self._etags.pop(name, None)
        self._bodies.drop(name)
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

    def remove(self, name: str, stamp: Stamp | None = None) -> int | None:
        """Delete a chunk and its hit marker; its size, or None if it was not there, or, given
        the ``stamp`` of the object judged, if its ETag is no longer the one judged (any other
        failure is raised)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            head = self._head(name, "remove")
        except FileNotFoundError:
            return None
        if stamp is not None:
            with self._lock:
                known = self._etags.get(name)
            if known is None or known[0] != stamp or not self._delete_if_match(name, known[1]):
                return None
        else:
            try:
                self.client.delete_object(Bucket=self.bucket, Key=self._key(name))
            except (BotoCoreError, ClientError) as e:
                raise self._error(e, name, "remove") from None
        self._bodies.drop(name)
        with contextlib.suppress(BotoCoreError, ClientError):
            self.client.delete_object(Bucket=self.bucket, Key=self._key(_hit_name(name)))
        return int(head["ContentLength"])

    def collect_garbage(self, model: str) -> tuple[int, int]:
        """No temp objects in the bucket (single PUTs); the local temp dirs of dead writers
        (:func:`collect_local_temps`). (files, bytes) removed."""
        return collect_local_temps()

    def root_names(self) -> list[str]:
        """The first components of the names under the prefix, sorted (of the first 1,000
        objects listed)."""
        return sorted({obj["Key"][len(self.prefix):].split("/", 1)[0]
                       for _, obj in zip(range(1000), self._list(""), strict=False)})

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
            if isinstance(error, FileNotFoundError):  # a listing has no object to miss
                raise KvtoolError(f"no store at {self.location}: "
                                  f"{self.client.meta.endpoint_url} answered a listing of "
                                  f"bucket {self.bucket} with a bare 404 (no such bucket, or "
                                  "not an S3 endpoint)") from None
            raise KvtoolError(error.strerror or str(error)) from None
        self._bucket_found()


def _chunk_id(name: str) -> str:
    """``<model>/<key>`` of a chunk name ``<model>/<xx>/<key>.kvz``."""
    parts = name.split("/")
    return f"{parts[0]}/{parts[-1].removesuffix('.kvz')}"


def _hit_name(name: str) -> str:
    return f"{HITS_DIR}/{_chunk_id(name)}"


def _stamp(etag: str, size: int, mtime: float) -> Stamp:
    digest = hashlib.sha256(etag.encode()).digest()
    return int.from_bytes(digest[:8], "little"), int(size), int(mtime * 1e9)

