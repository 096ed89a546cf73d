"""The mlx backend (:mod:`kvtool.kernels.mlx_ops`) against numpy, for every registered codec.

Codes must equal numpy's except where a rotated coordinate lies within float rounding of a bin
boundary (mlx's matmul sums in another order than numpy's BLAS); every other array and every
decoded value agrees within float rounding, and each backend decodes the other's bytes.
"""

from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from kvtool.codecs import get_codec, list_codecs  # noqa: E402
from kvtool.codecs.abc import Encoded  # noqa: E402
from kvtool.codecs.lloyd_max import planar_radius_codebook, sphere_marginal_codebook  # noqa: E402
from kvtool.codecs.prism import PrismCodec, angle_tables  # noqa: E402
from kvtool.codecs.rotation import rotation_matrix_t  # noqa: E402
from kvtool.codecs.turbo import TurboCodec  # noqa: E402
from kvtool.errors import CodecError  # noqa: E402
from kvtool.kernels import (  # noqa: E402
    available_backends,
    bitpack,
    compiled_for,
    mlx_metal,
    mlx_ops,
    numpy_ops,
    ops_for,
    to_mlx,
    to_numpy,
)

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
MX_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
TOL = 1e-6  # distance to a bin boundary below which either bin is a correct code


def sample(shape: tuple[int, ...], dtype: str, seed: int = 0) -> np.ndarray:
    """Vectors of very different norms, shared offsets, a zero vector, a dominant channel."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * rng.uniform(0.01, 30, (*shape[:-1], 1))
    flat = x.reshape(-1, shape[-1])
    flat[::7] += rng.standard_normal(shape[-1]) * 5
    flat[3 % len(flat), :] = 0
    flat[5 % len(flat), 1] = 40
    return x.astype(DTYPES[dtype])


def mlx_encoded(enc: Encoded) -> Encoded:
    return Encoded({k: to_mlx(v) for k, v in enc.arrays.items()}, enc.shape, enc.dtype)


def numpy_encoded(enc: Encoded) -> Encoded:
    return Encoded({k: to_numpy(v) for k, v in enc.arrays.items()}, enc.shape, enc.dtype)


# -- where codes may differ ----------------------------------------------------------------------
def _near(values: np.ndarray, bounds: np.ndarray, tol: np.ndarray | float) -> np.ndarray:
    if bounds.size == 0:
        return np.zeros(values.shape, bool)
    return np.abs(values[..., None] - bounds.astype(np.float64)).min(-1) < tol


def _rotated_unit(x: np.ndarray, padded: int, seed: int) -> np.ndarray:
    """The float64 rotated unit vectors turbo and prism quantise."""
    x64 = x.astype(np.float64).reshape(-1, x.shape[-1])
    unit = x64 / np.maximum(np.linalg.norm(x64, axis=-1, keepdims=True), 1e-300)
    unit = np.pad(unit, [(0, 0), (0, padded - x.shape[-1])])
    return unit @ rotation_matrix_t(padded, seed).astype(np.float64)


def loose_codes(codec, x: np.ndarray) -> dict[str, tuple[int, np.ndarray]] | None:
    """For each packed code array: (bit width, mask of codes that may differ), or None when
    the codec's codes must be identical (elementwise float math rounds alike everywhere)."""
    dim = x.shape[-1]
    lead = x.shape[:-1]
    if isinstance(codec, TurboCodec) and not codec.center:
        y = _rotated_unit(x, dim, codec.seed)
        near = _near(y, codec.codebook(dim).boundaries, TOL)
        return {"codes": (codec.bits, near.reshape(*lead, dim))}
    if isinstance(codec, PrismCodec):
        padded = -(-dim // 3) * 3
        t = _rotated_unit(x, padded, codec.seed).reshape(-1, padded // 3, 3)
        r = np.hypot(t[..., 0], t[..., 1])
        theta = np.arctan2(t[..., 1], t[..., 0])
        z_near = _near(t[..., 2], sphere_marginal_codebook(padded, 1 << codec.z_bits).boundaries,
                       TOL)
        r_near = _near(r, planar_radius_codebook(padded, 1 << codec.r_bits).boundaries, TOL)
        cut = (np.abs(t[..., 1]) < TOL) & (t[..., 0] < 0)  # atan2's ±π branch cut
        t_near = _near(theta, angle_tables(codec.theta_bits)[0], TOL / np.maximum(r, 1e-30)) | cut
        n = padded // 3
        return {"z": (codec.z_bits, z_near.reshape(*lead, n)),
                "r": (codec.r_bits, r_near.reshape(*lead, n)),
                "theta": (codec.theta_bits, t_near.reshape(*lead, n))}
    return None


def assert_codes_match(codec, x: np.ndarray, got: Encoded, want: Encoded) -> None:
    builtin = type(codec).__module__.startswith("kvtool.codecs.")
    loose = loose_codes(codec, x)
    for name, w in want.arrays.items():
        assert isinstance(got.arrays[name], mx.array), name
        g = to_numpy(got.arrays[name])
        assert g.dtype == w.dtype and g.shape == w.shape, name
        if loose is not None and name in loose:
            bits, near = loose[name]
            n = near.shape[-1]
            differ = (bitpack.unpack_bits(numpy_ops, g, bits, n)
                      != bitpack.unpack_bits(numpy_ops, w, bits, n))
            assert not (differ & ~near).any(), f"{name}: codes differ away from a boundary"
        elif loose is not None:  # rotation codecs' fp16 norms: sums in another order
            np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32),
                                       rtol=np.finfo(np.float16).eps, atol=0, err_msg=name)
        elif builtin:  # elementwise float math: the same IEEE roundings on both backends
            np.testing.assert_array_equal(g, w, err_msg=name)
        else:  # a plugin codec: allow a rare boundary flip
            assert (g != w).mean() <= 1e-3, name


def assert_decoded_close(got, want: np.ndarray, dtype: str) -> None:
    """Within float32 rounding of each vector's scale (one ulp more for 16-bit outputs)."""
    assert isinstance(got, mx.array) and got.dtype == MX_DTYPES[dtype]
    g, w = to_numpy(got).astype(np.float64), want.astype(np.float64)
    assert g.shape == w.shape
    scale = np.sqrt((w * w).sum(-1, keepdims=True)) + np.abs(w).max(-1, keepdims=True)
    ulp = 0 if dtype == "float32" else np.abs(np.spacing(want)).astype(np.float64)
    assert (np.abs(g - w) <= ulp + 1e-5 * scale + 1e-30).all()


# -- every codec, dtype and head dim -------------------------------------------------------------
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("codec_id", list_codecs())
def test_codec_matches_numpy_and_reads_its_bytes(codec_id, dtype, dim):
    codec = get_codec(codec_id)
    x = sample((3, 23, dim), dtype, seed=dim)
    want = codec.encode(x)
    got = codec.encode(to_mlx(x))
    assert_codes_match(codec, x.astype(np.float32), got, want)
    for enc in (want, numpy_encoded(got)):  # numpy's bytes and mlx's bytes, decoded by both
        for out in (dtype, "float32"):
            assert_decoded_close(codec.decode(mlx_encoded(enc), out), codec.decode(enc, out), out)


@pytest.mark.parametrize("spec", ["turbo3:center=true", "kivi4:axis=token", "int4:group_size=24",
                                  "kivi2:group_size=5", 'raw:dtype="bfloat16"',
                                  "prism:z_bits=2,r_bits=5,theta_bits=7", "turbo2:seed=7"])
@pytest.mark.parametrize("shape", [(2, 7, 64), (3, 1, 48), (5, 20), (33,)])
def test_options_and_shapes(spec, shape):
    codec = get_codec(spec)
    x = sample(shape, "float16", seed=len(shape)) if len(shape) > 1 else \
        np.linspace(-3, 5, shape[0]).astype(np.float16)
    want, got = codec.encode(x), codec.encode(to_mlx(x))
    for name, w in want.arrays.items():
        g = to_numpy(got.arrays[name])
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert (g != w).sum() <= max(2, g.size // 50), name  # a rotation may flip a code
    decoded = codec.decode(enc := mlx_encoded(want))
    assert decoded.dtype == mx.float16 and tuple(decoded.shape) == shape
    assert_decoded_close(codec.decode(enc, "float32"), codec.decode(want, "float32"), "float32")


@pytest.mark.parametrize("codec_id", list_codecs())
def test_torch_bytes_decode_on_mlx(codec_id):
    torch = pytest.importorskip("torch")
    codec = get_codec(codec_id)
    x = sample((2, 19, 128), "bfloat16", seed=3)
    enc = codec.encode(torch.from_numpy(x.view(np.int16)).view(torch.bfloat16))
    want = codec.decode(enc, "float32").numpy()
    assert_decoded_close(codec.decode(mlx_encoded(enc), "float32"), want, "float32")
    assert codec.decode(mlx_encoded(enc)).dtype == mx.bfloat16


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("codec_id", list_codecs())
def test_non_finite_input_is_refused(codec_id, bad):
    x = sample((4, 64), "float32")
    x[2, 7] = bad
    for dtype in MX_DTYPES.values():
        with pytest.raises(CodecError, match="NaN or Inf"):
            get_codec(codec_id).encode(to_mlx(x).astype(dtype))


def test_overflowing_norms_and_scales_are_refused():
    with pytest.raises(CodecError, match="fp16 range"):
        get_codec("turbo3").encode(mx.full((4, 64), 9000.0))  # norm 72000
    with pytest.raises(CodecError, match="fp16 range"):
        get_codec("int4").encode(mx.array([[-70000.0, 70000.0]]))


def test_turbo_scores_match_numpy():
    codec = get_codec("turbo3", center=True)
    keys = sample((3, 50, 64), "float32", seed=4) + 1.5
    q = sample((3, 4, 64), "float32", seed=5)
    enc = codec.encode(keys)
    want = codec.scores(q, enc)
    got = codec.scores(to_mlx(q), mlx_encoded(enc))
    assert isinstance(got, mx.array) and got.shape == want.shape
    np.testing.assert_allclose(to_numpy(got), want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


# -- the ops themselves --------------------------------------------------------------------------
def test_ops_for_and_conversions():
    x = sample((4, 64), "bfloat16")
    m = to_mlx(x)
    assert m.dtype == mx.bfloat16 and ops_for(m) is mlx_ops and ops_for(x) is numpy_ops
    assert compiled_for(m) is None  # numba never sees an mlx array
    back = to_numpy(m)
    assert back.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(back.view(np.uint16), x.view(np.uint16))  # bit for bit
    assert to_mlx(m) is m
    for dtype in (np.float16, np.float32, np.uint8, np.int8):
        a = np.arange(-6, 6).astype(dtype)
        np.testing.assert_array_equal(to_numpy(to_mlx(a)), a)
    fp8 = np.linspace(-448, 448, 97).astype(ml_dtypes.float8_e4m3fn)
    assert mlx_ops.dtype_name(to_mlx(fp8)) == "float8_e4m3fn"
    np.testing.assert_array_equal(to_numpy(to_mlx(fp8)).view(np.uint8), fp8.view(np.uint8))
    assert "mlx" in available_backends()
    assert mlx_metal.available() is bool(mx.metal.is_available())


def test_ops_for_never_imports_mlx():
    code = ("import sys, numpy as np; from kvtool.kernels import ops_for, to_numpy, compiled_for;"
            "from kvtool.codecs import get_codec; c = get_codec('turbo3');"
            "c.decode(c.encode(np.ones((2, 64), np.float32))); ops_for(np.ones(2));"
            "to_numpy(np.ones(2)); print('mlx.core' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_float8_conversion_matches_ml_dtypes():
    every = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = np.sort(every[np.isfinite(every)])
    x = np.concatenate([finite, (finite[1:] + finite[:-1]) / 2,  # ties round to even
                        np.random.default_rng(0).uniform(-448, 448, 5000)]).astype(np.float32)
    want = x.astype(ml_dtypes.float8_e4m3fn)
    f8 = mlx_ops.astype(mx.array(x), "float8_e4m3fn")
    np.testing.assert_array_equal(to_numpy(mlx_ops.view(f8, "uint8")), want.view(np.uint8))
    back = mlx_ops.astype(mlx_ops.view(to_mlx(want.view(np.uint8)), "float8_e4m3fn"), "float32")
    np.testing.assert_array_equal(to_numpy(back), want.astype(np.float32))


def test_bucketize_all_finite_and_packing():
    rng = np.random.default_rng(2)
    boundaries = np.sort(rng.standard_normal(15)).astype(np.float32)
    x = rng.standard_normal((50, 64)).astype(np.float32)
    x[0, :15] = boundaries  # ties count as not below
    want = np.searchsorted(boundaries, x, side="left").astype(np.uint8)
    got = mlx_ops.bucketize(mx.array(x), boundaries)
    assert got.dtype == mx.uint8
    np.testing.assert_array_equal(to_numpy(got), want)
    np.testing.assert_array_equal(to_numpy(mlx_ops.bucketize(mx.array(x), mx.array(boundaries))),
                                  want)
    for dtype in MX_DTYPES.values():
        a = mx.ones((3, 70), dtype=dtype)
        assert mlx_ops.all_finite(a) and mlx_ops.all_finite(mx.zeros((0, 4), dtype=dtype))
        for bad in (np.nan, np.inf, -np.inf):
            a[2, 69] = bad
            assert not mlx_ops.all_finite(a) and not mlx_ops.all_finite(a.T)
    for bits in range(1, 9):
        codes = rng.integers(0, 1 << bits, (3, 2, 37), dtype=np.uint8)
        packed = bitpack.pack_bits(numpy_ops, codes, bits)
        np.testing.assert_array_equal(to_numpy(mlx_ops.pack_bits(mx.array(codes), bits)), packed)
        np.testing.assert_array_equal(to_numpy(mlx_ops.unpack_bits(mx.array(packed), bits, 37)),
                                      codes)
        values = rng.standard_normal(1 << bits).astype(np.float32)
        looked_up = mlx_ops.unpack_lookup(mx.array(packed), bits, 37, values)
        np.testing.assert_array_equal(to_numpy(looked_up), values[codes])


def test_results_are_lazy_until_evaluated():
    codec = get_codec("turbo4")
    x = mx.array(sample((8, 64), "float32"))
    enc = codec.encode(x)
    mx.eval(*enc.arrays.values())  # mlx evaluates on demand; an explicit eval is fine too
    out = codec.decode(enc)
    mx.eval(out)
    assert out.dtype == mx.float32 and tuple(out.shape) == (8, 64)
    raw = get_codec("raw").encode(x)
    x[0, 0] = 123.0  # an mlx write rebinds x: the stored copy keeps the old value
    assert float(raw.arrays["data"][0, 0]) != 123.0
