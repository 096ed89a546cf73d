"""The connector's byte budget (:class:`StoreBudget`): the store's bounds, kept after each
write and on a full disk, by the rules of :mod:`~kvtool.engines.vllm.store_admin` (the whole
store's bytes count; stale temp files are collected, then the oldest quarantined files go,
then least recently hit chunks, pinned chunks never).

The store's tools are looked up on :mod:`~kvtool.engines.vllm.store_admin` at each call
(``admin.scan``, ...), so that a tool replaced there is the one the budget uses too. Nothing
here imports vLLM.
"""

from __future__ import annotations

import os
import threading
import time

from kvtool.engines.vllm import store_admin as admin
from kvtool.engines.vllm.store_backend import Backend

GIB = 1 << 30
QUARANTINE_SHARE = 0.1  # default quarantine bound: this share of max_bytes (1 GiB without one)
QUARANTINE_AGE = 7 * 86400.0  # default: quarantined files older than this are removed
RELIEF_SHARE = 0.1  # relieve() frees this share of max_bytes (or of the store) beyond the need
FILE_MARGIN = 1.25  # expected(): room made for a chunk file, over the largest one lately


class NoRoom(Exception):
    """A write would push a store that is over ``max_bytes`` further over, and the store cannot
    be pruned now (its scan failed moments ago, or only pinned chunks are left): the write is
    dropped, not made."""


class StoreBudget:
    """The connector's store bounds, kept after its writes (:meth:`added`) and on a full disk
    (:meth:`relieve`). ``max_bytes`` (None: no bound) bounds the whole store, every model's
    chunks with the quarantine and temp files; eviction goes down to ``low_water`` of it, so
    that it runs now and then, not after every write. The quarantine is bounded by
    ``quarantine_bytes`` (default: 10% of ``max_bytes``, or 1 GiB) and ``quarantine_age``
    seconds (default: 7 days; ``math.inf``: no age bound).

    Cheap: the store's size is an estimate, counted up by the writes; the store is scanned only
    when the estimate is over ``max_bytes``, when the oldest quarantined file comes of age, and
    every :attr:`recheck` seconds (other servers write and prune too). Thread-safe."""

    recheck = 600.0  # seconds between two scans when nothing else calls for one
    backoff = 60.0  # seconds without a scan after one that could not get under the bounds

    def __init__(self, root: str | os.PathLike | Backend, max_bytes: int | None,
                 low_water: float = 0.9, quarantine_bytes: int | None = None,
                 quarantine_age: float | None = None):
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if quarantine_bytes is not None and quarantine_bytes < 0:
            raise ValueError(f"quarantine_bytes must not be negative, got {quarantine_bytes}")
        if quarantine_age is not None and quarantine_age < 0:
            raise ValueError(f"quarantine_age must not be negative, got {quarantine_age}")
        self.root, self.low_water = admin.backend_of(root), low_water
        self.max_bytes = None if max_bytes is None else int(max_bytes)
        self.quarantine_bytes = int(quarantine_bytes if quarantine_bytes is not None
                                    else QUARANTINE_SHARE * max_bytes if max_bytes is not None
                                    else GIB)
        self.quarantine_age = QUARANTINE_AGE if quarantine_age is None else quarantine_age
        self.last: dict[str, tuple[int, int]] = {}  # the last removal's (files, bytes) by kind
        self._estimate: int | None = None
        self._file_bytes = 0  # the largest chunk file lately (decaying): what a write needs
        self._next_scan = self._backoff_until = 0.0
        self._lock = threading.Lock()

    def expected(self, raw_bytes: int) -> int:
        """The size to make room for before writing a chunk of ``raw_bytes`` of K/V: the
        largest file written lately with :data:`FILE_MARGIN` to spare (a prompt's first chunk
        keeps its sink tokens raw, and compressed sizes vary with the content), at most
        ``raw_bytes``; ``raw_bytes`` before the first write (an upper bound)."""
        if not self._file_bytes:
            return int(raw_bytes)
        return min(int(raw_bytes), int(self._file_bytes * FILE_MARGIN))

    def reserve(self, nbytes: int) -> tuple[int, int]:
        """Make room for a write of about ``nbytes`` before it starts (its temp file counts):
        when the estimate plus it would pass ``max_bytes``, evict down to ``low_water`` of
        it, the write included. (files, bytes) removed. Raises :class:`NoRoom` when it would
        pass ``max_bytes`` and the store cannot be pruned: its scan fails now, or a failed or
        fruitless scan backs off (writes then would grow the store past its bound for the
        whole back-off)."""
        with self._lock:
            if self.max_bytes is None:
                return 0, 0
            if self._estimate is not None and self._estimate + nbytes <= self.max_bytes:
                return 0, 0
            if self._file_bytes > self.max_bytes:  # it would evict everything, itself next
                raise NoRoom(f"a chunk file takes ~{self._file_bytes} bytes, more than "
                             f"max_bytes {self.max_bytes}: raise the bound (--max-store-bytes)")
            now = time.time()
            if self._estimate is not None and now < self._backoff_until:
                raise NoRoom(f"the store holds ~{self._estimate} bytes, a write of ~{nbytes} "
                             f"would pass max_bytes {self.max_bytes}, and it cannot be pruned "
                             f"for {self._backoff_until - now:.0f} s")
            try:
                return self._enforce(now, incoming=nbytes)
            except Exception as e:
                self._next_scan = self._backoff_until = now + self.backoff
                if self._estimate is not None:  # by the estimate there is no room, and no scan
                    raise NoRoom(f"the store holds ~{self._estimate} bytes, a write of "
                                 f"~{nbytes} would pass max_bytes {self.max_bytes}, and it "
                                 f"cannot be scanned ({e})") from e
                raise
            except BaseException:
                self._next_scan = self._backoff_until = now + self.backoff
                raise

    def added(self, nbytes: int) -> tuple[int, int]:
        """Account for ``nbytes`` just written; enforce the bounds when a scan is due (see the
        class docstring). (files, bytes) removed: quarantined, temp and chunk files."""
        with self._lock:
            now = time.time()
            if nbytes > 0:  # one file (the connector adds each chunk)
                self._file_bytes = max(int(nbytes), int(self._file_bytes * 0.9))
            if self._estimate is not None:
                self._estimate += nbytes
            over = self.max_bytes is not None and self._estimate is not None \
                and self._estimate > self.max_bytes
            if now < self._next_scan and not (over and now >= self._backoff_until):
                return 0, 0
            try:
                return self._enforce(now)
            except BaseException:
                self._next_scan = self._backoff_until = now + self.backoff
                raise

    def relieve(self, needed: int) -> tuple[int, int]:
        """Make room after a write failed for lack of space (ENOSPC, EDQUOT), before the
        writer's one retry: stale temp files, then the oldest quarantined files, then least
        recently hit unpinned chunks, until ``needed`` bytes plus 10% of ``max_bytes`` (or of
        the store, without one) are free. (files, bytes) removed. Writes nothing."""
        with self._lock:
            found = admin.scan(self.root, missing_ok=True)
            base = self.max_bytes if self.max_bytes is not None else found.total_bytes
            want = max(0, int(needed)) + int(RELIEF_SHARE * base)
            files, freed = admin.collect_temps(found)
            self.last = {"temps": (files, freed)}
            for kind, items in (("quarantine", sorted(found.quarantine,
                                                      key=admin.quarantined_at)),
                                ("chunks", admin.eviction_order(found))):
                take, planned = [], freed
                for item in items:
                    if planned >= want:
                        break
                    take.append(item)
                    planned += item.bytes if isinstance(item, admin.StoredChunk) else item.size
                n, b = admin.remove(take, self.root)
                files, freed = files + n, freed + b
                self.last[kind] = (n, b)
            self._estimate = found.total_bytes - freed
            return files, freed

    def _enforce(self, now: float, incoming: int = 0) -> tuple[int, int]:
        """Apply every bound now; ``incoming``: bytes about to be written, counted in."""
        found = admin.scan(self.root, missing_ok=True)
        total = found.total_bytes
        aged = admin.quarantine_plan(found, max_bytes=self.quarantine_bytes,
                                     older_than=self.quarantine_age, now=now)
        q = admin.remove(aged, self.root)
        t = admin.collect_temps(found)
        c = (0, 0)
        if self.max_bytes is not None and total - q[1] - t[1] + incoming > self.max_bytes:
            other = found.quarantined_bytes - q[1] + max(0, found.temp_bytes - t[1]) + incoming
            c = admin.remove(admin.prune_plan(found,
                                              max_bytes=int(self.max_bytes * self.low_water),
                                              now=now, other_bytes=other), self.root)
        self.last = {"quarantine": q, "temps": t, "chunks": c}
        freed = q[1] + t[1] + c[1]
        self._estimate = total - freed
        self._next_scan = now + self.recheck
        gone = {e.name for e in aged}
        kept = [admin.quarantined_at(e) for e in found.quarantine if e.name not in gone]
        if kept and self.quarantine_age != float("inf"):  # when the oldest one left expires
            self._next_scan = min(self._next_scan, min(kept) + self.quarantine_age + 1)
        if self.max_bytes is not None and self._estimate > self.max_bytes:
            self._backoff_until = now + self.backoff  # pinned chunks: no use scanning again
        return q[0] + t[0] + c[0], freed
