"""rANS entropy coding of stored tensors (``"compression": "rans"``, docs/format.md 6.2)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from kvz_util import read_parts, synthetic_cache, write_parts

from kvtool.cli.main import cli
from kvtool.codecs import entropy as E
from kvtool.codecs import get_codec
from kvtool.errors import FormatError
from kvtool.formats import constants as C
from kvtool.formats import load, open_kvz, save
from kvtool.formats.container import Blob, crc32_hex
from kvtool.kernels import cpu_kernels

GOLDEN = Path(__file__).resolve().parent / "golden"
P8 = np.array([.02, .08, .17, .23, .23, .17, .08, .02])  # a Lloyd–Max-like skew


@pytest.fixture(params=["compiled", "reference"])
def kernels(request, monkeypatch):
    """Run a test through the numba kernels and through the numpy reference."""
    if request.param == "compiled" and cpu_kernels() is None:
        pytest.skip("numba is not installed")
    if request.param == "reference":
        monkeypatch.setenv("KVTOOL_KERNELS", "reference")
    return request.param


def skewed_codes(rng, shape=(3, 1000, 64), bits=3) -> np.ndarray:
    """Bit-packed codes whose per-(head, coordinate) distribution is skewed differently."""
    heads, tokens, dim = shape
    shift = rng.integers(-2, 3, size=(heads, 1, dim))
    sym = np.clip(rng.choice(8, size=shape, p=P8) + shift, 0, (1 << bits) - 1)
    from kvtool.kernels import bitpack, numpy_ops

    return bitpack.pack_bits(numpy_ops, sym.astype(np.uint8), bits)


def blob_of(data: np.ndarray, **kw) -> np.ndarray:
    return np.frombuffer(E.encode(data.reshape(-1), **kw), np.uint8).copy()


@pytest.mark.parametrize(("bits", "dim"), [(1, 16), (2, 32), (3, 64), (3, 10), (4, 7), (5, 9),
                                           (7, 3), (8, 5)])
def test_round_trip_is_exact_for_every_width(kernels, rng, bits, dim):
    sym = rng.integers(0, 1 << bits, size=(2, 37, dim)).astype(np.uint8)
    sym[0, :, 0] = 0  # a constant column: a one-symbol table
    from kvtool.kernels import bitpack, numpy_ops

    packed = bitpack.pack_bits(numpy_ops, sym, bits)
    data = packed.reshape(-1)
    blob = blob_of(packed, code_bits=bits, row_bytes=packed.shape[-1], lead=2)
    assert np.array_equal(E.decode(blob, data.size), data)


def test_kernels_and_reference_write_and_read_the_same_bytes(rng, monkeypatch):
    if cpu_kernels() is None:
        pytest.skip("numba is not installed")
    packed = skewed_codes(rng)
    kw = {"code_bits": 3, "row_bytes": packed.shape[-1], "lead": 3}
    fast = blob_of(packed, **kw)
    monkeypatch.setenv("KVTOOL_KERNELS", "reference")
    assert np.array_equal(blob_of(packed, **kw), fast)
    assert np.array_equal(E.decode(fast, packed.size), packed.reshape(-1))


def test_skewed_codes_cost_less_than_fixed_width(rng):
    packed = skewed_codes(rng)
    blob = blob_of(packed, code_bits=3, row_bytes=packed.shape[-1], lead=3)
    elements = packed.size * 8 // 3
    assert blob.size * 8 / elements < 2.75  # fixed width: 3 bits; order-0 entropy ≈ 2.8
    layout = E._parse(blob, packed.size)[0]
    assert (layout.bits, layout.groups, layout.columns) == (3, 3, 64)  # per (head, coordinate)


def test_bytes_of_other_dtypes_round_trip(kernels, rng):
    norms = (rng.gamma(4.0, 2.0, size=(3, 3000))).astype(np.float16)
    data = norms.view(np.uint8).reshape(-1)
    blob = blob_of(norms.view(np.uint8), row_bytes=2, lead=3)
    assert E._parse(blob, data.size)[0].bits == 8
    assert np.array_equal(E.decode(blob, data.size), data)
    assert blob.size < data.size  # the exponent byte carries few bits


def test_turbo3_file_is_smaller_and_decodes_to_the_same_values(tmp_path, rng):
    cache = synthetic_cache(layers=2, heads=3, tokens=256, dim=64)
    fixed = save(cache, tmp_path / "fixed.kvz", codec="turbo3")
    coded = save(cache, tmp_path / "rans.kvz", codec="turbo3", entropy=True)
    assert coded["file_bytes"] < fixed["file_bytes"]
    with open_kvz(tmp_path / "rans.kvz") as f:
        table = f.header[C.H_TENSORS]
        assert table["layers.0.key.0.codes"]["compression"] == C.COMPRESSION_RANS
        assert f.verify() == []
    a, b = load(tmp_path / "fixed.kvz"), load(tmp_path / "rans.kvz")
    for x, y in zip(a.keys + a.values, b.keys + b.values, strict=True):
        assert np.array_equal(x, y)
    with open_kvz(tmp_path / "rans.kvz") as f, open_kvz(tmp_path / "fixed.kvz") as g:
        for i in range(2):  # the stored codes themselves, not just the decoded values
            for role in C.ROLES:
                (_, e1), (_, e2) = f.encoded(i, role)[0], g.encoded(i, role)[0]
                assert np.array_equal(e1.arrays["codes"], e2.arrays["codes"])


def test_tiny_and_constant_tensors_stay_valid(tmp_path, monkeypatch):
    cache = synthetic_cache(layers=1, heads=1, tokens=2, dim=8)  # too small to pay for tables
    save(cache, tmp_path / "tiny.kvz", codec="turbo3", entropy=True)
    with open_kvz(tmp_path / "tiny.kvz") as f:
        assert f.verify() == []
    data = np.zeros(1 << 21, np.uint8)  # codes to ~1.5 KB: past a (lowered) expansion limit
    blob = blob_of(data)
    assert np.array_equal(E.decode(blob, data.size), data)
    from kvtool.formats.writer import _Encoder

    monkeypatch.setattr(C, "MAX_ZSTD_RATIO", 100)
    assert data.size > blob.size * C.MAX_ZSTD_RATIO

    enc = _Encoder(0, entropy=True)
    enc.add("t", data)
    assert enc.table["t"]["compression"] == C.COMPRESSION_NONE


# -- hostile input ---------------------------------------------------------------------------------
def _valid_blob(rng) -> tuple[np.ndarray, np.ndarray]:
    packed = skewed_codes(rng, shape=(2, 40, 16))
    return blob_of(packed, code_bits=3, row_bytes=packed.shape[-1], lead=2), packed.reshape(-1)


def _header(blob: np.ndarray, **fields) -> np.ndarray:
    names = ["version", "bits", "precision", "reserved", "row_bytes", "groups", "columns",
             "lanes", "words"]
    values = dict(zip(names, struct.unpack("<4B5I", blob[:24].tobytes()), strict=True))
    values.update(fields)
    out = blob.copy()
    out[:24] = np.frombuffer(struct.pack("<4B5I", *values.values()), np.uint8)
    return out


@pytest.mark.parametrize("edit", [
    {"version": 2}, {"bits": 0}, {"bits": 9}, {"precision": 7}, {"precision": 16},
    {"reserved": 1}, {"row_bytes": 0}, {"row_bytes": 7}, {"groups": 0}, {"groups": 7},
    {"columns": 0}, {"columns": 17}, {"lanes": 0}, {"lanes": 5000}, {"words": 1 << 31},
    {"words": 0}])
def test_crafted_headers_are_refused(kernels, rng, edit):
    blob, data = _valid_blob(rng)
    with pytest.raises(FormatError):
        E.decode(_header(blob, **edit), data.size)


def test_truncated_tables_states_and_streams_are_refused(kernels, rng):
    blob, data = _valid_blob(rng)
    for cut in (0, 5, 23, 24, 60, blob.size - 2, blob.size - 1):
        with pytest.raises(FormatError):
            E.decode(blob[:cut], data.size)
    with pytest.raises(FormatError, match="does not sum"):
        bad = blob.copy()
        bad[24] ^= 1  # first frequency of the first table
        E.decode(bad, data.size)
    with pytest.raises(FormatError):
        E.decode(blob, data.size + 12)  # a logical size the blob does not hold


def test_a_table_that_still_sums_right_but_lies_is_refused(kernels, rng):
    blob, data = _valid_blob(rng)
    layout = E._parse(blob, data.size)[0]
    bad = blob.copy()
    freqs = bad[24:24 + 2 * layout.tables() * 8].view("<u2")
    i = int(np.argmax(freqs[:8]))
    j = (i + 1) % 8
    freqs[i] -= 5  # move probability mass between two symbols: the sum stays 2**P
    freqs[j] += 5
    with pytest.raises(FormatError, match="corrupt"):
        E.decode(bad, data.size)


def test_fuzzed_blobs_are_refused_or_decode_exactly(kernels, rng):
    """Flip bytes anywhere: a FormatError, or (mutations that change nothing) the same bytes."""
    blob, data = _valid_blob(rng)
    fuzz = np.random.default_rng(7)
    silent = 0
    for _ in range(150 if kernels == "compiled" else 40):
        bad = blob.copy()
        for pos in fuzz.integers(0, bad.size, size=fuzz.integers(1, 4)):
            bad[pos] ^= np.uint8(fuzz.integers(1, 256))
        try:
            out = E.decode(bad, data.size)
        except FormatError:
            continue
        assert np.array_equal(out, data), "a corrupted stream decoded to other data"
        silent += 1
    assert silent < 5


def test_corrupt_rans_tensor_in_a_file_is_a_format_error(tmp_path, rng):
    cache = synthetic_cache(layers=1, heads=3, tokens=256, dim=64)
    path = tmp_path / "rans.kvz"
    save(cache, path, codec="turbo3", entropy=True)
    metadata, blobs = read_parts(path)
    header = json.loads(metadata[C.META_HEADER])
    name = "layers.0.value.0.codes"
    for b in blobs:
        if b.name == name:  # corrupt the stream and refresh every checksum: only rANS checks
            data = bytearray(b.data)
            data[len(data) // 2] ^= 0x5A
            blobs[blobs.index(b)] = Blob(b.name, b.st_dtype, b.shape, bytes(data))
            header[C.H_TENSORS][name]["crc32"] = crc32_hex(bytes(data))
    raw = json.dumps(header, sort_keys=True, separators=(",", ":"))
    metadata[C.META_HEADER], metadata[C.META_HEADER_CRC32] = raw, crc32_hex(raw.encode())
    write_parts(tmp_path / "bad.kvz", metadata, blobs)
    with pytest.raises(FormatError, match="rans"):
        load(tmp_path / "bad.kvz")


# -- golden file and CLI ---------------------------------------------------------------------------
def test_golden_entropy_file_holds_rans_coded_turbo3_codes(kernels):
    expected = json.loads((GOLDEN / "expected.json").read_text())["entropy"]
    with open_kvz(GOLDEN / "entropy.kvz") as f:
        table = f.header[C.H_TENSORS]
        coded = [n for n, t in table.items() if t.get("compression") == C.COMPRESSION_RANS]
        assert "layers.0.key.1.codes" in coded
        blob = f._stored(f._entries["layers.0.key.1.codes"])
        layout = E._parse(blob, int(np.prod(table["layers.0.key.1.codes"]["shape"])))[0]
        assert layout.bits == 3
        assert f.verify() == []
    cache = load(GOLDEN / "entropy.kvz")
    got = float(np.asarray(cache.keys[0], np.float64).sum())
    assert got == pytest.approx(expected["layers"][0]["key"]["sum"], rel=1e-3, abs=1e-2)


def test_cli_compress_entropy_and_decompress_round_trip(tmp_path, runner):
    cache = synthetic_cache(layers=2, heads=3, tokens=300, dim=64)
    src = tmp_path / "raw.kvz"
    save(cache, src)
    for flags, out in ((["--entropy"], "rans.kvz"), ([], "fixed.kvz")):
        result = runner.invoke(cli, ["compress", str(src), "--codec", "turbo3", *flags,
                                     "-o", str(tmp_path / out), "--json"])
        assert result.exit_code == 0, result.output
    assert (tmp_path / "rans.kvz").stat().st_size < 0.93 * (tmp_path / "fixed.kvz").stat().st_size
    result = runner.invoke(cli, ["decompress", str(tmp_path / "rans.kvz"),
                                 "-o", str(tmp_path / "back.kvz")])
    assert result.exit_code == 0, result.output
    fixed, back = load(tmp_path / "fixed.kvz"), load(tmp_path / "back.kvz")
    for x, y in zip(fixed.keys + fixed.values, back.keys + back.values, strict=True):
        assert np.array_equal(x, y)


def test_turbo_codec_bits_drive_the_symbol_width():
    assert get_codec("turbo3").bits == 3  # the writer reads codec.bits for ``codes`` arrays
