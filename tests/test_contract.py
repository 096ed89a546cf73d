"""The codec contract: every codec writes exactly the arrays it declares, and takes only valid
options; files whose arrays break the declaration are refused before anything is decoded."""

from __future__ import annotations

import json

import numpy as np
import pytest
from kvz_util import NP_DTYPES, available_codecs, rewrite_header, synthetic_cache

from kvtool.codecs import get_codec
from kvtool.codecs.abc import ArraySpec
from kvtool.errors import CodecError, FormatError
from kvtool.formats import load, open_kvz, save
from kvtool.kernels import available_backends, to_mlx, to_numpy, to_torch
from kvtool.policy import CodecPolicy

SPECS = available_codecs() + ["turbo3:center=true", "kivi4:axis=token", "int4:group_size=24",
                              "kivi2:group_size=5", "raw:dtype=\"bfloat16\"",
                              "prism:z_bits=2,r_bits=5,theta_bits=7"]
#: the codecs of the presets users run (norm_bits=8 failed on no tokens)
PRESET_CODECS = sorted({json.dumps(c.get_config(), sort_keys=True)
                        for p in ("balanced", "quality", "small")
                        for c in CodecPolicy.from_label(p).codecs()})
SHAPES = [(2, 7, 64), (3, 1, 48), (5, 20), (33,), (1, 2, 3, 10)]


def _encode(codec, x, backend):
    if backend == "mlx":
        return codec.encode(to_mlx(x))
    return codec.encode(to_torch(x) if backend == "torch" else x)


@pytest.mark.parametrize("backend", available_backends())
@pytest.mark.parametrize("spec", SPECS)
def test_encode_writes_exactly_the_declared_arrays(spec, backend):
    codec = get_codec(spec)
    rng = np.random.default_rng(1)
    for shape in SHAPES:
        for dtype in ("float32", "float16", "bfloat16"):
            x = (rng.standard_normal(shape) * 3 + 1).astype(NP_DTYPES[dtype])
            enc = _encode(codec, x, backend)
            declared = codec.expected_arrays(shape, dtype)
            got = {k: (str(to_numpy(a).dtype), tuple(a.shape)) for k, a in enc.arrays.items()}
            want = {k: (s.dtype, tuple(s.shape)) for k, s in declared.items()}
            assert got == want, (spec, shape, dtype)
            for name, s in declared.items():  # values are in the declared range
                a = to_numpy(enc.arrays[name]).astype(np.float64)
                assert s.low is None or a.min() >= s.low
                assert s.high is None or a.max() <= s.high


@pytest.mark.parametrize("backend", available_backends())
@pytest.mark.parametrize("spec", SPECS + ["turbomix:outliers=8,center=true,candidates=2",
                                  "turbomix:norm_bits=8", "turbomix:vq=2", *PRESET_CODECS])
def test_empty_input_encodes_to_its_declared_finite_arrays(spec, backend):
    """No tokens or no heads: the declared (empty or per-group) arrays, all finite (a mean of
    no tokens was NaN), and an empty decode (turbomix's reference path failed to reshape)."""
    codec = get_codec(spec)
    for shape in [(2, 0, 64), (0, 5, 64), (0, 64)]:
        enc = _encode(codec, np.zeros(shape, np.float32), backend)
        want = {k: (s.dtype, tuple(s.shape))
                for k, s in codec.expected_arrays(shape, "float32").items()}
        assert {k: (str(to_numpy(a).dtype), tuple(a.shape))
                for k, a in enc.arrays.items()} == want, (spec, shape)
        for name, a in enc.arrays.items():
            a = to_numpy(a)
            if a.dtype.kind == "f" or "float" in str(a.dtype):
                assert np.isfinite(a.astype(np.float32)).all(), (spec, shape, name)
        assert tuple(to_numpy(codec.decode(enc)).shape) == shape


@pytest.mark.parametrize("backend", [b for b in available_backends() if b != "numpy"])
@pytest.mark.parametrize("spec", SPECS)
def test_every_backend_decodes_numpys_arrays_of_every_shape(spec, backend):
    """Every backend reads every other's output, a single vector's too: its per-vector arrays
    (norms, scales) are 0-d, which the torch backend turned into [1] and refused."""
    from kvtool.codecs import Encoded

    codec = get_codec(spec)
    move = to_mlx if backend == "mlx" else to_torch
    rng = np.random.default_rng(2)
    for shape in SHAPES:
        enc = codec.encode((rng.standard_normal(shape) * 3 + 1).astype(np.float32))
        moved = Encoded({k: move(a) for k, a in enc.arrays.items()}, enc.shape, enc.dtype)
        assert all(tuple(m.shape) == a.shape for m, a in zip(moved.arrays.values(),
                                                              enc.arrays.values(), strict=True))
        np.testing.assert_allclose(to_numpy(codec.decode(moved)), codec.decode(enc),
                                   rtol=1e-5, atol=1e-5, err_msg=f"{spec} {shape}")


# (not mlx: its arrays take no in-place writes from Python, a write rebinds)
@pytest.mark.parametrize("backend", [b for b in available_backends() if b != "mlx"])
@pytest.mark.parametrize("spec", SPECS)
def test_a_decode_shares_no_memory_with_the_encoding(spec, backend):
    """A caller may write to what it decoded (an engine's cache buffer): that must not change
    the stored codes. ``raw`` returned a view of its data, so a write changed every later
    decode."""
    codec = get_codec(spec)
    x = (np.random.default_rng(3).standard_normal((2, 7, 64)) * 3 + 1).astype(np.float32)
    for dtype in ("float32", "float16"):
        enc = _encode(codec, x.astype(NP_DTYPES[dtype]), backend)
        first = to_numpy(codec.decode(enc)).copy()
        out = codec.decode(enc)
        out[...] = 7
        np.testing.assert_array_equal(to_numpy(codec.decode(enc)), first, err_msg=spec)


@pytest.mark.parametrize("spec, message", [
    ("turbo3:center=maybe", "center must be true or false"),
    ("turbo3:center=1", "center must be true or false"),
    ("turbo3:seed=true", "seed must be an integer"),
    ("turbo3:seed=-1", "seed must be an integer"),
    ("turbo3:centre=true", "did you mean 'center'"),
    ("prism:z_bits=0", "z_bits must be an integer in"),
    ("prism:theta_bits=2.5", "theta_bits must be an integer"),
    ("kivi4:axis=chanel", "axis must be one of"),
    ("kivi4:group_size=false", "group_size must be an integer"),
    ("int4:group_size=0", "group_size must be an integer"),
    ("raw:dtype=float64", "dtype must be one of"),
    ('{"id": "turbo3", "codec_version": true}', "codec_version must be a positive integer"),
    ('{"id": "turbo3", "codec_version": 0}', "codec_version must be a positive integer"),
    ("fp8:bits=4", "no option 'bits'"),
])
def test_invalid_options_are_refused(spec, message):
    with pytest.raises(CodecError, match=message):
        get_codec(spec)


def test_config_round_trips_after_strict_validation():
    for spec in SPECS:
        codec = get_codec(spec)
        assert get_codec(codec.get_config()) == codec


def test_writer_refuses_a_codec_that_breaks_its_declaration(tmp_path, monkeypatch):
    codec = get_codec("turbo3")
    monkeypatch.setattr(type(codec), "expected_arrays",
                        lambda self, shape, dtype: {"codes": ArraySpec((1,), "uint8")})
    with pytest.raises(CodecError, match="declares"):
        save(synthetic_cache(layers=1), tmp_path / "x.kvz", codec="turbo3")
    assert not (tmp_path / "x.kvz").exists()


@pytest.fixture(scope="module")
def turbo_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("contract") / "t.kvz"
    save(synthetic_cache(layers=2, tokens=12, dim=32), path, key_codec="turbo3:center=true",
         value_codec="kivi4", sink_tokens=2)
    return path


def _drop_everywhere(header, key):
    """Remove ``key`` from every codec config in the header (segments and policy alike)."""
    if isinstance(header, dict):
        if isinstance(header.get("id"), str):
            header.pop(key, None)
        for value in header.values():
            _drop_everywhere(value, key)
    elif isinstance(header, list):
        for value in header:
            _drop_everywhere(value, key)


def _edit(src, dst, fn):
    rewrite_header(src, dst, fn)
    return dst


@pytest.mark.parametrize("name, fn, message", [
    ("codec id swapped", lambda h: h["layers"][0]["key"]["segments"][1]["codec"].update(
        id="turbo4"), "codec 'turbo4' writes|is not what codec"),
    ("kivi axis swapped", lambda h: h["layers"][1]["value"]["segments"][1]["codec"].update(
        axis="channel"), "is not what codec"),
    ("center dropped", lambda h: h["layers"][0]["key"]["segments"][1]["codec"].update(
        center=False), "writes arrays"),
    ("seed edited in one segment", lambda h: h["layers"][0]["key"]["segments"][1]["codec"]
        .update(seed=7), "not the ones the file's policy"),
    ("invalid option", lambda h: h["layers"][0]["key"]["segments"][1]["codec"].update(
        center="maybe"), "center must be true or false"),
    ("aliased tensor", lambda h: h["layers"][1]["key"]["segments"][1]["tensors"].update(
        norms="layers.0.key.1.norms"), "is not named|backs both"),
    ("seed left to the reader's default", lambda h: _drop_everywhere(h, "seed"),
     "lacks 'seed'"),
    ("codec_version left out", lambda h: _drop_everywhere(h, "codec_version"),
     "lacks 'codec_version'"),
    ("model dtype an alias", lambda h: h["model"].update(dtype="fp32"),
     "model.dtype is \"fp32\""),
    ("model dtype not a float", lambda h: h["model"].update(dtype=5), "model.dtype is 5"),
    ("model name not text", lambda h: h["model"].update(name="\ud800"),
     "unpaired surrogate"),
    ("policy and layer_policy", lambda h: h.update(layer_policy=dict(
        h["policy"], num_layers=2, layers={"0": {"key": h["policy"]["key"]}})),
     "only with policy null"),
    ("layer_policy with no layers", lambda h: h.update(
        layer_policy=dict(h["policy"], num_layers=2, layers={}), policy=None),
     "invalid layer_policy \\(no per-layer codecs"),
    ("layer_policy of another layer count", lambda h: h.update(layer_policy=dict(
        h["policy"], num_layers=3, layers={"0": {"key": h["policy"]["key"]}}), policy=None),
     "invalid layer_policy .*for 3 layers"),
])
def test_header_edits_that_no_writer_makes_are_refused(turbo_file, tmp_path, name, fn, message):
    bad = _edit(turbo_file, tmp_path / "bad.kvz", fn)
    with pytest.raises(FormatError, match=message) as e:
        load(bad)
    assert "\n" not in str(e.value)


def test_a_number_past_float_range_is_refused(turbo_file, tmp_path):
    """``1e999`` is valid JSON that parsed to inf: the file loaded, and saving its cache again
    failed ("Out of range float values")."""
    import json

    from kvz_util import read_parts, write_parts

    from kvtool.formats.container import crc32_hex

    metadata, blobs = read_parts(turbo_file)
    header = json.loads(metadata["kvz.header"])
    header["model"]["temperature"] = 12345.5
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).replace("12345.5", "1e999")
    metadata.update({"kvz.header": raw, "kvz.header_crc32": crc32_hex(raw.encode())})
    write_parts(tmp_path / "inf.kvz", metadata, blobs)
    with pytest.raises(FormatError, match="number 1e999 overflows a float"):
        open_kvz(tmp_path / "inf.kvz")


def test_unreferenced_tensor_is_refused_in_a_known_version(turbo_file, tmp_path):
    from kvz_util import read_parts, write_parts

    from kvtool.formats.container import Blob

    metadata, blobs = read_parts(turbo_file)
    write_parts(tmp_path / "x.kvz", metadata, [*blobs, Blob("extra", "U8", (3,), b"abc")])
    with pytest.raises(FormatError, match="'extra' is stored but not used"):
        open_kvz(tmp_path / "x.kvz")
    metadata["kvz.format_version"] = "1.9"  # a newer minor version may add tensors: ignored
    write_parts(tmp_path / "y.kvz", metadata, [*blobs, Blob("extra", "U8", (3,), b"abc")])
    load(tmp_path / "y.kvz")


def test_a_policy_a_reader_cannot_check_is_shown_as_declared(turbo_file, tmp_path):
    """A newer minor version's policy may produce other segments, so it is not checked; inspect
    then said ``policy raw`` beside ``lossy turbo3``, from a policy its segments contradict."""
    from click.testing import CliRunner
    from kvz_util import read_parts, write_parts

    from kvtool.cli.main import cli
    from kvtool.formats.info import file_info

    def contradict(h):
        h["policy"]["key"] = h["policy"]["lossless"]

    bad = _edit(turbo_file, tmp_path / "bad.kvz", contradict)
    with pytest.raises(FormatError, match="not the ones the file's policy"):
        open_kvz(bad)
    with open_kvz(turbo_file) as f:
        assert file_info(f)["policy_unchecked"] is None
    metadata, blobs = read_parts(bad)
    metadata["kvz.format_version"] = "1.9"
    write_parts(tmp_path / "newer.kvz", metadata, blobs)
    load(tmp_path / "newer.kvz")  # decoded from its segments
    with open_kvz(tmp_path / "newer.kvz") as f:
        assert "newer than this reader" in file_info(f)["policy_unchecked"]
    out = CliRunner().invoke(cli, ["inspect", str(tmp_path / "newer.kvz")]).output
    assert "(declared, not checked: format 1.9 is newer than this reader's)" in out


def test_negative_norm_is_refused_on_decode(turbo_file, tmp_path):
    """Values no writer stores (a negative norm, NaN, int8 code -128) are refused on decode."""
    from kvz_util import read_parts, write_parts

    from kvtool.formats.container import Blob, crc32_hex

    metadata, blobs = read_parts(turbo_file)
    import json

    header = json.loads(metadata["kvz.header"])
    name = "layers.1.key.1.norms"
    out = []
    for b in blobs:
        if b.name == name:
            arr = np.frombuffer(b.data, np.float16).copy()
            arr[3] = -arr[3]
            b = Blob(b.name, b.st_dtype, b.shape, arr.tobytes())
            header["tensors"][name]["crc32"] = crc32_hex(b.data)
        out.append(b)
    raw = json.dumps(header, sort_keys=True, separators=(",", ":"))
    metadata.update({"kvz.header": raw, "kvz.header_crc32": crc32_hex(raw.encode())})
    write_parts(tmp_path / "n.kvz", metadata, out)
    with open_kvz(tmp_path / "n.kvz") as f:
        f.layer(0)  # other layers still decode
        with pytest.raises(FormatError, match=f"{name}.*below"):
            f.layer(1)


def _tensor_edited(src, dst, name, dtype, edit):
    """``src`` with tensor ``name`` (of numpy ``dtype``) changed by ``edit`` in place, its
    checksum and the header's made right again: only the values are wrong."""
    import json

    from kvz_util import read_parts, write_parts

    from kvtool.formats.container import Blob, crc32_hex

    metadata, blobs = read_parts(src)
    header = json.loads(metadata["kvz.header"])
    out = []
    for b in blobs:
        if b.name == name:
            arr = np.frombuffer(b.data, dtype).copy()
            edit(arr)
            b = Blob(b.name, b.st_dtype, b.shape, arr.tobytes())
            header["tensors"][name]["crc32"] = crc32_hex(b.data)
        out.append(b)
    raw = json.dumps(header, sort_keys=True, separators=(",", ":"))
    metadata.update({"kvz.header": raw, "kvz.header_crc32": crc32_hex(raw.encode())})
    write_parts(dst, metadata, out)
    return dst


@pytest.mark.parametrize("codec, part, dtype, value, message", [
    ("fp8", "codes", np.uint8, 0x7F, "NaN code"), ("fp8", "codes", np.uint8, 0xFF, "NaN code"),
    ("kivi2", "scale", np.float16, -1.0, "negative scale"),
    ("kivi4", "scale", np.float16, -0.01, "negative scale"),
    ("int4", "scale", np.float16, -1.0, "negative scale")])
def test_values_only_a_crafted_file_holds_are_refused(tmp_path, codec, part, dtype, value,
                                                      message):
    """Codes or scales that pass every range yet no encode writes (an e4m3 NaN code, a
    negative group scale) are refused by the reader, not decoded into wrong K/V."""
    src = tmp_path / "ok.kvz"
    save(synthetic_cache(layers=1, tokens=12, dim=32), src, codec=codec, sink_tokens=0)
    load(src)

    def edit(arr):
        arr[5] = value

    bad = _tensor_edited(src, tmp_path / "bad.kvz", f"layers.0.key.0.{part}", dtype, edit)
    with pytest.raises(FormatError, match=message) as e:
        load(bad)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("codec", ["int4", "kivi2", "kivi4:axis=token"])
def test_constant_groups_load_whatever_their_scales_fp16_rounding(tmp_path, codec):
    """A constant group's fp16-rounded minimum can lie above its maximum, so its stored scale
    a hair below zero: a writer's file like that still loads."""
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.uniform(-60000, 60000, 40), rng.uniform(-2, 2, 40),
                             np.float32([1e-6, -3e-7, 0.1, 1 / 3, 1000.3, -65000.7])])
    cache = synthetic_cache(layers=1, tokens=len(values), dim=32, dtype="float32")
    for role in (cache.keys, cache.values):  # every token constant over its channels
        role[0][...] = values[None, :, None]
    save(cache, tmp_path / "c.kvz", codec=codec, sink_tokens=0)
    with open_kvz(tmp_path / "c.kvz") as f:
        scales = [enc.arrays["scale"] for role in ("key", "value")
                  for _, enc in f.encoded(0, role)]
    assert min(float(s.min()) for s in scales) < 0.0  # the hair below zero was written
    load(tmp_path / "c.kvz")


@pytest.mark.parametrize("writer, reader", [("turbo2", "turbo3"), ("fp8", "int8"),
                                            ("turbomix", "turbo4"), ("int4", "kivi4")])
def test_decode_refuses_another_codecs_output(writer, reader):
    x = synthetic_cache(layers=1, dtype="float32").keys[0]
    with pytest.raises(CodecError, match="not what it writes"):
        get_codec(reader).decode(get_codec(writer).encode(x))


@pytest.mark.parametrize("codec_id", ["raw", "fp8", "int8", "turbo3", "prism"])
def test_decode_refuses_a_relabelled_encoding_and_non_float_dtypes(codec_id):
    from kvtool.codecs import Encoded

    codec = get_codec(codec_id)
    enc = codec.encode(synthetic_cache(layers=1, heads=2, tokens=16, dim=64).keys[0])
    for bad in (Encoded(enc.arrays, (4, 16, 32), enc.dtype), Encoded(enc.arrays, enc.shape,
                                                                     "int32")):
        with pytest.raises(CodecError, match="not what it writes|cannot decode to"):
            codec.decode(bad)
    for dtype in ("int8", "float64", "bogus", np.dtype("float16"), np.float32):
        with pytest.raises(CodecError, match="cannot decode to"):  # a numpy dtype object
            codec.decode(enc, dtype)  # equals its name, then failed a lookup (KeyError)
    with pytest.raises(CodecError, match="dtype\\('float32'\\)"):
        codec.decode(Encoded(enc.arrays, enc.shape, np.dtype("float32")))
    torch = pytest.importorskip("torch")
    first = next(iter(enc.arrays))
    for odd in (torch.from_numpy(np.ascontiguousarray(enc.arrays[first])),
                enc.arrays[first].tolist()):
        if len(enc.arrays) == 1 and not isinstance(odd, list):
            continue  # one array is one backend
        mixed = Encoded({**enc.arrays, first: odd}, enc.shape, enc.dtype)
        with pytest.raises(CodecError, match="arrays of one backend"):
            codec.decode(mixed)
    assert codec.decode(enc, "float32").shape == (2, 16, 64)


def test_scores_refuse_a_query_without_its_row_axis_or_of_another_shape():
    x = synthetic_cache(layers=1, dtype="float32").keys[0]  # [heads, tokens, D]
    heads, _, dim = x.shape
    for codec_id in ("turbo3", "int8", "turbomix"):
        codec = get_codec(codec_id)
        enc = codec.encode(x)
        for q in (np.ones(dim, np.float32), np.ones((heads, 3, dim // 2), np.float32),
                  np.ones((heads + 3, 3, dim), np.float32)):  # numpy's own errors, before
            with pytest.raises(CodecError, match=r"queries \[\.\.\., M, D\] that broadcast"):
                codec.scores(q, enc)
        assert codec.scores(np.ones((1, 3, dim), np.float32), enc).shape == (heads, 3, x.shape[1])


@pytest.mark.parametrize("spec", ["turbo3", "turbo3:center=true", "int8", "turbomix"])
def test_scores_come_on_the_querys_backend_wherever_the_codes_are(spec):
    """Codes of one backend, queries of another: the scores are the query's, equal to those
    of a same-backend call (they failed with a type error from the mixed matmul)."""
    rng = np.random.default_rng(3)
    keys = rng.standard_normal((2, 40, 64)).astype(np.float32)
    q = rng.standard_normal((2, 3, 64)).astype(np.float32)
    codec = get_codec(spec)
    want = codec.scores(q, codec.encode(keys))
    backends = available_backends()
    queries = {"numpy": q, "torch": to_torch(q), "mlx": to_mlx(q)}
    for codes_on, q_on in [(b, c) for b in backends for c in backends if b != c]:
        got = codec.scores(queries[q_on], _encode(codec, keys, codes_on))
        assert type(got) is type(queries[q_on]), (codes_on, q_on)
        np.testing.assert_allclose(to_numpy(got), want, rtol=1e-4, atol=1e-4,
                                   err_msg=f"{codes_on} codes, {q_on} queries")


def _near_fp16s_limit() -> list[np.ndarray]:
    """fp16 vectors with one channel at or near ±65504: a lossy decode of that channel can land
    past the limit (at ±65504 the scale quantisers' did, at ±65000 among larger channels the
    rotation codecs' did)."""
    rng = np.random.default_rng(7)
    out = []
    for limit, scale in ((65504.0, 1.0), (65000.0, 300.0)):
        x = rng.standard_normal((2, 64, 64)).astype(np.float32) * scale
        x[..., 5] = np.where(rng.standard_normal((2, 64)) > 0, limit, -limit)
        out.append(np.clip(x, -65504, 65504).astype(np.float16))
    return out


def _preset_codecs() -> dict[str, object]:
    from kvtool.presets import preset_policy

    return {f"{name}/{role}": getattr(preset_policy(name), role)
            for name in ("quality", "balanced", "small") for role in ("key", "value")}


@pytest.mark.parametrize("kernels", ["auto", "reference"])
@pytest.mark.parametrize("backend", available_backends())
@pytest.mark.parametrize("spec", SPECS + list(_preset_codecs()))
def test_a_float16_decode_saturates_at_65504_and_never_gives_inf(spec, backend, kernels,
                                                                  monkeypatch):
    """Values near fp16's limit, saved by a lossy codec, decode to at most ±65504 on every
    backend and kernel path: a reconstruction a little past the limit was ±inf."""
    monkeypatch.setenv("KVTOOL_KERNELS", kernels)
    codec = _preset_codecs().get(spec) or get_codec(spec)
    for x in _near_fp16s_limit():
        try:
            enc = _encode(codec, x, backend)
        except CodecError as e:  # a codec may refuse the range outright: that is not silent
            assert "fp16 range" in str(e), e
            continue
        y = to_numpy(codec.decode(enc))
        assert y.dtype == np.float16
        assert np.isfinite(y).all(), f"{spec}: {int((~np.isfinite(y)).sum())} values are inf"
        wide = to_numpy(codec.decode(enc, "float32"))
        np.testing.assert_array_equal(y, np.clip(wide, -65504, 65504).astype(np.float16))


@pytest.mark.parametrize("dtype, value", [("float16", 1e6), ("float16", 0.1),
                                          ("bfloat16", 1.0 + 2.0 ** -10)])
def test_widened_raw_data_that_its_roles_dtype_cannot_hold_is_refused(tmp_path, dtype, value):
    """``raw:dtype=float32`` in a float16 role stores float16 values: one that is not (1e6,
    0.1) loaded clipped or rounded in float16 and unchanged in float32, from a file that read
    as exact."""
    src = tmp_path / "wide.kvz"
    save(synthetic_cache(layers=1, tokens=6, dim=8, dtype=dtype), src, codec="raw:dtype=float32")
    assert load(src).lossy_sources == []

    def edit(arr):
        arr[3] = value

    bad = _tensor_edited(src, tmp_path / "bad.kvz", "layers.0.value.0.data", np.float32, edit)
    for read in (dtype, "float32"):
        with pytest.raises(FormatError, match=f"not {dtype} values"):
            load(bad, dtype=read)
