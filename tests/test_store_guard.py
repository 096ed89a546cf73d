"""The store never blocks the engine (kvtool.engines.vllm.guard): deadlines on lookups and
chunk reads, a breaker that skips a dead store and probes it again, failures counted by kind;
and compiled kernels that leave the caller's OpenMP settings alone."""

from __future__ import annotations

import errno
import subprocess
import sys
import threading
import time
import weakref

import pytest

from kvtool.engines.vllm.common import stats
from kvtool.engines.vllm.guard import StoreGuard, StoreUnavailable, is_down


class SlowStore:
    """A lookup that validates ``fast`` chunks quickly, then hangs until released."""

    def __init__(self, fast: int):
        self.fast = fast
        self.release = threading.Event()

    def lookup(self, ids, limit, *, found, deadline):
        for i in range(self.fast):
            found.append(i)
        self.release.wait(30)
        return list(found)


def test_a_hung_lookup_is_a_partial_hit_within_its_deadline_then_skipped():
    guard = StoreGuard("s3://bucket/x", timeout=0.3, backoff=0.5)
    store = SlowStore(fast=2)
    before = stats()
    t0 = time.monotonic()
    assert guard.lookup(store.lookup, [1, 2, 3], 2) == [0, 1]  # what it had validated
    assert time.monotonic() - t0 < 1.0
    assert guard.is_down
    assert stats()["lookup_timeouts"] == before["lookup_timeouts"] + 1
    t0 = time.monotonic()  # while down: at once, counted as unavailable, nothing submitted
    assert guard.lookup(store.lookup, [1], 1) == []
    assert time.monotonic() - t0 < 0.2  # not its 0.3 s deadline
    assert stats()["store_unavailable"] == before["store_unavailable"] + 1
    store.release.set()
    time.sleep(0.6)  # past the backoff: the next call probes the store and it answers
    assert not guard.is_down
    assert guard.lookup(lambda *a, found, deadline: [7], [1], 1) == [7]
    assert guard._backoff == guard.base_backoff  # recovered: the backoff resets
    guard.shutdown()


def test_reads_time_out_and_an_unreachable_store_opens_the_breaker():
    guard = StoreGuard("/mnt/nfs/store", timeout=0.2, backoff=60)
    release = threading.Event()
    before = stats()
    with pytest.raises(StoreUnavailable, match="no answer to a load within 0.2 s"):
        guard.call("load", release.wait, 30)
    assert stats()["load_timeouts"] == before["load_timeouts"] + 1
    with pytest.raises(StoreUnavailable, match="skipped while it recovers"):
        guard.call("load", lambda: 1)
    release.set()

    other = StoreGuard("s3://b", timeout=5, backoff=60)

    def refused():
        raise ConnectionRefusedError(errno.ECONNREFUSED, "connection refused")

    with pytest.raises(ConnectionRefusedError):
        other.call("load", refused)
    assert other.is_down  # an unreachable endpoint, not a bad file: skipped for a while

    def damaged():
        raise ValueError("it is damaged")

    third = StoreGuard("s3://c", timeout=5)
    with pytest.raises(ValueError):
        third.call("load", damaged)
    assert not third.is_down  # one bad file says nothing about the store
    assert third.call("load", lambda: 42) == 42
    for g in (guard, other, third):
        g.shutdown()


def test_every_thread_stuck_means_skip_not_queue():
    guard = StoreGuard("s3://b", timeout=0.4, backoff=0.01, threads=2)
    release = threading.Event()
    for _ in range(2):
        with pytest.raises(StoreUnavailable):
            guard.call("load", release.wait, 30)
        time.sleep(0.05)  # past the backoff, but both threads are still taken
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match="every store thread"):
        guard.call("load", lambda: 1)
    assert time.monotonic() - t0 < 0.2  # not its 0.4 s timeout
    release.set()
    time.sleep(0.1)
    assert guard.call("load", lambda: 1) == 1
    guard.shutdown()


def test_is_down_tells_the_store_from_a_file():
    assert is_down(TimeoutError()) and is_down(OSError(errno.ETIMEDOUT, "x"))
    assert not is_down(FileNotFoundError(errno.ENOENT, "x"))
    assert not is_down(PermissionError(errno.EACCES, "x"))


def test_store_timeout_option_is_checked():
    from kvtool.engines.vllm.common import budget_options, store_timeout
    from kvtool.engines.vllm.options import check_extra
    from kvtool.errors import KvtoolError

    assert store_timeout({}) == 1.0 and store_timeout({"store_timeout": "2.5"}) == 2.5
    for bad in ("soon", 0, -1, float("nan")):
        with pytest.raises(KvtoolError, match="store_timeout"):
            store_timeout({"store_timeout": bad})
    check_extra({"store_timeout": 1, "quarantine_max_bytes": "1G", "quarantine_max_age": "2d"})
    assert budget_options({"max_bytes": "1MB", "quarantine_max_age": "1h"}) == {
        "max_bytes": 1_000_000, "quarantine_age": 3600.0}
    with pytest.raises(KvtoolError, match="quarantine_max_bytes"):
        budget_options({"quarantine_max_bytes": "lots"})
    for tiny in ("0", "0GB", 0, "999KB"):  # a bound that evicts every chunk as written
        with pytest.raises(KvtoolError, match="max_bytes: .* 1MB or more"):
            budget_options({"max_bytes": tiny})
    with pytest.raises(KvtoolError, match="store_timeout"):
        store_timeout({"store_timeout": 1e-300})


# -- compiled kernels and the caller's threads ----------------------------------------------------
THREADS_SCRIPT = r"""
import ctypes, threading, numpy as np, torch
torch.set_num_threads(1)                      # what vLLM's CPU worker does on a small machine
gomp = ctypes.CDLL("libgomp.so.1")            # the one torch (and vLLM's kernels) use
from kvtool.engines.vllm.common import policy_from_extra
from kvtool.kernels import cpu_kernels
from kvtool.presets import PRESETS, preset_policy
assert cpu_kernels() is not None, "compiled kernels inactive"
x = torch.randn(1, 3, 300, 64)
seen = []
def run():
    for name in [*PRESETS, None]:
        policy = preset_policy(name) if name else policy_from_extra({"codec": "turbo3"})
        for codec in (policy.key, policy.value):
            codec.decode(codec.encode(x), "bfloat16")
        seen.append((torch.get_num_threads(), gomp.omp_get_max_threads(),
                     gomp.omp_get_max_active_levels()))
levels = gomp.omp_get_max_active_levels()
run()                                          # on this (the engine's) thread
t = threading.Thread(target=run); t.start(); t.join()   # and on another (the saver)
run()
print(set(seen), levels)
assert set(seen) == {(1, 1, levels)}, seen
"""


def test_compiled_kernels_leave_the_callers_openmp_threads_alone():
    """numba's OpenMP layer used to set the calling thread's OpenMP thread count (shared with
    torch through one libgomp) on its first parallel call, which made vLLM's CPU attention
    abort after a store load. A fresh process, as numba starts its layer once per process."""
    pytest.importorskip("numba")
    out = subprocess.run([sys.executable, "-c", THREADS_SCRIPT], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]


# -- the saver: room before each write, a full disk, a dead store -------------------------------
def _store_and_budget(tmp_path, max_bytes):
    from kvtool.engines.vllm.common import policy_from_extra
    from kvtool.engines.vllm.store import PrefixStore
    from kvtool.engines.vllm.store_budget import StoreBudget

    store = PrefixStore(tmp_path / "store", {"fingerprint": "a" * 64, "name": "t"}, 16,
                        policy_from_extra({"codec": "turbo3"}))
    return store, StoreBudget(store.backend, max_bytes)


def _chunk_kv(seed):
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(seed)
    return ([torch.randn(2, 16, 64, generator=gen) for _ in range(3)],
            [torch.randn(2, 16, 64, generator=gen) for _ in range(3)])


def test_writes_keep_the_store_under_max_bytes_at_every_step(tmp_path):
    from kvtool.engines.vllm.saver import write_chunks
    from kvtool.engines.vllm.store_admin import scan

    store, budget = _store_and_budget(tmp_path, 20_000)
    sizes = []
    for i in range(12):  # each prompt: 2 chunks of its own
        ids = list(range(1000 * i, 1000 * i + 32))
        copies = [(c, *_chunk_kv(i * 2 + j)) for j, c in enumerate(store.chunks(ids))]
        assert write_chunks(store, budget, copies, ids) > 0
        sizes.append(scan(store.backend).total_bytes)
    assert max(sizes) <= 20_000 and min(sizes[3:]) > 10_000, sizes  # bounded, and used


def test_saves_are_dropped_not_written_while_a_failed_scan_backs_off(tmp_path, monkeypatch):
    """The S3 soak at 2.6 x max_bytes: a scan failed while the store was unreachable, the
    budget backed off for a minute, and every write meanwhile passed unbounded. Now a write
    that would pass max_bytes during the back-off is dropped (``saves_dropped``); after it,
    room is made and writes go on."""
    from kvtool.engines.vllm import store_admin
    from kvtool.engines.vllm.saver import write_chunks
    from kvtool.engines.vllm.store_admin import scan

    store, budget = _store_and_budget(tmp_path, 20_000)
    for i in range(6):  # fill the store up to its bound
        ids = list(range(1000 * i, 1000 * i + 32))
        write_chunks(store, budget, [(c, *_chunk_kv(i * 2 + j))
                                     for j, c in enumerate(store.chunks(ids))], ids)
    real_scan = store_admin.scan

    def unreachable(*args, **kwargs):
        raise OSError("endpoint did not answer")

    monkeypatch.setattr(store_admin, "scan", unreachable)
    budget._estimate = 20_000  # as full as it gets: the next write needs a scan
    before = stats()
    ids = list(range(9000, 9016))
    assert write_chunks(store, budget, [(store.chunks(ids)[0], *_chunk_kv(50))], ids) == 0
    monkeypatch.setattr(store_admin, "scan", real_scan)  # the store answers again
    for i in range(10):
        ids = list(range(10_000 + 100 * i, 10_000 + 100 * i + 16))
        assert write_chunks(store, budget, [(store.chunks(ids)[0], *_chunk_kv(60 + i))],
                            ids) == 0
    assert stats()["saves_dropped"] == before["saves_dropped"] + 11
    assert scan(store.backend).total_bytes <= 20_000
    budget._backoff_until = 0  # the back-off is over: room is made again
    ids = list(range(20_000, 20_016))
    assert write_chunks(store, budget, [(store.chunks(ids)[0], *_chunk_kv(99))], ids) > 0
    assert scan(store.backend).total_bytes <= 20_000


def test_a_full_disk_makes_room_and_retries_once(tmp_path, monkeypatch):
    from kvtool.engines.vllm.saver import write_chunks
    from kvtool.engines.vllm.store_admin import scan

    store, budget = _store_and_budget(tmp_path, None)
    old = list(range(500, 532))
    write_chunks(store, budget, [(c, *_chunk_kv(1)) for c in store.chunks(old)], old)
    real, calls = store.write, []

    def full_once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args)

    monkeypatch.setattr(store, "write", full_once)
    before = stats()
    ids = list(range(16))
    chunk = store.chunks(ids)[0]
    assert write_chunks(store, budget, [(chunk, *_chunk_kv(2))], ids) > 0
    assert len(calls) == 2 and store.exists(chunk)
    assert stats()["disk_full"] == before["disk_full"] + 1
    assert stats()["save_failures"] == before["save_failures"]
    assert len(scan(store.backend).chunks) < 3  # old chunks made room

    def always_full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "write", always_full)
    ids = list(range(100, 116))
    assert write_chunks(store, budget, [(store.chunks(ids)[0], *_chunk_kv(3))], ids) == 0
    assert stats()["save_failures"] == before["save_failures"] + 1  # one retry, then a miss


def test_a_dead_store_met_by_a_save_drops_saves_for_a_while(tmp_path, monkeypatch):
    from kvtool.engines.vllm.saver import write_chunks

    store, budget = _store_and_budget(tmp_path, None)
    guard = StoreGuard(str(store.root), timeout=1, backoff=60)

    def unreachable(*args):
        raise ConnectionRefusedError(errno.ECONNREFUSED, "endpoint unreachable")

    monkeypatch.setattr(store, "write", unreachable)
    ids = list(range(16))
    write_chunks(store, budget, [(store.chunks(ids)[0], *_chunk_kv(0))], ids, guard)
    assert guard.is_down  # the connector then drops saves instead of queueing them
    guard.shutdown()


def test_a_drained_save_queue_hands_its_memory_back_after_the_copies_are_gone(monkeypatch):
    from kvtool.engines.vllm import common

    alive = []  # whether the last save's copy still existed when the trim ran

    class Copy:
        pass

    copy = Copy()
    ref = weakref.ref(copy)
    monkeypatch.setattr(common, "release_freed_memory", lambda: alive.append(ref() is not None))
    release = threading.Event()
    futures = [common.submit(lambda c: release.wait(10), copy, bounded=True,
                             nbytes=common.TRIM_AFTER_BYTES)]
    del copy
    futures.append(common.submit(lambda: None, bounded=True, nbytes=1))
    release.set()
    assert common.flush(10)
    common.submit(lambda: None).result(10)  # the trim was queued behind the last save
    assert alive == [False]
    # a queue that never held much does not trim
    common.submit(lambda: None, bounded=True, nbytes=1).result(10)
    common.submit(lambda: None).result(10)
    assert alive == [False]


def test_release_freed_memory_returns_a_fragmented_heap_to_the_os():
    # 300 MB of ~100 KB blocks (the size of a queued chunk's layer), every tenth kept: glibc
    # cannot shrink the heap from its top, so the freed blocks stay resident until a trim
    code = """
import numpy as np
from pathlib import Path
from kvtool.engines.vllm.common import release_freed_memory

def anon():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

blocks = [np.ones(100_000, np.uint8) for _ in range(3000)]
kept = blocks[::10]
del blocks
before = anon()
assert release_freed_memory()
print(before - anon())
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert int(run.stdout) > 150e6, run.stdout


def test_a_chunk_that_cannot_be_written_is_warned_of_once_and_counted_each_time(caplog):
    """A directory in a chunk's place failed the write at every request of that prefix, with a
    warning each time."""
    import logging
    from types import SimpleNamespace

    from kvtool.engines.vllm.saver import save_failed

    chunk = SimpleNamespace(path=f"/store/m/ab/{time.time_ns()}.kvz")
    before = stats()["save_failures"]
    with caplog.at_level(logging.WARNING, logger="kvtool.vllm"):
        for _ in range(3):
            save_failed(chunk, IsADirectoryError(errno.EISDIR, "Is a directory"))
        save_failed(chunk, PermissionError(errno.EACCES, "Permission denied"))
    assert stats()["save_failures"] == before + 4
    assert caplog.text.count("cannot write") == 2 and "said once for this chunk" in caplog.text
