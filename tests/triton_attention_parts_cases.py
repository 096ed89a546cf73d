"""Attention straight from ``turbomix`` codes of every option on Triton
(:mod:`kvtool.kernels.triton_attention_parts`: the ``balanced`` and ``small`` presets' outlier
channels, ``vq=2`` pairs, trellis codes, uint8 norms, centered values) against a float64
reference on the decoded K/V, and ``CompressedCache`` attending from those codes through it.

Not collected on its own: ``tests/test_triton_attention.py`` runs this file in a fresh process
with ``TRITON_INTERPRET=1`` (see ``tests/triton_attention_cases.py``), and its ``gpu`` cases on
CUDA.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from triton_attention_cases import _agree, _inputs, _model, _run, close, reference  # noqa: E402

from kvtool.codecs import get_codec  # noqa: E402
from kvtool.kernels import triton_attention_parts as tap  # noqa: E402
from kvtool.kernels import triton_cuda  # noqa: E402
from kvtool.policy import CodecPolicy  # noqa: E402
from kvtool.presets import PRESETS, preset_policy  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
BALANCED, SMALL = (tuple(s.split("=", 1)[1] for s in PRESETS[name][0].split()[:2])
                   for name in ("balanced", "small"))
#: ``balanced``'s codecs with four candidate rotations (the preset keeps one)
CANDIDATES = tuple(spec.replace("trellis=true", "candidates=4,trellis=true") for spec in BALANCED)


@pytest.fixture(autouse=True)
def _interpreted():
    if not CUDA and not triton_cuda.INTERPRET:
        pytest.fail("triton was imported without TRITON_INTERPRET=1: run this file through "
                    "tests/test_triton_attention.py")


class Role:
    """One role's encoded tokens: the kernel's tensors and the reference's decoded values."""

    def __init__(self, spec: str, x: np.ndarray, block: int):
        batch, heads, n, dim = x.shape
        self.codec = get_codec(spec)
        enc = self.codec.encode(x.reshape(batch, heads, n // block, block, dim))
        arrays = {k: torch.from_numpy(np.ascontiguousarray(a)).to(DEVICE)
                  for k, a in enc.arrays.items()}
        self.tensors = tap.role_tensors(self.codec, arrays, batch * heads, n, block, dim)
        self.decoded = torch.from_numpy(
            np.asarray(self.codec.decode(enc), np.float64).reshape(batch, heads, n, dim))


@pytest.mark.parametrize("kspec,vspec,group,nq,dim,block", [
    (*BALANCED, 2, 1, 64, 16),
    (*SMALL, 4, 1, 32, 32),
    ("turbomix:bits=3,outliers=8,outlier_bits=4,vq=2,norm_bits=8,candidates=2",
     "turbomix:bits=2,outliers=6,center=true,candidates=3", 2, 3, 32, 16),
    ("turbomix:bits=4,trellis=true,center=true", "turbomix:bits=3,vq=2,norm_bits=8", 8, 1, 16,
     32),
])
def test_every_option_matches_the_decoded_reference(kspec, vspec, group, nq, dim, block):
    """The presets' own codecs and the other options (pairs with outliers, uint8 norms,
    centered values, several candidates), with exact tokens, a bias and the causal rule."""
    q, k, v, ke, ve = _inputs(2, 2, group, nq, 64, dim, seed=group + dim, x=5,
                              dtype=torch.bfloat16)
    k += 1.0  # an offset: the key means matter
    kr, vr = Role(kspec, k, block), Role(vspec, v, block)
    bias = torch.zeros(2, nq, 5)
    bias[1, :, 2] = -torch.inf
    bias[0, 0, 4] = 2.5
    out = tap.attend(q, kr.tensors, vr.tensors, ke, ve, scale=dim ** -0.5,
                     bias=bias.to(DEVICE), causal=nq > 1)
    close(out, reference(q, kr.decoded, vr.decoded, ke, ve, dim ** -0.5, bias,
                         causal=nq > 1))
    out = tap.attend(q, kr.tensors, vr.tensors, scale=0.3)  # no exact tokens
    close(out, reference(q, kr.decoded, vr.decoded, None, None, 0.3))
    # written in the query's 16-bit dtype straight from the fp32 accumulator: one rounding (to
    # nearest on GPUs; the interpreter may truncate: one ulp)
    typed = tap.attend(q, kr.tensors, vr.tensors, scale=0.3, out_dtype=torch.bfloat16)
    assert typed.dtype == torch.bfloat16
    torch.testing.assert_close(typed, out.to(torch.bfloat16),
                               rtol=torch.finfo(torch.bfloat16).eps, atol=0)


def test_several_candidates_are_really_in_use_and_read():
    """Blocks of the same row under different rotations: a kernel that read candidate 0 for
    every block would be off by far more than the tolerance."""
    q, k, v, _, _ = _inputs(1, 2, 2, 1, 96, 64, seed=3)
    kr, vr = Role(CANDIDATES[0], k, 16), Role(CANDIDATES[1], v, 16)
    assert len(set(kr.tensors.choice.flatten().tolist())) > 1
    out = tap.attend(q, kr.tensors, vr.tensors, scale=0.25)
    want = reference(q, kr.decoded, vr.decoded, None, None, 0.25)
    close(out, want)
    wrong = dataclasses.replace(kr.tensors, choice=torch.zeros_like(kr.tensors.choice))
    err = (tap.attend(q, wrong, vr.tensors, scale=0.25).double().cpu() - want).abs().max()
    assert err > 2e-2 * want.abs().max()


def test_bad_shapes_are_refused_with_a_clear_error():
    """Also after a good call of the same roles: a plan is kept per signature, and a call of
    another one is checked anew."""
    q, k, v, ke, ve = _inputs(1, 2, 2, 1, 32, 32, x=3)
    kr, vr = Role(SMALL[0], k, 16), Role(SMALL[1], v, 16)
    other = Role(SMALL[1], v[:, :, :16], 16)
    want = reference(q, kr.decoded, vr.decoded, ke, ve, 0.1)
    close(tap.attend(q, kr.tensors, vr.tensors, ke, ve, scale=0.1), want)
    plans = len(tap._PLANS)
    close(tap.attend(q, kr.tensors, vr.tensors, ke, ve, scale=0.1), want)  # its plan, reused
    assert len(tap._PLANS) == plans
    bad = [((q[..., :16], kr.tensors, vr.tensors), {}, "head_dim"),
           ((q, kr.tensors, other.tensors), {}, "same whole blocks"),
           ((q.expand(1, 4, 40, 32), kr.tensors, vr.tensors), {}, "query rows"),
           ((q, kr.tensors, vr.tensors, ke), {}, "exact keys/values"),
           ((q, kr.tensors, vr.tensors, ke, ve), {"bias": torch.zeros(1, 1, 4)}, "bias"),
           ((q.expand(3, -1, -1, -1), kr.tensors, vr.tensors), {}, "does not fit"),
           ((q, kr.tensors, vr.tensors), {"out_dtype": torch.int32}, "out_dtype")]
    for call, extra, match in bad:
        with pytest.raises(ValueError, match=match):
            tap.attend(*call, scale=0.1, **extra)


def _policy(preset: str) -> CodecPolicy:
    """The preset (its outlier counts scaled to the test model's head_dim 16), a window of 16."""
    return dataclasses.replace(preset_policy(preset), recent_tokens=16)


@pytest.mark.skipif(CUDA, reason="the CPU routing switch is for the interpreter")
@pytest.mark.parametrize("preset", ["balanced", "small"])
def test_compressed_cache_attends_from_preset_codes_through_triton(preset):
    """The presets' codes read on the device path: every decode step from codes, the tokens
    and logits of the numba kernel and of decode-then-attend."""
    pytest.importorskip("transformers")
    pytest.importorskip("numba")
    model, policy = _model(), _policy(preset)
    ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(1))
    runs = {name: _run(model, ids, policy, route, flag) for name, route, flag in
            (("triton", True, None), ("numba", False, None), ("decoded", False, False))}
    assert runs["triton"][2] == 8 and runs["numba"][2] == 8 and runs["decoded"][2] == 0
    _agree(runs, ("numba", "decoded"))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("preset", ["balanced", "small"])
def test_compressed_cache_on_cuda_attends_from_preset_codes(preset):
    pytest.importorskip("transformers")
    model, policy = _model().cuda(), _policy(preset)
    ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(1)).cuda()
    runs = {name: _run(model, ids, policy, False, flag) for name, flag in
            (("triton", None), ("decoded", False))}
    assert runs["triton"][2] == 8 and runs["decoded"][2] == 0
    _agree(runs, ("decoded",))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("preset", [BALANCED, SMALL])
def test_preset_codes_at_bench_shape_match_the_decoded_reference(preset):
    """Hq 32, Hkv 8, D 128, 8K tokens in blocks of 64 (the store's), the device's encode."""
    batch, hkv, group, dim, n, block = 1, 8, 4, 128, 8192, 64
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(batch, hkv, n, dim, generator=gen) for _ in range(2))
    q = torch.randn(batch, hkv * group, 1, dim, generator=gen).cuda()
    kr, vr = Role(preset[0], k.numpy(), block), Role(preset[1], v.numpy(), block)
    out = tap.attend(q, kr.tensors, vr.tensors, scale=dim ** -0.5)
    close(out, reference(q, kr.decoded, vr.decoded, None, None, dim ** -0.5), rel=4e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_every_autotune_config_reads_the_codes_right(monkeypatch):
    """Each config the autotuner may pick, forced alone, against the decoded reference: both
    presets at head_dim 128 (the trellis byte windows, the in-kernel rotations of 96- and
    32-wide parts) with exact tokens, and pairs with outliers at head_dim 64."""
    kernel = tap._parts_kernel
    cases = []
    for kspec, vspec, dim in (*((*spec, 128) for spec in (BALANCED, SMALL)),
                              ("turbomix:bits=3,outliers=8,outlier_bits=4,vq=2,norm_bits=8,"
                               "candidates=2", "turbomix:bits=2,outliers=6,center=true,"
                               "candidates=3", 64)):
        q, k, v, ke, ve = _inputs(2, 2, 4, 1, 256, dim, seed=dim, x=5, dtype=torch.bfloat16)
        cases.append((q, Role(kspec, k + 1.0, 64), Role(vspec, v, 64), ke, ve))
    for config in list(kernel.configs):
        monkeypatch.setattr(kernel, "configs", [config])
        kernel.cache.clear()
        tap._LAUNCH.compiled.clear()
        for q, kr, vr, ke, ve in cases:
            out = tap.attend(q, kr.tensors, vr.tensors, ke, ve, scale=0.1)
            close(out, reference(q, kr.decoded, vr.decoded, ke, ve, 0.1))
    kernel.cache.clear()
    tap._LAUNCH.compiled.clear()
