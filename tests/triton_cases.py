"""Triton turbo kernels (:mod:`kvtool.kernels.triton_cuda`) against the numpy codec.

Not collected on its own: ``tests/test_triton_kernels.py`` runs this file in a fresh process,
under ``TRITON_INTERPRET=1`` without CUDA (setting it in the main test process would turn every
later Triton kernel, vLLM's included, into an interpreted one) and with ``-m gpu`` on CUDA.

The interpreter needs the variable when ``@triton.jit`` decorates: for triton's own library
(``tl.max``, ``tl.sum``...) when triton is first imported, for ours when the module is. So this
file sets it before it imports triton, loads a private copy of the module, and sets it again
around each test (triton also reads it at launch).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

import numpy as np
import pytest
from conftest import relative_mse

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
_saved_env = os.environ.get("TRITON_INTERPRET")
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
try:
    triton = pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    def _load() -> ModuleType:
        if CUDA:
            from kvtool.kernels import triton_cuda

            return triton_cuda
        origin = importlib.util.find_spec("kvtool.kernels.triton_cuda").origin
        spec = importlib.util.spec_from_file_location("_kvtool_triton_interpreted", origin)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module

    tc = _load()
finally:
    if _saved_env is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _saved_env

from kvtool.codecs import get_codec  # noqa: E402
from kvtool.codecs.abc import Encoded  # noqa: E402
from kvtool.codecs.lloyd_max import sphere_marginal_codebook  # noqa: E402
from kvtool.codecs.rotation import rotation_matrix  # noqa: E402
from kvtool.kernels import numpy_ops, to_numpy, to_torch  # noqa: E402
from kvtool.kernels.bitpack import unpack_bits  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SEED = 0x1234
#: the kernels can run in this process (compiled on CUDA, or fully interpreted)
IN_PROCESS = CUDA or isinstance(triton.language.max, InterpretedFunction)


@pytest.fixture(autouse=True)
def _interpreter(request, monkeypatch):
    if not CUDA:
        if not IN_PROCESS:
            pytest.fail("triton was imported without TRITON_INTERPRET=1 before this module: "
                        "run this file through tests/test_triton_kernels.py")
        monkeypatch.setenv("TRITON_INTERPRET", "1")


# -- helpers -------------------------------------------------------------------------------------
def _inputs(rng: np.random.Generator, rows: int, dim: int) -> np.ndarray:
    """Gaussian rows plus a zero row, a one-hot row, a large-offset row and a tiny row."""
    x = rng.standard_normal((rows, dim)).astype(np.float32)
    x[0] = 0
    x[1] = 0
    x[1, 3] = 2.5
    x[2, 5] += 60
    x[3] *= 1e-3
    return x


def _near_boundary(x: np.ndarray, bits: int, seed: int, tol: float = 1e-6) -> np.ndarray:
    """Where the float64 normalised rotated coordinate lies within ``tol`` of a boundary."""
    x = np.asarray(x, dtype=np.float64)
    y = x @ rotation_matrix(x.shape[-1], seed).astype(np.float64).T
    norm = np.sqrt((x * x).sum(-1, keepdims=True))
    u = y / np.where(norm > 0, norm, 1)
    b = sphere_marginal_codebook(x.shape[-1], 1 << bits).boundaries.astype(np.float64)
    i = np.searchsorted(b, u)
    lo = np.abs(u - b[np.maximum(i - 1, 0)])
    hi = np.abs(u - b[np.minimum(i, len(b) - 1)])
    return np.minimum(lo, hi) < tol


def _assert_codes(ours, ref, near: np.ndarray, bits: int) -> None:
    """Codes equal except near a boundary, and there by at most one cell."""
    dim = near.shape[-1]
    a = unpack_bits(numpy_ops, np.asarray(to_numpy(ours)), bits, dim).astype(int)
    b = unpack_bits(numpy_ops, np.asarray(to_numpy(ref)), bits, dim).astype(int)
    wrong = a != b
    assert not (wrong & ~near).any(), f"{int((wrong & ~near).sum())} codes differ off-boundary"
    assert (np.abs(a - b) <= 1).all()


def _f64(t) -> np.ndarray:
    return np.asarray(to_numpy(t)).astype(np.float64)


def _assert_decoded(ours, ref, dtype: str, norms) -> None:
    """fp32: within 1e-5 relative; fp16/bf16: within one ulp of the reference. Both with an
    absolute floor of 1e-6·‖x‖ (fp32 summation order alone moves elements near zero)."""
    a, b = _f64(ours), _f64(ref)
    floor = 1e-6 * _f64(norms)[..., None]
    if dtype == "float32":
        bound = 1e-5 * np.abs(b) + floor
    else:
        p = 11 if dtype == "float16" else 8
        tiny = 2.0**-14 if dtype == "float16" else 2.0**-126
        ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(b), tiny))) - (p - 1))
        bound = np.maximum(ulp, floor)
    bad = np.abs(a - b) > bound
    assert not bad.any(), f"{int(bad.sum())} elements off, worst {np.abs(a - b).max()}"


def _encoded(codes, norms, shape) -> Encoded:
    return Encoded({"codes": np.asarray(to_numpy(codes)),
                    "norms": np.asarray(to_numpy(norms)).astype(np.float16)},
                   tuple(shape), "float32")


def _dev(a: np.ndarray) -> torch.Tensor:
    return to_torch(a, DEVICE)


# -- CPU (interpreter) and GPU ------------------------------------------------------------------
def test_module_surface():
    assert tc.name == "triton"
    assert tc.available()
    assert tc.INTERPRET == (not CUDA)
    assert tc.supported(128, 3) and tc.supported(16, 2) and tc.supported(256, 4)
    for dim, bits in ((96, 3), (8, 2), (512, 4), (128, 1), (128, 8)):
        assert not tc.supported(dim, bits)
    with pytest.raises(ValueError):
        tc.turbo_encode(torch.zeros(2, 96, device=DEVICE), 3, SEED)


@pytest.mark.parametrize("dim", (16, 64, 128, 256))
def test_rotation_is_exact_in_16_bits(dim):
    """Entries are k/D (|k| ≤ D, exact in fp16/bf16) up to float64 residue the kernels drop."""
    for seed in (SEED, 7, 99):
        k = rotation_matrix(dim, seed).astype(np.float64) * dim
        assert np.abs(k - np.round(k)).max() < 1e-9 and np.abs(k).max() <= dim


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("dim", (64, 128))
@pytest.mark.parametrize("bits", (2, 3, 4))
def test_encode_matches_numpy(bits, dim, dtype, rng):
    x = _dev(_inputs(rng, 45, dim)).to(DTYPES[dtype])
    codes, norms = tc.turbo_encode(x, bits, SEED)
    assert codes.dtype == torch.uint8 and codes.shape == (45, dim * bits // 8)
    assert norms.dtype == torch.float32 and norms.shape == (45,)
    x_np = to_numpy(x)
    ref = get_codec(f"turbo{bits}", seed=SEED).encode(x_np)
    _assert_codes(codes, ref.arrays["codes"], _near_boundary(x_np, bits, SEED), bits)
    x32 = np.asarray(x_np, dtype=np.float32)
    np.testing.assert_allclose(to_numpy(norms), numpy_ops.norm(x32)[:, 0], rtol=1e-6, atol=0)


@pytest.mark.parametrize("bits", (2, 3))
@pytest.mark.parametrize("dim", (16, 32, 256))
def test_other_dims_and_leading_axes(dim, bits, rng):
    codec = get_codec(f"turbo{bits}", seed=7)
    x = _inputs(rng, 24, dim).reshape(2, 12, dim)
    codes, norms = tc.turbo_encode(_dev(x), bits, 7)
    assert codes.shape == (2, 12, dim * bits // 8) and norms.shape == (2, 12)
    ref = codec.encode(x)
    _assert_codes(codes.reshape(24, -1), ref.arrays["codes"].reshape(24, -1),
                  _near_boundary(x.reshape(24, dim), bits, 7), bits)
    nrm = ref.arrays["norms"]
    ours = tc.turbo_decode(_dev(ref.arrays["codes"]), _dev(nrm), dim, bits, 7, torch.float16)
    assert ours.shape == (2, 12, dim)
    _assert_decoded(ours, codec.decode(ref, "float16"), "float16", nrm)


@pytest.mark.parametrize("out", list(DTYPES))
@pytest.mark.parametrize("dim", (64, 128))
@pytest.mark.parametrize("bits", (2, 3, 4))
def test_decode_matches_numpy(bits, dim, out, rng):
    codec = get_codec(f"turbo{bits}", seed=SEED)
    enc = codec.encode(_inputs(rng, 45, dim))
    norms = enc.arrays["norms"]
    ours = tc.turbo_decode(_dev(enc.arrays["codes"]), _dev(norms), dim, bits, SEED,
                           DTYPES[out])
    assert ours.dtype == DTYPES[out] and ours.shape == (45, dim)
    _assert_decoded(ours, codec.decode(enc, out), out, norms)


@pytest.mark.parametrize("bits", (2, 3, 4))
def test_cross_read(bits, rng):
    """Triton codes decode with the numpy codec, numpy codes with triton, to the same values."""
    dim, codec = 128, get_codec(f"turbo{bits}", seed=99)
    x = rng.standard_normal((64, dim)).astype(np.float32)
    codes, norms = tc.turbo_encode(_dev(x), bits, 99)
    norms16 = norms.half()
    mine = _encoded(codes, norms16, x.shape)
    by_numpy = codec.decode(mine, "float32")
    _assert_decoded(tc.turbo_decode(codes, norms16, dim, bits, 99, torch.float32), by_numpy,
                    "float32", norms16)
    assert relative_mse(x, by_numpy) == pytest.approx(codec.theoretical_mse(dim), rel=0.35)
    theirs = codec.encode(x)
    by_triton = tc.turbo_decode(_dev(theirs.arrays["codes"]), _dev(theirs.arrays["norms"]),
                                dim, bits, 99, torch.float32)
    _assert_decoded(by_triton, codec.decode(theirs, "float32"), "float32",
                    theirs.arrays["norms"])


def _assert_scores(ours, ref, q, k_hat) -> None:
    """Within 1e-4 relative, with an absolute floor of 1e-6·‖q‖·‖k̂‖."""
    scale = np.linalg.norm(q, axis=-1)[..., :, None] * np.linalg.norm(k_hat, axis=-1)[..., None, :]
    err = np.abs(_f64(ours) - np.asarray(ref, dtype=np.float64))
    assert (err <= 1e-4 * np.abs(ref) + 1e-6 * scale).all(), err.max()


@pytest.mark.parametrize("bits,dim,m", [(2, 64, 5), (3, 128, 1), (4, 128, 20)])
def test_scores_match_numpy(bits, dim, m, rng):
    codec = get_codec(f"turbo{bits}", seed=SEED)
    enc = codec.encode(rng.standard_normal((2, 3, 37, dim)).astype(np.float32))
    q = rng.standard_normal((2, 3, m, dim)).astype(np.float32)
    ours = tc.turbo_scores(_dev(q), _dev(enc.arrays["codes"]), _dev(enc.arrays["norms"]), bits,
                           SEED)
    assert ours.shape == (2, 3, m, 37) and ours.dtype == torch.float32
    _assert_scores(ours, codec.scores(q, enc), q, codec.decode(enc, "float32"))


def test_scores_broadcast_leading_axes(rng):
    codec = get_codec("turbo3", seed=5)
    enc = codec.encode(rng.standard_normal((2, 3, 20, 64)).astype(np.float32))
    q = rng.standard_normal((1, 3, 4, 64)).astype(np.float32)
    ours = tc.turbo_scores(_dev(q), _dev(enc.arrays["codes"]), _dev(enc.arrays["norms"]), 3, 5)
    assert ours.shape == (2, 3, 4, 20)
    _assert_scores(ours, codec.scores(q, enc), q, codec.decode(enc, "float32"))


def _attention_reference(q, k_hat, v_hat, scale: float) -> np.ndarray:
    """softmax(q·k̂ᵀ·scale)·v̂ in float64 with GQA head sharing."""
    q, k_hat, v_hat = (np.asarray(a, dtype=np.float64) for a in (q, k_hat, v_hat))
    group = q.shape[1] // k_hat.shape[1]
    k_hat, v_hat = np.repeat(k_hat, group, axis=1), np.repeat(v_hat, group, axis=1)
    s = np.einsum("bhd,bhnd->bhn", q, k_hat) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhn,bhnd->bhd", p, v_hat)


def _attention_case(rng, b, hq, hkv, n, dim, k_codec, v_codec, sharp=1.0):
    q = rng.standard_normal((b, hq, dim)).astype(np.float32)
    enc_k = k_codec.encode(rng.standard_normal((b, hkv, n, dim)).astype(np.float32))
    enc_v = v_codec.encode(rng.standard_normal((b, hkv, n, dim)).astype(np.float32))
    scale = sharp / np.sqrt(dim)
    ref = _attention_reference(q, k_codec.decode(enc_k, "float32"),
                               v_codec.decode(enc_v, "float32"), scale)
    args = (_dev(q), _dev(enc_k.arrays["codes"]), _dev(enc_k.arrays["norms"]),
            _dev(enc_v.arrays["codes"]), _dev(enc_v.arrays["norms"]))
    kw = {"dim": dim, "k_bits": k_codec.bits, "k_seed": k_codec.seed, "v_bits": v_codec.bits,
          "v_seed": v_codec.seed, "scale": scale}
    return args, kw, ref


@pytest.mark.parametrize("split_k", (None, 1, 3, 7, 30))
def test_decode_attention_gqa_mixed_codecs(split_k, rng):
    """turbo3 keys / turbo2 values with other seeds, Hq=4 over Hkv=2, splits that do not
    divide N=50 (30 splits of 2 tokens leave five empty)."""
    k_codec, v_codec = get_codec("turbo3", seed=11), get_codec("turbo2", seed=12345)
    args, kw, ref = _attention_case(rng, 2, 4, 2, 50, 64, k_codec, v_codec)
    out = tc.turbo_decode_attention(*args, **kw, split_k=split_k)
    assert out.shape == (2, 4, 64) and out.dtype == torch.float32
    np.testing.assert_allclose(_f64(out), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("hq,hkv,n,split_k,sharp", [(2, 2, 33, 2, 4.0), (16, 1, 40, 3, 1.0),
                                                    (8, 1, 9, 4, 8.0)])
def test_decode_attention_head_groups(hq, hkv, n, split_k, sharp, rng):
    """MHA (one head per kv head), a 16-head group (tensor-core path) and an 8-head group."""
    k_codec, v_codec = get_codec("turbo4", seed=3), get_codec("turbo3", seed=4)
    args, kw, ref = _attention_case(rng, 1, hq, hkv, n, 128, k_codec, v_codec, sharp)
    out = tc.turbo_decode_attention(*args, **kw, split_k=split_k)
    np.testing.assert_allclose(_f64(out), ref, rtol=1e-4, atol=1e-4)


def test_decode_attention_rejects_bad_shapes(rng):
    codec = get_codec("turbo3")
    (q, *kv), kw, _ = _attention_case(rng, 1, 4, 2, 8, 64, codec, codec)
    with pytest.raises(ValueError):  # 3 query heads over 2 kv heads
        tc.turbo_decode_attention(q[:, :3], *kv, **kw)
    with pytest.raises(ValueError):  # value codes of another width
        tc.turbo_decode_attention(q, *kv, **{**kw, "v_bits": 2})


# -- real CUDA, larger shapes -------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
class TestCuda:
    @pytest.mark.parametrize("dtype", ("float16", "float32", "bfloat16"))
    @pytest.mark.parametrize("dim", (64, 128, 256))
    @pytest.mark.parametrize("bits", (2, 3, 4))
    def test_encode_decode(self, bits, dim, dtype, rng):
        codec = get_codec(f"turbo{bits}", seed=SEED)
        x = _dev(_inputs(rng, 70_001, dim)).to(DTYPES[dtype])
        codes, norms = tc.turbo_encode(x, bits, SEED)
        x_np = to_numpy(x)
        ref = codec.encode(x_np)
        _assert_codes(codes, ref.arrays["codes"], _near_boundary(x_np, bits, SEED), bits)
        np.testing.assert_allclose(to_numpy(norms), numpy_ops.norm(
            np.asarray(x_np, dtype=np.float32))[:, 0], rtol=1e-6, atol=0)
        nrm = ref.arrays["norms"]
        for out in DTYPES:
            ours = tc.turbo_decode(_dev(ref.arrays["codes"]), _dev(nrm), dim, bits, SEED,
                                   DTYPES[out])
            _assert_decoded(ours, codec.decode(ref, out), out, nrm)

    def test_scores(self, rng):
        codec = get_codec("turbo3", seed=SEED)
        enc = codec.encode(rng.standard_normal((4, 8, 3000, 128)).astype(np.float32))
        q = rng.standard_normal((4, 8, 33, 128)).astype(np.float32)
        ours = tc.turbo_scores(_dev(q), _dev(enc.arrays["codes"]), _dev(enc.arrays["norms"]),
                               3, SEED)
        _assert_scores(ours, codec.scores(q, enc), q, codec.decode(enc, "float32"))

    @pytest.mark.parametrize("split_k", (None, 1, 13))
    @pytest.mark.parametrize("hq,dim", [(32, 128), (8, 256), (64, 64), (128, 128)])
    def test_decode_attention(self, split_k, hq, dim, rng):
        k_codec, v_codec = get_codec("turbo4", seed=1), get_codec("turbo2", seed=2)
        args, kw, ref = _attention_case(rng, 3, hq, 8, 4099, dim, k_codec, v_codec)
        out = tc.turbo_decode_attention(*args, **kw, split_k=split_k)
        np.testing.assert_allclose(_f64(out), ref, rtol=1e-4, atol=1e-4)
