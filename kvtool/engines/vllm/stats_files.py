"""Store activity kept in the store: one JSON file per server process under ``<root>/stats/``.

Nothing here imports vLLM (``kvtool store stats`` reads a store at rest without it).

* **Writing** (:class:`StatsWriter`): each process that writes to a store keeps one file,
  ``stats/<host>-<pid>-<nonce>.json``, with its :func:`~kvtool.engines.vllm.activity.totals`
  since it opened the store. It is replaced atomically every ``interval`` seconds while they
  change, at least every :data:`HEARTBEAT` seconds while the process lives (``updated``), and
  at exit with ``"ended": true``. No two processes share a file, so servers never race.
* **Reading** (:func:`store_activity`): the sum of :data:`FOLDED` and every process file.
* **Folding** (:func:`fold_ended`, run by ``kvtool store prune``): the files of ended
  processes (``ended``, or not updated for :data:`STALE` seconds: killed, or their host lost)
  are added into :data:`FOLDED` and removed, so a store whose servers restart often keeps a
  few files, not one per start. ``FOLDED`` names the files it holds (with their ``updated``)
  until they are gone, so a fold cut short, or two at once, never count a file twice; a writer
  whose file was folded while it lived (its heartbeats failed for an hour) notices the file
  gone and continues in a new one from what was folded.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import secrets
import stat
import threading
import time
from collections.abc import Iterator
from typing import Any

from kvtool.engines.vllm.activity import counter_keys, minus, totals
from kvtool.engines.vllm.common import log
from kvtool.engines.vllm.store_backend import Backend, is_url, open_backend

STATS_DIR = "stats"
FOLDED = "folded.json"  # in STATS_DIR: the totals of ended processes
MAX_STATS_FILE = 1 << 20
HEARTBEAT = 600.0  # a live writer rewrites its file at least this often (seconds)
STALE = 3600.0  # a process file not updated for this long is an ended process's
LEGACY_STALE = 30 * 86400.0  # the same for files of writers before heartbeats


# -- writing --------------------------------------------------------------------------------------
class StatsWriter:
    """Keeps ``<root>/stats/<host>-<pid>-<nonce>.json`` up to date for this process, through
    the store's backend (a directory or an object store)."""

    def __init__(self, store: Any, policy: str, lossy: bool, interval: float = 5.0):
        from kvtool.fileio import host_name

        self.root = str(store.root)
        self.backend: Backend = getattr(store, "backend", None) or open_backend(self.root)
        self.interval, self.local = interval, not is_url(self.root)
        self.name = _process_file_name()
        self.head = {"host": host_name(), "pid": os.getpid(), "started": time.time(),
                     "policy": policy, "lossy": lossy, "heartbeat": HEARTBEAT}
        self._base = totals()
        self._written: dict[str, float] | None = None
        self._written_at = 0.0  # time.monotonic() of the last write that succeeded
        self._stop = threading.Event()
        self._existed = False
        self._write_lock = threading.Lock()
        if interval > 0:
            threading.Thread(target=self._run, name="kvtool-stats", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self.write() is None:
                return

    def _gone(self) -> bool:
        """Whether a local store was removed (a test's temp dir): never recreate it."""
        if not self.local:
            return False
        if os.path.isdir(self.root):
            self._existed = True
            return False
        return self._existed

    def write(self, *, ended: bool = False) -> bool | None:
        """Write the file if the counters changed since the last write, a heartbeat is due, or
        the process ends; False on failure, None when the store directory is gone."""
        with self._write_lock:
            if self._gone():
                return None
            since = time.monotonic() - self._written_at
            try:
                if self._written is not None and since > STALE / 2 and not self.backend.exists(
                        f"{STATS_DIR}/{self.name}"):
                    self._refold()
                counters = minus(totals(), self._base)
                if counters == self._written and since < HEARTBEAT and not ended:
                    return True
                data = json.dumps({**self.head, "updated": time.time(), "counters": counters,
                                   **({"ended": True} if ended else {})}, sort_keys=True)
                put_stats_file(self.backend, self.name, data.encode())
            except Exception as e:  # a full disk or a lost bucket: stats are not worth a crash
                log.debug("kvtool store: cannot write stats under %s (%s)", self.root, e)
                return False
            self._written, self._written_at = counters, time.monotonic()
            return True

    def _refold(self) -> None:
        """The file was folded while this process lived: what it held is counted in
        :data:`FOLDED`, so count from there, in a file of a new name."""
        written = self._written or {}
        self._base = {k: v + written.get(k, 0) for k, v in self._base.items()}
        self.name, self._written = _process_file_name(), None
        log.info("kvtool store: stats file folded while this server ran; continuing in %s",
                 self.name)

    def close(self) -> None:
        self._stop.set()
        self.write(ended=True)


def _process_file_name() -> str:
    from kvtool.fileio import host_name

    return f"{host_name()}-{os.getpid()}-{secrets.token_hex(3)}.json"


def put_stats_file(backend: Backend, name: str, data: bytes) -> None:
    """Replace ``stats/<name>`` atomically (in a directory, never through a symlinked
    ``stats/``)."""
    from kvtool.engines.vllm.safeio import fd_path, open_dir
    from kvtool.fileio import atomic_write

    if is_url(backend.location):
        backend.write_small(f"{STATS_DIR}/{name}", data)
        return
    dir_fd = open_dir(backend.location, [STATS_DIR], create=True)
    try:
        atomic_write(os.path.join(fd_path(dir_fd), name), lambda f: f.write(data),
                     follow_symlinks=False)
    finally:
        os.close(dir_fd)


_WRITERS: dict[str, StatsWriter] = {}
_WRITERS_LOCK = threading.Lock()


def stats_writer(store: Any, dtype: str | None, interval: float = 5.0) -> StatsWriter | None:
    """The process's writer for ``store`` (a :class:`~kvtool.engines.vllm.store.PrefixStore`;
    one writer per store location, however many connectors of this process use it); None when
    ``interval`` is 0."""
    if interval <= 0:
        return None
    root = str(store.root)
    key = root if is_url(root) else os.path.realpath(root)
    with _WRITERS_LOCK:  # not activity's lock: a new writer reads the totals
        if key not in _WRITERS:
            if not _WRITERS:
                atexit.register(close_writers)
            _WRITERS[key] = StatsWriter(store, store.policy.describe(),
                                        store.policy.is_lossy(dtype), interval)
        return _WRITERS[key]


def close_writers() -> None:
    for writer in list(_WRITERS.values()):
        writer.close()


# -- reading --------------------------------------------------------------------------------------
def store_activity(root: str | os.PathLike) -> dict[str, Any]:
    """The sum of :data:`FOLDED` and every process's counters in ``<root>/stats/``
    (JSON-ready): ``processes`` (those counted, folded ones included), ``folded`` (of which
    folded), ``counters``, ``policies`` (labels seen, with ``lossy``), ``last_update``,
    ``unreadable`` (files skipped). ``root`` is a directory (symlinks and non-regular files
    are never read) or an ``s3://`` URL."""
    out: dict[str, Any] = {"processes": 0, "folded": 0,
                           "counters": dict.fromkeys(counter_keys(), 0), "policies": {},
                           "last_update": None, "unreadable": 0}
    folded_blob, files = _stats_files(os.fspath(root))
    folded = _parse_folded(folded_blob) if folded_blob is not None else _empty_folded()
    if folded is None:
        out["unreadable"] += 1
        folded = _empty_folded()
    _add(out, folded["counters"], folded["policies"], folded["last_update"])
    out["processes"] = out["folded"] = folded["processes"]
    for name, blob in files:
        data = _parse_process(blob)
        if data is None:
            out["unreadable"] += 1
        elif not _already_folded(folded, name, data):
            out["processes"] += 1
            _add(out, data["counters"], {data["policy"]: data["lossy"]}, data["updated"])
    out["counters"] = {k: int(v) if float(v).is_integer() else v
                       for k, v in out["counters"].items()}
    return out


def _add(into: dict[str, Any], counters: dict[str, float], policies: dict[str, bool],
         updated: float | None) -> None:
    for k, v in counters.items():
        into["counters"][k] = into["counters"].get(k, 0) + v
    into["policies"].update({p: lossy for p, lossy in policies.items() if p})
    if updated is not None:
        into["last_update"] = max(into["last_update"] or 0, updated)


def _stats_files(root: str) -> tuple[bytes | None, list[tuple[str, bytes | None]]]:
    """(:data:`FOLDED`'s contents or None, [(name, contents) of each process file]); a file
    that must not be read (a symlink, a special file, over :data:`MAX_STATS_FILE`) has None
    as contents, and an absent FOLDED is None too."""
    folded, files = None, []
    for name, blob in _stats_blobs(root):
        if name == FOLDED:
            folded = blob if blob is not None else b"<not a regular file>"
        else:
            files.append((name, blob))
    return folded, files


def _stats_blobs(root: str) -> Iterator[tuple[str, bytes | None]]:
    if is_url(root):
        backend = open_backend(root, writable=False)  # an S3Backend: it lists by prefix
        for name, size in backend.list_names(f"{STATS_DIR}/"):
            if name.endswith(".json") and "/" not in name[len(STATS_DIR) + 1:]:
                blob = backend.read_small(name) if size <= MAX_STATS_FILE else None
                yield name[len(STATS_DIR) + 1:], blob
        return
    with contextlib.suppress(OSError), os.scandir(os.path.join(root, STATS_DIR)) as it:
        for e in it:
            if not e.name.endswith(".json"):
                continue
            try:
                st = e.stat(follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_STATS_FILE:
                    yield e.name, None
                    continue
                with open(e.path, "rb") as f:
                    yield e.name, f.read(MAX_STATS_FILE)
            except OSError:
                yield e.name, None


def _number(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"not a number: {v!r}")
    return float(v)


def _parse_process(blob: bytes | None) -> dict[str, Any] | None:
    """A process file's ``counters``, ``policy``, ``lossy``, ``updated``, ``ended``,
    ``heartbeat`` (None if it is not one)."""
    try:
        if blob is None:
            raise ValueError("not a regular file of stats")
        data = json.loads(blob)
        updated = data.get("updated")
        return {"counters": {str(k): _number(v) for k, v in data["counters"].items()},
                "policy": data.get("policy") if isinstance(data.get("policy"), str) else "",
                "lossy": bool(data.get("lossy")),
                "updated": _number(updated) if updated is not None else None,
                "ended": data.get("ended") is True,
                "heartbeat": isinstance(data.get("heartbeat"), (int, float))}
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _empty_folded() -> dict[str, Any]:
    return {"processes": 0, "counters": {}, "policies": {}, "last_update": None, "files": {}}


def _parse_folded(blob: bytes) -> dict[str, Any] | None:
    """:data:`FOLDED`'s contents (None if damaged): what :func:`_empty_folded` holds, with
    ``files`` the folded file names still present at the last fold → their ``updated``."""
    try:
        data = json.loads(blob)
        if data.get("kind") != "kvtool-folded-stats":
            raise ValueError("not a folded stats file")
        last = data.get("last_update")
        processes = data["processes"]
        if isinstance(processes, bool) or not isinstance(processes, int) or processes < 0:
            raise ValueError("bad process count")
        return {"processes": processes,
                "counters": {str(k): _number(v) for k, v in data["counters"].items()},
                "policies": {str(k): bool(v) for k, v in data["policies"].items()},
                "last_update": _number(last) if last is not None else None,
                "files": {str(k): _number(v) for k, v in data["files"].items()}}
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _already_folded(folded: dict[str, Any], name: str, data: dict[str, Any]) -> bool:
    """Whether FOLDED counts this version of the file (or a later one) already."""
    at = folded["files"].get(name)
    return at is not None and (data["updated"] or 0) <= at


# -- folding --------------------------------------------------------------------------------------
def fold_ended(backend: Backend, *, now: float | None = None,
               dry_run: bool = False) -> tuple[int, int]:
    """Add the files of ended processes into :data:`FOLDED` and remove them: (files, bytes)
    (with ``dry_run``: those it would fold, changing nothing). A damaged ``FOLDED`` is a
    :class:`~kvtool.errors.KvtoolError`: it is never overwritten."""
    from kvtool.errors import KvtoolError

    now = time.time() if now is None else now
    blob, files = _stats_files(backend.location)
    folded = _parse_folded(blob) if blob is not None else _empty_folded()
    if folded is None:
        raise KvtoolError(f"{STATS_DIR}/{FOLDED} in {backend.location} is damaged: move it "
                          "aside to fold the stats of ended servers again")
    present = {name for name, _ in files}
    folded["files"] = {k: v for k, v in folded["files"].items() if k in present}
    chosen: dict[str, tuple[float, int]] = {}  # name → (updated, bytes)
    for name, file_blob in files:
        data = _parse_process(file_blob)
        if data is None or data["updated"] is None:
            continue
        stale = STALE if data["heartbeat"] else LEGACY_STALE
        if not (data["ended"] or now - data["updated"] > stale):
            continue
        chosen[name] = data["updated"], len(file_blob or b"")
        if _already_folded(folded, name, data):
            continue
        folded["processes"] += 1
        for k, v in data["counters"].items():
            folded["counters"][k] = folded["counters"].get(k, 0) + v
        if data["policy"]:
            folded["policies"][data["policy"]] = data["lossy"]
        folded["last_update"] = max(folded["last_update"] or 0, data["updated"])
        folded["files"][name] = data["updated"]
    if dry_run or not chosen:
        return len(chosen), sum(size for _, size in chosen.values())
    removed = [0, 0]
    try:
        put_stats_file(backend, FOLDED, json.dumps({"kind": "kvtool-folded-stats", **folded},
                                                   sort_keys=True).encode())
        # remove only what the FOLDED now in the store holds: another fold may have replaced it
        written = backend.read_small(f"{STATS_DIR}/{FOLDED}")
        held = (_parse_folded(written) or _empty_folded())["files"] if written else {}
        for name, (updated, _) in chosen.items():
            if held.get(name, -math.inf) >= updated:
                size = backend.remove(f"{STATS_DIR}/{name}")
                if size is not None:
                    removed[0], removed[1] = removed[0] + 1, removed[1] + size
    except OSError as e:
        raise KvtoolError(f"cannot fold the stats of ended servers in {backend.location}: "
                          f"{e.strerror or e}") from None
    return removed[0], removed[1]
