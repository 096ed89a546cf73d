"""The mlx ``turbomix`` backend (:mod:`kvtool.kernels.mlx_turbomix`) against the numpy
reference: the same codes (but for coordinates within float rounding of a decision), decoded
values within float rounding, each side decodes the other's bytes, and bad input is refused
with the numba path's messages. Every quantiser and option, fp16 and fp32 input."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_codes_agree
from fit_codecs import SHIPPED_FIT_CODECS

from kvtool.codecs import get_codec
from kvtool.codecs.abc import Encoded
from kvtool.errors import CodecError
from kvtool.kernels import to_mlx

mx = pytest.importorskip("mlx.core")
mlx_turbomix = pytest.importorskip("kvtool.kernels.mlx_turbomix")

QUANTIZERS = {"scalar": "", "pair": ",vq=2", "trellis": ",trellis=true"}
# quantiser, bits, outliers, center, candidates, norm_bits, head_dim, input dtype: each
# option's values meet each other's (D=128 with 16 outliers: a dense 112-channel rotation)
MATRIX = [
    ("scalar", 2, 0, False, 1, 16, 64, "float16"),
    ("scalar", 3, 0, True, 3, 8, 128, "float32"),
    ("scalar", 4, 16, False, 3, 16, 128, "float16"),
    ("scalar", 3, 16, True, 1, 8, 64, "float16"),
    ("pair", 2, 0, True, 3, 16, 64, "float32"),
    ("pair", 4, 0, False, 1, 8, 128, "float16"),
    ("pair", 3, 16, True, 1, 16, 128, "float16"),
    ("pair", 2, 16, False, 3, 8, 64, "float32"),
    ("trellis", 2, 0, False, 3, 8, 128, "float16"),
    ("trellis", 3, 0, True, 1, 16, 64, "float16"),
    ("trellis", 4, 16, True, 3, 8, 128, "float16"),
    ("trellis", 2, 16, False, 1, 16, 64, "float32"),
    ("trellis", 3, 16, True, 3, 16, 128, "bfloat16"),
    ("scalar", 4, 0, True, 3, 8, 64, "bfloat16"),
]
PRESET_CODECS = [
    "turbomix:bits=4,center=true,candidates=4",  # quality
    "turbomix:candidates=4",
    "turbomix:outliers=16,center=true,trellis=true,norm_bits=8",  # balanced
    "turbomix:bits=2,outliers=48,outlier_bits=3,trellis=true,norm_bits=8",
    "turbomix:bits=2,outliers=16,outlier_bits=3,center=true,candidates=4,select=scalar,"
    "trellis=true",  # small
    "turbomix:bits=2,candidates=4,select=scalar,trellis=true",
    "turbomix:bits=3,outliers=12,outlier_bits=8,center=true",  # 8-bit outliers
    *SHIPPED_FIT_CODECS,  # the fits kvtool ships
]


def spec_of(quantizer, bits, outliers, center, candidates, norm_bits) -> str:
    return (f"turbomix:bits={bits},outliers={outliers},center={str(center).lower()},"
            f"candidates={candidates},norm_bits={norm_bits}{QUANTIZERS[quantizer]}")


def reference(spec: str):
    codec = get_codec(spec)
    codec._fused = lambda like: None  # the numpy reference ops
    return codec


def keys(shape=(2, 3, 80, 64), seed=0, dtype="float16") -> np.ndarray:
    """Key-like rows: a common offset, a few loud channels, Gaussian rest."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x[..., 5] *= 9
    x[..., shape[-1] // 2 + 3] += 4
    x[..., 1::7] *= 3
    x += 0.5
    return x.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)


def mlx_encode(spec: str, x: np.ndarray) -> Encoded:
    """The mlx encode as the codec would hand it out (arrays reshaped to the codec's)."""
    codec = get_codec(spec)
    arrays = mlx_turbomix.encode(codec, to_mlx(x))
    assert all(isinstance(a, mx.array) for a in arrays.values())
    expected = codec.expected_arrays(x.shape, "float32")
    assert arrays.keys() == expected.keys()
    return Encoded({k: a.reshape(expected[k].shape) for k, a in arrays.items()}, x.shape,
                   str(x.dtype))


def mlx_decode(spec: str, enc: Encoded, dtype: str = "float32") -> np.ndarray:
    out = mlx_turbomix.decode(get_codec(spec), enc.arrays, enc.shape, dtype)
    assert isinstance(out, mx.array) and tuple(out.shape) == tuple(enc.shape)
    return np.array(out.astype(mx.float32))


def agree(mine: Encoded, ref: Encoded) -> None:
    assert_codes_agree({k: np.array(v) for k, v in mine.arrays.items()}, ref.arrays,
                       codes=5e-4, fp16_norms=0.002)


def check(spec: str, x: np.ndarray) -> None:
    mine, ref = mlx_encode(spec, x), reference(spec).encode(x)
    agree(mine, ref)
    want = reference(spec).decode(ref, "float32")
    # mlx decodes the reference's bytes (numpy arrays, and as mx arrays) as the reference does
    np.testing.assert_allclose(mlx_decode(spec, ref), want, rtol=1e-4, atol=1e-4)
    as_mx = Encoded({k: mx.array(v) for k, v in ref.arrays.items()}, ref.shape, ref.dtype)
    np.testing.assert_allclose(mlx_decode(spec, as_mx), want, rtol=1e-4, atol=1e-4)
    # the reference decodes mlx's bytes as mlx does
    np.testing.assert_allclose(reference(spec).decode(mine.to_numpy(), "float32"),
                               mlx_decode(spec, mine), rtol=1e-4, atol=1e-4)
    assert np.mean((want - x.astype(np.float32)) ** 2) < 0.2 * np.mean(x.astype(np.float32) ** 2)


@pytest.mark.parametrize("case", MATRIX, ids=lambda c: "-".join(map(str, c)))
def test_mlx_encode_writes_the_reference_codes(case):
    *options, dim, dtype = case
    check(spec_of(*options), keys(shape=(2, 3, 80, dim), seed=dim, dtype=dtype))


@pytest.mark.parametrize("spec", PRESET_CODECS)
def test_preset_codecs_write_the_reference_codes(spec):
    check(spec, keys(shape=(2, 2, 120, 128), seed=1))


def test_select_scalar_groups_shuffled_by_rotation_and_back():
    spec = "turbomix:bits=3,candidates=4,select=scalar,vq=2,norm_bits=8"
    x = keys(shape=(3, 5, 40, 64), seed=3)
    check(spec, x)
    rotation = np.array(mlx_encode(spec, x).arrays["rotation"]).reshape(-1).astype(int)
    assert len(set(rotation)) > 1 and (np.diff(rotation) < 0).any()


@pytest.mark.parametrize("shape", [(64,), (5, 64), (2, 1, 64), (2, 65, 32), (1, 200, 128)])
def test_short_groups_and_odd_shapes(shape):
    check("turbomix:bits=3,outliers=4,outlier_bits=4,center=true,candidates=3,trellis=true",
          keys(shape=shape, seed=2))


@pytest.mark.parametrize("quantizer", list(QUANTIZERS))
def test_two_and_three_channel_parts(quantizer):
    """Parts narrower than the butterflies (dense rotations) and than the trellis memory."""
    vq = quantizer == "pair"
    spec = f"turbomix:bits=2,outliers={2 if vq else 3},outlier_bits=3,candidates=2" \
           + QUANTIZERS[quantizer]
    check(spec, keys(shape=(3, 60, 34 if vq else 35), seed=4))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_decode_writes_each_output_dtype(dtype):
    spec = "turbomix:outliers=16,center=true,candidates=4,trellis=true,norm_bits=8"
    x = keys(shape=(3, 70, 64), seed=5)
    enc = mlx_encode(spec, x)
    out = mlx_turbomix.decode(get_codec(spec), enc.arrays, enc.shape, dtype)
    assert out.dtype == getattr(mx, dtype)
    want = reference(spec).decode(enc.to_numpy(), "float32")
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), want, rtol=1e-2, atol=1e-2)


def test_ties_go_to_the_lowest_candidate_and_the_reference_path():
    """All-zero and constant groups: every candidate has the same error (the lowest wins);
    ties in the Viterbi search (lower predecessor, lowest final state), between pair points and
    between channel energies (the lowest channels are outliers) give the reference's codes."""
    x = np.zeros((4, 32, 64), np.float16)
    x[1] = 1.0  # constant rows: centered away to zero
    x[2, :, ::2] = 0.25
    x[3] = np.float16(0.5) * (np.arange(64) % 3 == 0)
    for spec in ("turbomix:center=true,candidates=4,trellis=true",
                 "turbomix:candidates=4,bits=2,trellis=true",
                 "turbomix:candidates=4,vq=2,norm_bits=8",
                 "turbomix:outliers=8,candidates=3,center=true",
                 "turbomix:outliers=8,candidates=3,trellis=true"):
        mine, ref = mlx_encode(spec, x), reference(spec).encode(x)
        agree(mine, ref)
        rotation = np.array(mine.arrays["rotation"]).reshape(-1)
        assert rotation[0] == 0  # zeros: every candidate's error is 0
        if "center=true" in spec:
            assert rotation[1] == 0  # constant rows, centered to zeros


def test_float32_sums_off_the_cpu_round_to_the_same_means(monkeypatch):
    """Where mlx has no float64 (the GPU), means are a float32 mean corrected by its
    residuals' mean: the same fp16 means in practice, and so the same codes."""
    monkeypatch.setattr(mlx_turbomix, "_wide", lambda: mx.float32)
    spec = "turbomix:bits=4,outliers=16,center=true,candidates=2,norm_bits=8"
    for seed, dtype in ((6, "float16"), (7, "float32")):
        x = keys(shape=(4, 4, 190, 128), seed=seed, dtype=dtype)
        x[..., :40] += 37.0  # large offsets: a float32 sum alone would round differently
        mine, ref = mlx_encode(spec, x), reference(spec).encode(x)
        assert np.array_equal(np.array(mine.arrays["mean"]), ref.arrays["mean"])
        agree(mine, ref)


def messages(spec: str, x: np.ndarray) -> list[str]:
    """The CodecError messages of the mlx, the reference and (where numba loads) the fused
    encodes of ``x``."""
    encoders = [lambda: mlx_turbomix.encode(get_codec(spec), mx.array(x)),
                lambda: reference(spec).encode(x)]
    if get_codec(spec)._fused(x) is not None:
        encoders.append(lambda: get_codec(spec).encode(x))
    found = []
    for run in encoders:
        with pytest.raises(CodecError) as info:
            run()
        found.append(str(info.value))
    return found


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the reference's
@pytest.mark.parametrize("spec", ["turbomix:bits=4,center=true,candidates=4",
                                  "turbomix:outliers=8,trellis=true,norm_bits=8"])
def test_nan_inf_and_huge_inputs_are_refused_with_the_same_messages(spec):
    x = keys(shape=(2, 20, 64), dtype="float32")
    for bad, wanted in ((np.nan, "NaN or Inf"), (np.inf, "NaN or Inf"),
                        (3e38, "exceeds the fp16 range"), (7e4, "exceeds the fp16 range")):
        y = x.copy()
        y[1, 3, 7] = bad
        found = messages(spec, y)
        assert len(set(found)) == 1 and wanted in found[0], found


def test_arrays_no_encode_writes_are_refused():
    spec = "turbomix:bits=4,outliers=8,candidates=4,norm_bits=8"
    enc = mlx_encode(spec, keys(shape=(2, 16, 64)))
    codec = get_codec(spec)

    def refused(name, bad, match):
        arrays = dict(enc.arrays)
        arrays[name] = bad(np.array(arrays[name]))
        with pytest.raises(CodecError, match=match):
            mlx_turbomix.decode(codec, {k: mx.array(v) if isinstance(v, np.ndarray) else v
                                        for k, v in arrays.items()}, enc.shape, "float32")

    def flip(mask):
        mask[1, 0, 0] ^= 0b1111  # four channels more or fewer: no longer 8 set
        return mask

    def swap(ranges):
        return ranges[..., ::-1].copy()  # least norm above the greatest

    refused("rotation", lambda a: np.full_like(a, 4), "no writer stores")
    refused("codes", lambda a: a[..., :-1].copy(), "no writer stores")
    refused("norms", lambda a: a.astype(np.float16), "no writer stores")
    refused("outlier_mask", flip, "outlier mask does not name 8 of 64")
    refused("norm_range", swap, "least norm is above its greatest")
