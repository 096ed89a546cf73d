"""Triton turbo kernels (:mod:`kvtool.kernels.triton_cuda`) against float64 math and the numpy
codec.

Not collected on its own: ``tests/test_triton_kernels.py`` runs this file in a fresh process,
under ``TRITON_INTERPRET=1`` without CUDA (setting it in the main test process would turn every
later Triton kernel, vLLM's included, into an interpreted one) and with ``-m gpu`` on CUDA.

The interpreter needs the variable when ``@triton.jit`` decorates: for triton's own library
(``tl.max``, ``tl.sum``...) when triton is first imported, for ours when the module is. So this
file sets it before it imports triton, loads a private copy of the module
(:func:`gpu_util.kernel_module`), and sets it again around each test (triton also reads it at
launch).

References are float64 torch on the kernels' device (the exact cells, values, scores and
attention of the codes), plus the numpy codec on a sample of rows. Decoded 16-bit values may
differ from either by one step of the output dtype plus ``2**-17`` of the vector's norm: the
kernel multiplies the fp32 centroids as two bf16 pieces (each product within ``2**-18``
relative), and through the orthogonal rotation that is at most ``2**-18·‖x̂‖`` per element, more
than one step of an element far below the norm (turbo2, D=128: 5 of 9M elements, measured on
an H100 and reproduced by emulating the split on the CPU).

GPU budget (``-m gpu``, one H100, a cold Triton cache). The cases are compile bound: one
compile per kernel variant (:mod:`gpu_util` pins the autotuner to one configuration), 0.3-2.9 s
each (``triton.compile`` for sm_90, timed on a 2-core EPYC); the float64 references of 70K
rows take well under a second on the GPU, the numpy codec on 2K sampled rows ~0.1 s.
``test_encode_decode``: 9 cases, 1 encode + 3 decode variants each, 2-10 s a case, ~50 s;
``test_scores``: 2 variants, ~3 s; ``test_decode_attention``: 12 cases, the first of each
(hq, dim) compiling its split kernel (2-4 s), ~20 s in all; ``test_every_config``: the 4
configurations kept at head_dim 128 for both kernels (6 new compiles) and the autotuner's
timing, ~15 s. With the process start (~10 s), about 100 s.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import relative_mse

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()

from gpu_util import (  # noqa: E402
    assert_checks_deferred,
    autotuned,
    defer_cpu_checks,
    kept_configs,
    kernel_module,
    pin_config,
    pin_kept_config,
    use_interpreter,
)

triton, tc, IN_PROCESS = kernel_module("kvtool.kernels.triton_cuda", CUDA)

from kvtool.codecs import get_codec  # noqa: E402
from kvtool.codecs.abc import Encoded  # noqa: E402
from kvtool.codecs.lloyd_max import sphere_marginal_codebook  # noqa: E402
from kvtool.codecs.rotation import rotation_matrix  # noqa: E402
from kvtool.kernels import to_numpy, to_torch, torch_ops  # noqa: E402
from kvtool.kernels.bitpack import unpack_bits  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
SEED = 0x1234
#: the split of fp32 centroids into two bf16 pieces for 16-bit outputs: within this fraction of
#: the vector's norm (see the module docstring)
TWO_PIECES = 2.0**-17


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    use_interpreter(monkeypatch, CUDA, IN_PROCESS, "tests/test_triton_kernels.py")


# -- helpers: float64 references on the device ---------------------------------------------------
def _inputs(rng: np.random.Generator, rows: int, dim: int) -> np.ndarray:
    """Gaussian rows plus a zero row, a one-hot row, a large-offset row and a tiny row."""
    x = rng.standard_normal((rows, dim)).astype(np.float32)
    x[0] = 0
    x[1] = 0
    x[1, 3] = 2.5
    x[2, 5] += 60
    x[3] *= 1e-3
    return x


def _dev(a) -> torch.Tensor:
    """``a`` (numpy or torch) on the kernels' device."""
    return a.to(DEVICE) if isinstance(a, torch.Tensor) else to_torch(np.asarray(a), DEVICE)


def _f64(a) -> torch.Tensor:
    return _dev(a).double()


def _rotation64(dim: int, seed: int) -> torch.Tensor:
    return _f64(rotation_matrix(dim, seed).astype(np.float64))


def _exact_cells(x, bits: int, seed: int, tol: float = 1e-6
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cell of each normalised rotated coordinate, whether it lies within ``tol`` of a cell
    boundary, the norms), in float64 on the device."""
    x = _f64(x)
    dim = x.shape[-1]
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    u = (x @ _rotation64(dim, seed).T) / torch.where(norm > 0, norm, 1.0)
    b = _f64(sphere_marginal_codebook(dim, 1 << bits).boundaries.astype(np.float64))
    cell = torch.searchsorted(b, u.contiguous())  # boundaries strictly below, as the kernels
    gap = torch.minimum((u - b[(cell - 1).clamp_min(0)]).abs(),
                        (u - b[cell.clamp_max(len(b) - 1)]).abs())
    return cell, gap < tol, norm[..., 0]


def _exact_decode(codes, norms, dim: int, bits: int, seed: int) -> torch.Tensor:
    """float64 x̂ of packed codes and their (fp16) norms."""
    cells = unpack_bits(torch_ops, _dev(codes), bits, dim).long()
    centroids = _f64(sphere_marginal_codebook(dim, 1 << bits).centroids.astype(np.float64))
    return (centroids[cells] @ _rotation64(dim, seed)) * _f64(norms)[..., None]


def _cells(packed, bits: int, dim: int) -> torch.Tensor:
    return unpack_bits(torch_ops, _dev(packed), bits, dim).long()


def _assert_codes(ours, cells, near, bits: int) -> None:
    """Packed codes ``ours`` hold ``cells`` except near a boundary, and there by at most one."""
    a, b = _cells(ours, bits, near.shape[-1]), _dev(cells)
    wrong, near = a != b, _dev(near)
    assert not (wrong & ~near).any(), f"{int((wrong & ~near).sum())} codes differ off-boundary"
    assert ((a - b).abs() <= 1).all()


def _assert_decoded(ours, ref, dtype: str, norms) -> None:
    """fp32: within 1e-5 relative of the reference, with an absolute floor of 1e-6·‖x‖
    (summation order alone moves elements near zero); fp16/bf16: one step of the dtype plus
    :data:`TWO_PIECES` of ‖x‖."""
    a, b, n = _f64(ours), _f64(ref), _f64(norms)[..., None]
    if dtype == "float32":
        bound = 1e-5 * b.abs() + 1e-6 * n
    else:
        p, tiny = (11, 2.0**-14) if dtype == "float16" else (8, 2.0**-126)
        bound = 2.0 ** (torch.floor(torch.log2(b.abs().clamp_min(tiny))) - (p - 1)) \
            + TWO_PIECES * n
    bad = (a - b).abs() > bound
    assert not bad.any(), f"{int(bad.sum())} elements off, worst {(a - b).abs().max():.3g}"


def _assert_scores(ours, ref, q, k_hat) -> None:
    """Within 1e-4 relative, with an absolute floor of 1e-6·‖q‖·‖k̂‖."""
    q, k_hat = _f64(q), _f64(k_hat)
    scale = torch.linalg.vector_norm(q, dim=-1)[..., :, None] \
        * torch.linalg.vector_norm(k_hat, dim=-1)[..., None, :]
    err = (_f64(ours) - _f64(ref)).abs()
    assert (err <= 1e-4 * _f64(ref).abs() + 1e-6 * scale).all(), float(err.max())


def _encoded(codes, norms, shape) -> Encoded:
    return Encoded({"codes": np.asarray(to_numpy(codes)),
                    "norms": np.asarray(to_numpy(norms)).astype(np.float16)},
                   tuple(shape), "float32")


def _random_codes(gen: torch.Generator, lead: tuple[int, ...], dim: int, bits: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(random packed codes: every byte pattern is valid, fp16 norms around sqrt(dim))."""
    codes = torch.randint(0, 256, (*lead, dim * bits // 8), generator=gen, dtype=torch.uint8)
    norms = (0.5 + torch.rand(lead, generator=gen)) * dim**0.5
    return _dev(codes), _dev(norms.half())


def _attention_case(seed: int, b, hq, hkv, n, dim, k_codec, v_codec, sharp=1.0):
    """Random codes, queries and the float64 attention of their exact values (GQA: query head
    h reads kv head h // (hq/hkv))."""
    gen = torch.Generator().manual_seed(seed)
    q = _dev(torch.randn((b, hq, dim), generator=gen))
    kc, kn = _random_codes(gen, (b, hkv, n), dim, k_codec.bits)
    vc, vn = _random_codes(gen, (b, hkv, n), dim, v_codec.bits)
    scale = sharp / dim**0.5
    k_hat = _exact_decode(kc, kn, dim, k_codec.bits, k_codec.seed)
    v_hat = _exact_decode(vc, vn, dim, v_codec.bits, v_codec.seed)
    s = torch.einsum("bhgd,bhnd->bhgn", q.double().view(b, hkv, hq // hkv, dim), k_hat) * scale
    ref = torch.einsum("bhgn,bhnd->bhgd", s.softmax(-1), v_hat).reshape(b, hq, dim)
    kw = {"dim": dim, "k_bits": k_codec.bits, "k_seed": k_codec.seed, "v_bits": v_codec.bits,
          "v_seed": v_codec.seed, "scale": scale}
    return (q, kc, kn, vc, vn), kw, ref


def _assert_attention(out, ref) -> None:
    """Within 2e-3 of the output's scale: the kernel (:mod:`kvtool.kernels.triton_attention`)
    multiplies centroids and probabilities as fp16 on tensor cores with fp32 sums (~6e-4)."""
    assert out.dtype == torch.float32
    err = (out.double() - ref).abs().max().item()
    assert err <= 2e-3 * ref.abs().max().item(), err


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
    cells, near, exact_norms = _exact_cells(x, bits, SEED)
    _assert_codes(codes, _cells(ref.arrays["codes"], bits, dim), near, bits)
    _assert_codes(codes, cells, near, bits)
    torch.testing.assert_close(norms.double(), exact_norms, rtol=1e-6, atol=0)


@pytest.mark.parametrize("bits", (2, 3))
@pytest.mark.parametrize("dim", (16, 32, 256))
def test_other_dims_and_leading_axes(dim, bits, rng):
    codec = get_codec(f"turbo{bits}", seed=7)
    x = _inputs(rng, 24, dim).reshape(2, 12, dim)
    codes, norms = tc.turbo_encode(_dev(x), bits, 7)
    assert codes.shape == (2, 12, dim * bits // 8) and norms.shape == (2, 12)
    ref = codec.encode(x)
    _assert_codes(codes.reshape(24, -1), _cells(ref.arrays["codes"].reshape(24, -1), bits, dim),
                  _exact_cells(x.reshape(24, dim), bits, 7)[1], bits)
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
    _assert_decoded(ours, _exact_decode(enc.arrays["codes"], norms, dim, bits, SEED), out,
                    norms)


@pytest.mark.parametrize("dim", (64, 128))
def test_decode_in_one_tile(dim, rng, monkeypatch):
    """A block decoded as one tile (R in chunks per dot: the H100's winners) as well as in
    sub-tiles (R loaded once: every other case here) writes the reference's values."""
    codec = get_codec("turbo3", seed=SEED)
    enc = codec.encode(_inputs(rng, 45, dim))
    monkeypatch.setattr(tc, "_rows_launch", lambda rows, sub=False: {
        "grid": (-(-rows // 32),), "meta": {"BLOCK_M": 32, "SUB": 32}})
    ours = tc.turbo_decode(_dev(enc.arrays["codes"]), _dev(enc.arrays["norms"]), dim, 3, SEED,
                           torch.float16)
    _assert_decoded(ours, codec.decode(enc, "float16"), "float16", enc.arrays["norms"])


def test_decode_saturates_float16_at_65504():
    """A channel at ±65,000 among larger ones: some values decode past 65504 in float32; in
    float16 they are 65504 (as numpy's decode gives), not inf."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((128, 64)).astype(np.float32) * 300
    x[:, 5] = np.where(rng.standard_normal(128) > 0, 65000.0, -65000.0)
    codec = get_codec("turbo4", seed=SEED)
    enc = codec.encode(np.clip(x, -65504, 65504).astype(np.float16))
    codes, norms = _dev(enc.arrays["codes"]), _dev(enc.arrays["norms"])
    wide = tc.turbo_decode(codes, norms, 64, 4, SEED, torch.float32)
    assert (wide.abs() > 65504).any()  # the case this test is for
    ours = tc.turbo_decode(codes, norms, 64, 4, SEED, torch.float16)
    assert torch.isfinite(ours).all()
    _assert_decoded(ours, codec.decode(enc, "float16"), "float16", enc.arrays["norms"])


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


@pytest.mark.parametrize("split_k", (None, 1, 3, 7, 30))
def test_decode_attention_gqa_mixed_codecs(split_k):
    """turbo3 keys / turbo2 values with other seeds, Hq=4 over Hkv=2, splits that do not
    divide N=50 (30 splits of 2 tokens leave five empty)."""
    k_codec, v_codec = get_codec("turbo3", seed=11), get_codec("turbo2", seed=12345)
    args, kw, ref = _attention_case(0, 2, 4, 2, 50, 64, k_codec, v_codec)
    out = tc.turbo_decode_attention(*args, **kw, split_k=split_k)
    assert out.shape == (2, 4, 64)
    _assert_attention(out, ref)


@pytest.mark.parametrize("hq,hkv,n,split_k,sharp", [(2, 2, 33, 2, 4.0), (16, 1, 40, 3, 1.0),
                                                    (8, 1, 9, 4, 8.0)])
def test_decode_attention_head_groups(hq, hkv, n, split_k, sharp):
    """MHA (one head per kv head), a 16-head group (tensor-core path) and an 8-head group."""
    k_codec, v_codec = get_codec("turbo4", seed=3), get_codec("turbo3", seed=4)
    args, kw, ref = _attention_case(1, 1, hq, hkv, n, 128, k_codec, v_codec, sharp)
    _assert_attention(tc.turbo_decode_attention(*args, **kw, split_k=split_k), ref)


def test_decode_attention_rejects_bad_shapes():
    codec = get_codec("turbo3")
    (q, *kv), kw, _ = _attention_case(2, 1, 4, 2, 8, 64, codec, codec)
    with pytest.raises(ValueError):  # 3 query heads over 2 kv heads
        tc.turbo_decode_attention(q[:, :3], *kv, **kw)
    with pytest.raises(ValueError):  # value codes of another width
        tc.turbo_decode_attention(q, *kv, **{**kw, "v_bits": 2})


# -- real CUDA, large shapes ---------------------------------------------------------------------
ROWS = 70_001  # past 65536: the kernels' bulk size class
SAMPLE = 2048  # rows also checked against the numpy codec


def _sample_rows(rows: int, seed: int) -> torch.Tensor:
    """The four special rows of :func:`_inputs`, the last row and a random sample."""
    gen = torch.Generator().manual_seed(seed)
    picked = torch.cat([torch.arange(4), torch.randperm(rows - 5, generator=gen)[:SAMPLE] + 4,
                        torch.tensor([rows - 1])])
    return picked.to(DEVICE)


def check_encode_decode(bits: int, dim: int, dtype: str, rows: int, seed: int,
                        outs: tuple[str, ...] = tuple(DTYPES)) -> None:
    """Encode ``rows`` rows: every code against the float64 cells, every norm against float64;
    decode the kernel's bytes to each of ``outs`` against float64 values; a sample of rows
    against the numpy codec both ways."""
    codec = get_codec(f"turbo{bits}", seed=SEED)
    x = _dev(_inputs(np.random.default_rng(seed), rows, dim)).to(DTYPES[dtype])
    codes, norms = tc.turbo_encode(x, bits, SEED)
    cells, near, exact_norms = _exact_cells(x, bits, SEED)
    _assert_codes(codes, cells, near, bits)
    torch.testing.assert_close(norms.double(), exact_norms, rtol=1e-6, atol=0)
    norms16 = norms.half()
    exact = _exact_decode(codes, norms16, dim, bits, SEED)
    decoded = {}
    for out in outs:
        decoded[out] = tc.turbo_decode(codes, norms16, dim, bits, SEED, DTYPES[out])
        assert decoded[out].dtype == DTYPES[out] and decoded[out].shape == (rows, dim)
        _assert_decoded(decoded[out], exact, out, norms16)
    sample = _sample_rows(rows, seed) if rows > SAMPLE + 5 else torch.arange(rows, device=DEVICE)
    ref = codec.encode(to_numpy(x[sample]))  # the numpy codec (reference ops on GPUs)
    _assert_codes(codes[sample], _cells(ref.arrays["codes"], bits, dim), near[sample], bits)
    by_numpy = codec.decode(_encoded(codes[sample], norms16[sample], (len(sample), dim)),
                            outs[0])
    _assert_decoded(decoded[outs[0]][sample], by_numpy, outs[0], norms16[sample])


def check_scores(lead: tuple[int, ...], n: int, m: int, dim: int, bits: int) -> None:
    """Scores of random codes against the float64 products of their exact values."""
    gen = torch.Generator().manual_seed(n)
    codes, norms = _random_codes(gen, (*lead, n), dim, bits)
    q = _dev(torch.randn((*lead, m, dim), generator=gen))
    ours = tc.turbo_scores(q, codes, norms, bits, SEED)
    k_hat = _exact_decode(codes, norms, dim, bits, SEED)
    _assert_scores(ours, q.double() @ k_hat.transpose(-1, -2), q, k_hat)


DTYPE_ROTATION = list(DTYPES)  # the input dtype of the bits × dim case (i, j): a Latin square


@pytest.fixture
def numpy_codec(monkeypatch):
    """The numpy codec's reference ops for the sampled rows: no numba compile on a fresh GPU
    machine."""
    monkeypatch.setenv("KVTOOL_KERNELS", "reference")


def check_deferred(bits: int) -> None:
    """Inside ``deferred()`` (what CompressedCache does) the codec's encode on these kernels
    queues its input check instead of reading a flag back; resolved, it refuses a bad input."""
    codec = get_codec(f"turbo{bits}", seed=SEED)
    codec._kernels = lambda like, dim: tc  # CPU tensors too (the interpreter)
    x = _inputs(np.random.default_rng(bits), 40, 64)
    bad = x.copy()
    bad[7, 3] = np.nan
    assert_checks_deferred(codec.encode, _dev(x), _dev(bad))


def test_deferred_checks_read_nothing_back(monkeypatch):
    defer_cpu_checks(monkeypatch)  # CPU tensors queued as CUDA ones are
    check_deferred(3)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.usefixtures("numpy_codec")
class TestCuda:
    @pytest.mark.parametrize("dim", (64, 128, 256))
    @pytest.mark.parametrize("bits", (2, 3, 4))
    def test_encode_decode(self, bits, dim, monkeypatch):
        """Every bits × head_dim; each input dtype at every bits and every head_dim once;
        every output dtype; one launch configuration per case, a different one each
        (:mod:`gpu_util`)."""
        case = 3 * (bits - 2) + (64, 128, 256).index(dim)
        pin_kept_config(monkeypatch, tc, case, D=dim)
        dtype = DTYPE_ROTATION[(bits + (64, 128, 256).index(dim)) % 3]
        check_encode_decode(bits, dim, dtype, ROWS, seed=bits * dim)

    def test_scores(self):
        check_scores((4, 8), 3000, 33, 128, 3)

    def test_deferred_checks(self):
        check_deferred(4)

    @pytest.mark.parametrize("split_k", (None, 1, 13))
    @pytest.mark.parametrize("hq,dim", [(32, 128), (8, 256), (64, 64), (128, 128)])
    def test_decode_attention(self, split_k, hq, dim):
        k_codec, v_codec = get_codec("turbo4", seed=1), get_codec("turbo2", seed=2)
        args, kw, ref = _attention_case(hq + dim, 3, hq, 8, 4099, dim, k_codec, v_codec)
        _assert_attention(tc.turbo_decode_attention(*args, **kw, split_k=split_k), ref)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.usefixtures("numpy_codec")
def test_every_config(monkeypatch):
    """Each configuration the pruning keeps at head_dim 128, of both autotuned kernels at once,
    then the autotuner's own pick (timing those compiled kernels), pass the checks."""
    kernels = autotuned(tc)
    assert {k.fn.__name__ for k in kernels} == {"_encode_kernel", "_decode_kernel"}
    kept = [kept_configs(k, D=128) for k in kernels]
    for i in range(max(map(len, kept))):
        with monkeypatch.context() as m:
            for kernel, configs in zip(kernels, kept, strict=True):
                pin_config(m, kernel, configs[i % len(configs)])
            check_encode_decode(3, 128, "float16", ROWS, seed=1, outs=("float16",))
    check_encode_decode(3, 128, "float16", ROWS, seed=1, outs=("float16",))
