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
the bytes it judged. There are no temp objects: nothing is left behind by a killed writer.

**Last hits (LRU).** S3 has no access time. A load served from chunk ``<model>/<xx>/<key>.kvz``
PUTs an empty marker ``hits/<model>/<key>``, whose ``LastModified`` is the hit time; at most
one marker PUT per chunk per :data:`HIT_INTERVAL` seconds per process, and none from a
read-only store (``kv_consumer``). ``kvtool store`` lists ``hits/`` together with the chunks
(one listing) and takes a chunk's last hit as the later of its write and its marker; pruning
removes the marker with the chunk. Times are the server's, at one-second resolution.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from kvtool.engines.vllm.safeio import Stamp, pinned
from kvtool.engines.vllm.store_backend import MODEL_DIR, QUARANTINE_DIR, SHARD_DIR, Entry
from kvtool.errors import KvtoolError

HITS_DIR = "hits"
HIT_INTERVAL = 300.0  # seconds between two hit marks of one chunk by one process
_UNSUPPORTED = {"NotImplemented", "InvalidArgument", "InvalidRequest"}  # conditional headers


class S3Backend:
    """A prefix store under ``s3://bucket/prefix``; see the module docstring.
    ``storage_options``: keyword arguments of ``boto3.client("s3", ...)`` (``endpoint_url``,
    ``region_name``, ``aws_access_key_id``, ...), over the standard environment."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *,
                 writable: bool = True):
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise KvtoolError(f"{url}: an S3 store needs boto3: pip install 'kvtool[s3]'"
                              ) from None
        bucket, _, prefix = url[len("s3://"):].partition("/")
        if not bucket:
            raise KvtoolError(f"{url}: no bucket name (expected s3://bucket/prefix)")
        self.location = url.rstrip("/")
        self.bucket, self.prefix = bucket, (prefix.strip("/") + "/" if prefix.strip("/") else "")
        self.writable = writable
        options = dict(storage_options or {})
        config = Config(retries={"max_attempts": 5, "mode": "standard"},
                        max_pool_connections=16)
        self.client = boto3.session.Session().client("s3", config=config, **options)
        self._etags: dict[str, tuple[Stamp, str]] = {}  # name → (stamp, ETag) as last pinned
        self._hits: dict[str, float] = {}  # name → when this process last marked a hit
        self._lock = threading.Lock()

    # -- names ---------------------------------------------------------------------------------
    def path(self, name: str) -> str:
        return f"{self.location}/{name}"

    def _key(self, name: str) -> str:
        return self.prefix + name

    def _error(self, e: Exception, name: str, action: str) -> OSError:
        """An ``OSError`` for a failed request (``FileNotFoundError`` for a missing key)."""
        code = getattr(e, "response", {}).get("Error", {}).get("Code", "")
        where = self.path(name)
        if code in ("NoSuchKey", "404", "NotFound"):
            return FileNotFoundError(errno.ENOENT, f"{where}: no such object")
        if code in ("AccessDenied", "403", "Forbidden"):
            return PermissionError(errno.EACCES, f"cannot {action} {where}: access denied")
        return OSError(errno.EIO, f"cannot {action} {where}: {code or type(e).__name__}: {e}")

    # -- reading -------------------------------------------------------------------------------
    def pin(self, name: str) -> contextlib.AbstractContextManager[tuple[str, Stamp]]:
        """Download the object whole into an anonymous file; ``(path to read it, stamp)``."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            got = self.client.get_object(Bucket=self.bucket, Key=self._key(name))
            data = got["Body"].read()
        except (BotoCoreError, ClientError) as e:
            raise self._error(e, name, "read") from None
        stamp = _stamp(got["ETag"], len(data), got["LastModified"].timestamp())
        with self._lock:
            self._etags[name] = (stamp, got["ETag"])
        return self._pinned(data, name, stamp)

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
        """The object's stamp from a HEAD (None if it cannot be told: then it is pinned)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(name))
        except (BotoCoreError, ClientError) as e:
            if isinstance(self._error(e, name, "read"), FileNotFoundError):
                raise FileNotFoundError(errno.ENOENT, f"{self.path(name)}: no such object"
                                        ) from None
            return None
        return _stamp(head["ETag"], int(head["ContentLength"]),
                      head["LastModified"].timestamp())

    def exists(self, name: str) -> bool:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(name))
            return True
        except (BotoCoreError, ClientError):
            return False

    def read_small(self, name: str) -> bytes | None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"].read()
        except (BotoCoreError, ClientError):
            return None

    # -- writing -------------------------------------------------------------------------------
    def write_new(self, name: str, encode: Callable[[str], int]) -> int:
        """Encode into a local temp file, then one ``PutObject`` with ``If-None-Match: *``;
        0 if the object exists already (checked first, to skip the encoding)."""
        if self.exists(name):
            return 0
        with tempfile.TemporaryDirectory(prefix="kvtool-s3-") as tmp:
            path = os.path.join(tmp, name.rsplit("/", 1)[-1])
            encode(path)
            with open(path, "rb") as f:
                data = f.read()
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
            code = getattr(e, "response", {}).get("Error", {}).get("Code", "")
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
            code = getattr(e, "response", {}).get("Error", {}).get("Code", "")
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
        """Delete a chunk and its hit marker; its size, or None if it was not there."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(name))
            self.client.delete_object(Bucket=self.bucket, Key=self._key(name))
        except (BotoCoreError, ClientError):
            return None
        with contextlib.suppress(BotoCoreError, ClientError):
            self.client.delete_object(Bucket=self.bucket, Key=self._key(_hit_name(name)))
        return int(head["ContentLength"])

    def collect_garbage(self, model: str) -> tuple[int, int]:
        return 0, 0  # single PUTs leave no temp objects behind

    def check(self) -> None:
        """A :class:`KvtoolError` unless the bucket can be reached."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            if code in ("404", "NoSuchBucket", "NotFound"):
                raise KvtoolError(f"no store at {self.location}: the bucket {self.bucket} "
                                  "does not exist") from None
            raise KvtoolError(f"cannot reach {self.location}: {code}: {e}") from None
        except BotoCoreError as e:
            raise KvtoolError(f"cannot reach {self.location}: {e} (check AWS_ENDPOINT_URL "
                              "and credentials)") from None


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

