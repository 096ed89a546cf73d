"""Baseline codecs: raw, fp8, int8, int4, kivi2/kivi4, prism (numpy reference + torch)."""

from __future__ import annotations

import json
import tracemalloc

import ml_dtypes
import numpy as np
import pytest

from kvtool.codecs import get_codec
from kvtool.codecs.kivi import Kivi2, Kivi4
from kvtool.errors import CodecError

# every baseline, with the non-default layouts that take different code paths
SPECS = ["raw", "fp8", "int8", "int4", "int4:group_size=32", "kivi2", "kivi4",
         "kivi2:axis=token", "kivi4:axis=token,group_size=64", "prism",
         "prism:z_bits=3,r_bits=2,theta_bits=4"]
LOSSY = [s for s in SPECS if s != "raw"]


def gaussian(shape=(2, 256, 128), seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def nmse(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(((x - y) ** 2).sum() / (x**2).sum())


def as_f32(a) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        from kvtool.kernels import to_numpy

        a = to_numpy(a)
    return a.astype(np.float32)


# -- comparing what two code paths compute ---------------------------------------------------------
# Two backends (numpy/OpenBLAS vs torch/MKL), two loops (strided vs contiguous input) or two CPUs
# (AVX2 vs AVX-512) round matmuls, norms and trig differently in the last bits. So: integer codes
# and packed bytes are compared exactly, floats to rounding (rtol of the data's scale, plus an
# ulp of the output dtype for fp16/bf16 outputs). Bit-exact floats are expected only from one
# code path on one input (raw passthrough, zero vectors, the same call twice).
def _np(a) -> np.ndarray:
    if isinstance(a, np.ndarray):
        return a
    from kvtool.kernels import to_numpy

    return to_numpy(a)


def _tolerances(actual, desired, rtol):
    a, d = _np(actual), _np(desired)
    eps = max(float(ml_dtypes.finfo(x.dtype).eps) for x in (a, d))  # fp16/bf16: ≥ 1 ulp
    d32 = d.astype(np.float32)
    scale = float(np.abs(d32).max()) if d.size else 0.0
    return a.astype(np.float32), d32, max(rtol, eps), rtol * (scale or 1.0)


def assert_close(actual, desired, rtol=1e-5):
    a, d, rel, atol = _tolerances(actual, desired, rtol)
    np.testing.assert_allclose(a, d, rtol=rel, atol=atol)


def close_fraction(actual, desired, rtol=1e-5) -> float:
    """The fraction of elements equal up to rounding (see :func:`assert_close`)."""
    a, d, rel, atol = _tolerances(actual, desired, rtol)
    return float(np.mean(np.isclose(a, d, rtol=rel, atol=atol)))


def assert_same_encoding(enc, ref, min_agree=1.0):
    """Integer arrays (packed codes, fp8 bytes) equal; float arrays (fp16 norms, scales, means)
    equal up to rounding. ``min_agree < 1``: only across backends, whose rotations may put a
    value a rounding away from a codebook boundary into the next cell."""
    enc, ref = enc.to_numpy(), ref.to_numpy()
    assert set(enc.arrays) == set(ref.arrays)
    for name, b in ref.arrays.items():
        a = enc.arrays[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if a.dtype.kind in "ui" or a.dtype.itemsize == 1:
            if min_agree == 1.0:
                np.testing.assert_array_equal(a, b, err_msg=name)
            else:
                assert np.mean(a == b) >= min_agree, name
        else:
            assert_close(a, b)


# -- error bounds ----------------------------------------------------------------------------------
# Uniform quantiser with step Δ = range/(2^b − 1) has MSE ≈ Δ²/12. The expected range of n standard
# Gaussians is ≈ 4.8σ (n=64) and ≈ 5.2σ (n=128), so: int4/g64 ≈ (4.8/15)²/12 ≈ 0.0085,
# kivi4/g128 ≈ (5.2/15)²/12 ≈ 0.0100, kivi2/g128 ≈ (5.2/3)²/12 ≈ 0.25. int8: (2.9/127)²/12 ≈ 4e-5.
# fp8 e4m3 keeps 3 mantissa bits: relative rounding error ≈ 6e-4. prism values are measured
# (default 0.0236 at 3.33 code bits; 3/2/4 bits 0.0338, on par with turbo3's 0.0339).
BOUNDS = {
    "int8": (1e-5, 1e-4),
    "fp8": (2e-4, 2e-3),
    "int4": (0.006, 0.011),
    "kivi4": (0.008, 0.012),
    "kivi4:axis=token,group_size=64": (0.006, 0.011),
    "kivi2": (0.22, 0.28),
    "kivi2:axis=token": (0.22, 0.28),
    "prism": (0.0215, 0.0260),
    "prism:z_bits=3,r_bits=2,theta_bits=4": (0.031, 0.037),
}


@pytest.mark.parametrize("spec", list(BOUNDS))
def test_gaussian_error_bounds(spec):
    x = gaussian()
    codec = get_codec(spec)
    y = codec.decode(codec.encode(x))
    assert y.shape == x.shape and y.dtype == np.float32
    lo, hi = BOUNDS[spec]
    assert lo < nmse(x, y) < hi


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_raw_bit_exact_numpy(dtype):
    x = gaussian((3, 5, 64)).astype(np.dtype(getattr(ml_dtypes, dtype, None) or dtype))
    codec = get_codec("raw")
    enc = codec.encode(x)
    y = codec.decode(enc)
    assert y.dtype == x.dtype
    assert np.array_equal(y.view(np.uint8), x.view(np.uint8))
    assert enc.nbytes == x.nbytes


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_raw_bit_exact_torch(dtype):
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(gaussian((3, 5, 64))).to(getattr(torch, dtype))
    y = get_codec("raw").decode(get_codec("raw").encode(x))
    assert y.dtype == x.dtype and torch.equal(y.view(torch.uint8), x.view(torch.uint8))


def test_raw_stores_a_private_copy_and_converts():
    x = gaussian((4, 64))
    enc = get_codec("raw").encode(x)
    x[:] = 0  # a cache buffer being overwritten must not change the encoded data
    assert np.abs(get_codec("raw").decode(enc)).sum() > 0
    x = gaussian((4, 64))
    codec = get_codec("raw", dtype="float16")
    enc = codec.encode(x)
    assert enc.arrays["data"].dtype == np.float16 and enc.nbytes == x.size * 2
    y = codec.decode(enc)
    assert y.dtype == np.float32 and np.array_equal(y, x.astype(np.float16).astype(np.float32))
    assert get_codec("raw", dtype="float32").bits_per_element(128) == 32
    with pytest.raises(CodecError, match="float16 range"):
        codec.encode(x * 1e5)
    big = get_codec("raw", dtype="bfloat16")
    assert nmse(x * 1e5, big.decode(big.encode(x * 1e5))) < 1e-4


# -- sizes -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", LOSSY)
@pytest.mark.parametrize("dim", [64, 128])
def test_bytes_match_bits_per_element(spec, dim):
    codec = get_codec(spec)
    x = gaussian((2, 256, dim))  # 256 tokens: whole KIVI token groups
    enc = codec.encode(x)
    assert enc.nbytes * 8 == pytest.approx(codec.bits_per_element(dim) * x.size, abs=1e-6)


def test_bits_per_element_values():
    assert get_codec("raw").bits_per_element(128) == 16
    assert get_codec("fp8").bits_per_element(128) == 8.125
    assert get_codec("int8").bits_per_element(64) == 8.25
    assert get_codec("int4").bits_per_element(128) == 4.5
    assert get_codec("int4").bits_per_element(32) == 5.0  # group clamped to head_dim
    assert get_codec("kivi2").bits_per_element(128) == 2.25
    assert get_codec("kivi4").bits_per_element(128) == 4.25
    assert get_codec("kivi2:axis=token").bits_per_element(64) == 2.5
    # 43 triplets: 17 + 17 + 22 bytes of codes + 2 bytes of norm = 464 bits
    assert get_codec("prism").bits_per_element(128) == 464 / 128


def test_partial_groups_round_trip():
    x = gaussian((200, 96))  # 96 = 64 + a partial group of 32; 200 tokens = 128 + 72
    for spec in ("int4", "kivi4", "kivi4:axis=token,group_size=64", "kivi2"):
        codec = get_codec(spec)
        enc = codec.encode(x)
        y = codec.decode(enc)
        assert y.shape == x.shape and nmse(x, y) < (0.3 if "kivi2" in spec else 0.012)
    enc = get_codec("int4").encode(x)
    assert enc.arrays["scale"].shape == (200, 2) and enc.arrays["codes"].shape == (200, 48)
    enc = get_codec("kivi4").encode(x)
    assert enc.arrays["scale"].shape == (2, 96) and enc.arrays["codes"].shape == (200, 48)
    # 1-D input is one token; fewer tokens than a group is one padded group
    for shape in ((128,), (5, 128)):
        x = gaussian(shape)
        codec = get_codec("kivi4")
        assert codec.decode(codec.encode(x)).shape == shape

    # a group longer than the tokens is one group of the tokens, not padded to its size (a
    # file's group_size of 2**20 made a 1-token decode allocate gigabytes): the same bytes
    x = gaussian((2, 5, 64))
    huge, exact = get_codec("kivi2:group_size=1048576"), get_codec("kivi2:group_size=5")
    a, b = huge.encode(x), exact.encode(x)
    for name in a.arrays:
        assert np.array_equal(a.arrays[name], b.arrays[name]), name
    assert np.array_equal(huge.decode(a), exact.decode(b))
    tracemalloc.start()
    huge.decode(huge.encode(x))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.parametrize("dim", [3, 10, 64])
def test_prism_pads_to_triplets(dim):
    x = gaussian((300, dim))
    codec = get_codec("prism")
    enc = codec.encode(x)
    n = -(-dim // 3)
    assert enc.arrays["theta"].shape == (300, (n * 4 + 7) // 8)
    assert nmse(x, codec.decode(enc)) < 0.06


# -- backends --------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", SPECS)
def test_numpy_torch_agree(spec):
    torch = pytest.importorskip("torch")
    x = gaussian((2, 256, 128), seed=1)
    codec = get_codec(spec)
    enc_np = codec.encode(x)
    enc_t = codec.encode(torch.from_numpy(x))
    assert set(enc_np.arrays) == set(enc_t.arrays)
    for name, a in enc_np.arrays.items():
        b = enc_t.arrays[name]
        assert isinstance(b, torch.Tensor) and a.shape == tuple(b.shape)
    # codes: ≥ 99.9% equal (a rotated value within a rounding of a codebook boundary may fall in
    # the next cell); fp16 norms/scales: equal up to one fp16 rounding
    assert_same_encoding(enc_t, enc_np, min_agree=0.999)
    y_np = codec.decode(enc_np)
    y_np_from_t = codec.decode(enc_t.to_numpy())
    y_t_from_np = codec.decode(enc_np.to_torch())
    y_t = codec.decode(enc_t)
    assert isinstance(y_t_from_np, torch.Tensor)
    # the same bytes decode to the same values up to rounding (OpenBLAS vs MKL matmuls)
    assert_close(y_t_from_np, y_np)
    assert_close(y_np_from_t, y_t)


# -- configs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", SPECS + ["raw:dtype=bfloat16", "prism:seed=7,z_bits=4"])
def test_config_json_round_trip(spec):
    codec = get_codec(spec)
    cfg = json.loads(json.dumps(codec.get_config()))
    again = get_codec(cfg)
    assert again.get_config() == codec.get_config() and again == codec
    assert type(again) is type(codec)


BAD = [
    {"id": "raw", "dtype": "int8"},
    {"id": "fp8", "scale": "fp32"},
    {"id": "int8", "group_size": 4},
    {"id": "int4", "group_size": 0},
    {"id": "int4", "group_size": "64"},
    {"id": "int4", "group_size": True},
    {"id": "kivi2", "axis": "row"},
    {"id": "kivi4", "group_size": -1},
    {"id": "kivi4", "group_size": 2.5},
    {"id": "prism", "z_bits": 0},
    {"id": "prism", "r_bits": 9},
    {"id": "prism", "theta_bits": 1.5},
    {"id": "prism", "seed": -1},
]


@pytest.mark.parametrize("config", BAD, ids=lambda c: json.dumps(c))
def test_bad_options_raise(config):
    with pytest.raises(CodecError):
        get_codec(config)


# -- edge inputs -----------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", SPECS)
def test_zero_vectors(spec):
    codec = get_codec(spec)
    y = codec.decode(codec.encode(np.zeros((2, 130, 64), np.float32)))
    assert np.array_equal(y, np.zeros_like(y))
    if "axis" not in spec and not spec.startswith("kivi"):  # per-token codecs: zero rows exact
        x = gaussian((16, 64))
        x[3] = 0
        y = codec.decode(codec.encode(x))
        assert np.isfinite(y).all() and np.array_equal(y[3], np.zeros(64, np.float32))


@pytest.mark.parametrize("spec", LOSSY)
def test_half_precision_inputs_numpy(spec):
    codec = get_codec(spec)
    bound = BOUNDS.get(spec, (0, 0.3))[1] * 1.2 + 1e-3
    for dtype in (np.float16, ml_dtypes.bfloat16):
        x = gaussian((256, 64)).astype(dtype)
        y = codec.decode(codec.encode(x))
        assert y.dtype == x.dtype and y.shape == x.shape
        assert nmse(as_f32(x), as_f32(y)) < bound


@pytest.mark.parametrize("spec", LOSSY)
def test_half_precision_inputs_torch(spec):
    torch = pytest.importorskip("torch")
    codec = get_codec(spec)
    bound = BOUNDS.get(spec, (0, 0.3))[1] * 1.2 + 1e-3
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.from_numpy(gaussian((256, 64))).to(dtype)
        y = codec.decode(codec.encode(x))
        assert y.dtype == dtype and y.shape == x.shape
        assert nmse(as_f32(x), as_f32(y)) < bound
        # the same codes as encoding the numpy copy (but a boundary case or so, as in
        # test_numpy_torch_agree); decoded values equal up to an ulp of the half dtype
        from kvtool.kernels import to_numpy

        enc_np = codec.encode(to_numpy(x))
        assert_same_encoding(codec.encode(x), enc_np, min_agree=0.999)
        assert close_fraction(y, codec.decode(enc_np)) > 0.999


@pytest.mark.parametrize("spec", SPECS)
def test_non_contiguous_inputs(spec):
    codec = get_codec(spec)
    base = gaussian((256, 2, 128))
    x = base.transpose(1, 0, 2)[:, ::2]  # [2, 128, 128], strided
    assert not x.flags.c_contiguous
    ref_enc = codec.encode(np.ascontiguousarray(x))
    ref = codec.decode(ref_enc)
    # numpy may run strided inputs through other loops (einsum, non-BLAS matmul): the same
    # codes, floats equal up to rounding
    enc = codec.encode(x)
    assert_same_encoding(enc, ref_enc)
    assert_close(codec.decode(enc), ref)
    torch = pytest.importorskip("torch")
    xt = torch.from_numpy(base).transpose(0, 1)[:, ::2]
    assert not xt.is_contiguous()
    # torch (MKL matmul, its own atan2) against numpy: codes as in test_numpy_torch_agree, and
    # decoded floats equal up to rounding, not bit for bit (they differ by ~1e-6 on AVX2 CPUs)
    enc_t = codec.encode(xt)
    assert_same_encoding(enc_t, ref_enc, min_agree=0.999)
    yt = codec.decode(enc_t)
    assert isinstance(yt, torch.Tensor) and close_fraction(yt, ref) > 0.999


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_raises(spec, bad):
    x = gaussian((4, 64))
    x[1, 7] = bad
    with pytest.raises(CodecError, match="NaN or Inf"):
        get_codec(spec).encode(x)


def test_non_finite_input_raises_torch():
    torch = pytest.importorskip("torch")
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    x[2, 3] = float("nan")
    for spec in SPECS:
        with pytest.raises(CodecError):
            get_codec(spec).encode(x)


def test_scales_beyond_fp16_raise():
    x = gaussian((4, 64)) * 1e5
    for spec in ("int4", "kivi4", "prism"):
        with pytest.raises(CodecError, match="fp16"):
            get_codec(spec).encode(x)
    # a per-token scale absmax/127 still fits fp16 here
    assert nmse(x, get_codec("int8").decode(get_codec("int8").encode(x))) < 1e-4


def test_fp8_codes_are_e4m3_bytes():
    x = np.array([[448.0, -224.0, 1.0, 0.0]], np.float32)
    enc = get_codec("fp8").encode(x)
    assert enc.arrays["codes"].dtype == np.uint8 and enc.arrays["scale"].dtype == np.float16
    fp8 = enc.arrays["codes"].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(fp8, [[448.0, -224.0, 1.0, 0.0]])
    np.testing.assert_array_equal(get_codec("fp8").decode(enc), x)


# -- KIVI roles ------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [Kivi2, Kivi4])
def test_kivi_for_role(cls):
    codec = cls(group_size=32)
    assert codec.axis == "channel"
    key, value = codec.for_role("key"), codec.for_role("value")
    assert type(key) is type(value) is cls
    assert (key.axis, value.axis) == ("channel", "token")
    assert key.group_size == value.group_size == 32
    assert value.for_role("key") == key
    with pytest.raises(CodecError):
        codec.for_role("query")


def test_kivi_keys_with_channel_offset():
    x = gaussian((2, 256, 128), seed=3)
    x[..., 17] += 50.0  # an outlier channel, as real keys have
    centred = x - x.mean(-2, keepdims=True)

    def err(spec):  # error relative to the signal without its fixed offset
        codec = get_codec(spec).for_role("key") if "axis" not in spec else get_codec(spec)
        return float(((x - codec.decode(codec.encode(x))) ** 2).sum() / (centred**2).sum())

    # per channel, the offset sits inside each group's minimum: same error as without it
    assert err("kivi4") < 0.012
    assert err("kivi2") < 0.28
    # per token, the offset widens every token's range 10x: far worse
    assert err("kivi4:axis=token") > 20 * err("kivi4")
