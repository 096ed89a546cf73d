"""The prefix store's rules for a shared store (design brief, "Store rules"), without vLLM:
a reader never deletes; a damaged chunk is quarantined only by a writer (a kv_consumer skips it
until it changes); chunks of a newer kvtool are left alone; symlinks and special files are
never followed or opened; crash leftovers (stale temp files) are counted and collected."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")

from kvz_util import read_parts, rewrite_header, write_parts  # noqa: E402

from kvtool.engines.vllm.common import (  # noqa: E402
    policy_from_extra,
    request_kvz,
    request_switch,
    stats,
)
from kvtool.engines.vllm.safeio import UnsafeFileError, stamp_of  # noqa: E402
from kvtool.engines.vllm.store import PrefixStore  # noqa: E402
from kvtool.engines.vllm.store_backend import QUARANTINE_DIR  # noqa: E402
from kvtool.errors import FormatError, NewerVersionError  # noqa: E402
from kvtool.fileio import TEMP_SUFFIX, temp_prefix  # noqa: E402
from kvtool.formats import constants as KC  # noqa: E402

MODEL = {"fingerprint": "e" * 64, "name": "tiny", "num_layers": 3}
CHUNK = 16
IDS = list(range(200, 264))


def kv(tokens: int = CHUNK, seed: int = 0) -> tuple[list, list]:
    gen = torch.Generator().manual_seed(seed)
    return ([torch.randn(2, tokens, 32, generator=gen) for _ in range(3)],
            [torch.randn(2, tokens, 32, generator=gen) for _ in range(3)])


def make(root, writable: bool = True, codec: str = "raw") -> PrefixStore:
    return PrefixStore(root, MODEL, CHUNK, policy_from_extra({"codec": codec}),
                       writable=writable)


def fill(store: PrefixStore, n: int = 3) -> list:
    chunks = store.chunks(IDS)[:n]
    for i, c in enumerate(chunks):
        keys, values = kv(seed=i)
        assert store.write(c, keys, values, IDS) > 0
    return chunks


def tree(root) -> dict[str, tuple[bytes, int]]:
    """Every entry under ``root``: contents (or link target) and mtime, to prove nothing changed."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(d, name)
            st = os.lstat(p)
            if os.path.islink(p):
                out[p] = (os.readlink(p).encode(), st.st_mtime_ns)
            elif os.path.isfile(p):
                out[p] = (open(p, "rb").read(), st.st_mtime_ns)
            else:
                out[p] = (b"", st.st_mtime_ns)
    return out


def poison(path: str) -> None:
    """Shrink layer 0's key norms to one element (checksums recomputed): a file no writer
    writes, which a lenient reader would broadcast silently."""
    metadata, blobs = read_parts(path)
    header = json.loads(metadata[KC.META_HEADER])
    name = header["layers"][0]["key"]["segments"][0]["tensors"]["norms"]
    i = next(j for j, b in enumerate(blobs) if b.name == name)
    blobs[i].data, blobs[i].shape = bytes(blobs[i].data)[:2], (1,)
    write_parts(path, metadata, blobs)

    def fix(h):
        from kvtool.formats.container import crc32_hex

        h["tensors"][name].update(shape=[1], crc32=crc32_hex(bytes(blobs[i].data)))
    rewrite_header(path, path, fix)


def quarantined(root) -> list[str]:
    q = os.path.join(root, QUARANTINE_DIR)
    return sorted(os.listdir(q)) if os.path.isdir(q) else []


# -- damaged files --------------------------------------------------------------------------------
def test_writer_quarantines_damaged_chunks(tmp_path, caplog):
    store = make(tmp_path)
    c0, c1, c2 = fill(store)
    damaged = b"not a kvz file" * 50
    open(c1.path, "wb").write(damaged)
    before = stats()
    with caplog.at_level(logging.WARNING, logger="kvtool.vllm"):
        assert store.lookup(IDS) == [c0]
    assert not os.path.exists(c1.path) and os.path.exists(c2.path)
    (name,) = quarantined(tmp_path)
    assert name.startswith(f"{'e' * 16}-{c1.key}.") and name.endswith(".kvz")  # its origin
    assert open(tmp_path / QUARANTINE_DIR / name, "rb").read() == damaged  # moved, not deleted
    assert "quarantine" in caplog.text and "recomputed" in caplog.text
    assert stats()["quarantined_files"] == before["quarantined_files"] + 1
    assert stats()["invalid_files"] == before["invalid_files"] + 1
    keys, values = kv(seed=1)  # the writer writes the chunk anew
    assert not store.exists(c1) and store.write(c1, keys, values, IDS) > 0
    assert store.lookup(IDS) == [c0, c1, c2]


def test_a_damaged_chunk_whose_quarantine_failed_is_replaced_once_it_works(tmp_path, caplog,
                                                                           monkeypatch):
    """A quarantine folder that cannot be written (a symlink, a read-only mount) kept the
    damaged file, and every later write found the place taken: the prefix was computed on
    every request until a restart. The write now quarantines it again, warned of once."""
    store = make(tmp_path)
    c0, c1, _ = fill(store)
    open(c1.path, "wb").write(b"not a kvz file" * 50)
    real = store.backend.quarantine

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "quarantine")

    monkeypatch.setattr(store.backend, "quarantine", refuse)
    keys, values = kv(seed=1)
    with caplog.at_level(logging.WARNING, logger="kvtool.vllm"):
        assert store.lookup(IDS) == [c0]  # damaged: skipped, and kept
        assert store.write(c1, keys, values, IDS) == 0 and store.write(c1, keys, values, IDS) == 0
    assert os.path.exists(c1.path) and quarantined(tmp_path) == []
    assert caplog.text.count("cannot quarantine") == 1
    monkeypatch.setattr(store.backend, "quarantine", real)
    assert store.write(c1, keys, values, IDS) > 0 and len(quarantined(tmp_path)) == 1
    assert store.lookup(IDS)[:2] == [c0, c1]


def test_poisoned_chunk_refused_and_quarantined(tmp_path):
    store = make(tmp_path, codec="turbo3")
    c0, c1, _ = fill(store)
    poison(c1.path)
    with pytest.raises(FormatError) as e:
        store.read(c1)
    assert not isinstance(e.value, NewerVersionError) and c1.path in str(e.value)
    assert not os.path.exists(c1.path) and len(quarantined(tmp_path)) == 1
    assert store.lookup(IDS) == [c0]


def test_consumer_never_modifies_the_store(tmp_path, caplog):
    writer = make(tmp_path, codec="turbo3")
    c0, c1, c2 = fill(writer)
    poison(c1.path)
    open(c2.path, "wb").write(b"garbage" * 40)
    _old_temp(os.path.join(os.path.dirname(c0.path), f".x.kvz.otherhost.1.abc{TEMP_SUFFIX}"))
    snapshot = tree(tmp_path)
    reader = make(tmp_path, writable=False, codec="turbo3")
    with caplog.at_level(logging.WARNING, logger="kvtool.vllm"):
        with pytest.raises(FormatError):
            reader.read(c1)
        assert not reader.is_valid(c1, IDS)  # remembered as bad: not retried
        assert not reader.is_valid(c2, IDS)
        assert reader.lookup(IDS) == [c0]
        assert reader.collect_garbage() == (0, 0)
        with pytest.raises(PermissionError):
            reader.write(c1, *kv(), IDS)
    assert "left in place" in caplog.text
    assert caplog.text.count(c2.path) == 1  # warned once
    assert tree(tmp_path) == snapshot and quarantined(tmp_path) == []
    writer_fix = make(tmp_path / "other")  # a rewritten file is retried
    fresh = writer_fix.chunks(IDS)[1]
    writer_fix.write(fresh, *kv(seed=1), IDS)
    os.replace(fresh.path, c1.path)
    assert reader.is_valid(c1, IDS)


def _old_temp(path: str) -> None:
    """A temp file of another host, 7 hours old: a crash leftover."""
    open(path, "wb").write(b"x" * 1000)
    old = time.time() - 7 * 3600
    os.utime(path, (old, old))


# -- newer versions --------------------------------------------------------------------------------
def test_newer_versions_skipped_and_left_alone(tmp_path, caplog):
    store = make(tmp_path)
    c0, c1, c2 = fill(store)

    def codec_v2(h):
        for layer in h["layers"]:
            for role in ("key", "value"):
                for seg in layer[role]["segments"]:
                    seg["codec"]["codec_version"] = 2
    rewrite_header(c1.path, c1.path, codec_v2)
    metadata, blobs = read_parts(c2.path)
    metadata[KC.META_FORMAT_VERSION] = "2"
    write_parts(c2.path, metadata, blobs)
    snapshot = tree(tmp_path)
    before = stats()
    with caplog.at_level(logging.WARNING, logger="kvtool.vllm"):
        if store.is_valid(c1, IDS):  # a codec version may only show when decoding
            with pytest.raises(NewerVersionError):
                store.read(c1)
        assert not store.is_valid(c1, IDS)
        assert not store.is_valid(c2, IDS)
        assert store.lookup(IDS) == [c0]
        for c in (c1, c2):  # a lossless write judges them: kept, not replaced
            assert store.write(c, *kv(seed=3), IDS) == 0
    assert tree(tmp_path) == snapshot and quarantined(tmp_path) == []
    assert store.replaced == 0
    assert caplog.text.count("newer kvtool") == 1  # one warning
    assert stats()["newer_files"] - before["newer_files"] == 2
    assert stats()["quarantined_files"] == before["quarantined_files"]


def test_a_chunk_of_a_codec_this_server_lacks_is_skipped_and_left_alone(tmp_path, caplog):
    """A server with a codec plugin wrote it; one without the plugin shares the store: a miss
    for this one (said once), never quarantined, still served to the plugin's servers."""
    from kvtool.codecs import register_codec
    from kvtool.codecs.raw import RawCodec
    from kvtool.codecs.registry import reset_registry
    from kvtool.errors import MissingCodecError

    class PluginRaw(RawCodec):
        codec_id = "test-plugin-raw"

    register_codec(PluginRaw)
    try:
        plugin = PrefixStore(tmp_path, MODEL, CHUNK,
                             policy_from_extra({"codec": "test-plugin-raw"}))
        c0, *_ = fill(plugin, 1)
    finally:
        reset_registry()  # this server: no plugin
    snapshot = tree(tmp_path)
    store = make(tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvtool.vllm"):
        for _ in range(2):
            with pytest.raises(MissingCodecError, match="test-plugin-raw"):
                store.read(c0)
        assert store.lookup(IDS) == []
    assert tree(tmp_path) == snapshot and quarantined(tmp_path) == []
    assert caplog.text.count("left alone for the servers that have the codec") == 1


def test_an_error_of_this_process_leaves_the_chunk_usable(tmp_path, monkeypatch):
    """The chunk's bytes are in memory when it is decoded: an OSError then (EMFILE, ENOMEM) is
    this process's, so the chunk is neither quarantined nor remembered as bad."""
    store = make(tmp_path)
    c0, *_ = fill(store, 1)

    def too_many_files(*args):
        raise OSError(24, "Too many open files")
    with monkeypatch.context() as patched:
        patched.setattr(os, "memfd_create", too_many_files)
        with pytest.raises(OSError, match="Too many open files"):
            store.read(c0)
        with pytest.raises(OSError, match="Too many open files"):
            store.read_into(c0, CHUNK, None, lambda f: None)
    assert quarantined(tmp_path) == [] and store.lookup(IDS) == [c0]
    assert store.read(c0).num_tokens == CHUNK


@pytest.mark.parametrize("error", [MemoryError(), type("OutOfMemoryError", (RuntimeError,), {})(
    "CUDA out of memory")], ids=["host memory", "device memory"])
@pytest.mark.parametrize("path", ["host", "device"])
def test_a_decode_that_runs_out_of_memory_does_not_judge_the_chunk(tmp_path, monkeypatch, path,
                                                                   error):
    """Memory, the OS, a device or a kernel compiler failing mid-decode says nothing about the
    file: the error is raised as it is, and the chunk is neither quarantined nor remembered."""
    from kvtool.codecs.raw import RawCodec
    from kvtool.engines.vllm import device_io
    from kvtool.engines.vllm.layout import detect_layout

    store = make(tmp_path)
    c0, *_ = fill(store, 1)

    def fail(*args, **kwargs):
        raise error
    monkeypatch.setattr(RawCodec, "decode", fail)
    kv = torch.zeros(4, 2, 4, 64)
    target = [(kv, detect_layout(kv, 32, "FLASHINFER"), [0, 1, 2, 3])] * 3
    with pytest.raises(type(error)):
        if path == "host":
            store.read(c0)
        else:
            store.read_into(c0, CHUNK, None,
                            lambda f: device_io.load_file(f, target, 0, 0, CHUNK))
    monkeypatch.undo()
    assert quarantined(tmp_path) == [] and store.lookup(IDS) == [c0]
    assert store.read(c0).num_tokens == CHUNK


def test_a_chunk_with_a_partial_window_is_never_served(tmp_path):
    """A chunk whose sliding-window layer kept only its last tokens (no connector writes one):
    scattered as a prefix, those tokens would land at positions 0.. and leave the rest of its
    slots stale. Refused at lookup and at load, on both paths, before any slot is written."""
    import numpy as np

    from kvtool.cache import KVCache
    from kvtool.engines.vllm import paged_io
    from kvtool.engines.vllm.common import Source
    from kvtool.engines.vllm.layout import detect_layout
    from kvtool.formats import save

    store = make(tmp_path)
    c0, *_ = fill(store, 1)
    keys, values = kv()
    window = [{}, {"sliding_window": 4}, {}]
    cache = KVCache([k if i != 1 else k[:, -4:] for i, k in enumerate(keys)],
                    [v if i != 1 else v[:, -4:] for i, v in enumerate(values)],
                    token_ids=np.asarray(IDS[:CHUNK]), model=MODEL, layer_info=window)
    save(cache, c0.path, codec="raw")
    assert not store.is_valid(c0, IDS)
    guard = type("Guard", (), {"call": staticmethod(lambda name, fn, *a: fn(*a))})()
    for on_device in (False, True):
        save(cache, c0.path, codec="raw")
        caches = [torch.full((4, 2, 4, 64), -1.0) for _ in range(3)]
        layers = [(x, detect_layout(x, 32, "FLASHINFER"), 1) for x in caches]
        with pytest.raises(ValueError, match="cannot be served as a prefix"):
            paged_io.load_source(layers, [0, 1, 2, 3], Source(c0.path, 0, CHUNK, c0), 0, CHUNK,
                                 store, guard, MODEL, on_device)
        assert all(bool((x == -1.0).all()) for x in caches), on_device


# -- symlinks and special files --------------------------------------------------------------
def test_symlinked_chunk_is_not_followed(tmp_path, caplog):
    store = make(tmp_path / "store")
    outside = make(tmp_path / "outside")
    c0 = fill(store, 1)[0]
    real = fill(outside, 2)[1]
    c1 = store.chunks(IDS)[1]
    os.makedirs(os.path.dirname(c1.path), exist_ok=True)
    os.symlink(real.path, c1.path)
    target = open(real.path, "rb").read()
    with caplog.at_level(logging.WARNING, logger="kvtool.vllm"):
        assert store.lookup(IDS) == [c0]
        with pytest.raises(UnsafeFileError):
            store.read(c1)
    assert "symbolic link" in caplog.text
    assert os.path.islink(c1.path) and not store.exists(c1)  # left alone, not quarantined
    assert store.write(c1, *kv(seed=1), IDS) > 0  # replaces the link, never writes through
    assert not os.path.islink(c1.path) and open(real.path, "rb").read() == target
    assert store.lookup(IDS)[:2] == [c0, c1]


def test_symlinked_directories_are_not_followed(tmp_path):
    store = make(tmp_path / "store")
    outside = make(tmp_path / "outside")
    good = fill(outside, 1)[0]
    shard = os.path.dirname(good.path)
    c0 = store.chunks(IDS)[0]
    os.makedirs(store.dir)
    os.symlink(shard, os.path.dirname(c0.path))  # <fp>/<key[:2]> -> elsewhere
    assert os.path.isfile(c0.path)  # what a path-following reader would see
    assert not store.is_valid(c0, IDS) and store.lookup(IDS) == []
    with pytest.raises(UnsafeFileError):
        store.write(c0, *kv(), IDS)
    assert os.listdir(shard) == [os.path.basename(good.path)]
    os.unlink(os.path.dirname(c0.path))
    os.rmdir(store.dir)
    os.symlink(os.path.dirname(shard), store.dir)  # <fp> -> elsewhere
    assert not store.is_valid(c0, IDS)
    assert store.size_bytes() == 0


def test_fifo_in_the_store_is_never_opened(tmp_path):
    store = make(tmp_path)
    c0 = store.chunks(IDS)[0]
    os.makedirs(os.path.dirname(c0.path))
    os.mkfifo(c0.path)
    start = time.monotonic()
    assert not store.is_valid(c0, IDS) and store.lookup(IDS) == []
    with pytest.raises(UnsafeFileError):
        store.read(c0)
    assert time.monotonic() - start < 5


def test_lossless_store_skips_lossy_and_cast_chunks(tmp_path, caplog):
    """A lossless server answers as a cold run: it loads no chunk another server stored lossy
    (nor one stored exactly in another dtype, which a cast would round), and leaves it for
    the lossy servers, unrejected; a lossy server loads any chunk."""
    root = tmp_path / "s"
    lossy = make(root, codec="turbo3")
    chunks = fill(lossy, 2)
    before = tree(root)
    with caplog.at_level(logging.WARNING, logger="kvtool.vllm"):
        assert make(root).lookup(IDS) == []
        assert make(root).lookup(IDS) == []  # cached verdicts: the same answer
    assert caplog.text.count("loads no chunk stored lossy") == 2 and tree(root) == before
    assert [c.key for c in make(root, codec="turbo4").lookup(IDS)] == [c.key for c in chunks]
    def store(dtype: str, codec: str = "raw") -> PrefixStore:  # one root: dtype-free keys
        return PrefixStore(tmp_path / "d", {**MODEL, "dtype": dtype}, CHUNK,
                           policy_from_extra({"codec": codec}))

    for i, c in enumerate(store("float32").chunks(IDS)[:2]):  # a float32 server's raw chunks
        store("float32").write(c, *kv(seed=i), IDS)
    assert len(store("float32").lookup(IDS)) == 2
    assert store("bfloat16").lookup(IDS) == []
    assert len(store("bfloat16", "turbo3").lookup(IDS)) == 2


def test_a_lossless_server_writes_over_lossy_chunks_and_nothing_else(tmp_path):
    """A lossless server never loads another server's lossy chunk, and its own saves of that
    prefix were skipped (the first writer wins): it computed the prefix on every request. Its
    exact write now replaces a lossy chunk; no write replaces an exact one (of any dtype), and
    a lossy server's write never replaces anything."""
    root = tmp_path / "s"
    lossy_chunks = fill(make(root, codec="turbo3"), 2)
    lossless = make(root)
    assert lossless.lookup(IDS) == []
    for i, c in enumerate(lossless.chunks(IDS)[:2]):
        assert lossless.write(c, *kv(seed=i), IDS) > 0  # replaced, not skipped
    assert [c.key for c in make(root).lookup(IDS)] == [c.key for c in lossy_chunks]
    exact = tree(root)
    for c in lossy_chunks:
        assert make(root, codec="turbo3").write(c, *kv(seed=9), IDS) == 0  # kept
        assert lossless.write(c, *kv(seed=9), IDS) == 0  # exact already: kept
    assert tree(root) == exact

    def store(dtype: str) -> PrefixStore:
        return PrefixStore(tmp_path / "d", {**MODEL, "dtype": dtype}, CHUNK,
                           policy_from_extra({"codec": "raw"}))

    chunk = store("float32").chunks(IDS)[0]
    assert store("float32").write(chunk, *kv(), IDS) > 0
    assert store("bfloat16").write(chunk, *kv(), IDS) == 0  # exact in float32: kept
    assert len(store("float32").lookup(IDS)) == 1


def test_a_lossless_write_that_meets_a_damaged_chunk_quarantines_it_and_writes(tmp_path):
    """A lossless store judges a file it finds in the chunk's place (it may be stored lossy):
    a damaged one is quarantined and the chunk written anew, not skipped. A lossy store keeps
    whatever is there without reading it (its lookups judge it)."""
    root = tmp_path / "s"
    c0, c1 = fill(make(root), 2)
    damaged = b"not a kvz file" * 50
    for c in (c0, c1):
        open(c.path, "wb").write(damaged)
    assert make(root, codec="turbo3").write(c0, *kv(), IDS) == 0
    assert open(c0.path, "rb").read() == damaged and quarantined(root) == []
    lossless = make(root)
    assert lossless.write(c1, *kv(seed=1), IDS) > 0 and lossless.replaced == 1
    assert len(quarantined(root)) == 1 and open(c1.path, "rb").read() != damaged
    assert make(root).is_valid(c1, IDS)


def test_a_lossy_chunk_that_cannot_be_replaced_is_kept_and_later_saves_go_on(tmp_path, caplog,
                                                                          monkeypatch):
    """A store that lets a server write new files but not replace one (another user's file in
    a sticky directory; an S3 policy that refuses the overwrite) keeps the lossy chunk: the
    write is skipped, with one warning, not failed (a failed write stops the rest of a
    prompt's saves)."""
    from kvtool.engines.vllm import store_backend

    root = tmp_path / "s"
    (lossy,) = fill(make(root, codec="turbo3"), 1)
    before = open(lossy.path, "rb").read()
    lossless = make(root)
    lossless.lookup(IDS)

    real_replace, encodes = os.replace, []

    def denied(src, dst, **kwargs):  # the rename over the judged file, not a temp file's
        if "dst_dir_fd" in kwargs:
            raise PermissionError(1, "Operation not permitted")
        return real_replace(src, dst, **kwargs)

    def counted(name, encode, **kwargs):
        def counting(path):
            encodes.append(name)
            return encode(path)
        return write_new(name, counting, **kwargs)

    write_new = lossless.backend.write_new
    monkeypatch.setattr(store_backend.os, "replace", denied)
    monkeypatch.setattr(lossless.backend, "write_new", counted)
    with caplog.at_level(logging.WARNING, logger="kvtool.vllm"):
        for _ in range(3):
            assert lossless.write(lossy, *kv(), IDS) == 0
    assert caplog.text.count("cannot replace the lossy chunk") == 1
    assert len(encodes) == 1  # refused once: the same file is not encoded over again
    assert f"not permitted: '{lossy.path}')" in caplog.text  # the chunk, not "... -> None"
    assert open(lossy.path, "rb").read() == before
    assert not [n for n in os.listdir(os.path.dirname(lossy.path)) if n.endswith(TEMP_SUFFIX)]
    second = lossless.chunks(IDS)[1]
    assert lossless.write(second, *kv(seed=1), IDS) > 0


def test_a_failed_replacement_keeps_the_lossy_chunk(tmp_path, monkeypatch):
    """The exact chunk is encoded before the lossy file goes: a replacement that fails (a full
    disk) raises as any failed write and leaves the lossy chunk in place, for lossy servers to
    load, and no temp file. The next write replaces it."""
    import errno

    import kvtool.formats

    root = tmp_path / "s"
    (lossy,) = fill(make(root, codec="turbo3"), 1)
    before = open(lossy.path, "rb").read()
    lossless = make(root)
    assert lossless.lookup(IDS) == []
    save = kvtool.formats.save

    def disk_full(cache, path, *args, **kwargs):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(kvtool.formats, "save", disk_full)
    with pytest.raises(OSError, match="No space left") as err:
        lossless.write(lossy, *kv(), IDS)
    assert err.value.filename == lossy.path
    assert open(lossy.path, "rb").read() == before
    assert not [n for n in os.listdir(os.path.dirname(lossy.path)) if n != os.path.basename(
        lossy.path)]
    assert [c.key for c in make(root, codec="turbo3").lookup(IDS)] == [lossy.key]
    monkeypatch.setattr(kvtool.formats, "save", save)
    assert lossless.write(lossy, *kv(), IDS) > 0 and lossless.replaced == 1
    assert [c.key for c in make(root).lookup(IDS)] == [lossy.key]


def test_a_chunk_rewritten_since_it_was_judged_is_neither_removed_nor_written_over(tmp_path):
    """Two lossless servers that judged the same lossy chunk: the second must not remove, nor
    write over, the exact chunk the first wrote in its place (its stamp is no longer the one
    judged)."""
    root = tmp_path / "s"
    (chunk,) = fill(make(root, codec="turbo3"), 1)
    store = make(root)
    with store.pin(chunk) as (_, judged):
        pass
    name = store._name(chunk)
    time.sleep(0.01)
    os.remove(chunk.path)
    assert make(root).write(chunk, *kv(seed=4), IDS) > 0  # another writer's, since
    theirs = open(chunk.path, "rb").read()

    def encode(path):
        with open(path, "wb") as f:
            return f.write(b"mine")

    assert store.backend.write_new(name, encode, replace=judged) == 0
    assert store.backend.remove(name, judged) is None and open(chunk.path, "rb").read() == theirs
    with store.pin(chunk) as (_, now):
        assert store.backend.write_new(name, encode, replace=now) == 4
    assert open(chunk.path, "rb").read() == b"mine"
    with store.pin(chunk) as (_, now):
        assert store.backend.remove(name, now) > 0 and not os.path.exists(chunk.path)


def test_request_switches_take_only_booleans(caplog):
    """``"kvtool_load": "false"`` must not read as true (a non-empty string): it is ignored,
    with a warning, and the default holds."""
    assert request_switch({}, "kvtool_load", True) is True
    assert request_switch({"kvtool_load": False}, "kvtool_load", True) is False
    assert request_switch({"kvtool_capture": True}, "kvtool_capture", False) is True
    with caplog.at_level(logging.WARNING, logger="kvtool.vllm"):
        for bad in ("false", "true", 0, 1, None, [False]):
            assert request_switch({"kvtool_save": bad}, "kvtool_save", True) is True
            assert request_switch({"kvtool_capture": bad}, "kvtool_capture", False) is False
    assert caplog.text.count("expected true or false") == 12


def test_request_paths_confined(tmp_path, caplog):
    allowed, other = tmp_path / "allowed", tmp_path / "other"
    allowed.mkdir()
    other.mkdir()
    src = make(tmp_path / "s")
    c = fill(src, 1)[0]
    good = allowed / "doc.kvz"
    good.write_bytes(open(c.path, "rb").read())
    (other / "x.kvz").write_bytes(good.read_bytes())
    os.symlink(other / "x.kvz", allowed / "escape.kvz")
    os.mkfifo(allowed / "fifo.kvz")
    dirs, fp = [os.path.realpath(allowed)], MODEL
    path, ids, whole, stamp = request_kvz(str(good), dirs, [], fp)
    assert path == os.path.realpath(good) and list(ids) == IDS[:CHUNK] and not whole
    assert stamp == stamp_of(os.stat(good))  # what the worker checks before it loads
    before = stats()["refused_files"]
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="kvtool.vllm"):
        for bad in (other / "x.kvz", allowed / "escape.kvz", allowed / "fifo.kvz",
                    allowed / ".." / "other" / "x.kvz", allowed, 42,
                    f"{good}\x00x", "\ud800.kvz"):  # os.path raises ValueError on these
            p = bad if isinstance(bad, int | str) else str(bad)
            assert len(request_kvz(p, dirs, [], fp)[1]) == 0
    assert time.monotonic() - start < 5
    assert stats()["refused_files"] - before == 8 and "refusing" in caplog.text
    listed = os.path.realpath(other / "x.kvz")
    assert len(request_kvz(str(other / "x.kvz"), [], [listed], fp)[1]) == CHUNK


# -- crash leftovers -------------------------------------------------------------------------
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temps_counted_and_collected(tmp_path):
    store = make(tmp_path)
    c0, c1 = fill(store, 2)
    chunk_bytes = store.size_bytes()
    assert chunk_bytes == os.path.getsize(c0.path) + os.path.getsize(c1.path)
    shard0, shard1 = os.path.dirname(c0.path), os.path.dirname(c1.path)
    dead = temp_prefix(c0.path).replace(f".{os.getpid()}.", f".{_dead_pid()}.")
    leftover = os.path.join(shard0, f"{dead}abc{TEMP_SUFFIX}")
    open(leftover, "wb").write(b"y" * 3000)
    old = os.path.join(shard1, f".{os.path.basename(c1.path)}.otherhost.1.abc{TEMP_SUFFIX}")
    _old_temp(old)
    live = os.path.join(shard1, f"{temp_prefix(c1.path)}live{TEMP_SUFFIX}")  # a write in progress
    open(live, "wb").write(b"z" * 500)
    assert store.size_bytes() == chunk_bytes + 3000 + 1000 + 500
    reader = make(tmp_path, writable=False)
    assert reader.collect_garbage() == (0, 0) and os.path.exists(leftover)
    assert store.collect_garbage() == (2, 4000)
    assert not os.path.exists(leftover) and not os.path.exists(old) and os.path.exists(live)
    assert store.size_bytes() == chunk_bytes + 500
    c2 = store.chunks(IDS)[2]  # a write into a shard directory collects its leftovers too
    os.makedirs(os.path.dirname(c2.path), exist_ok=True)
    leftover = os.path.join(os.path.dirname(c2.path), os.path.basename(leftover))
    open(leftover, "wb").write(b"y" * 3000)
    assert store.write(c2, *kv(), IDS) > 0 and not os.path.exists(leftover)


def test_the_scheduler_follows_what_a_failed_load_left_wrong(caplog):
    """After vLLM hears of a failed load (``invalid_block_ids``), the scheduler half tracks the
    blocks it left wrong (the failed ones and those computed over them): a request vLLM rolled
    back to its first failed block plans its chunks and capture again; one that reads a wrong
    block (shared through vLLM's prefix cache, or its own after a preemption) stores nothing
    more, and what it computes is wrong too; a block written again from its first token is
    clean, and a request that only writes a freed one is not touched."""
    from kvtool.engines.vllm.common import ReqState
    from kvtool.engines.vllm.load_failures import PoisonedBlocks

    bs, chunk = 16, 64
    prompt = list(range(640))
    poison = PoisonedBlocks(bs)

    def step(*plans):  # (id, state, first token written, computed, after) of one step
        poison.step(plans, chunk)

    # A loaded tokens 0..512 into blocks 100..131 and computed up to 600; B (a prefix hit on
    # A's blocks 100..115) computed its own 256..300
    a = ReqState(prompt, block_ids=list(range(100, 140)), next_chunk=9, stored=8,
                 captured=True, capture=True, planned=600)
    b = ReqState(prompt, block_ids=[*range(100, 116), 200, 201, 202], next_chunk=4, planned=300)
    c = ReqState(prompt, block_ids=[300, 301], planned=20)  # elsewhere in the cache
    reqs = {"a": a, "b": b, "c": c}
    poison.heard(reqs, {108, 109})  # tokens 128..160 failed to load
    assert a.load_failed and b.load_failed and not c.load_failed
    assert set(range(108, 138)) <= poison.blocks and {200, 201, 202} <= poison.blocks
    # vLLM rolls A back to 128 and recomputes 128..200; B is not rolled back past its prefix
    step(("a", a, 128, 128, 200), ("b", b, 300, 300, 310), ("c", c, 20, 20, 40))
    assert (a.next_chunk, a.stored, a.captured, a.save, a.tainted) == (2, 2, False, True, False)
    assert b.tainted and not b.save and not b.capture and "request b" in caplog.text
    assert not c.tainted
    assert not {108, 109, 110, 111} & poison.blocks and 112 in poison.blocks  # 192..200: part
    # D hits A's blocks 100..119 through the prefix cache while A rewrites 112..115 (read
    # fresh in the same forward); 116..119 are still wrong
    d = ReqState(prompt, block_ids=[*range(100, 120), 400], planned=0)
    step(("a", a, 200, 200, 256), ("d", d, 320, 320, 336))
    assert d.tainted and 400 in poison.blocks  # what D computes over them is wrong too
    assert not {112, 113, 114, 115} & poison.blocks and 116 in poison.blocks
    e = ReqState(prompt, block_ids=list(range(100, 116)), planned=0)  # a later hit: clean now
    step(("e", e, 256, 256, 260))
    assert not e.tainted and e.save
    # A is preempted and resumes with a prefix hit on its own blocks up to 512, where 120..131
    # were never written again: it goes on from the failed load's K/V
    step(("a", a, 512, 512, 520))
    assert a.tainted and not a.save
    # F is given block 130 (freed, then evicted) and writes it from its first token
    f = ReqState(prompt, block_ids=[500, 130], planned=0)
    step(("f", f, 0, 0, 32))
    assert not f.tainted and 130 not in poison.blocks
