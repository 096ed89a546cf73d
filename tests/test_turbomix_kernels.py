"""The fused ``turbomix`` CPU kernels (:mod:`kvtool.kernels.numba_turbomix`) against the numpy
reference: the same codes (but for coordinates within float rounding of a decision), decoded
values within float rounding, and each side decodes the other's bytes. Every preset's codecs
and every option, on numpy arrays and CPU tensors, in fp16, bf16 and fp32."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import assert_codes_agree
from fit_codecs import SHIPPED_FIT_CODECS

from kvtool.codecs import get_codec
from kvtool.errors import CodecError
from kvtool.policy import CodecPolicy
from kvtool.presets import preset_policy

pytest.importorskip("numba")

OPTIONS = [
    "turbomix:bits=4,center=true,candidates=4",  # quality's key codec
    "turbomix:candidates=4",  # quality's value codec
    "turbomix:outliers=16,outliers_per=64,center=true,trellis=true,norm_bits=8",  # balanced
    "turbomix:bits=2,outliers=48,outliers_per=64,outlier_bits=3,trellis=true,norm_bits=8",
    "turbomix:bits=2,outliers=16,outliers_per=64,outlier_bits=3,center=true,candidates=4,"
    "trellis=true",  # small
    "turbomix:bits=2,candidates=4,trellis=true",
    "turbomix:vq=2,candidates=2,outliers=8,bits=4",
    "turbomix:vq=2,bits=2,norm_bits=8",
    "turbomix:bits=3,outliers=12,outlier_bits=8,center=true",
    "turbomix:bits=4,trellis=true,outliers=6,outlier_bits=2",
    "turbomix:bits=2,outliers=16,outliers_per=64,outlier_bits=3,center=true,candidates=4,"
    "select=scalar,trellis=true",  # small since 2026-11-30
    "turbomix:bits=2,candidates=4,select=scalar,trellis=true",
    "turbomix:vq=2,candidates=3,select=scalar,norm_bits=8",
    *SHIPPED_FIT_CODECS,  # the fits kvtool ships
]


def test_every_presets_codecs_are_among_the_options():
    """The fixed presets' codecs, and those of every fit kvtool ships (what ``--preset`` means
    on a bundled model)."""
    from kvtool import preset_fit

    covered = {json.dumps(get_codec(s).get_config(), sort_keys=True) for s in OPTIONS}
    policies = {name: preset_policy(name) for name in ("quality", "balanced", "small")}
    shipped = sorted(preset_fit.shipped_path("x").parent.glob("preset-fits-*.json"))
    for path in shipped:
        for name, entry in json.loads(path.read_text())["presets"].items():
            policies[f"{path.name} {name}"] = CodecPolicy.from_label(entry["label"])
    assert len(policies) >= 6
    for name, policy in policies.items():
        for codec in (policy.key, policy.value):
            assert json.dumps(codec.get_config(), sort_keys=True) in covered, (name, codec)


def reference(spec: str):
    codec = get_codec(spec)
    codec._fused = lambda like: None  # the numpy reference ops
    return codec


def keys(shape=(2, 3, 150, 64), seed=0, dtype=np.float16) -> np.ndarray:
    """Key-like rows: a common offset, a few loud channels, Gaussian rest."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x[..., 5] *= 9
    x[..., shape[-1] // 2 + 3] += 4
    x += 0.5
    return x.astype(dtype)


def agree(fused, ref) -> None:
    assert_codes_agree(fused.arrays, ref.arrays)


@pytest.mark.parametrize("spec", OPTIONS)
def test_fused_encode_writes_the_reference_codes(spec):
    x = keys()
    fused, ref = get_codec(spec).encode(x), reference(spec).encode(x)
    agree(fused, ref)
    # each side decodes the other's bytes to the same values, within float rounding
    for enc in (fused, ref):
        a = get_codec(spec).decode(enc, "float32")
        b = reference(spec).decode(enc, "float32")
        assert a.dtype == np.float32 and a.shape == x.shape
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spec", [OPTIONS[0], OPTIONS[2], OPTIONS[4], OPTIONS[9]],
                         ids=["quality-k", "balanced-k", "small-k", "trellis-outliers"])
def test_tiles_encoded_side_by_side_are_the_tiles_encoded_alone(spec):
    """A thread encodes its tiles several at a time (the trellis runs over them side by side),
    across groups and past a group's short last tile: every byte is what the group alone (one
    tile at a time) gets."""
    from kvtool.kernels.numba_support import num_threads
    from kvtool.kernels.numba_turbomix import SPAN

    x = keys(shape=(70, 150, 64), seed=5)
    assert 70 * 3 >= num_threads() * 8 * SPAN  # every thread's chunk: SPAN tiles side by side
    codec = get_codec(spec)
    together = codec.encode(x)
    alone = [codec.encode(x[g:g + 1]) for g in range(0, 70, 23)]
    for g, enc in zip(range(0, 70, 23), alone, strict=True):
        for name, a in enc.arrays.items():  # each array's leading axis: the groups
            got = np.asarray(together.arrays[name])[g:g + 1]
            np.testing.assert_array_equal(np.asarray(a), got, err_msg=name)


SELECTED = ["turbomix:bits=2,outliers=16,outliers_per=64,outlier_bits=3,center=true,"
            "candidates=4,select=scalar,trellis=true,norm_bits=8",
            "turbomix:bits=3,candidates=3,select=scalar,vq=2"]


def scalar_probe(spec: str) -> str:
    """``spec`` with the scalar codebook: the encode ``select=scalar`` picks rotations by."""
    for option in (",select=scalar", ",trellis=true", ",vq=2", ",norm_bits=8"):
        spec = spec.replace(option, "")
    return spec


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("spec", SELECTED)
def test_select_scalar_quantises_the_rotation_the_scalar_codebook_picks(spec, fused):
    """Each group's rotation is the scalar codebook's best (a cheap encode of every candidate),
    and its codes are what that one rotation alone writes; the groups are shuffled by their
    rotation and back, so a wrong order would put one group's codes in another's place."""
    from kvtool.codecs.turbomix import candidate_seed

    x = keys(shape=(3, 5, 40, 64), seed=7)
    codec = get_codec(spec) if fused else reference(spec)
    enc = codec.encode(x)
    probe = (get_codec if fused else reference)(scalar_probe(spec)).encode(x)
    rotation = np.asarray(enc.arrays["rotation"])
    np.testing.assert_array_equal(rotation, np.asarray(probe.arrays["rotation"]))
    order = np.diff(rotation.reshape(-1).astype(int))
    assert len(np.unique(rotation)) > 1 and (order < 0).any()  # groups shuffled and back
    config = {k: v for k, v in codec.get_config().items() if k != "select"}
    for g in np.ndindex(x.shape[:-2]):
        c = int(rotation[g].item())
        alone = get_codec({**config, "candidates": 1, "seed": candidate_seed(codec.seed, c)})
        for name, a in alone.encode(x[g]).arrays.items():
            np.testing.assert_array_equal(np.asarray(enc.arrays[name][g]).reshape(a.shape),
                                          np.asarray(a), err_msg=f"{name} {g}")
    assert codec.get_config()["select"] == "scalar"
    np.testing.assert_allclose(get_codec(spec).decode(enc, "float32"),
                               reference(spec).decode(enc, "float32"), rtol=1e-4, atol=1e-4)


def test_select_scalar_keeps_a_subclass_and_its_backend_choice():
    from kvtool.codecs.turbomix import TurboMixCodec

    class Counted(TurboMixCodec):
        parts = 0

        @staticmethod
        def _encode_part(*args, **kwargs):
            Counted.parts += 1
            return TurboMixCodec._encode_part(*args, **kwargs)

    codec = Counted(bits=2, candidates=4, select="scalar", trellis=True)
    codec._fused = lambda like: None  # the reference, for every step
    x = keys(shape=(3, 20, 64), seed=4)
    enc = codec.encode(x)
    assert Counted.parts >= 4 + 1  # the scalar pass's four candidates, then the chosen ones
    agree(enc, reference("turbomix:bits=2,candidates=4,select=scalar,trellis=true").encode(x))


def test_select_scalar_on_cpu_tensors_and_bf16():
    torch = pytest.importorskip("torch")
    spec = SELECTED[0]
    x = keys(shape=(4, 70, 64), seed=8, dtype=np.float32)
    given = torch.from_numpy(x).to(torch.bfloat16)
    fused, ref = get_codec(spec).encode(given), reference(spec).encode(given)
    assert all(isinstance(a, torch.Tensor) for a in fused.arrays.values())
    agree(fused, ref)
    assert get_codec(spec).decode(fused).dtype == torch.bfloat16


def test_select_is_checked_and_named_only_when_set():
    assert "select" not in get_codec("turbomix:candidates=4,trellis=true").get_config()
    with pytest.raises(CodecError, match="select must be one of exact, scalar"):
        get_codec("turbomix:candidates=4,select=trellis")
    # with the scalar codebook (or one rotation) there is nothing to choose apart: the same
    # codes, and the same config (older readers take it)
    x = keys(shape=(2, 30, 64))
    for spec in ("turbomix:candidates=4", "turbomix:trellis=true"):
        assert get_codec(spec + ",select=scalar") == get_codec(spec)
        a, b = get_codec(spec).encode(x), get_codec(spec + ",select=scalar").encode(x)
        assert a.arrays.keys() == b.arrays.keys()
        for name in a.arrays:
            np.testing.assert_array_equal(np.asarray(a.arrays[name]), np.asarray(b.arrays[name]))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_fused_kernels_take_every_dtype_and_cpu_tensors(dtype, backend):
    spec = "turbomix:outliers=16,center=true,candidates=4,trellis=true,norm_bits=8"
    x = keys(shape=(3, 70, 64), seed=1, dtype=np.float32)
    if backend == "torch":
        torch = pytest.importorskip("torch")
        given = torch.from_numpy(x).to(getattr(torch, dtype))
        as_numpy = given.float().numpy()
    else:
        import ml_dtypes

        given = x.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
        as_numpy = given.astype(np.float32)
    fused, ref = get_codec(spec).encode(given), reference(spec).encode(given)
    agree(fused, ref)
    out = get_codec(spec).decode(fused)
    want = reference(spec).decode(fused)
    if backend == "torch":
        assert type(out) is type(given) and out.dtype == given.dtype
        out, want = out.float().numpy(), want.float().numpy()
    else:
        assert out.dtype == given.dtype
        out, want = out.astype(np.float32), want.astype(np.float32)
    np.testing.assert_allclose(out, want, rtol=1e-2, atol=1e-2)
    assert np.mean((out - as_numpy) ** 2) < 0.1 * np.mean(as_numpy ** 2)


@pytest.mark.parametrize("shape", [(64,), (1, 64), (5, 64), (2, 1, 64), (2, 65, 32),
                                   (1, 130, 128)])
def test_fused_kernels_handle_short_groups_and_odd_shapes(shape):
    spec = "turbomix:bits=3,outliers=4,outlier_bits=4,center=true,candidates=3,trellis=true"
    x = keys(shape=shape, seed=2)
    fused, ref = get_codec(spec).encode(x), reference(spec).encode(x)
    agree(fused, ref)
    np.testing.assert_allclose(get_codec(spec).decode(fused, "float32"),
                               reference(spec).decode(fused, "float32"), rtol=1e-4, atol=1e-4)


def test_strided_input_encodes_as_its_copy():
    spec = "turbomix:bits=4,center=true,candidates=4"
    x = keys(shape=(2, 100, 128), seed=3)[:, ::2, ::2]
    fused = get_codec(spec).encode(x)
    agree(fused, get_codec(spec).encode(np.ascontiguousarray(x)))


def test_ties_go_to_the_lowest_candidate_and_the_reference_path():
    """All-zero and constant groups: every candidate has the same error (the lowest wins), and
    the Viterbi search's ties (lower predecessor, lowest final state) give the reference's
    path."""
    x = np.zeros((4, 32, 64), np.float16)
    x[1] = 1.0  # constant rows: centered away to zero
    x[2, :, ::2] = 0.25
    x[3] = np.float16(0.5) * (np.arange(64) % 3 == 0)
    for spec in ("turbomix:center=true,candidates=4,trellis=true",
                 "turbomix:candidates=4,bits=2,trellis=true",
                 "turbomix:candidates=4,vq=2"):
        fused, ref = get_codec(spec).encode(x), reference(spec).encode(x)
        agree(fused, ref)
        rotation = np.asarray(fused.arrays["rotation"]).reshape(-1)
        assert rotation[0] == 0  # zeros: every candidate's error is 0
        if "center=true" in spec:
            assert rotation[1] == 0  # constant rows, centered to zeros
    # subnormal rows: their squared errors underflow fp32 on every backend but were summed
    # in float64 by the fused kernel, which then chose another rotation
    tiny = (np.round(np.random.default_rng(1).standard_normal((2, 3, 64)) * 3)
            * 2.0**-149).astype(np.float32)
    for spec in ("turbomix:candidates=4", "turbomix:candidates=4,bits=2,trellis=true"):
        fused, ref = get_codec(spec).encode(tiny), reference(spec).encode(tiny)
        assert np.array_equal(np.asarray(fused.arrays["rotation"]), ref.arrays["rotation"])
        agree(fused, ref)


def test_nan_and_huge_inputs_are_refused_by_the_fused_path():
    codec = get_codec("turbomix:bits=4,center=true,candidates=4")
    x = keys(shape=(2, 20, 64), dtype=np.float32)
    x[1, 3, 7] = np.nan
    with pytest.raises(CodecError, match="NaN or Inf"):
        codec.encode(x)
    x[1, 3, 7] = 3e38
    with pytest.raises(CodecError, match="fp16 range|NaN or Inf"):
        codec.encode(x)


@pytest.mark.parametrize("fused", [True, False])
def test_an_outlier_mask_naming_the_wrong_count_is_refused(fused):
    spec = "turbomix:outliers=8,candidates=2"
    codec = get_codec(spec) if fused else reference(spec)
    enc = codec.encode(keys(shape=(2, 16, 64)))
    mask = np.array(enc.arrays["outlier_mask"])
    mask[1, 0, 0] ^= 0b1111  # flips four channels: no longer 8 set
    enc.arrays["outlier_mask"] = mask
    with pytest.raises(CodecError, match="outlier mask"):
        codec.decode(enc)


def test_turbomix_defaults_still_write_turbo3s_codes():
    x = keys(shape=(2, 50, 64))
    mix, turbo = get_codec("turbomix:bits=3").encode(x), get_codec("turbo3").encode(x)
    assert np.mean(np.asarray(mix.arrays["codes"]) != np.asarray(turbo.arrays["codes"])) < 2e-3
    assert np.array_equal(np.asarray(mix.arrays["norms"]), np.asarray(turbo.arrays["norms"]))


@pytest.mark.parametrize("fused", [True, False])
def test_arrays_no_encode_writes_are_refused_before_any_kernel_reads_them(fused):
    spec = "turbomix:bits=4,center=true,candidates=4"
    codec = get_codec(spec) if fused else reference(spec)
    enc = codec.encode(keys(shape=(2, 16, 64)))
    for name, bad in (("rotation", lambda a: np.full_like(a, 4)),  # past the candidates
                      ("codes", lambda a: a[..., :-1].copy()),  # a byte short per row
                      ("norms", lambda a: a.astype(np.float32))):
        arrays = dict(enc.arrays)
        arrays[name] = bad(np.asarray(arrays[name]))
        with pytest.raises(CodecError, match="no writer stores|not what it writes"):
            codec.decode(type(enc)(arrays, enc.shape, enc.dtype))


def test_dense_products_of_any_output_count():
    """``numba_quantizers._dense`` (the CPU rotations, and the attention kernel's rotations of
    a block's query rows and value sums: fewer or more outputs than inputs) is M @ t, through
    both its four-output and its one-output loops and both orientations of M."""
    import numba

    from kvtool.kernels.numba_quantizers import _dense

    @numba.njit
    def product(t, u, m, back):
        _dense(t, u, m, back)

    rng = np.random.default_rng(0)
    for outputs, inputs, width in [(1, 64, 64), (3, 48, 48), (4, 8, 7), (5, 61, 64),
                                   (11, 3, 1), (48, 16, 16), (7, 130, 5)]:
        t = rng.standard_normal((inputs, width)).astype(np.float32)
        m = rng.standard_normal((outputs, inputs)).astype(np.float32)
        want = m.astype(np.float64) @ t
        for back, given in ((False, m), (True, np.ascontiguousarray(m.T))):
            u = np.full((outputs, width), np.nan, np.float32)
            product(t, u, given, back)
            np.testing.assert_allclose(u, want, rtol=1e-4, atol=1e-4 * np.sqrt(inputs))
