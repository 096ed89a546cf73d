"""A prefix store in use (issue 23): writers of one chunk racing (threads, processes), errors
that name the store's path, the connector's budget (quarantine and temp files counted, ENOSPC
relief), and ``kvtool store`` on a live store: verify during a prune, prune of temp files and
the aged quarantine, prune exit codes, a symlinked root, option names in errors."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kvtool.cli.main import cli
from kvtool.engines.vllm import safeio, store_admin
from kvtool.engines.vllm.common import policy_from_extra
from kvtool.engines.vllm.store import PrefixStore
from kvtool.engines.vllm.store_backend import LocalBackend
from kvtool.engines.vllm.store_budget import StoreBudget
from kvtool.fileio import TEMP_SUFFIX, atomic_write

CHUNK = 16
MODEL = {"fingerprint": "c" * 64, "name": "live"}
IDS = list(range(1000, 1000 + 8 * CHUNK))


def make(root) -> PrefixStore:
    return PrefixStore(root, MODEL, CHUNK, policy_from_extra({"codec": "raw"}))


def kv(seed: int = 0) -> tuple[list, list]:
    rng = np.random.default_rng(seed)
    return ([rng.standard_normal((2, CHUNK, 32)).astype(np.float32) for _ in range(2)],
            [rng.standard_normal((2, CHUNK, 32)).astype(np.float32) for _ in range(2)])


def fill(root, n: int) -> tuple[PrefixStore, list]:
    store = make(root)
    chunks = store.chunks(IDS)[:n]
    for i, c in enumerate(chunks):
        assert store.write(c, *kv(i), IDS) > 0
    return store, chunks


def set_hit(path: str, when: float) -> None:
    os.utime(path, ns=(int(when * 1e9), int(when * 1e9)))


def temps_under(root) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files
            if f.endswith(TEMP_SUFFIX)]


def stale_temp(directory, size: int, name: str = "x.kvz") -> str:
    """A temp file of a writer on another host, 7 hours old: a crash leftover."""
    path = os.path.join(directory, f".{name}.otherhost.1.abc{TEMP_SUFFIX}")
    with open(path, "wb") as f:
        f.write(b"t" * size)
    old = time.time() - 7 * 3600
    os.utime(path, (old, old))
    return path


def quarantined(root, size: int, days_ago: float, key: str = "d" * 64) -> str:
    """A quarantined file, moved aside ``days_ago`` (its name says when)."""
    os.makedirs(os.path.join(root, "quarantine"), exist_ok=True)
    when = int((time.time() - days_ago * 86400) * 1e9)
    path = os.path.join(root, "quarantine", f"{'c' * 16}-{key}.{when}.kvz")
    with open(path, "wb") as f:
        f.write(b"q" * size)
    return path


# -- A: writers of one chunk ------------------------------------------------------------------
def test_threads_writing_one_chunk_leave_one_intact_file_counted_once(tmp_path, monkeypatch):
    import kvtool.formats

    store = make(tmp_path)
    real_save = kvtool.formats.save
    barrier = threading.Barrier(4)

    def racing_save(*args, **kwargs):
        barrier.wait(timeout=20)  # every writer is past the existence check: they all encode
        return real_save(*args, **kwargs)

    monkeypatch.setattr(kvtool.formats, "save", racing_save)
    for chunk in store.chunks(IDS)[:3]:
        results: list[int] = []
        errors: list[Exception] = []

        def write(seed: int, chunk=chunk, results=results, errors=errors) -> None:
            try:
                results.append(store.write(chunk, *kv(seed), IDS))
            except Exception as e:  # pragma: no cover - the bug this test guards against
                errors.append(e)

        threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert sorted(r > 0 for r in results) == [False, False, False, True]  # counted once
        assert os.path.getsize(chunk.path) == max(results)
        assert temps_under(tmp_path) == []
        barrier.reset()
    monkeypatch.setattr(kvtool.formats, "save", real_save)
    assert store_admin.verify(store_admin.scan(tmp_path)).damaged == []
    assert len(store.lookup(IDS)) == 3


WRITER = """
import os, sys, time
from kvtool.engines.vllm.store_backend import LocalBackend
from kvtool.engines.vllm.store_budget import StoreBudget
from kvtool.fileio import atomic_write

root, name, sync, fill = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].encode()

def encode(path):
    open(os.path.join(sync, str(os.getpid())), "w").close()
    deadline = time.monotonic() + 20
    while len(os.listdir(sync)) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    return atomic_write(path, lambda f: f.write(fill * 200_000))

print(LocalBackend(root).write_new(name, encode))
"""


def test_processes_writing_one_chunk_leave_one_intact_file_counted_once(tmp_path):
    root, sync = tmp_path / "store", tmp_path / "sync"
    sync.mkdir()
    name = f"{'c' * 16}/ab/{'ab' * 32}.kvz"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(root), name, str(sync), fill],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for fill in "AB"]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    results = sorted(int(out) for out, _ in outs)
    assert results == [0, 200_000]
    data = (root / name).read_bytes()
    assert data in (b"A" * 200_000, b"B" * 200_000)  # one writer's file, whole
    assert temps_under(root) == []


@pytest.mark.parametrize("mode", ["link", "renameat2", "checked rename"])
def test_publish_never_replaces_a_published_file(tmp_path, monkeypatch, mode):
    if mode != "link":
        def no_link(*args, **kwargs):
            raise OSError(errno.EPERM, "Operation not permitted")

        monkeypatch.setattr(safeio.os, "link", no_link)
    if mode == "checked rename":
        monkeypatch.setattr(safeio, "_rename_noreplace", lambda *args: False)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name, data in (("tmp1", b"first"), ("tmp2", b"second")):
            (tmp_path / name).write_bytes(data)
        assert safeio.publish_new(fd, "tmp1", "chunk.kvz") is True
        assert safeio.publish_new(fd, "tmp2", "chunk.kvz") is False  # the first one stays
        assert (tmp_path / "chunk.kvz").read_bytes() == b"first"
        (tmp_path / "elsewhere").write_bytes(b"not mine")
        os.symlink(tmp_path / "elsewhere", tmp_path / "link.kvz")
        assert safeio.publish_new(fd, "tmp2", "link.kvz") is True  # the link goes, not through
        assert not os.path.islink(tmp_path / "link.kvz")
        assert (tmp_path / "link.kvz").read_bytes() == b"second"
        assert (tmp_path / "elsewhere").read_bytes() == b"not mine"
    finally:
        os.close(fd)


def test_a_write_without_hard_links_still_publishes_once(tmp_path, monkeypatch):
    def no_link(*args, **kwargs):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(safeio.os, "link", no_link)
    store = make(tmp_path)
    c0 = store.chunks(IDS)[0]
    assert store.write(c0, *kv(), IDS) > 0
    assert store.write(c0, *kv(1), IDS) == 0
    assert store.lookup(IDS) == [c0] and temps_under(tmp_path) == []


def test_atomic_write_to_an_own_temp_name_writes_it_in_place(tmp_path):
    """write_new hands save() a temp name in the pinned directory: atomic_write fills that
    file itself (no second temp, no rename through a re-walked path)."""
    from kvtool.fileio import temp_name

    tmp = tmp_path / temp_name(str(tmp_path / "chunk.kvz"))
    tmp.write_bytes(b"")
    inode = os.stat(tmp).st_ino
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert atomic_write(os.path.join(safeio.fd_path(fd), tmp.name),
                            lambda f: f.write(b"data")) == 4
    finally:
        os.close(fd)
    assert os.listdir(tmp_path) == [tmp.name] and os.stat(tmp).st_ino == inode
    assert tmp.read_bytes() == b"data"
    other = tmp_path / tmp.name.replace(f".{os.getpid()}.", ".1.")  # not this process's
    atomic_write(other, lambda f: f.write(b"x"))
    assert other.read_bytes() == b"x"


# -- B: errors name the store's path ----------------------------------------------------------
def full_disk_after(nbytes: int):
    """An encode callable that writes ``nbytes`` through atomic_write, then hits ENOSPC."""
    def encode(path: str) -> int:
        def write(f) -> int:
            f.write(b"x" * nbytes)
            raise OSError(errno.ENOSPC, "No space left on device")
        return atomic_write(path, write)
    return encode


def test_errors_name_the_chunk_in_the_store_not_an_fd_path(tmp_path, monkeypatch, runner):
    from kvtool.cli._common import os_error_message

    backend = LocalBackend(tmp_path)
    name = f"{'c' * 16}/ab/{'ab' * 32}.kvz"
    with pytest.raises(OSError) as info:
        backend.write_new(name, full_disk_after(1000))
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == backend.path(name)
    assert "/proc/" not in str(info.value) and "kvtmp" not in str(info.value)
    assert os_error_message(info.value) == f"No space left on device: {backend.path(name)}"
    assert temps_under(tmp_path) == []
    with pytest.raises(FileNotFoundError) as info:
        backend.pin(name)
    assert info.value.filename == backend.path(name)
    store, (c0,) = fill(tmp_path / "s", 1)

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "rename", read_only)
    with pytest.raises(OSError) as info:
        store.backend.quarantine(f"{'c' * 16}/{c0.key[:2]}/{c0.key}.kvz", "x.kvz", None)
    assert info.value.filename == c0.path


def test_a_full_disk_during_pin_is_one_line_naming_the_store(tmp_path, runner, monkeypatch):
    import kvtool.formats.writer as writer
    from kvtool.cache import KVCache
    from kvtool.formats import save

    keys, values = kv()
    kvz = tmp_path / "p.kvz"
    save(KVCache(keys, values, token_ids=np.array(IDS[:CHUNK]), model=MODEL), kvz)
    real = writer.write_container

    def full(f, *args, **kwargs):
        f.write(b"x" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer, "write_container", full)
    out = runner.invoke(cli, ["store", "pin", str(tmp_path / "store"), str(kvz),
                              "--chunk-tokens", str(CHUNK)])
    monkeypatch.setattr(writer, "write_container", real)
    assert out.exit_code == 1
    key = make(tmp_path / "store").chunks(IDS)[0].key
    assert out.output.strip() == (f"Error: No space left on device: {tmp_path}/store/"
                                  f"{'c' * 16}/{key[:2]}/{key}.kvz")


# -- C: the budget ------------------------------------------------------------------------------
def test_budget_counts_quarantine_and_temp_files(tmp_path):
    store, chunks = fill(tmp_path, 4)
    size = os.path.getsize(chunks[0].path)
    for i, c in enumerate(chunks):
        set_hit(c.path, 1_000_000 + i)
    quarantined(tmp_path, size // 2, days_ago=1)
    live = os.path.join(os.path.dirname(chunks[0].path), f".x.kvz.h.{os.getpid()}.a{TEMP_SUFFIX}")
    open(live, "wb").write(b"z" * (size // 2))  # a write in progress: counted, kept
    budget = StoreBudget(tmp_path, max_bytes=int(4.5 * size),
                                     quarantine_bytes=size)
    files, freed = budget.added(0)  # 4 chunks fit, with the quarantine and the temp they do not
    assert (files, freed) == (1, size)  # down to 0.9 * 4.5 = 4.05 sizes: 3 chunks + 1
    assert budget.last["chunks"] == (1, size)
    assert not os.path.exists(chunks[0].path) and os.path.exists(live)


def test_budget_bounds_the_quarantine_and_collects_stale_temps(tmp_path):
    store, chunks = fill(tmp_path, 2)
    old = quarantined(tmp_path, 100, days_ago=8, key="1" * 64)
    mid = quarantined(tmp_path, 300, days_ago=3, key="2" * 64)
    new = quarantined(tmp_path, 300, days_ago=1, key="3" * 64)
    leftover = stale_temp(os.path.dirname(chunks[0].path), 700)
    budget = StoreBudget(tmp_path, None, quarantine_bytes=400)  # no max_bytes
    assert budget.added(0) == (3, 100 + 300 + 700)
    assert budget.last == {"quarantine": (2, 400), "temps": (1, 700), "chunks": (0, 0)}
    assert not os.path.exists(old) and not os.path.exists(mid)  # too old, then oldest first
    assert os.path.exists(new) and not os.path.exists(leftover)
    assert all(os.path.exists(c.path) for c in chunks)
    defaults = StoreBudget(tmp_path, 10_000)
    assert (defaults.quarantine_bytes, defaults.quarantine_age) == (1000, 7 * 86400)
    assert StoreBudget(tmp_path, None).quarantine_bytes == 1 << 30


def test_budget_does_not_rescan_on_every_write(tmp_path, monkeypatch):
    store, chunks = fill(tmp_path, 2)
    size = os.path.getsize(chunks[0].path)
    scans = []
    real = store_admin.scan
    monkeypatch.setattr(store_admin, "scan",
                        lambda root, **kw: scans.append(1) or real(root, **kw))
    budget = StoreBudget(tmp_path, max_bytes=100 * size)
    for _ in range(50):
        assert budget.added(size // 10) == (0, 0)
    assert len(scans) == 1  # the first call; then the estimate
    budget.added(100 * size)  # over by the estimate: a scan, which finds the truth
    assert len(scans) == 2
    budget._next_scan = 0  # the periodic recheck is due
    budget.added(0)
    assert len(scans) == 3


def test_budget_makes_room_for_a_chunk_larger_than_the_last_ones(tmp_path):
    """A prompt's first chunk keeps its sinks raw, and compressed sizes vary: the room made
    before a write has a margin over the largest file lately, never more than the raw K/V."""
    budget = StoreBudget(tmp_path, max_bytes=1 << 20)
    assert budget.expected(50_000) == 50_000  # nothing written yet: the raw bytes
    budget.added(10_000)
    assert budget.expected(50_000) == 12_500
    assert budget.expected(11_000) == 11_000


def test_enospc_relief_makes_room_for_the_retry(tmp_path):
    """A fake full disk: the store may hold ``capacity`` bytes; a write past it writes part of
    its temp file and fails with ENOSPC. The connector's recovery: relieve, then retry once."""
    store, chunks = fill(tmp_path, 6)
    size = os.path.getsize(chunks[0].path)
    for i, c in enumerate(chunks):
        set_hit(c.path, 1_000_000 + i)
    pins = {chunks[0].key: {"file": "/x.kvz", "model": "c" * 16}}  # the oldest, pinned
    (tmp_path / "pins.json").write_text(json.dumps(pins))
    leftover = stale_temp(os.path.dirname(chunks[1].path), size // 4)
    q = quarantined(tmp_path, size // 4, days_ago=1)
    capacity = store_admin.scan(tmp_path).total_bytes  # the disk is full
    real_write_new = store.backend.write_new

    def disk_write_new(name, encode):
        def limited(path: str) -> int:
            n = encode(path)
            if store_admin.scan(tmp_path).total_bytes > capacity:
                with open(path, "r+b") as f:
                    f.truncate(n // 2)
                raise OSError(errno.ENOSPC, "No space left on device")
            return n
        return real_write_new(name, limited)

    store.backend.write_new = disk_write_new
    new = store.chunks(IDS)[6]
    with pytest.raises(OSError) as info:
        store.write(new, *kv(6), IDS)
    assert info.value.errno == errno.ENOSPC and info.value.filename == new.path
    assert temps_under(tmp_path) == [leftover]  # the failed write left nothing
    budget = StoreBudget(store.backend, None)
    files, freed = budget.relieve(size)
    want = size + capacity // 10
    assert freed >= want
    assert budget.last["temps"] == (1, size // 4) and budget.last["quarantine"] == (1, size // 4)
    assert budget.last["chunks"][0] >= 1
    assert not os.path.exists(q) and not os.path.exists(leftover)
    assert os.path.exists(chunks[0].path)  # pinned: never evicted
    assert not os.path.exists(chunks[1].path)  # the least recently hit unpinned chunk
    assert store.write(new, *kv(6), IDS) == size  # the retry fits
    budget2 = StoreBudget(tmp_path, max_bytes=20 * size)  # 10% of max_bytes
    before = store_admin.scan(tmp_path).total_bytes
    assert budget2.relieve(0) == (2, 2 * size)
    assert store_admin.scan(tmp_path).total_bytes == before - 2 * size


def test_enospc_on_a_real_tiny_tmpfs(tmp_path):
    """The same on a real full filesystem (a 512 KiB tmpfs), where mounting is possible."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs",
                                            str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        store = make(mnt)
        chunks = store.chunks(IDS * 8)
        written = 0
        with pytest.raises(OSError) as info:
            for c in chunks:
                written += bool(store.write(c, *kv(), IDS * 8))
        assert info.value.errno == errno.ENOSPC and written > 2
        assert info.value.filename.startswith(str(mnt)) and "/proc/" not in str(info.value)
        assert temps_under(mnt) == []
        budget = StoreBudget(store.backend, None)
        files, freed = budget.relieve(os.path.getsize(chunks[0].path))
        assert files >= 1
        assert store.write(chunks[written], *kv(), IDS * 8) > 0  # the retry fits
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


# -- D: kvtool store on a live store ----------------------------------------------------------
def test_verify_reports_chunks_pruned_meanwhile_as_gone(tmp_path, runner, monkeypatch):
    store, chunks = fill(tmp_path, 4)
    real_pin = LocalBackend.pin

    def pruned_first(self, name):
        if name.endswith(f"{chunks[1].key}.kvz"):
            os.unlink(self.path(name))  # a prune got there between the scan and the read
        return real_pin(self, name)

    monkeypatch.setattr(LocalBackend, "pin", pruned_first)
    out = runner.invoke(cli, ["store", "verify", str(tmp_path)])
    assert out.exit_code == 0, out.output
    assert f"GONE {chunks[1].path} (removed during the scan)" in out.output
    assert "DAMAGED" not in out.output and "3 of 3 chunks ok; 1 removed" in out.output
    os.unlink(chunks[2].path)  # the same, found by the scan of --json
    monkeypatch.setattr(LocalBackend, "pin", lambda self, name: (
        os.unlink(self.path(name)) if name.endswith(f"{chunks[3].key}.kvz") else None,
        real_pin(self, name))[1])
    out = runner.invoke(cli, ["store", "verify", str(tmp_path), "--json"])
    report = json.loads(out.output)
    assert out.exit_code == 0 and report["damaged"] == [] and report["gone"] == [chunks[3].path]


def test_verify_during_a_concurrent_prune_never_says_damaged(tmp_path, runner):
    store, chunks = fill(tmp_path, 8)
    found = store_admin.scan(tmp_path)
    stop = threading.Event()

    def prune() -> None:
        for c in found.chunks:
            if stop.is_set():
                return
            store_admin.remove([c], tmp_path)
            time.sleep(0.002)

    pruner = threading.Thread(target=prune)
    pruner.start()
    report = store_admin.verify(found)
    stop.set()
    pruner.join()
    assert report.damaged == []
    assert set(report.gone) <= {c.path for c in found.chunks}


def test_prune_collects_stale_temps_and_the_aged_quarantine(tmp_path, runner):
    store, chunks = fill(tmp_path, 2)
    leftover = stale_temp(os.path.dirname(chunks[0].path), 700)
    live = os.path.join(os.path.dirname(chunks[0].path), f".y.kvz.h.{os.getpid()}.a{TEMP_SUFFIX}")
    open(live, "wb").write(b"z" * 10)
    old = quarantined(tmp_path, 100, days_ago=8, key="1" * 64)
    new = quarantined(tmp_path, 300, days_ago=1, key="2" * 64)
    dry = runner.invoke(cli, ["store", "prune", str(tmp_path), "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.output
    info = json.loads(dry.output)
    assert (info["removed_temp_files"], info["removed_quarantined_files"]) == (1, 1)
    assert os.path.exists(leftover) and os.path.exists(old)
    out = runner.invoke(cli, ["store", "prune", str(tmp_path)])  # no option: temps, quarantine
    assert out.exit_code == 0, out.output
    assert "removed 1 stale temp files (700 B)" in out.output
    assert "removed 1 quarantined files (100 B)" in out.output
    assert "removed 0 chunks" in out.output
    assert not os.path.exists(leftover) and not os.path.exists(old)
    assert os.path.exists(live) and os.path.exists(new)
    assert all(os.path.exists(c.path) for c in chunks)
    keep = runner.invoke(cli, ["store", "prune", str(tmp_path), "--quarantine-older-than",
                               "never", "--json"])
    assert json.loads(keep.output)["removed_quarantined_files"] == 0 and os.path.exists(new)
    out = runner.invoke(cli, ["store", "prune", str(tmp_path), "--quarantine-older-than", "12h",
                              "--json"])
    assert json.loads(out.output)["removed_quarantined_bytes"] == 300
    assert LocalBackend(tmp_path).collect_garbage("") == (0, 0)  # no model: nothing to do


def test_prune_max_bytes_counts_the_quarantine_and_temps(tmp_path, runner):
    store, chunks = fill(tmp_path, 3)
    size = os.path.getsize(chunks[0].path)
    for i, c in enumerate(chunks):
        set_hit(c.path, 1_000_000 + i)
    quarantined(tmp_path, size, days_ago=1)
    out = runner.invoke(cli, ["store", "prune", str(tmp_path), "--max-bytes", str(3 * size),
                              "--json"])
    info = json.loads(out.output)
    assert info["removed_files"] == 1 and info["bytes_left"] == 3 * size
    assert not os.path.exists(chunks[0].path)


def test_prune_fails_loudly_when_it_cannot_remove(tmp_path, runner, monkeypatch):
    store, chunks = fill(tmp_path, 3)
    real_unlink = os.unlink

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "unlink", read_only)
    out = runner.invoke(cli, ["store", "prune", str(tmp_path), "--max-bytes", "0"])
    monkeypatch.setattr(os, "unlink", real_unlink)
    assert out.exit_code == 1
    errors = [line for line in out.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in out.output
    assert errors[0].startswith(f"Error: cannot remove {tmp_path}/")
    assert errors[0].endswith(": Read-only file system (and 2 more files)")
    assert all(os.path.exists(c.path) for c in chunks)
    with pytest.raises(OSError) as info:
        monkeypatch.setattr(os, "unlink", read_only)
        LocalBackend(tmp_path).remove(f"{'c' * 16}/{chunks[0].key[:2]}/{chunks[0].key}.kvz")
    monkeypatch.setattr(os, "unlink", real_unlink)
    assert info.value.errno == errno.EROFS and info.value.filename == chunks[0].path
    assert LocalBackend(tmp_path).remove(f"{'c' * 16}/ff/{'f' * 64}.kvz") is None  # not there


def test_a_symlinked_store_root_works_in_every_command(tmp_path, runner):
    from kvtool.cache import KVCache
    from kvtool.formats import save

    real = tmp_path / "real"
    store, chunks = fill(real, 2)
    link = tmp_path / "link"
    os.symlink(real, link)
    stats = runner.invoke(cli, ["store", "stats", str(link), "--json"])
    assert stats.exit_code == 0, stats.output
    assert json.loads(stats.output)["chunks"] == 2
    ls = runner.invoke(cli, ["store", "ls", str(link), "--json"])
    assert [r["path"].startswith(str(link)) for r in json.loads(ls.output)] == [True, True]
    verify = runner.invoke(cli, ["store", "verify", str(link)])
    assert verify.exit_code == 0 and "2 of 2 chunks ok" in verify.output
    keys, values = kv(9)
    kvz = tmp_path / "p.kvz"
    ids = IDS[:2 * CHUNK]
    save(KVCache([np.concatenate([k, k], 1) for k in keys],
                 [np.concatenate([v, v], 1) for v in values],
                 token_ids=np.array(ids), model=MODEL), kvz)
    pin = runner.invoke(cli, ["store", "pin", str(link), str(kvz), "--chunk-tokens", str(CHUNK)])
    assert pin.exit_code == 0 and "pinned 2 chunks" in pin.output, pin.output
    prune = runner.invoke(cli, ["store", "prune", str(link), "--max-bytes", "0", "--json"])
    assert prune.exit_code == 0 and json.loads(prune.output)["removed_files"] == 0  # pinned
    unpin = runner.invoke(cli, ["store", "unpin", str(link), str(kvz)])
    assert "unpinned 2 chunks" in unpin.output
    prune = runner.invoke(cli, ["store", "prune", str(link), "--max-bytes", "0", "--json"])
    assert json.loads(prune.output)["removed_files"] == 2
    assert os.path.islink(link) and store_admin.scan(real).chunks == []
    fill(real, 1)
    serve = runner.invoke(cli, ["serve", "--dry-run", "--store", str(link)])
    assert serve.exit_code == 0, serve.output
    assert f"store:  {link} (1 chunks" in serve.output
    # below the root, symlinks stay ignored
    os.symlink(real / ("c" * 16), real / ("d" * 16))
    assert json.loads(runner.invoke(cli, ["store", "stats", str(link), "--json"])
                      .output)["chunks"] == 1


@pytest.mark.parametrize("option, value, message", [
    ("--max-bytes", "lots", "'lots' is not a size"),
    ("--older-than", "soon", "'soon' is not a duration"),
    ("--quarantine-older-than", "soon", "'soon' is not a duration"),
])
def test_bad_values_name_their_option(tmp_path, runner, option, value, message):
    out = runner.invoke(cli, ["store", "prune", str(tmp_path), option, value])
    assert out.exit_code == 2
    assert f"Invalid value for '{option}': {message}" in out.output
    assert "Traceback" not in out.output
