"""The .kvz v1 format: round trips, lazy access, policies, safety rules, atomic writes."""

from __future__ import annotations

import json
import os
import re
import warnings

import numpy as np
import pytest
from kvz_util import (
    NP_DTYPES,
    as_f32,
    available_codecs,
    bits,
    codec_or_skip,
    read_parts,
    rewrite_header,
    synthetic_cache,
    write_parts,
)

from kvtool.cache import KVCache
from kvtool.codecs import list_codecs
from kvtool.errors import FormatError
from kvtool.formats import KvzFile, load, open_kvz, save, transcode
from kvtool.formats import constants as C
from kvtool.formats.container import crc32_hex
from kvtool.policy import CodecPolicy

torch = pytest.importorskip("torch")


# -- round trips -----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_raw_round_trip_is_bit_exact(tmp_path, dtype, backend):
    cache = synthetic_cache(dtype=dtype, layer_info=[{"sliding_window": 8}, None, {}])
    if backend == "torch":
        cache = cache.to_torch()
    report = save(cache, tmp_path / "c.kvz")
    assert report["file_bytes"] == os.path.getsize(tmp_path / "c.kvz")
    assert report["fp16_bytes"] == sum(2 * 2 * int(np.prod(k.shape)) for k in cache.keys)
    out = load(tmp_path / "c.kvz", backend=backend)
    assert out.num_layers == cache.num_layers
    for a, b in zip(cache.keys + cache.values, out.keys + out.values, strict=True):
        assert type(a) is type(b)
        assert tuple(a.shape) == tuple(b.shape)
        assert bits(a) == bits(b)
    assert out.dtype == dtype
    np.testing.assert_array_equal(out.token_ids, cache.token_ids)
    assert out.model == cache.model
    assert out.tokenizer_fingerprint == cache.tokenizer_fingerprint
    assert out.layer_info == [{"sliding_window": 8}, None, {}]


@pytest.mark.parametrize("codec_id", list_codecs())
def test_every_codec_round_trips_through_a_file(tmp_path, codec_id):
    codec = codec_or_skip(codec_id)
    cache = synthetic_cache(tokens=16)
    save(cache, tmp_path / "c.kvz", codec=codec_id)
    out = load(tmp_path / "c.kvz")
    out_torch = load(tmp_path / "c.kvz", backend="torch")
    for role, xs, ys in (("key", cache.keys, out.keys), ("value", cache.values, out.values)):
        c = codec.for_role(role)
        for x, y, yt in zip(xs, ys, out_torch.values if role == "value" else out_torch.keys,
                            strict=True):
            # the file changes nothing: same values as encoding and decoding in memory
            assert bits(y) == bits(c.decode(c.encode(x)))
            np.testing.assert_allclose(as_f32(yt), as_f32(y), rtol=1e-2, atol=1e-2)
            x32 = as_f32(x)
            rel = float(((as_f32(y) - x32) ** 2).sum() / (x32**2).sum())
            assert rel < (1e-12 if codec_id == "raw" else 0.3), (codec_id, role, rel)


def test_policy_segments_are_stored_as_given(tmp_path):
    policy = CodecPolicy.from_options(key_codec="turbo4", value_codec="turbo3", protect_layers=1,
                                      sink_tokens=2, recent_tokens=3)
    cache = synthetic_cache(layers=4, tokens=12)
    save(cache, tmp_path / "p.kvz", policy)
    with open_kvz(tmp_path / "p.kvz") as f:
        for i in range(4):
            for role in C.ROLES:
                want = policy.segments(role, i, 4, 12)
                got = f.encoded(i, role)
                assert [(s["start"], s["stop"]) for s, _ in got] == \
                    [(s.start, s.stop) for s in want]
                assert [s["codec"] for s, _ in got] == [s.codec.get_config() for s in want]
        assert CodecPolicy.from_json(f.header["policy"]) == policy
    out = load(tmp_path / "p.kvz")
    # lossless parts (protected layers, sink and recent tokens) are bit-exact
    assert bits(out.keys[0]) == bits(cache.keys[0])
    assert bits(out.values[3]) == bits(cache.values[3])
    for x, y in ((cache.keys[1], out.keys[1]), (cache.values[2], out.values[2])):
        assert bits(y[:, :2]) == bits(x[:, :2]) and bits(y[:, -3:]) == bits(x[:, -3:])
        assert bits(y[:, 2:-3]) != bits(x[:, 2:-3])


def test_load_dtype_layers_and_backend(tmp_path):
    cache = synthetic_cache(layers=4, layer_info=[{"i": i} for i in range(4)])
    save(cache, tmp_path / "c.kvz", codec="turbo3")
    full = load(tmp_path / "c.kvz")
    sub = load(tmp_path / "c.kvz", layers=[3, 1], dtype="fp32", backend="torch")
    assert sub.num_layers == 2 and sub.dtype == "float32"
    assert sub.layer_info == [{"i": 3}, {"i": 1}]
    np.testing.assert_allclose(as_f32(sub.keys[0]), as_f32(full.keys[3]), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="dtype"):
        load(tmp_path / "c.kvz", dtype="int8")
    with pytest.raises(IndexError):
        load(tmp_path / "c.kvz", layers=[4])


def test_zstd_is_smaller_and_lossless(tmp_path):
    cache = synthetic_cache(tokens=64, dtype="bfloat16")
    plain = save(cache, tmp_path / "a.kvz")
    packed = save(cache, tmp_path / "b.kvz", zstd=True)
    assert packed["file_bytes"] < plain["file_bytes"]
    with open_kvz(tmp_path / "b.kvz") as f:
        assert f.info()["zstd_tensors"] > 0
        assert f.verify() == []
    out = load(tmp_path / "b.kvz")
    assert all(bits(a) == bits(b) for a, b in zip(cache.keys, out.keys, strict=True))
    save(cache, tmp_path / "c.kvz", zstd=19)
    with pytest.raises(ValueError, match="zstd"):
        save(cache, tmp_path / "d.kvz", zstd=99)


def test_empty_and_sliding_window_layers(tmp_path):
    keys = [np.ones((2, 10, 8), np.float16), np.ones((2, 4, 8), np.float16)]
    cache = KVCache(keys, [k * 2 for k in keys], token_ids=np.arange(10),
                    layer_info=[{}, {"sliding_window": 4}])
    save(cache, tmp_path / "s.kvz", codec="turbo3", sink_tokens=1)
    out = load(tmp_path / "s.kvz")
    assert out.keys[1].shape == (2, 4, 8) and out.num_tokens == 10
    empty = KVCache([np.zeros((2, 0, 8), np.float32)], [np.zeros((2, 0, 8), np.float32)])
    save(empty, tmp_path / "e.kvz", codec="turbo3")
    out = load(tmp_path / "e.kvz")
    assert out.keys[0].shape == (2, 0, 8) and out.token_ids is None and out.dtype == "float32"


# -- lazy access -----------------------------------------------------------------------------------
def _spy_reads(monkeypatch) -> list[str]:
    names: list[str] = []
    original = KvzFile._stored

    def spy(self, entry):
        names.append(entry.name)
        return original(self, entry)

    monkeypatch.setattr(KvzFile, "_stored", spy)
    return names


def test_single_layer_reads_only_that_layer(tmp_path, monkeypatch):
    cache = synthetic_cache(layers=5)
    save(cache, tmp_path / "c.kvz", codec="turbo3", sink_tokens=2)
    full = load(tmp_path / "c.kvz")
    reads = _spy_reads(monkeypatch)
    with open_kvz(tmp_path / "c.kvz") as f:
        assert reads == []  # opening reads the header only
        assert (f.num_layers, f.num_tokens) == (5, 12)
        k, v = f.layer(3)
        assert reads and all(n.startswith("layers.3.") for n in reads)
        assert bits(k) == bits(full.keys[3]) and bits(v) == bits(full.values[3])
        kt, _ = f.layer(3, dtype="bf16", backend="torch")
        assert kt.dtype == torch.bfloat16
        assert isinstance(f.to_cache(), KVCache)


@pytest.mark.parametrize("n", [0, 1, 2, 5, 9, 12])
def test_token_prefix_reads_only_needed_segments(tmp_path, monkeypatch, n):
    cache = synthetic_cache(tokens=12)
    save(cache, tmp_path / "c.kvz", codec="turbo3", sink_tokens=2, recent_tokens=3)
    want = load(tmp_path / "c.kvz").prefix(n)
    reads = _spy_reads(monkeypatch)
    got = load(tmp_path / "c.kvz", tokens=n)
    assert got.num_tokens == n and len(got.token_ids) == n
    for a, b in zip(want.keys + want.values, got.keys + got.values, strict=True):
        assert bits(a) == bits(b)
    segments_read = {r.split(".")[3] for r in reads if r.startswith("layers.")}
    expected = {"0"} if n <= 2 else {"0", "1"} if n <= 9 else {"0", "1", "2"}
    assert segments_read == (expected if n else set())
    with pytest.raises(ValueError):
        load(tmp_path / "c.kvz", tokens=13)


@pytest.mark.parametrize("tokens, error", [(True, TypeError), (2.5, TypeError),
                                           (-1, ValueError), (13, ValueError)])
def test_a_token_prefix_that_is_not_a_count_within_the_file_is_refused(tmp_path, tokens, error):
    """``tokens=True`` read a 1-token prefix; ``layer(i, tokens=...)`` cut 13 of 12 tokens to
    all 12 and failed on -1 with numpy's "negative dimensions"."""
    save(synthetic_cache(tokens=12), tmp_path / "c.kvz", codec="turbo3", sink_tokens=2)
    with pytest.raises(error, match="tokens"):
        load(tmp_path / "c.kvz", tokens=tokens)
    with open_kvz(tmp_path / "c.kvz") as f, pytest.raises(error, match="tokens"):
        f.layer(0, tokens=tokens)
    assert load(tmp_path / "c.kvz", tokens=np.int32(3)).num_tokens == 3


# -- determinism, container compatibility, transcoding ---------------------------------------------
def test_identical_bytes_on_resave(tmp_path):
    cache = synthetic_cache()
    for i, opts in enumerate([{}, {"codec": "turbo3", "zstd": True},
                              {"key_codec": "turbo4", "sink_tokens": 1}]):
        save(cache, tmp_path / f"a{i}.kvz", **opts)
        save(synthetic_cache(), tmp_path / f"b{i}.kvz", **opts)
        assert (tmp_path / f"a{i}.kvz").read_bytes() == (tmp_path / f"b{i}.kvz").read_bytes()
    save(cache.to_torch(), tmp_path / "t.kvz")
    assert (tmp_path / "t.kvz").read_bytes() == (tmp_path / "a0.kvz").read_bytes()


@pytest.mark.parametrize("framework", ["np", "pt"])
def test_any_safetensors_reader_lists_and_reads_the_tensors(tmp_path, framework):
    from safetensors import safe_open

    cache = synthetic_cache(dtype="bfloat16")
    save(cache, tmp_path / "c.kvz", key_codec="turbo3", sink_tokens=2)
    with open_kvz(tmp_path / "c.kvz") as f:
        table = f.header["tensors"]
        with safe_open(str(tmp_path / "c.kvz"), framework) as st:
            assert sorted(st.keys()) == sorted(table)
            assert st.metadata()["kvz.format"] == "kvz"
            assert st.metadata()["kvz.format_version"] == "1"
            for name in st.keys():
                assert bits(st.get_tensor(name)) == bits(f.read_tensor(name))
            assert bits(st.get_tensor("layers.0.value.0.data")) == bits(cache.values[0])


def test_transcode(tmp_path):
    cache = synthetic_cache(tokens=32)
    save(cache, tmp_path / "raw.kvz")
    small = transcode(tmp_path / "raw.kvz", tmp_path / "t3.kvz", "turbo3")
    assert small["ratio"] > 1.0
    back = transcode(tmp_path / "t3.kvz", tmp_path / "f32.kvz", CodecPolicy.from_options("raw"),
                     dtype="fp32")
    assert back["file_bytes"] > small["file_bytes"]
    out = load(tmp_path / "f32.kvz")
    assert out.dtype == "float32" and out.model == cache.model
    np.testing.assert_array_equal(out.token_ids, cache.token_ids)
    assert bits(out.keys[1]) == bits(load(tmp_path / "t3.kvz", dtype="fp32").keys[1])
    transcode(tmp_path / "t3.kvz", tmp_path / "t3.kvz", "raw")  # in place
    assert load(tmp_path / "t3.kvz").dtype == "float16"


# -- atomic writes ---------------------------------------------------------------------------------
def _leftovers(directory) -> list[str]:
    return sorted(p for p in os.listdir(directory) if p.endswith(".tmp"))


def test_failed_write_leaves_previous_file_and_no_temp(tmp_path, monkeypatch):
    from kvtool.formats import container

    path = tmp_path / "c.kvz"
    save(synthetic_cache(), path)
    before = path.read_bytes()
    calls = {"n": 0}
    original = container.Blob.nbytes.fget

    def fail_midway(self):  # the writer asks each blob's size while writing; fail in the middle
        calls["n"] += 1
        if calls["n"] > 20:
            raise OSError("disk full (simulated)")
        return original(self)

    monkeypatch.setattr(container.Blob, "nbytes", property(fail_midway))
    with pytest.raises(OSError, match="disk full"):
        save(synthetic_cache(seed=1), path, codec="turbo3")
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert _leftovers(tmp_path) == []


def test_interrupted_fsync_and_codec_error_leave_previous_file(tmp_path, monkeypatch):
    from kvtool.formats import writer

    path = tmp_path / "c.kvz"
    save(synthetic_cache(), path)
    before = path.read_bytes()
    monkeypatch.setattr(writer.os, "fsync", lambda fd: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        save(synthetic_cache(seed=2), path)
    monkeypatch.undo()
    bad = synthetic_cache()
    bad.keys[1][0, 0, 0] = np.nan
    with pytest.raises(Exception, match="NaN"):
        save(bad, path, codec="turbo3")
    assert path.read_bytes() == before and _leftovers(tmp_path) == []
    assert load(path).num_layers == 3


# -- reader safety ---------------------------------------------------------------------------------
@pytest.fixture
def small_file(tmp_path):
    path = tmp_path / "small.kvz"
    save(synthetic_cache(), path, codec="turbo3", sink_tokens=2, zstd=True)
    return path


def test_verify_reports_a_damaged_token_tensor_once(small_file, tmp_path):
    rewrite_header(small_file, tmp_path / "t.kvz",
                   lambda h: h["tensors"]["tokens"].update(crc32="00000000"))
    with open_kvz(tmp_path / "t.kvz", verify=False) as f:
        assert f.verify() == ["checksum mismatch in tensor 'tokens' (file corrupted)"]


def test_unknown_codec_names_the_codec_and_plugins(small_file, tmp_path):
    def rename(h):
        h["layers"][1]["key"]["segments"][1]["codec"]["id"] = "nosuchcodec"

    rewrite_header(small_file, tmp_path / "u.kvz", rename)
    with open_kvz(tmp_path / "u.kvz") as f:  # opening and inspecting still work
        assert f.info()["codecs"]["nosuchcodec"] == 1
        assert any("nosuchcodec" in p for p in f.verify())
        f.layer(0)
        with pytest.raises(FormatError, match="nosuchcodec.*plugin"):
            f.layer(1)
    with pytest.raises(FormatError, match="nosuchcodec.*plugin"):
        load(tmp_path / "u.kvz")


def test_future_major_version_is_refused(small_file, tmp_path):
    metadata, blobs = read_parts(small_file)
    for version, ok in (("2", False), ("1.7", True), ("10.0", False), ("one", False),
                        ("1.0", True), ("\uff11", False), ("01", False), ("1.07", False),
                        ("1\n", False)):  # ASCII decimal only, as written: no "１" or "01"
        metadata["kvz.format_version"] = version
        write_parts(tmp_path / "v.kvz", metadata, blobs)
        if ok:
            load(tmp_path / "v.kvz")
        else:
            with pytest.raises(FormatError, match=re.escape(version.strip())) as e:
                load(tmp_path / "v.kvz")
            assert "\n" not in str(e.value)


def test_unknown_optional_keys_are_ignored(small_file, tmp_path):
    def extend(h):
        h["future_key"] = {"anything": [1, 2]}
        h["layers"][0]["key"]["segments"][0]["future"] = True
        h["tensors"]["tokens"]["future"] = "x"

    rewrite_header(small_file, tmp_path / "x.kvz", extend)
    metadata, blobs = read_parts(tmp_path / "x.kvz")
    metadata["kvz.something_new"] = "1"
    write_parts(tmp_path / "x.kvz", metadata, blobs)
    assert load(tmp_path / "x.kvz").num_layers == 3


def test_bytes_of_no_tensor_are_refused(small_file, tmp_path):
    """safetensors covers its data section exactly: bytes appended after the last tensor (or
    a hole between two) would be carried along unread and unchecked."""
    (tmp_path / "t.kvz").write_bytes(small_file.read_bytes() + b"\0" * 64)
    with pytest.raises(FormatError, match="64 bytes after the last tensor"):
        load(tmp_path / "t.kvz")
    metadata, blobs = read_parts(small_file)
    write_parts(tmp_path / "h.kvz", metadata, blobs)
    data = bytearray((tmp_path / "h.kvz").read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    first = min((k for k in header if k != "__metadata__"),
                key=lambda k: header[k]["data_offsets"][0])
    header[first]["data_offsets"] = [x + 8 for x in header[first]["data_offsets"]]
    for k in header:  # every tensor moves up 8 bytes but the first: a hole before it
        if k not in ("__metadata__", first):
            header[k]["data_offsets"] = [x + 8 for x in header[k]["data_offsets"]]
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    body = data[8 + n:]
    (tmp_path / "h.kvz").write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * 8 + body)
    with pytest.raises(FormatError, match="8 bytes before tensor"):
        load(tmp_path / "h.kvz")


@pytest.mark.parametrize("edit, message", [
    (lambda h: h.update(num_tokens=1000), "num_tokens is 1000, but the longest layer holds 12"),
    (lambda h: h.update(layer_info=[{"sliding_window": -1}, None, None]),
     "sliding_window -1 is not a positive integer"),
    (lambda h: h.update(layer_info=[{"sliding_window": "8"}, None, None]),
     "sliding_window 8 is not a positive integer"),
    (lambda h: h.update(dtype="float32"), "'dtype' float32 is not the first layer's float16"),
])
def test_token_counts_that_disagree_are_refused(small_file, tmp_path, edit, message):
    rewrite_header(small_file, tmp_path / "n.kvz", edit)
    with pytest.raises(FormatError, match=message):
        load(tmp_path / "n.kvz")


@pytest.mark.parametrize("place", [
    {"key": "A" * 64, "start": 0}, {"key": "a" * 63, "start": 0}, {"key": "a" * 64},
    {"key": "a" * 64, "start": -12}, {"key": "a" * 64, "start": 5},
    {"key": "a" * 64, "start": True}, ["a" * 64, 0],
])
def test_a_store_chunk_place_no_writer_records_is_refused(small_file, tmp_path, place):
    """``store_chunk``: 64 lowercase hex digits and a start that is a whole number of chunks
    (the file's 12 tokens); the reader refuses anything else, the writer never writes it."""
    rewrite_header(small_file, tmp_path / "s.kvz", lambda h: h.update(store_chunk=place))
    with pytest.raises(FormatError, match="store_chunk must be"):
        load(tmp_path / "s.kvz")
    rewrite_header(small_file, tmp_path / "ok.kvz",
                   lambda h: h.update(store_chunk={"key": "0a" * 32, "start": 24}))
    assert open_kvz(tmp_path / "ok.kvz").store_chunk == {"key": "0a" * 32, "start": 24}
    with pytest.raises(ValueError, match="store_chunk must be"):
        save(load(small_file), tmp_path / "w.kvz", store_chunk=place)


def test_token_ids_must_be_one_per_token(small_file, tmp_path):
    """40 ids over 12 tokens of K/V: a store would key chunks by ids that have no K/V."""
    metadata, blobs = read_parts(small_file)
    tokens = next(b for b in blobs if b.name == C.TOKENS_TENSOR)
    ids = np.arange(40, dtype=np.int32)
    blobs[blobs.index(tokens)] = type(tokens)(tokens.name, "I32", (40,), ids.tobytes())
    write_parts(tmp_path / "i.kvz", metadata, blobs)

    def grow(h):
        h["token_ids"]["count"] = 40
        h["tensors"][C.TOKENS_TENSOR]["shape"] = [40]
        h["tensors"][C.TOKENS_TENSOR]["crc32"] = crc32_hex(ids.tobytes())

    rewrite_header(tmp_path / "i.kvz", tmp_path / "i.kvz", grow)
    with pytest.raises(FormatError, match="40 token ids for 12 tokens"):
        load(tmp_path / "i.kvz")



def test_negative_token_ids_are_refused(small_file, tmp_path):
    cache = synthetic_cache()
    cache.token_ids[3] = -5
    with pytest.raises(ValueError, match="token id -5 is negative"):
        save(cache, tmp_path / "neg.kvz")
    metadata, blobs = read_parts(small_file)
    tokens = next(b for b in blobs if b.name == C.TOKENS_TENSOR)
    ids = np.frombuffer(bytes(tokens.data), np.int32).copy()
    ids[0] = -5
    blobs[blobs.index(tokens)] = type(tokens)(tokens.name, tokens.st_dtype, tokens.shape,
                                              ids.tobytes())
    write_parts(tmp_path / "neg.kvz", metadata, blobs)
    rewrite_header(tmp_path / "neg.kvz", tmp_path / "neg.kvz", lambda h: h["tensors"][
        C.TOKENS_TENSOR].update(crc32=crc32_hex(ids.tobytes())))
    with pytest.raises(FormatError, match="token id -5 is negative"):
        load(tmp_path / "neg.kvz")
    with open_kvz(tmp_path / "neg.kvz") as f:
        assert any("token id -5 is negative" in p for p in f.verify())


def test_a_short_layer_saves_only_as_a_sliding_window_layer(tmp_path):
    cache = synthetic_cache()
    cache.keys[1], cache.values[1] = cache.keys[1][:, 4:], cache.values[1][:, 4:]
    with pytest.raises(ValueError, match="layer 1 holds 8 of 12 tokens"):
        save(cache, tmp_path / "s.kvz")
    assert not (tmp_path / "s.kvz").exists()
    cache.layer_info = [{}, {"sliding_window": 10}, {}]  # it keeps its last 9 tokens
    with pytest.raises(ValueError, match="layer 1 holds 8 of 12 tokens, fewer than its"):
        save(cache, tmp_path / "s.kvz")
    cache.layer_info = [{}, {"sliding_window": 8}, {}]
    save(cache, tmp_path / "s.kvz")
    assert load(tmp_path / "s.kvz").keys[1].shape == (2, 8, 32)
    # a file claiming the wider window for the same 8 tokens: no writer's, refused on read
    rewrite_header(tmp_path / "s.kvz", tmp_path / "w.kvz",
                   lambda h: h.update(layer_info=[{}, {"sliding_window": 10}, {}]))
    with pytest.raises(FormatError, match="layer 1 holds 8 of 12 tokens, fewer than its"):
        load(tmp_path / "w.kvz")


def test_a_cast_past_float16s_range_is_refused_not_inf(tmp_path):
    import ml_dtypes

    from kvtool.errors import KvtoolError

    cache = synthetic_cache(dtype="bfloat16")
    cache.keys[1][0, 3, 5] = ml_dtypes.bfloat16(70000)
    save(cache, tmp_path / "b.kvz")
    assert load(tmp_path / "b.kvz", dtype="float32").keys[1][0, 3, 5] == 70144  # bf16 of 7e4
    for backend in ("numpy", "torch"):
        with warnings.catch_warnings(), \
                pytest.raises(KvtoolError, match="layer 1 key holds values past float16's 65504"):
            warnings.simplefilter("error")  # the refusal alone: numpy's overflow warning came first
            load(tmp_path / "b.kvz", dtype="float16", backend=backend)


def test_a_bad_kernels_setting_is_not_blamed_on_the_file(small_file, monkeypatch):
    from kvtool.errors import CodecError

    monkeypatch.setenv("KVTOOL_KERNELS", "bogus")
    with pytest.raises(CodecError, match="KVTOOL_KERNELS='bogus' is not one of") as e:
        load(small_file)
    assert not isinstance(e.value, FormatError)


def test_a_prefix_is_not_cut_from_a_layer_that_kept_only_the_last_tokens(tmp_path):
    """A sliding-window layer holds the latest positions: its first stored tokens are not the
    prefix's, so a prefix of the file (or of the cache) is refused, not mislabelled."""
    pos = np.arange(10, dtype=np.float32)
    full = np.broadcast_to(pos[None, :, None], (1, 10, 8)).copy()
    last = full[:, 6:].copy()
    cache = KVCache([full, last], [full, last], token_ids=np.arange(10),
                    layer_info=[{}, {"sliding_window": 4}])
    save(cache, tmp_path / "s.kvz")
    for cut in (lambda: load(tmp_path / "s.kvz", tokens=5), lambda: cache.prefix(5)):
        with pytest.raises(ValueError, match="layer 1 keeps only the last 4 of 10 tokens"):
            cut()
    assert load(tmp_path / "s.kvz", tokens=10).keys[1][0, :, 0].tolist() == [6, 7, 8, 9]
    assert load(tmp_path / "s.kvz", layers=[0], tokens=5).keys[0].shape == (1, 5, 8)


def test_a_missing_cuda_device_is_not_blamed_on_the_file(small_file, monkeypatch):
    import torch

    from kvtool.errors import KvtoolError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(KvtoolError, match="no CUDA device") as e:
        load(small_file, device="cuda")
    assert not isinstance(e.value, FormatError)


def test_layer_indices_and_the_policy_argument_are_type_checked(small_file, tmp_path):
    for layers in ([1.7], [True], ["1"]):  # 1.7 was read as layer 1
        with pytest.raises(TypeError, match="layer indices must be integers"):
            load(small_file, layers=layers)
    assert load(small_file, layers=[np.int64(1)]).num_layers == 1
    with pytest.raises(TypeError, match="policy must be a CodecPolicy"):
        save(synthetic_cache(), tmp_path / "p.kvz", "turbo3")
    with pytest.raises(ValueError, match="model info keys must be strings"):
        save(synthetic_cache(model={1: 2}), tmp_path / "p.kvz")


def test_checksums_catch_corruption(small_file, tmp_path):
    data = bytearray(small_file.read_bytes())
    data[-5] ^= 0x10  # inside the last tensor
    (tmp_path / "bad.kvz").write_bytes(bytes(data))
    with open_kvz(tmp_path / "bad.kvz") as f:
        problems = f.verify()
        assert len(problems) == 1 and "checksum mismatch" in problems[0]
    with pytest.raises(FormatError, match="checksum mismatch"):
        load(tmp_path / "bad.kvz")
    load(tmp_path / "bad.kvz", verify=False)  # corrupt values, but readable on request


def test_foreign_and_hostile_files(tmp_path):
    from safetensors.numpy import save_file

    save_file({"a": np.zeros(3, np.float32)}, str(tmp_path / "plain.safetensors"))
    cases = {
        "plain.safetensors": None,
        "empty.kvz": b"",
        "short.kvz": b"\x05\x00",
        "huge_header.kvz": (2**40).to_bytes(8, "little") + b"{}",
        "not_json.kvz": (4).to_bytes(8, "little") + b"{abc",
        "nested.kvz": (200_000).to_bytes(8, "little") + b"[" * 100_000 + b"]" * 100_000,
        "pickle.kvz": b"\x80\x04\x95" + b"\x00" * 64,
    }
    for name, content in cases.items():
        if content is not None:
            (tmp_path / name).write_bytes(content)
        with pytest.raises(FormatError) as e:
            load(tmp_path / name)
        assert "\n" not in str(e.value), name


def test_header_schema_errors_are_format_errors(small_file, tmp_path):
    mutations = [
        lambda h: h.pop("layers"),
        lambda h: h.__setitem__("num_layers", 7),
        lambda h: h["layers"][0]["key"]["segments"][0].__setitem__("stop", 1),
        lambda h: h["layers"][0]["key"].__setitem__("shape", [2, 12, 10**6]),
        lambda h: h["layers"][2]["value"]["segments"].pop(),
        lambda h: h["tensors"]["tokens"].__setitem__("crc32", "zz"),
        lambda h: h["tensors"]["tokens"].__setitem__("shape", [13]),
        lambda h: h["tensors"].pop("layers.1.key.1.codes"),
        lambda h: h["layers"][1]["key"]["segments"][1]["codec"].__setitem__("seed", -1),
        lambda h: h["layers"][1]["key"]["segments"][1]["tensors"].pop("norms"),
        lambda h: h.__setitem__("dtype", "int8"),
        lambda h: h.__setitem__("layer_info", [1, 2, 3]),
    ]
    for i, mutate in enumerate(mutations):
        rewrite_header(small_file, tmp_path / f"m{i}.kvz", mutate)
        with pytest.raises(FormatError):
            load(tmp_path / f"m{i}.kvz")


def test_header_is_deterministic_json(small_file):
    metadata, _ = read_parts(small_file)
    raw = metadata["kvz.header"]
    assert raw == json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":"))
    header = json.loads(raw)
    assert header["creator"]["name"] == "kvtool"
    assert set(header["tensors"]) >= {"tokens", "layers.0.key.0.data", "layers.0.key.1.codes"}


def test_available_codecs_helper_lists_turbo():
    assert {"turbo2", "turbo3", "turbo4"} <= set(available_codecs())
    assert NP_DTYPES


def test_layers_and_shapes_the_fingerprinted_layout_contradicts_are_refused(tmp_path):
    """The layout a fingerprint covers declares the layer count and KV shape too: a file that
    dropped a layer and the model's own ``num_layers`` (kept its fingerprint and layout) passed
    ``inspect --verify`` and ``store pin`` and failed only when a model loaded it."""
    from kvtool.identity import canonical_sha256

    def model(layers=3, heads=2, dim=32, **top):
        layout = {"architecture": "llama", "num_layers": layers, "num_kv_heads": heads,
                  "head_dim": dim}
        return {"name": "m", "layout": layout, "fingerprint": canonical_sha256(layout), **top}

    save(synthetic_cache(model=model()), tmp_path / "ok.kvz")
    for bad, message in ((model(4), "3 layers, the model has 4"),
                         (model(heads=4), "num_kv_heads 2, the model has 4"),
                         (model(dim=64), "head_dim 32, the model has 64"),
                         (model(num_layers=4), "model's num_layers is 4, its layout's 3")):
        with pytest.raises(ValueError, match=message):
            save(synthetic_cache(model=bad), tmp_path / "bad.kvz")
        assert not (tmp_path / "bad.kvz").exists()

    def drop_a_layer(header):
        header["layers"] = header["layers"][:2]
        header["num_layers"] = 2

    rewrite_header(tmp_path / "ok.kvz", tmp_path / "edited.kvz", drop_a_layer)
    with pytest.raises(FormatError, match="2 layers, the model has 3"):
        load(tmp_path / "edited.kvz")


def test_windows_and_identities_no_model_has_are_neither_written_nor_read(tmp_path):
    """A layer's sliding window must be the model's (its layout names it, and each layer's
    type where they differ), and a fingerprint must be its layout's: the writer refuses what
    the reader would, and a header edited to declare a window the model lacks is refused."""
    from kvtool.identity import canonical_sha256

    def model(window, types=None):
        layout = {"architecture": "llama", "num_layers": 3, "num_kv_heads": 2, "head_dim": 32,
                  "sliding_window": window, "layer_types": types}
        return {"name": "m", "layout": layout, "fingerprint": canonical_sha256(layout)}

    info = [{"sliding_window": 8}, None, None]
    save(synthetic_cache(model=model(8), layer_info=info), tmp_path / "ok.kvz")
    types = ["sliding_attention", "full_attention", "full_attention"]
    save(synthetic_cache(model=model(8, types), layer_info=info), tmp_path / "ok2.kvz")
    for bad, message in ((model(None), "sliding window of 8"), (model(4), "sliding window of 8"),
                         (model(8, types[::-1]), "sliding window of 8"),
                         ({**model(8), "fingerprint": "0" * 64}, "does not match its layout")):
        with pytest.raises(ValueError, match=message):
            save(synthetic_cache(model=bad, layer_info=info), tmp_path / "bad.kvz")
        assert not (tmp_path / "bad.kvz").exists()

    def add_window(header):
        header["layer_info"] = [None, {"sliding_window": 8}, None]

    rewrite_header(tmp_path / "ok2.kvz", tmp_path / "edited.kvz", add_window)
    with pytest.raises(FormatError, match="layer 1: a sliding window of 8"):
        load(tmp_path / "edited.kvz")


def test_a_weights_fingerprint_is_a_sha256_digest_or_absent(tmp_path):
    """``model.weights`` names a checkpoint (:func:`kvtool.checkpoint.weights_fingerprint`): a
    reader compares it, so a value no writer gives (a number, a short or upper-case hex) is
    neither written nor read, while null and a digest are."""
    base = synthetic_cache().model
    for ok in (None, "a" * 64):
        save(synthetic_cache(model={**base, "weights": ok}), tmp_path / "ok.kvz")
        assert load(tmp_path / "ok.kvz").model.get("weights") == ok
    for bad in (5, "abc", "A" * 64, ["a" * 64]):
        with pytest.raises(ValueError, match="model.weights must be a sha256"):
            save(synthetic_cache(model={**base, "weights": bad}), tmp_path / "bad.kvz")
        assert not (tmp_path / "bad.kvz").exists()
        rewrite_header(tmp_path / "ok.kvz", tmp_path / "edited.kvz",
                       lambda h, bad=bad: h["model"].update(weights=bad))
        with pytest.raises(FormatError, match="model.weights must be a sha256"):
            load(tmp_path / "edited.kvz")


def test_the_specs_worked_example_is_what_the_writer_writes(tmp_path):
    """docs/format.md section 11 is a real dump: the same cache saved today gives the file
    size, header length, header checksum and tensor checksums it shows."""
    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "format.md")).read()
    example = doc[doc.index("## 11. Worked example"):]
    rng = np.random.default_rng(0)
    keys, values = (rng.standard_normal((2, 4, 8)).astype(np.float16) for _ in range(2))
    cache = KVCache([keys], [values], token_ids=np.array([1, 2, 3, 4]),
                    model={"name": "example", "architecture": "LlamaForCausalLM",
                           "fingerprint": "3f2a9c4e1b7d5a60"},
                    tokenizer_fingerprint="9b1e44c0a2f3d815")
    path = tmp_path / "example.kvz"
    save(cache, path, key_codec="turbo3", value_codec="raw", sink_tokens=1)
    data = path.read_bytes()
    size, first8, length = re.search(
        r"File: (\d+) bytes; first 8 bytes ([0-9a-f]{16}) = header length (\d+)", example).groups()
    assert (len(data), data[:8].hex(), int.from_bytes(data[:8], "little")) == (
        int(size), first8, int(length))
    with open_kvz(path) as f:  # the raw tensors' checksums: a codec's floats (and so the
        tensor_crcs = {name: t["crc32"] for name, t in f.header["tensors"].items()  # header's)
                       if name.endswith(("data", "tokens"))}  # may round apart on other CPUs
    assert len(tensor_crcs) == 3
    for name, crc in tensor_crcs.items():
        assert re.search(rf'"{re.escape(name)}": {{"compression": "none", "crc32": "{crc}"',
                         example), name
