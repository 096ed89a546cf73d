"""Fuzzing the reader: truncated, bit-flipped and mutated files end in FormatError, nothing else.

A damaged file may also still load (a flipped bit in a value, with ``verify=False``); what must
never happen is another exception type, a multi-line message, a hang or a huge allocation.
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvz_util import read_parts, rewrite_header, synthetic_cache, write_parts

from kvtool.errors import FormatError
from kvtool.formats import open_kvz, save

# 4 x 500 hypothesis cases by default; KVTOOL_FUZZ_EXAMPLES=20000 for a long local run
FUZZ = settings(max_examples=int(os.environ.get("KVTOOL_FUZZ_EXAMPLES", 500)), deadline=None,
                database=None,
                suppress_health_check=[HealthCheck.too_slow])


class Base:
    """The file under test (a short repr keeps hypothesis' failure reports readable)."""

    def __init__(self, path):
        self.path, self.data = str(path), path.read_bytes()

    def __repr__(self) -> str:
        return f"Base({self.path!r}, {len(self.data)} bytes)"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Base:
    """A small file exercising two codecs, raw sink/recent segments, zstd and token ids."""
    path = tmp_path_factory.mktemp("fuzz") / "base.kvz"
    cache = synthetic_cache(layers=3, heads=2, tokens=10, dim=16)
    cache = cache.map_arrays(lambda a: (a * 4).round() / 4)  # compressible: zstd frames too
    save(cache, path, key_codec="turbo3", value_codec="turbo2", protect_layers=1, sink_tokens=2,
         recent_tokens=2, zstd=True)
    with open_kvz(path) as f:
        assert f.info()["zstd_tensors"] >= 4
    return Base(path)


def check(data: bytes, verify: bool) -> str:
    """Write ``data`` to a temp file and use it every way a user could; 'ok' or 'error'."""
    fd, path = tempfile.mkstemp(suffix=".kvz")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        try:
            with open_kvz(path, verify=verify) as f:
                f.info()
                f.verify()
                f.to_cache()
        except FormatError as e:
            assert "\n" not in str(e)
            return "error"
        return "ok"
    finally:
        os.unlink(path)


def test_every_truncation_is_a_format_error(base):
    data = base.data
    step = max(1, len(data) // 1500)
    for n in range(0, len(data), step):
        assert check(data[:n], verify=n % 2 == 0) == "error", n


@FUZZ
@given(flips=st.lists(st.integers(min_value=0), min_size=1, max_size=3), verify=st.booleans())
def test_bit_flips(base, flips, verify):
    data = base.data
    buf = bytearray(data)
    for bit in flips:
        bit %= len(buf) * 8
        buf[bit // 8] ^= 1 << (bit % 8)
    result = check(bytes(buf), verify)
    if verify and bytes(buf) != data:
        assert result == "error"  # checksums cover the header and every tensor


@FUZZ
@given(pos=st.integers(min_value=0), junk=st.binary(min_size=0, max_size=16),
       cut=st.integers(min_value=0, max_value=16), verify=st.booleans())
def test_random_byte_mutations(base, pos, junk, cut, verify):
    data = base.data
    pos %= len(data)
    check(data[:pos] + junk + data[pos + cut:], verify)


def _paths(obj, prefix=()):
    """Every path into a JSON document."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.sampled_from([0, 1, 2, -1])
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8)
    | st.sampled_from(["float16", "uint8", "zstd", "raw", "turbo3", "tokens", "key"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=3),
    max_leaves=6,
)


@FUZZ
@given(choice=st.integers(min_value=0), value=json_values, delete=st.booleans(),
       verify=st.booleans())
def test_header_value_mutations(base, choice, value, delete, verify, tmp_path_factory):
    """A consistent (checksummed) header with one value changed: the schema checks catch it."""
    header = json.loads(read_parts(base.path)[0]["kvz.header"])
    paths = list(_paths(header))[1:]
    _mutate_and_check(base.path, paths[choice % len(paths)], value, delete, verify,
                      tmp_path_factory.mktemp("hm") / "m.kvz")


def _mutate_and_check(path, target: tuple, value, delete: bool, verify: bool, out) -> None:
    """Rewrite ``path``'s header (checksummed) with the value at ``target`` replaced or
    deleted, then :func:`check` the result."""
    def mutate(h):
        parent = h
        for key in target[:-1]:
            parent = parent[key]
        if delete:
            del parent[target[-1]]
        else:
            parent[target[-1]] = value

    rewrite_header(path, out, mutate)
    check(out.read_bytes(), verify)


@FUZZ
@given(choice=st.integers(min_value=0), field=st.sampled_from(["dtype", "shape", "data_offsets"]),
       value=json_values | st.lists(st.integers(-5, 10**6), max_size=3), verify=st.booleans())
def test_container_entry_mutations(base, choice, field, value, verify):
    """The safetensors entries (dtype, shape, data_offsets) of one tensor changed."""
    import struct

    data = base.data
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    names = sorted(k for k in header if k != "__metadata__")
    header[names[choice % len(names)]][field] = value
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    check(struct.pack("<Q", len(raw)) + raw + data[8 + n:], verify)


def test_metadata_mutations(base, tmp_path):
    path = base.path
    metadata, blobs = read_parts(path)
    for key in list(metadata):
        for value in ("", "0", "{}", "[]", "null", metadata[key][:-3]):
            changed = {**metadata, key: value}
            write_parts(tmp_path / "m.kvz", changed, blobs)
            assert check((tmp_path / "m.kvz").read_bytes(), verify=True) == "error", (key, value)
        without = {k: v for k, v in metadata.items() if k != key}
        write_parts(tmp_path / "m.kvz", without, blobs)
        check((tmp_path / "m.kvz").read_bytes(), verify=True)


LAYERED_POLICY = {"key": "turbo3", "value": "turbo2", "sink_tokens": 2, "num_layers": 3,
                  "layers": {"0": "lossless", "2": {"key": "turbo4"}}}


@pytest.fixture(scope="module")
def layered(tmp_path_factory) -> Base:
    """A small file whose policy gives layers their own codecs (header key ``layer_policy``)."""
    from kvtool.policy import CodecPolicy

    path = tmp_path_factory.mktemp("fuzz") / "layered.kvz"
    save(synthetic_cache(layers=3, heads=2, tokens=10, dim=16), path,
         policy=CodecPolicy.from_json(LAYERED_POLICY))
    return Base(path)


@FUZZ
@given(choice=st.integers(min_value=0), value=json_values, delete=st.booleans(),
       verify=st.booleans())
def test_layer_policy_mutations(layered, choice, value, delete, verify, tmp_path_factory):
    """One value inside ``layer_policy`` changed or deleted: FormatError or a clean load."""
    header = json.loads(read_parts(layered.path)[0]["kvz.header"])
    paths = [("layer_policy",)] + [p for p in _paths(header) if p[:1] == ("layer_policy",)][1:]
    _mutate_and_check(layered.path, paths[choice % len(paths)], value, delete, verify,
                      tmp_path_factory.mktemp("lp") / "m.kvz")


def test_layer_policy_must_match_the_segments(layered, tmp_path):
    out = tmp_path / "m.kvz"
    for change, refused in [
            (lambda h: h["layer_policy"]["layers"].pop("2") and None, True),  # layer 2's own
            (lambda h: h["layer_policy"].update(num_layers=4), True),  # another model
            (lambda h: h["layer_policy"]["layers"].update({"5": "lossless"}), True),
            (lambda h: h["layer_policy"]["layers"].update({"2": {"key": "turbo2"}}), True),
            (lambda h: h.update(policy={"key": "turbo3", "value": "turbo2"}), True),
            (lambda h: h.pop("layer_policy") and None, False),  # what older readers check
            (lambda h: None, False)]:
        rewrite_header(layered.path, out, change)
        assert check(out.read_bytes(), verify=True) == ("error" if refused else "ok")


@pytest.mark.parametrize("edit, message", [
    (lambda frame: frame + b"JUNKJUNK", "bytes follow it"),
    (lambda frame: frame + frame, "bytes follow it"),
    (lambda frame: _frame_without_size(frame), "names no content size")])
def test_a_zstd_tensor_is_one_whole_frame(base, tmp_path, edit, message):
    """Bytes after the frame, a second frame, or a frame that names no size are no writer's,
    even with every checksum made right (format.md 6.1: one zstd frame)."""
    import json

    import zstandard
    from kvz_util import read_parts, write_parts

    from kvtool.formats.container import Blob, crc32_hex

    metadata, blobs = read_parts(base.path)
    header = json.loads(metadata["kvz.header"])
    name = next(n for n, info in header["tensors"].items() if info["compression"] == "zstd")
    out = []
    for b in blobs:
        if b.name == name:
            assert zstandard.ZstdDecompressor().decompress(b.data)  # a whole frame, as written
            b = Blob(b.name, b.st_dtype, (len(edit(b.data)),), edit(b.data))
            header["tensors"][name]["crc32"] = crc32_hex(b.data)
        out.append(b)
    raw = json.dumps(header, sort_keys=True, separators=(",", ":"))
    metadata.update({"kvz.header": raw, "kvz.header_crc32": crc32_hex(raw.encode())})
    write_parts(tmp_path / "z.kvz", metadata, out)
    with pytest.raises(FormatError, match=message):
        with open_kvz(tmp_path / "z.kvz") as f:
            f.to_cache()


def _frame_without_size(frame: bytes) -> bytes:
    import zstandard

    data = zstandard.ZstdDecompressor().decompress(frame)
    return zstandard.ZstdCompressor(write_content_size=False).compress(data)
