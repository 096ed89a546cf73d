"""Triton ``turbomix`` kernels (:mod:`kvtool.kernels.triton_turbomix`) against the numpy reference.

Not collected on its own: ``tests/test_triton_turbomix.py`` runs this file in a fresh process,
under ``TRITON_INTERPRET=1`` on CPU tensors without CUDA, and its ``gpu`` cases on CUDA (see
``tests/triton_cases.py`` for why the interpreter must never be set in the main test process).

The kernels must write the reference's codes (but for coordinates within float rounding of a
decision, as ``tests/test_turbomix_kernels.py`` tolerates for the numba kernels), decode the
reference's bytes to its values within float rounding, and the reference must decode theirs.

The ``gpu`` cases encode every group of a large input, compare the groups of a sample (at least
1200 rows) with the numpy reference's encode (its Viterbi and candidate searches are the slow
part: 1-4 s per 10K rows), and check every group by decoding: the device and the reference
decode the kernels' bytes alike, and each group's round trip error stays near the reference's.

GPU budget (``-m gpu``, one H100, a cold Triton cache). The cases are compile bound: one
compile per kernel variant (:mod:`gpu_util` pins the autotuner to one configuration), 0.9-4.1 s
each (``triton.compile`` for sm_90, timed on a 2-core EPYC). ``test_encode_decode``: 8 cases of
2-5 variants (stats, then encode and decode per part), 5-13 s a case, plus ~1 s of numpy
reference, ~85 s in all; ``test_dtypes``: 3 cases, 10 new variants, ~25 s;
``test_many_short_groups`` (one-token groups specialise anew) ~13 s; ``test_every_config``:
6 configurations × 2 kernels (11 new compiles) and the autotuner's timing, ~30 s. With the
process start (~10 s), about 165 s.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_codes_agree

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()

from gpu_util import (  # noqa: E402
    assert_checks_deferred,
    autotuned,
    defer_cpu_checks,
    kept_configs,
    kernel_module,
    pin_config,
    pin_first_config,
    use_interpreter,
)

triton, tm, IN_PROCESS = kernel_module("kvtool.kernels.triton_turbomix", CUDA)

from kvtool.codecs import get_codec  # noqa: E402
from kvtool.codecs.abc import Encoded  # noqa: E402
from kvtool.codecs.turbomix import norm_codes, norm_values  # noqa: E402
from kvtool.errors import CodecError  # noqa: E402
from kvtool.kernels import to_numpy, to_torch  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

#: (quantiser and bit options, head_dim, center, candidates, norm_bits): quantiser × outliers
#: 0/16 × head_dim 64/128 (128 with 16 outliers: a dense 112-wide part), each run as given and
#: with center, candidates (1/3) and norm_bits (8/16) all flipped
_BASES = [
    ("bits=3", 64, True, 3, 8),
    ("bits=2,outliers=16,outlier_bits=4", 64, False, 1, 16),
    ("bits=4", 128, False, 3, 16),
    ("bits=3,outliers=16,outlier_bits=8", 128, True, 1, 8),
    ("vq=2,bits=2", 64, True, 1, 16),
    ("vq=2,bits=4,outliers=16,outlier_bits=4", 64, False, 3, 8),
    ("vq=2,bits=3", 128, True, 3, 8),
    ("vq=2,bits=2,outliers=16,outlier_bits=3", 128, False, 1, 16),
    ("trellis=true,bits=2", 64, False, 3, 8),
    ("trellis=true,bits=3,outliers=16,outlier_bits=4", 64, True, 1, 16),
    ("trellis=true,bits=4", 128, True, 1, 8),
    ("trellis=true,bits=2,outliers=16,outlier_bits=3", 128, True, 3, 8),
]
CASES = [(f"turbomix:{opts},center={str(center if keep else not center).lower()},"
          f"candidates={cands if keep else 4 - cands},norm_bits={bits if keep else 24 - bits}",
          dim) for opts, dim, center, cands, bits in _BASES for keep in (True, False)]


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    use_interpreter(monkeypatch, CUDA, IN_PROCESS, "tests/test_triton_turbomix.py")


# -- helpers -------------------------------------------------------------------------------------
def reference(spec: str):
    codec = get_codec(spec)
    codec._fused = lambda like: None  # the numpy reference ops
    return codec


def keys(shape, seed: int = 0, dtype=np.float16) -> np.ndarray:
    """Key-like rows: a common offset, a few loud channels, Gaussian rest (as the numba tests)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x[..., 5] *= 9
    x[..., shape[-1] // 2 + 3] += 4
    x += 0.5
    return x.astype(dtype)


def _dev(a) -> torch.Tensor:
    return to_torch(np.asarray(a), DEVICE)


def _np(t) -> np.ndarray:
    return np.asarray(to_numpy(t))


def agree(mine: dict, ref: Encoded) -> None:
    """:func:`conftest.assert_codes_agree` of the kernels' tensors and the reference's arrays."""
    assert_codes_agree({k: _np(v) for k, v in mine.items()}, ref.arrays)


def close(ours, want, dtype: str = "float32") -> None:
    """fp32: within 1e-5 of the largest magnitude; fp16/bf16: within one step of the value."""
    a, b = _np(ours).astype(np.float64), np.asarray(want).astype(np.float64)
    assert a.shape == b.shape
    scale = np.abs(b).max() + 1e-30
    if dtype == "float32":
        bound = 1e-5 * scale
    else:
        p, tiny = (11, 2.0**-14) if dtype == "float16" else (8, 2.0**-126)
        bound = np.maximum(2.0 ** (np.floor(np.log2(np.maximum(np.abs(b), tiny))) - (p - 1)),
                           1e-6 * scale)
    bad = np.abs(a - b) > bound
    rows = bad.reshape(-1, bad.shape[-1])
    assert not bad.any(), (f"{int(bad.sum())} elements off, worst {np.abs(a - b).max()}, in "
                           f"{int(rows.any(1).sum())} of {len(rows)} rows and channels "
                           f"{np.flatnonzero(rows.any(0))[:16].tolist()}")


def _decode(codec, arrays: dict, shape, dtype: str = "float32"):
    return tm.decode(codec, {k: _dev(v) for k, v in arrays.items()}, tuple(shape), dtype)


def check_roundtrip(spec: str, x: np.ndarray, given=None) -> None:
    """Encode ``given`` (default: ``x`` on the device) and compare with the reference; decode
    both sides' bytes with both."""
    codec, ref = get_codec(spec), reference(spec)
    mine = tm.encode(codec, _dev(x) if given is None else given)
    assert all(v.device.type == DEVICE for v in mine.values())
    want = ref.encode(x)
    agree(mine, want)
    ours = {k: _np(v) for k, v in mine.items()}
    close(_decode(codec, ours, x.shape), ref.decode(Encoded(ours, x.shape, "float32")))
    close(_decode(codec, want.arrays, x.shape), ref.decode(want, "float32"))


# -- CPU (interpreter) and GPU -------------------------------------------------------------------
def test_module_surface():
    assert tm.name == "triton" and tm.available()
    assert tm.INTERPRET == (not CUDA)


@pytest.mark.parametrize("spec,dim", CASES)
def test_encode_decode_match_the_reference(spec, dim):
    check_roundtrip(spec, keys((2, 16, dim), seed=dim))


@pytest.mark.parametrize("spec", [
    "turbomix:bits=2,outliers=16,outlier_bits=3,center=true,candidates=4,select=scalar,"
    "trellis=true,norm_bits=8",  # the small preset's key codec, uint8 norms
    "turbomix:bits=3,candidates=3,select=scalar,vq=2"])
def test_select_scalar_matches_the_reference(spec):
    """``select=scalar`` (the ``small`` preset): each group quantised with the rotation the
    scalar codebook picks (the kernel reads it per group), as the reference (which encodes the
    groups sorted by rotation, and puts them back)."""
    x = keys((5, 12, 64), seed=5)
    check_roundtrip(spec, x)
    rotation = _np(tm.encode(get_codec(spec), _dev(x))["rotation"]).reshape(-1).astype(int)
    assert len(set(rotation)) > 1 and (np.diff(rotation) < 0).any()  # shuffled and back


@pytest.mark.parametrize("spec,shape", [
    ("turbomix:bits=3,outliers=6,outlier_bits=5,center=true,candidates=3", (2, 24, 64)),
    ("turbomix:trellis=true,bits=3,outliers=4,outlier_bits=2,candidates=3", (1, 20, 32)),
    ("turbomix:vq=2,bits=3,outliers=2,outlier_bits=2,center=true", (3, 5, 24)),
    ("turbomix:bits=2,center=true,candidates=3,trellis=true", (64,)),
    ("turbomix:bits=4,outliers=8,center=true,norm_bits=8", (2, 1, 64)),
])
def test_odd_widths_and_shapes(spec, shape):
    """Dense parts narrower than a tile (6, 4 and 2 channels: the trellis shorter than its
    memory), 5-bit packing, one-token groups and a single vector."""
    check_roundtrip(spec, keys(shape, seed=len(shape)))


@pytest.mark.parametrize("spec,dim", [
    ("turbomix:bits=2,outliers=64,outlier_bits=3,center=true,candidates=2", 256),
    ("turbomix:vq=2,bits=3,outliers=64,outlier_bits=4,candidates=2,select=scalar", 256),
    ("turbomix:bits=3,center=true,candidates=2", 192)])
def test_wide_rotations_a_chunk_of_rows_per_dot(spec, dim):
    """A 192-wide part (at D=256 beside 64 outliers: the ``small`` key's probe, Gemma's fitted
    ``quality`` keys; or every channel of D=192): its rotation's three 256² bf16 pieces pass
    what one dot may take on sm_90 (they failed to compile), so the scalar and pair encodes,
    and ``select=scalar``'s probe, take 32 rows of it per dot; a 64-wide exact rotation stays
    whole."""
    from kvtool.kernels.triton_turbomix_tables import _rotation_rows

    assert _rotation_rows(256, 3) == 32 and _rotation_rows(256, 1) == 256
    assert _rotation_rows(64, 1) == 64 and _rotation_rows(128, 3) == 128
    check_roundtrip(spec, keys((2, 16, dim), seed=11))


def test_groups_longer_than_a_selection_step():
    """1100-token groups: the per-group candidate choice, code copy and uint8 norms run in
    three steps (512 tokens of 16-byte code rows; the uint8 norms read back what all three
    stored)."""
    check_roundtrip("turbomix:bits=3,outliers=4,outlier_bits=4,candidates=3,norm_bits=8",
                    keys((2, 1100, 32), seed=7))


@pytest.mark.parametrize("dim,n_hi", [(6, 2), (96, 16), (128, 48), (256, 64)])
def test_outlier_channels_match_a_stable_sort(dim, n_hi):
    """Exactly ``n_hi`` channels whatever the energies: ties go to the lowest channel (the
    reference's stable sort), NaN ranks as +inf; both parts ascend; the mask is the
    reference's LSB-first packing."""
    from kvtool.kernels.triton_turbomix_select import outlier_channels

    rng = np.random.default_rng(dim)
    energy = np.round(rng.exponential(1.0, (7, dim)), 1)  # many ties
    energy[1] = 2.0  # all tied
    energy[2, ::3] = np.nan
    energy[3, 1] = np.inf
    energy[4] = 0.0
    mask, lo, hi = outlier_channels(_dev(energy), n_hi)
    ranked = np.where(np.isnan(energy), np.inf, energy)
    top = np.argsort(-ranked, axis=1, kind="stable")[:, :n_hi]
    want = np.zeros((7, dim), bool)
    np.put_along_axis(want, top, True, axis=1)
    np.testing.assert_array_equal(_np(hi), np.sort(top, axis=1))
    np.testing.assert_array_equal(_np(lo), np.stack([np.flatnonzero(~m) for m in want]))
    np.testing.assert_array_equal(_np(mask)[:, 0], np.packbits(want, axis=1, bitorder="little"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_input_and_output_dtypes(dtype):
    spec = "turbomix:outliers=16,center=true,candidates=3,trellis=true,norm_bits=8"
    x32 = keys((2, 16, 64), seed=5, dtype=np.float32)
    given = torch.from_numpy(x32).to(DTYPES[dtype]).to(DEVICE)
    check_roundtrip(spec, _np(given), given)
    # 16-bit outputs within a step of the reference's values: parts of every channel (quality
    # at 64, one part of 96; with the rotation's leading terms alone, 3 values of the 96-wide
    # part and, in the vLLM device path, bf16 values near zero were more than a step off)
    for each, x in ((spec, _np(given)), ("turbomix:bits=4,center=true,candidates=4", x32),
                    ("turbomix:bits=3,candidates=2", keys((2, 32, 96), seed=9))):
        codec, enc = get_codec(each), reference(each).encode(x)
        for out in ("float16", "bfloat16"):
            ours = _decode(codec, enc.arrays, enc.shape, out)
            assert ours.dtype == DTYPES[out]
            close(ours.float(), reference(each).decode(enc, "float32"), out)


def test_float16_decode_saturates_at_65504():
    """Values near fp16's limit (a channel at ±65,000 among larger ones): the float32 decode
    passes 65504, the float16 one stops there, as the reference's does, and is never inf."""
    spec = "turbomix:bits=2,outliers=48,outliers_per=64,outlier_bits=3,trellis=true,norm_bits=8"
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 64, 64)).astype(np.float32) * 300
    x[..., 5] = np.where(rng.standard_normal((2, 64)) > 0, 65000.0, -65000.0)
    x = np.clip(x, -65504, 65504).astype(np.float16)
    codec, enc = get_codec(spec), reference(spec).encode(x)
    assert (_decode(codec, enc.arrays, enc.shape).abs() > 65504).any()  # the case tested
    ours = _decode(codec, enc.arrays, enc.shape, "float16")
    assert torch.isfinite(ours).all()
    close(ours.float(), np.clip(reference(spec).decode(enc, "float32"), -65504, 65504),
          "float16")


def test_ties_go_to_the_lowest_candidate_and_the_reference_path():
    """Zero and constant groups: every candidate's error ties (the lowest wins), and the
    degenerate rows take the reference's Viterbi paths and pair points."""
    x = np.zeros((4, 16, 64), np.float16)
    x[1] = 1.0
    x[2, :, ::2] = 0.25
    x[3] = np.float16(0.5) * (np.arange(64) % 3 == 0)
    for spec in ("turbomix:center=true,candidates=3,trellis=true",
                 "turbomix:candidates=3,vq=2"):
        mine, want = tm.encode(get_codec(spec), _dev(x)), reference(spec).encode(x)
        agree(mine, want)
        assert _np(mine["rotation"]).reshape(-1)[0] == 0


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's, in the interpreter
@pytest.mark.parametrize("spec", ["turbomix:bits=4,center=true,candidates=3",
                                  "turbomix:bits=2,outliers=4,trellis=true"])
def test_nan_inf_and_huge_inputs_are_refused(spec):
    """Refused with the reference's errors (the kernels run on NaN rows without failing)."""
    x = keys((2, 16, 32), dtype=np.float32)
    for bad, match in ((np.nan, "NaN or Inf"), (-np.inf, "NaN or Inf"),
                       (3e38, "fp16 range|NaN or Inf")):
        y = x.copy()
        y[1, 3, 7] = bad
        with pytest.raises(CodecError, match=match):
            tm.encode(get_codec(spec), _dev(y))


def check_deferred(spec: str) -> None:
    """Inside ``deferred()`` (what CompressedCache does) an encode queues its input check
    instead of reading a flag back; the queue refuses a bad input when resolved."""
    x = keys((2, 16, 32), dtype=np.float32)
    bad = x.copy()
    bad[1, 3, 7] = np.inf
    assert_checks_deferred(lambda y: tm.encode(get_codec(spec), y), _dev(x), _dev(bad))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's, in the interpreter
@pytest.mark.parametrize("spec", ["turbomix:bits=4,center=true,candidates=3",
                                  "turbomix:bits=2,outliers=4,norm_bits=8"])
def test_deferred_checks_read_nothing_back(spec, monkeypatch):
    defer_cpu_checks(monkeypatch)  # CPU tensors queued as CUDA ones are
    check_deferred(spec)


def test_arrays_no_encode_writes_are_refused():
    spec = "turbomix:bits=3,outliers=8,center=true,candidates=2"
    codec = get_codec(spec)
    enc = reference(spec).encode(keys((2, 16, 64)))
    mask = np.array(enc.arrays["outlier_mask"])
    mask[1, 0, 0] ^= 0b1111
    for key, value, match in (("rotation", np.full_like(enc.arrays["rotation"], 2), "past"),
                              ("codes", enc.arrays["codes"][..., :-1].copy(), "no writer"),
                              ("norms", enc.arrays["norms"].astype(np.float32), "no writer"),
                              ("outlier_mask", mask, "outlier mask")):
        with pytest.raises(CodecError, match=match):
            _decode(codec, {**enc.arrays, key: value}, enc.shape)


@pytest.mark.parametrize("shape", [(5, 33), (3, 1500), (4, 1)])
def test_norm_codes_match_numpy(shape):
    """One program per group, in chunks of at most 1024 tokens (1500: two passes of two)."""
    rng = np.random.default_rng(3)
    norms = np.exp(rng.uniform(-6, 4, shape)).astype(np.float16)
    norms[1, :4] = 0
    norms[2] = 0
    norms[-1, -1] = 7.5
    codes, ranges = norm_codes(norms)
    mine, mine_range = tm.norm_codes(_dev(norms))
    assert _np(mine).dtype == np.uint8 and _np(mine_range).shape == (shape[0], 1, 2)
    assert np.mean(_np(mine) != codes) <= 2e-3
    np.testing.assert_array_equal(_np(mine_range), ranges)
    np.testing.assert_allclose(_np(tm.norm_values(_dev(codes), _dev(ranges[:, 0]))),
                               norm_values(codes, ranges[:, 0]), rtol=1e-7)
    bad = ranges[:, 0].copy()
    bad[0] = (2.0, 1.0)
    with pytest.raises(CodecError, match="least norm is above"):
        tm.norm_values(_dev(codes), _dev(bad))


# -- real CUDA, larger shapes -------------------------------------------------------------------
def _preset_codecs() -> list[tuple[str, dict]]:
    """(preset/role, codec config) of every lossy preset's key and value codec."""
    from kvtool.presets import PRESETS, preset_policy

    return [(f"{name}/{role}", getattr(preset_policy(name), role).get_config())
            for name in PRESETS if name != "lossless" for role in ("key", "value")]


#: (id, spec, head_dim): every preset codec, vq=2 and 8-bit outliers; the scalar and trellis
#: quantisers at both head dims
GPU_CASES = [(name, spec, (128, 64)[i % 2]) for i, (name, spec) in enumerate(_preset_codecs())] \
    + [("vq2", "turbomix:vq=2,candidates=2,outliers=8,bits=4", 128),
       ("outlier-bits-8", "turbomix:bits=3,outliers=12,outlier_bits=8,center=true", 64)]
SAMPLE_ROWS = 1200  # rows of sampled groups the numpy reference encodes


def _groups(arrays: dict, lead: int, pick: np.ndarray) -> dict:
    """The arrays of groups ``pick`` (every array leads with the groups' ``lead`` axes)."""
    return {k: np.asarray(a).reshape(-1, *np.asarray(a).shape[lead:])[pick]
            for k, a in arrays.items()}


def _group_errors(x: np.ndarray, x_hat) -> np.ndarray:
    """‖x − x̂‖² / ‖x‖² of each group ``[..., tokens, dim]``."""
    x = np.asarray(x, np.float64).reshape(-1, x.shape[-2] * x.shape[-1])
    diff = x - np.asarray(x_hat, np.float64).reshape(x.shape)
    return (diff ** 2).sum(1) / (x ** 2).sum(1)


def check_large(spec, x: np.ndarray, given=None) -> None:
    """Encode every group on the device; sampled groups (first, last, random) against the
    numpy reference both ways; every group decoded alike by the device and the reference, and
    reconstructed within 3x the reference's mean error on the sample (a garbled group's error
    is ~2: a vector of the right norm pointing elsewhere)."""
    codec, ref = get_codec(spec), reference(spec)
    mine = tm.encode(codec, _dev(x) if given is None else given)
    assert all(v.device.type == DEVICE for v in mine.values())
    lead, (tokens, dim) = x.ndim - 2, x.shape[-2:]
    groups = int(np.prod(x.shape[:-2]))
    count = min(groups, max(4, -(-SAMPLE_ROWS // tokens)))
    rest = np.random.default_rng(groups).permutation(np.arange(1, groups - 1))
    pick = np.unique(np.concatenate([[0, groups - 1], rest[:count - 2]]))
    sample = x.reshape(groups, tokens, dim)[pick]
    want = ref.encode(sample)
    ours = {k: _np(v) for k, v in mine.items()}
    agree(_groups(ours, lead, pick), want)
    decoded = _decode(codec, ours, x.shape)
    close(decoded, ref.decode(Encoded(ours, x.shape, "float32")))
    close(_decode(codec, want.arrays, sample.shape), ref.decode(want, "float32"))
    reference_error = _group_errors(sample, ref.decode(want, "float32")).mean()
    # 1e-6: one-token groups with center=true reconstruct exactly (the mean is the vector)
    assert _group_errors(x, _np(decoded)).max() <= 3 * reference_error + 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
class TestCuda:
    @pytest.fixture(autouse=True)
    def _one_config(self, monkeypatch):
        pin_first_config(monkeypatch, tm)  # one compile per kernel variant: gpu_util

    @pytest.mark.parametrize("spec,dim", [c[1:] for c in GPU_CASES], ids=[c[0] for c in GPU_CASES])
    def test_encode_decode(self, spec, dim):
        check_large(spec, keys((4, 8, 300, dim), seed=dim))

    def test_deferred_checks(self):
        check_deferred("turbomix:bits=4,center=true,candidates=4")

    def test_repeat_calls_launch_directly_and_read_their_own_inputs(self):
        """Encodes and decodes after the first of a shape skip Triton's dispatch (counted:
        stats, outliers, two parts, the choice, two decodes) and still match the reference
        on new data."""
        from kvtool.kernels import triton_support

        spec = "turbomix:bits=3,outliers=8,center=true,candidates=3,norm_bits=8"
        for seed in range(3):
            check_roundtrip(spec, keys((2, 16, 64), seed=seed))
            if seed == 0:
                fast = sum(launcher.fast for launcher in triton_support._LAUNCHERS.values())
        assert sum(launcher.fast for launcher in triton_support._LAUNCHERS.values()) >= fast + 2 * 7

    @pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
    def test_dtypes(self, dtype):
        spec = "turbomix:outliers=16,center=true,candidates=4,trellis=true,norm_bits=8"
        given = torch.from_numpy(keys((8, 4, 257, 128), seed=9, dtype=np.float32)) \
            .to(DTYPES[dtype]).to(DEVICE)
        check_large(spec, _np(given), given)
        enc = reference(spec).encode(_np(given[:1]))
        ours = _decode(get_codec(spec), enc.arrays, enc.shape, dtype)
        assert ours.dtype == DTYPES[dtype]
        close(ours.float(), reference(spec).decode(enc, "float32"), dtype)

    def test_many_short_groups(self):
        """Decode-step shapes: one token per group, many groups."""
        check_large("turbomix:bits=3,outliers=16,center=true,candidates=4,trellis=true",
                    keys((64, 32, 1, 128), seed=11))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_every_config(monkeypatch):
    """Each configuration of both autotuned kernels at once (300-token groups, one 128-wide
    part: the pruning keeps every one), then the autotuner's own pick, pass the checks."""
    kernels = autotuned(tm)
    assert {k.fn.__name__ for k in kernels} == {"_encode_kernel", "_decode_kernel"}
    kept = [kept_configs(k, tok_class=64, NP=128) for k in kernels]
    x = keys((2, 8, 300, 128), seed=3)
    spec = "turbomix:bits=4,center=true,candidates=4"
    for i in range(max(map(len, kept))):
        with monkeypatch.context() as m:
            for kernel, configs in zip(kernels, kept, strict=True):
                pin_config(m, kernel, configs[i % len(configs)])
            check_large(spec, x)
    check_large(spec, x)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_every_trellis_config(monkeypatch):
    """The trellis search's own tiles (a row per thread: its 32 path costs in registers), each
    alone, at blocks of 64 tokens and at 8-token groups (the one-warp 16-row tile)."""
    kernel = tm._encode_kernel
    spec = "turbomix:bits=3,outliers=16,outlier_bits=4,center=true,candidates=4,trellis=true"
    for tokens, tok_class in ((64, 64), (8, 16)):
        x = keys((4, 8, tokens, 128), seed=tokens)
        configs = kept_configs(kernel, tok_class=tok_class, NP=128, QUANT=tm.TRELLIS)
        assert configs and all(c.kwargs["BM"] >= 32 * c.num_warps or c.num_warps == 1
                               for c in configs)
        for config in configs:
            with monkeypatch.context() as m:
                pin_config(m, kernel, config)
                check_large(spec, x)
