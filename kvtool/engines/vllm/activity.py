"""Store activity: the connector's counters and latencies, for logs, Prometheus and the store.

Nothing here imports vLLM (``kvtool store stats`` reads a store at rest without it).

* **Totals** (:func:`totals`): this process's :func:`~kvtool.engines.vllm.common.stats`
  counters, plus what this module counts itself (requests and prompt tokens that hit or
  missed the store, bytes loaded, evictions) and the count and sum of load / save latencies.
* **Deltas** (:func:`drain`): what changed since the last drain, with every latency observed
  since; the connector hands them to vLLM as its ``KVConnectorStats`` (see
  :mod:`~kvtool.engines.vllm.metrics`). One drain per process takes everything once, however
  many connector halves (scheduler, worker) the process holds.
* **In the store** (:class:`StatsWriter`): each process that writes to a store keeps one JSON
  file, ``<root>/stats/<host>-<pid>-<nonce>.json``, with its totals since it opened the store,
  replaced atomically every ``interval`` seconds while they change and at exit. No two
  processes share a file, so several servers on one store never race; :func:`store_activity`
  sums every file (those of ended processes stay: they are the store's history).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import stat
import threading
import time
from collections.abc import Iterator
from typing import Any

from kvtool.engines.vllm.common import COUNTER_NAMES, log, stats

STATS_DIR = "stats"
MAX_STATS_FILE = 1 << 20
MAX_OBSERVATIONS = 4096  # latencies kept between two drains
EXTRA_NAMES = ("requests_hit", "requests_missed", "prompt_tokens_hit", "prompt_tokens_missed",
               "bytes_loaded", "chunks_evicted", "bytes_evicted")
OPS = ("lookup", "load", "save")
_EXTRA: dict[str, int] = dict.fromkeys(EXTRA_NAMES, 0)
_LATENCY: dict[str, list[float]] = {op: [0, 0.0] for op in OPS}  # count, seconds
_OBSERVED: dict[str, list[float]] = {op: [] for op in OPS}  # since the last drain
_LAST: dict[str, float] = {}
_LOCK = threading.Lock()
_POLICIES_LOGGED: set[str] = set()


def record(name: str, n: int = 1) -> None:
    """Add ``n`` to one of :data:`EXTRA_NAMES`."""
    with _LOCK:
        _EXTRA[name] += n


def observe(op: str, seconds: float) -> None:
    """One load (a request's prefix) or save (a batch of chunks) and how long it took."""
    with _LOCK:
        _LATENCY[op][0] += 1
        _LATENCY[op][1] += seconds
        if len(_OBSERVED[op]) < MAX_OBSERVATIONS:
            _OBSERVED[op].append(seconds)


def totals() -> dict[str, float]:
    """This process's counters since it started (latencies as ``<op>_count``/``<op>_seconds``)."""
    current = stats()
    out: dict[str, float] = {k: current[k] for k in COUNTER_NAMES}
    with _LOCK:
        out.update(_EXTRA)
        for op in OPS:
            out[f"{op}_count"], out[f"{op}_seconds"] = _LATENCY[op]
    return out


def _minus(now: dict[str, float], base: dict[str, float]) -> dict[str, float]:
    """``now - base`` per key; a counter below its base was reset, so it counts from zero."""
    return {k: v - base.get(k, 0) if v >= base.get(k, 0) else v for k, v in now.items()}


def drain() -> dict[str, Any] | None:
    """What changed since the last drain in this process (None: nothing): ``counters`` (the
    nonzero deltas) and ``load_seconds``/``save_seconds`` (each latency observed)."""
    global _LAST
    now = totals()
    with _LOCK:
        delta = _minus(now, _LAST)
        _LAST = now
        observed = {op: _OBSERVED[op][:] for op in OPS}
        for op in OPS:
            _OBSERVED[op].clear()
    counters = {k: v for k, v in delta.items() if v}
    if not counters and not any(observed.values()):
        return None
    return {"counters": counters, **{f"{op}_seconds": observed[op] for op in OPS}}


def lookup(request_id: str, matched: int, prompt_tokens: int, files: int,
           seconds: float, computed: int = 0) -> None:
    """Count and log a request's lookup: ``matched`` of its tokens are stored (a hit counts
    what the store holds; ``loaded_tokens`` what it loaded), ``computed`` of them already in
    vLLM's own prefix cache (not loaded); it took ``seconds``."""
    record("requests_hit" if matched else "requests_missed")
    record("prompt_tokens_hit", matched)
    record("prompt_tokens_missed", prompt_tokens - matched)
    observe("lookup", seconds)
    if matched:
        local = min(computed, matched)
        log.info("kvtool store: hit: request %s: %d of %d prompt tokens stored in %d file(s)%s, "
                 "found in %.0f ms (%s)", request_id, matched, prompt_tokens, files,
                 f", {local} of them already in vLLM's prefix cache" if local else "",
                 seconds * 1e3, summary())
    else:
        log.info("kvtool store: miss: request %s (%d prompt tokens) in %.0f ms (%s)",
                 request_id, prompt_tokens, seconds * 1e3, summary())


def file_bytes(path: str) -> int:
    """A loaded file's size (0 when it cannot be told, e.g. an object-store URL)."""
    try:
        return os.stat(path).st_size
    except (OSError, ValueError):
        return 0


def summary() -> str:
    """Running totals for log lines: hit rate and failures."""
    t = totals()
    seen = t["requests_hit"] + t["requests_missed"]
    timeouts = t["lookup_timeouts"] + t["load_timeouts"]
    return (f"{t['requests_hit']:.0f} of {seen:.0f} requests hit; failures: "
            f"{t['load_failures']:.0f} load, {t['save_failures']:.0f} save, "
            f"{t['invalid_files']:.0f} bad files"
            + (f", {timeouts:.0f} timeouts" if timeouts else ""))


def log_policy(policy: Any, dtype: str | None) -> None:
    """Say once per process and policy which policy the store uses, and if it is lossy."""
    label = policy.describe()
    if label in _POLICIES_LOGGED:
        return
    _POLICIES_LOGGED.add(label)
    if policy.is_lossy(dtype):
        log.info("kvtool store: policy %s is lossy: answers served from the store may differ "
                 "slightly from recomputing them (codec raw keeps them exact)", label)
    else:
        log.info("kvtool store: policy %s (lossless)", label)


# -- in the store -------------------------------------------------------------------------------
class StatsWriter:
    """Keeps ``<root>/stats/<host>-<pid>-<nonce>.json`` up to date for this process, through
    the store's backend (a directory or an object store)."""

    def __init__(self, store: Any, policy: str, lossy: bool, interval: float = 5.0):
        from kvtool.fileio import host_name

        self.store, self.root, self.interval = store, str(store.root), interval
        self.local = "://" not in self.root
        self.name = f"{host_name()}-{os.getpid()}-{secrets.token_hex(3)}.json"
        self.head = {"host": host_name(), "pid": os.getpid(), "started": time.time(),
                     "policy": policy, "lossy": lossy}
        self._base = totals()
        self._written: dict[str, float] | None = None
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

    def write(self) -> bool | None:
        """Write the file if the counters changed since the last write; False on failure,
        None when the store directory is gone."""
        with self._write_lock:
            if self._gone():
                return None
            counters = _minus(totals(), self._base)
            if counters == self._written:
                return True
            data = json.dumps({**self.head, "updated": time.time(), "counters": counters},
                              sort_keys=True).encode()
            try:
                self._put(data)
            except Exception as e:  # a full disk or a lost bucket: stats are not worth a crash
                log.debug("kvtool store: cannot write stats under %s (%s)", self.root, e)
                return False
            self._written = counters
            return True

    def _put(self, data: bytes) -> None:
        from kvtool.engines.vllm.safeio import fd_path, open_dir
        from kvtool.fileio import atomic_write

        name = f"{STATS_DIR}/{self.name}"
        if not self.local:
            self.store.backend.write_small(name, data)
            return
        dir_fd = open_dir(self.root, [STATS_DIR], create=True)  # never a symlinked stats/
        try:
            atomic_write(os.path.join(fd_path(dir_fd), self.name), lambda f: f.write(data),
                         follow_symlinks=False)
        finally:
            os.close(dir_fd)

    def close(self) -> None:
        self._stop.set()
        self.write()


_WRITERS: dict[str, StatsWriter] = {}
_WRITERS_LOCK = threading.Lock()


def stats_writer(store: Any, dtype: str | None, interval: float = 5.0) -> StatsWriter | None:
    """The process's writer for ``store`` (a :class:`~kvtool.engines.vllm.store.PrefixStore`;
    one writer per store location, however many connectors of this process use it); None when
    ``interval`` is 0."""
    if interval <= 0:
        return None
    root = str(store.root)
    key = root if "://" in root else os.path.realpath(root)
    with _WRITERS_LOCK:  # not _LOCK: a new writer reads the totals
        if key not in _WRITERS:
            if not _WRITERS:
                atexit.register(close_writers)
            _WRITERS[key] = StatsWriter(store, store.policy.describe(),
                                        store.policy.is_lossy(dtype), interval)
        return _WRITERS[key]


def close_writers() -> None:
    for writer in list(_WRITERS.values()):
        writer.close()


def store_activity(root: str | os.PathLike) -> dict[str, Any]:
    """The sum of every process's counters in ``<root>/stats/`` (JSON-ready): ``processes``
    (files read), ``counters``, ``policies`` (labels seen, with ``lossy``), ``last_update``,
    ``unreadable`` (files skipped). ``root`` is a directory (symlinks and non-regular files
    are never read) or an ``s3://`` URL."""
    out: dict[str, Any] = {"processes": 0, "counters": dict.fromkeys(_counter_keys(), 0),
                           "policies": {}, "last_update": None, "unreadable": 0}
    for blob in _stats_blobs(os.fspath(root)):
        try:
            if blob is None:
                raise ValueError("not a regular file of stats")
            data = json.loads(blob)
            counters = {k: float(v) for k, v in data["counters"].items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            out["unreadable"] += 1
            continue
        out["processes"] += 1
        for k, v in counters.items():
            out["counters"][k] = out["counters"].get(k, 0) + v
        if isinstance(data.get("policy"), str):
            out["policies"][data["policy"]] = bool(data.get("lossy"))
        updated = data.get("updated")
        if isinstance(updated, (int, float)):
            out["last_update"] = max(out["last_update"] or 0, updated)
    out["counters"] = {k: int(v) if float(v).is_integer() else v
                       for k, v in out["counters"].items()}
    return out


def _stats_blobs(root: str) -> Iterator[bytes | None]:
    """The contents of each ``stats/*.json`` under ``root`` (None: one that must not be read:
    a symlink, a special file, or over :data:`MAX_STATS_FILE`)."""
    from kvtool.engines.vllm.store_backend import is_url, open_backend

    if is_url(root):
        backend = open_backend(root, writable=False)  # an S3Backend: it lists by prefix
        for name, size in backend.list_names(f"{STATS_DIR}/"):
            if name.endswith(".json"):
                yield backend.read_small(name) if size <= MAX_STATS_FILE else None
        return
    with contextlib.suppress(OSError), os.scandir(os.path.join(root, STATS_DIR)) as it:
        for e in it:
            if not e.name.endswith(".json"):
                continue
            try:
                st = e.stat(follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_STATS_FILE:
                    yield None
                    continue
                with open(e.path, "rb") as f:
                    yield f.read(MAX_STATS_FILE)
            except OSError:
                yield None


def _counter_keys() -> list[str]:
    return [*COUNTER_NAMES, *EXTRA_NAMES, *(f"{op}_{x}" for op in OPS for x in ("count",
                                                                               "seconds"))]
