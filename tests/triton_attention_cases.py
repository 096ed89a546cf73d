"""Attention straight from codes on Triton (:mod:`kvtool.kernels.triton_attention`) against a
float64 reference on the decoded K/V, and ``CompressedCache`` attending from codes through it.

Not collected on its own: ``tests/test_triton_attention.py`` runs this file in a fresh process
with ``TRITON_INTERPRET=1`` set from the start (CPU tensors; the variable must be set when triton
and every kernel module are imported, and must never be set in the main test process), and its
``gpu`` cases on CUDA.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")
tl = triton.language

from kvtool.codecs import get_codec  # noqa: E402
from kvtool.codecs.turbomix import candidate_seed  # noqa: E402
from kvtool.kernels import triton_attention as ta  # noqa: E402
from kvtool.kernels import triton_cuda  # noqa: E402
from kvtool.kernels.triton_attention_steps import _prmt  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
QUALITY = ("turbomix:bits=4,center=true,candidates=4", "turbomix:candidates=4")  # the preset's


@pytest.fixture(autouse=True)
def _interpreted():
    if not CUDA and not triton_cuda.INTERPRET:
        pytest.fail("triton was imported without TRITON_INTERPRET=1: run this file through "
                    "tests/test_triton_attention.py")


# -- helpers -------------------------------------------------------------------------------------
def _dev(a) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(DEVICE)


class Role:
    """One role's encoded tokens: the kernel's arrays and the reference's decoded values."""

    def __init__(self, spec: str, x: np.ndarray, block: int):
        batch, heads, n, dim = x.shape
        self.codec = get_codec(spec)
        enc = self.codec.encode(x.reshape(batch, heads, n // block, block, dim))
        a = enc.arrays
        self.codes = _dev(a["codes"].reshape(batch * heads, n, -1))
        self.norms = _dev(a["norms"].reshape(batch * heads, n))
        self.rotations = _dev(a["rotation"].reshape(batch * heads, -1)) \
            if "rotation" in a else None
        self.means = _dev(a["mean"].reshape(batch * heads, n // block, dim)) \
            if "mean" in a else None
        self.decoded = torch.from_numpy(
            np.asarray(self.codec.decode(enc), np.float64).reshape(batch, heads, n, dim))
        self.seeds = seeds(self.codec)


def seeds(codec) -> tuple[int, ...]:
    """The rotation seed of each candidate (turbo: its one seed)."""
    return tuple(candidate_seed(codec.seed, c) for c in range(getattr(codec, "candidates", 1)))


def reference(q, keys: torch.Tensor, values: torch.Tensor, ke, ve, scale, bias=None,
              causal=False) -> torch.Tensor:
    """float64 softmax attention [B, Q, Hq, D]: encoded tokens visible to every query, then the
    exact tokens under the bias and the causal rule."""
    batch, hq, nq, _ = q.shape
    group = hq // keys.shape[1]
    k = keys if ke is None else torch.cat([keys, ke.double().cpu()], dim=2)
    v = values if ve is None else torch.cat([values, ve.double().cpu()], dim=2)
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q.double().cpu() @ k.transpose(-1, -2) * scale
    n, x = keys.shape[2], 0 if ke is None else ke.shape[2]
    if bias is not None:
        s[..., n:] += bias.double().cpu()[:, None]
    if causal:
        j, i = torch.arange(x), torch.arange(nq)
        s[..., n:] = s[..., n:].masked_fill(j[None, :] > x - nq + i[:, None], -torch.inf)
    return (s.softmax(-1) @ v).transpose(1, 2)


def close(out: torch.Tensor, want: torch.Tensor, rel: float = 2e-3) -> None:
    """Within ``rel`` of the largest magnitude (fp16 centroids and queries: ~6e-4 here)."""
    assert out.shape == want.shape and out.dtype == torch.float32
    err = (out.double().cpu() - want).abs().max().item()
    assert err <= rel * want.abs().max().item(), err


def _inputs(batch, hkv, group, nq, n, dim, seed=0, x=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(batch, hkv, n, dim, generator=gen) for _ in range(2))
    k[..., 3] += 2.0  # a loud channel, as real keys have
    q = torch.randn(batch, hkv * group, nq, dim, generator=gen) * 2
    ke, ve = ((torch.randn(batch, hkv, x, dim, generator=gen)).to(dtype).to(DEVICE)
              for _ in range(2)) if x else (None, None)
    return q.to(DEVICE), k.numpy(), v.numpy(), ke, ve


def _attend(q, kr: Role, vr: Role, ke=None, ve=None, block=0, **kw):
    dim = q.shape[-1]
    return ta.attend(q, kr.codes, kr.norms, vr.codes, vr.norms, ke, ve, dim=dim,
                     k_bits=kr.codec.bits, v_bits=vr.codec.bits, k_seeds=kr.seeds,
                     v_seeds=vr.seeds, k_rotations=kr.rotations, v_rotations=vr.rotations,
                     key_means=kr.means, block=block, **kw)


@triton.jit
def _prmt_kernel(a_ptr, b_ptr, sel_ptr, out_ptr):
    i = tl.arange(0, 4)
    tl.store(out_ptr + i, _prmt(tl.load(a_ptr + i), tl.load(b_ptr + i), tl.load(sel_ptr + i)))


def test_byte_permute_is_ptx_prmt():
    """``_prmt`` (PTX ``prmt.b32`` compiled, emulated under the interpreter) picks bytes of
    {b, a} as PTX documents: cub's example, the byte planes and the interleave the code
    lookups use."""
    def u32(*values):
        return torch.tensor(values, dtype=torch.int64).to(torch.uint32).to(DEVICE)

    out = torch.empty(4, dtype=torch.uint32, device=DEVICE)
    # fp16 pairs (1.0, 0.5), (3.0, 4.0) -> their high bytes; lo/hi bytes -> fp16 pairs; the
    # sign mode (nibble bit 3) that masks 4-bit codes' upper table half
    _prmt_kernel[(1,)](u32(0x03020100, 0x3C003800, 0x03020100, 0),
                       u32(0x07060504, 0x44004200, 0x07060504, 0x80808080),
                       u32(0x7531, 0x7531, 0x5140, 0x8C8C), out)
    assert out.cpu().to(torch.int64).tolist() == [0x07050301, 0x44423C38, 0x05010400,
                                                  0x00FF00FF]


# -- turbo ---------------------------------------------------------------------------------------
def _misaligned(codes: torch.Tensor) -> torch.Tensor:
    """``codes`` copied to an odd address: the kernel reads them byte by byte."""
    buf = torch.empty(codes.numel() + 1, dtype=torch.uint8, device=codes.device)
    out = buf[1:].view(codes.shape)
    out.copy_(codes)
    return out


@pytest.mark.parametrize("kspec,vspec,group,dim,split", [
    ("turbo2", "turbo2", 1, 32, 1), ("turbo3", "turbo4:seed=9", 2, 32, 3),
    ("turbo4", "turbo3", 4, 16, 1), ("turbo2:seed=5", "turbo4", 8, 64, 3),
    ("turbo3:seed=3", "turbo3", 4, 128, 2)])
def test_decode_attention_matches_the_decoded_reference(kspec, vspec, group, dim, split):
    """Bit widths × GQA groups × splits; 3-bit rows of 6 bytes (dim 16) and, for the first
    two cases, codes at an odd address are read byte by byte, the rest as 32-bit words; at
    dim 128 the 3-bit tiles pair rows (as GPUs do with two rows per thread). A second call of
    the same layout on other tokens (which skips the checks) reads its own tokens; for the
    last two cases the codes are a view of a longer token buffer (not contiguous)."""
    for seed in (group, group + 10):
        q, k, v, _, _ = _inputs(2, 2, group, 1, 48, dim, seed=seed)
        kr, vr = Role(kspec, k, 48), Role(vspec, v, 48)
        if group <= 2:
            kr.codes, vr.codes = _misaligned(kr.codes), _misaligned(vr.codes)
            assert kr.codes.data_ptr() % 2
        arrays = [kr.codes.reshape(2, 2, 48, -1), kr.norms.reshape(2, 2, 48),
                  vr.codes.reshape(2, 2, 48, -1), vr.norms.reshape(2, 2, 48)]
        if group >= 8 or dim == 128:
            arrays = [torch.cat([a, a[:, :, :5]], 2)[:, :, :48] for a in arrays]
            assert not arrays[0].is_contiguous()
        out = ta.turbo_decode_attention(
            q[:, :, 0], *arrays, dim=dim, k_bits=kr.codec.bits, k_seed=kr.codec.seed,
            v_bits=vr.codec.bits, v_seed=vr.codec.seed, scale=dim ** -0.5, split_k=split)
        assert out.shape == (2, 2 * group, dim)
        close(out[:, None], reference(q, kr.decoded, vr.decoded, None, None, dim ** -0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_exact_tokens_causal_and_bias_join_the_softmax(dtype):
    """Three new tokens (causal among them), sinks and a window as exact tokens, and a bias with
    -inf columns; the exact tokens' scores dominate some rows (a large bias), so mistakes in
    their part show."""
    q, k, v, ke, ve = _inputs(2, 2, 2, 3, 32, 32, seed=4, x=21, dtype=dtype)
    kr, vr = Role("turbo3", k, 32), Role("turbo4", v, 32)
    bias = torch.zeros(2, 3, 21)
    bias[0, :, 5] = -torch.inf
    bias[1, 1, :4] = -torch.inf
    bias[:, 2, 7] = 3.0
    for b in (None, bias[:1], bias):
        out = _attend(q, kr, vr, ke, ve, scale=0.2, bias=None if b is None else b.to(DEVICE),
                      causal=True, split_k=2)
        close(out, reference(q, kr.decoded, vr.decoded, ke, ve, 0.2, b, causal=True))
    out = _attend(q, kr, vr, ke, ve, scale=0.2)  # not causal: every exact token visible
    close(out, reference(q, kr.decoded, vr.decoded, ke, ve, 0.2))
    # written in the exact tokens' dtype straight from the fp32 accumulator: one rounding (to
    # nearest on GPUs; the interpreter may truncate: one ulp)
    typed = _attend(q, kr, vr, ke, ve, scale=0.2, out_dtype=dtype)
    assert typed.dtype == dtype
    torch.testing.assert_close(typed, out.to(dtype), rtol=torch.finfo(dtype).eps, atol=0)


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("block", [8, 32])
def test_quality_preset_codes_with_candidates_and_key_means(split, block):
    """Per-block rotation candidates for keys and values (16 groups of blocks), centered keys,
    exact tokens: tiles that span blocks (8 < the interpreter's 16-token tile) and blocks that
    span tiles."""
    q, k, v, ke, ve = _inputs(1, 2, 4, 1, 96, 32, seed=7, x=5, dtype=torch.bfloat16)
    k += 1.5  # a common offset: the key means matter
    kr, vr = Role(QUALITY[0], k, block), Role(QUALITY[1], v, block)
    assert kr.means is not None and kr.rotations is not None and vr.rotations is not None
    assert len(set(kr.rotations.flatten().tolist())) > 1  # several candidates really in use
    out = _attend(q, kr, vr, ke, ve, block=block, scale=32 ** -0.5, split_k=split)
    close(out, reference(q, kr.decoded, vr.decoded, ke, ve, 32 ** -0.5))


def test_three_query_tokens_of_eight_heads_per_kv_head_with_candidates():
    q, k, v, ke, ve = _inputs(1, 1, 8, 3, 64, 16, seed=8, x=3)
    kr, vr = Role("turbomix:bits=2,candidates=3", k, 16), Role("turbo3", v, 16)
    out = _attend(q, kr, vr, ke, ve, block=16, scale=0.3, causal=True)
    close(out, reference(q, kr.decoded, vr.decoded, ke, ve, 0.3, causal=True))


def test_bad_shapes_are_refused_with_a_clear_error():
    q, k, v, _, _ = _inputs(1, 2, 2, 1, 32, 32)
    kr, vr = Role("turbo3", k, 32), Role("turbo3", v, 32)
    args = (kr.codes, kr.norms, vr.codes, vr.norms)
    base = {"dim": 32, "k_bits": 3, "v_bits": 3, "k_seeds": kr.seeds, "v_seeds": vr.seeds,
            "scale": 0.1}
    bad = [((q[..., :16], *args), {}, "q must be"),
           ((q, *args), {"dim": 24}, "supports dims"),
           ((q, *args), {"k_bits": 4}, "key codes"),
           ((q, kr.codes[..., :5], kr.norms, vr.codes, vr.norms), {}, "key codes"),
           ((q.expand(3, -1, -1, -1), *args), {}, "do not hold"),
           ((q, *args), {"k_seeds": (1, 2)}, "whole blocks"),
           ((q, *args), {"block": 8, "key_means": torch.zeros(2, 3, 32)}, "key_means"),
           ((q, *args, torch.zeros(1, 2, 3, 32)), {}, "exact keys/values"),
           ((q, *args, torch.zeros(1, 2, 3, 32), torch.zeros(1, 2, 3, 32)),
            {"bias": torch.zeros(1, 1, 4)}, "bias"),
           ((q, *args), {"out_dtype": torch.int32}, "out_dtype"),
           ((q.expand(1, 4, 40, 32), *args), {}, "query rows")]
    for call, extra, match in bad:
        with pytest.raises(ValueError, match=match):
            ta.attend(*call, **{**base, **extra})
    with pytest.raises(ValueError, match="split_k"):
        ta.turbo_decode_attention(q[:, :, 0], kr.codes[None], kr.norms[None], vr.codes[None],
                                  vr.norms[None], dim=32, k_bits=3, k_seed=kr.codec.seed,
                                  v_bits=3, v_seed=vr.codec.seed, scale=0.1, split_k=0)
    many = torch.zeros(1, 2, 129, 32)  # two parts of exact tokens past 65535 split parts
    with pytest.raises(ValueError, match="pass 65535"):
        ta.attend(q, *args, many, many, **{**base, "split_k": 65535})
    with pytest.raises(ValueError, match="inconsistent"):
        ta.turbo_decode_attention(q[:, :, 0], kr.codes[None], kr.norms[None], vr.codes[None],
                                  vr.norms[None, :, :5], dim=32, k_bits=3,
                                  k_seed=kr.codec.seed, v_bits=3, v_seed=vr.codec.seed,
                                  scale=0.1)


def test_launch_keys_tell_apart_what_triton_specialises_on():
    """A compiled kernel is reused only for arguments Triton would compile the same way."""
    from kvtool.kernels.triton_launch import _hooks_set, launch_key

    assert not _hooks_set()  # no profiler here: the direct launches are on

    def spec(arg):
        return launch_key((arg,))

    buf = torch.zeros(64, dtype=torch.uint8)
    assert spec(buf) != spec(buf[1:]) and spec(buf) != spec(buf.view(torch.int8))
    assert spec(buf[16:]) == spec(buf)
    assert len({spec(1), spec(16), spec(17), spec(2**31), spec(-2**31 - 1)}) == 5
    assert spec(17) == spec(19) and spec(0.5) == spec(2.0) and spec(-16) == spec(32)
    assert spec(True) != spec(False) != spec(None) and spec(1) != spec(True)
    assert spec(buf) != spec(torch.nn.Parameter(buf.float()))  # another type, another key
    args = (buf, 3, buf[16:], 1.5, None, 32)
    assert launch_key(args) == launch_key((buf[32:], 5, buf, 0.1, None, 64))
    for other in ((buf, 3, buf[1:], 1.5, None, 32), (buf, 1, buf, 1.5, None, 32),
                  (buf, 3, buf, 1.5, True, 32), (buf, 3, buf, 1.5, None, 33),
                  (buf, 3, buf.view(torch.int8), 1.5, None, 32), (buf, 3, buf, 2, None, 32)):
        assert launch_key(other) != launch_key(args), other
    with pytest.raises(TypeError):
        launch_key((buf, "a"))


def test_calls_share_their_scratch_and_plans(monkeypatch):
    """Launches that share a stream's scratch (on CUDA by default; turned on here) read only
    their own parts: a larger call after a smaller one, then the smaller again, each matches
    its reference; every KV head's ticket is back at zero after each launch; a repeat call
    reuses its plan, and bad shapes after good ones are still refused."""
    from kvtool.kernels.triton_launch import StreamScratch

    monkeypatch.setattr(ta, "_SCRATCH", StreamScratch(shared=True))
    calls = []
    for seed, (batch, group, n, x) in enumerate(((1, 2, 64, 3), (2, 4, 96, 130), (1, 2, 64, 5))):
        q, k, v, ke, ve = _inputs(batch, 2, group, 1, n, 32, seed=seed, x=x)
        kr, vr = Role("turbo3", k, n), Role("turbo4", v, n)
        out = _attend(q, kr, vr, ke, ve, scale=0.2, split_k=2)
        close(out, reference(q, kr.decoded, vr.decoded, ke, ve, 0.2))
        (work, tickets), = ta._SCRATCH.buffers.values()
        assert not tickets.any() and tickets.numel() >= 2 * batch
        calls.append((q, kr, vr, ke, ve))
    assert tickets.numel() == 4  # grown once, for the largest call
    plans = len(ta._PLANS)
    q, kr, vr, ke, ve = calls[0]
    close(_attend(q, kr, vr, ke, ve, scale=0.2, split_k=2),
          reference(q, kr.decoded, vr.decoded, ke, ve, 0.2))
    assert len(ta._PLANS) == plans
    with pytest.raises(ValueError, match="exact keys/values"):
        _attend(q, kr, vr, ke, ve[..., :2, :], scale=0.2, split_k=2)
    with pytest.raises(ValueError, match="split_k"):
        _attend(q, kr, vr, ke, ve, scale=0.2, split_k=0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_repeated_calls_launch_directly_and_read_their_own_inputs():
    """Calls after the first of a specialisation skip Triton's dispatch (counted) and still
    read their own inputs: new data and another exact length under one key, then misaligned
    codes (another key), then the first key again."""
    fast = ta._LAUNCH.fast
    for seed, x, odd in ((1, 6, False), (2, 7, False), (3, 7, True), (4, 9, False)):
        q, k, v, ke, ve = _inputs(2, 2, 4, 1, 96, 64, seed=seed, x=x)
        kr, vr = Role("turbo3", k, 96), Role("turbo4", v, 96)
        if odd:
            kr.codes = _misaligned(kr.codes)
        out = _attend(q, kr, vr, ke, ve, scale=0.125)
        close(out, reference(q, kr.decoded, vr.decoded, ke, ve, 0.125))
    assert ta._LAUNCH.fast >= fast + 2


# -- CompressedCache through the transformers hook -------------------------------------------
def _model():
    """A random-init 2-layer Llama; weights 5x the default scale make attention peaky, so a
    mistake in the codes path shows in the logits (dropping the key means moves them by 0.5)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=512, initializer_range=0.1)
    return LlamaForCausalLM(config).eval()


def _run(model, ids, policy, route: bool, flag, steps: int = 3):
    """Prefill ``ids`` and ``steps`` greedy steps; a 2-token chunk at the end: (tokens, logits,
    attention calls from codes)."""
    from kvtool.engines import hf_attention
    from kvtool.engines.hf_runtime import CompressedCache

    before = hf_attention.STATS["codes"]
    past = CompressedCache(policy, config=model.config, block_size=16,
                           attention_from_codes=flag)
    tokens, logits = [], []
    hf_attention.DEVICE_ATTENTION_ON_CPU = route
    try:
        with torch.inference_mode():
            out = model(ids, past_key_values=past, use_cache=True).logits[:, -1:]
            for _ in range(steps):
                tok = out.argmax(-1)
                tokens.append(int(tok))
                out = model(tok, past_key_values=past, use_cache=True).logits
                logits.append(out[0, -1])
            logits.append(model(ids[:, :2], past_key_values=past, use_cache=True).logits[0])
    finally:
        hf_attention.DEVICE_ATTENTION_ON_CPU = False
    return tokens, logits, hf_attention.STATS["codes"] - before


def _policy(preset: str):
    from kvtool.policy import CodecPolicy

    return CodecPolicy.from_options("turbo3", sink_tokens=4, recent_tokens=16) \
        if preset == "turbo3" else CodecPolicy.from_options(preset="quality", recent_tokens=16)


def _agree(runs: dict, others: tuple[str, ...]) -> None:
    """Same greedy tokens; logits within 1e-3 of their scale (quality: 3e-4 · scale)."""
    scale = max(x.abs().max().item() for x in runs["triton"][1])
    for other in others:
        assert runs["triton"][0] == runs[other][0]
        delta = max((a - b).abs().max().item()
                    for a, b in zip(runs["triton"][1], runs[other][1], strict=True))
        assert delta <= 1e-3 * scale, (other, delta, scale)


@pytest.mark.skipif(CUDA, reason="the CPU routing switch is for the interpreter")
@pytest.mark.parametrize("preset", ["turbo3", "quality"])
def test_compressed_cache_attends_from_codes_through_triton(preset, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("numba")
    prepare, stores = ta.prepare, []
    monkeypatch.setattr(ta, "prepare", lambda *a, **k: stores.append(prepare(*a, **k))
                        or stores[-1])
    model, policy = _model(), _policy(preset)
    ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(1))
    runs = {name: _run(model, ids, policy, route, flag) for name, route, flag in
            (("triton", True, None), ("numba", False, None), ("decoded", False, False))}
    # 3 decode steps and the 2-token chunk, 2 layers each, read the encoded tokens from codes
    assert runs["triton"][2] == 8 and runs["numba"][2] == 8 and runs["decoded"][2] == 0
    _agree(runs, ("numba", "decoded"))
    # no block was flushed after the prefill: each layer prepared its store once for 4 calls
    assert len(stores) == 2 and stores[0].k_codes.shape[1] == 64


@pytest.mark.skipif(CUDA, reason="the CPU routing switch is for the interpreter")
def test_device_views_masks_and_fallbacks(monkeypatch):
    """The hook on the device path: a view of tensors, a mask hiding an exact token served from
    codes (its bias computed once per mask object), one hiding an encoded token decoded."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kvtool.engines import hf_attention
    from kvtool.engines.hf_runtime import CompressedCache

    monkeypatch.setattr(hf_attention, "DEVICE_ATTENTION_ON_CPU", True)
    module = SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)
    gen = torch.Generator().manual_seed(5)
    k, v = (torch.randn(1, 2, 60, 32, generator=gen) for _ in range(2))
    caches = []
    for flag in (True, False):
        past = CompressedCache(_policy("quality"), num_layers=1, block_size=8,
                               attention_from_codes=flag)
        past.update(k, v, 0)
        caches.append(past)
    q = torch.randn(1, 4, 1, 32, generator=gen)
    k1, v1 = (torch.randn(1, 2, 1, 32, generator=gen) for _ in range(2))
    (keys, values), (full_k, full_v) = (past.update(k1, v1, 0) for past in caches)
    view = getattr(keys, hf_attention.ATTR).view
    assert view.on_device and isinstance(view.codes[0], torch.Tensor)
    assert view.tokens == 40 and view.rotations[0].shape == (2, 5)
    assert view.key_means.dtype == torch.float16
    for hidden, path in ((58, "codes"), (10, "fallback")):  # an exact token, an encoded one
        mask = torch.ones(1, 1, 1, 61, dtype=torch.bool)
        mask[..., hidden] = False
        setattr(keys, hf_attention.ATTR, hf_attention.CodesTag(view))
        before = dict(hf_attention.STATS)
        out, _ = hf_attention.kvtool_attention(module, q, keys, values, mask, scaling=0.2)
        assert hf_attention.STATS[path] == before[path] + 1
        want, _ = sdpa_attention_forward(module, q, full_k, full_v, mask, scaling=0.2)
        assert (out - want).abs().max().item() <= 2e-3 * want.abs().max().item()
        assert hf_attention._MASK_MEMO[0][0] is mask
        first = hf_attention._MASK_MEMO[0][2]
        assert hf_attention._plan(module, q, keys, values, mask, 0.0, view, {}) is first


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("preset", ["turbo3", "quality"])
def test_compressed_cache_on_cuda_attends_from_codes(preset):
    pytest.importorskip("transformers")
    model, policy = _model().cuda(), _policy(preset)
    ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(1)).cuda()
    runs = {name: _run(model, ids, policy, False, flag) for name, flag in
            (("triton", None), ("decoded", False))}
    assert runs["triton"][2] == 8 and runs["decoded"][2] == 0
    _agree(runs, ("decoded",))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_every_autotune_config_reads_the_codes_right(monkeypatch):
    """Each config the autotuner may pick, forced alone, against the decoded reference: turbo
    2/3/4 bits (the register lookups, 3-bit tiles paired or not), the byte path (misaligned
    codes) and the quality preset's codes, at head_dim 128 and 64 rows of tokens per part."""
    kernel = ta._attend_kernel
    configs = list(kernel.configs)
    cases = []
    for kspec, vspec, group, dim, odd in (("turbo3", "turbo3", 4, 128, False),
                                          ("turbo4", "turbo2", 4, 128, False),
                                          ("turbo3", "turbo4", 2, 64, True)):
        q, k, v, ke, ve = _inputs(2, 2, group, 1, 640, dim, seed=dim, x=5)
        kr, vr = Role(kspec, k, 640), Role(vspec, v, 640)
        if odd:
            kr.codes = _misaligned(kr.codes)
        cases.append((q, kr, vr, ke, ve, 0))
    q, k, v, ke, ve = _inputs(1, 2, 4, 1, 640, 128, seed=3, x=5)
    cases.append((q, Role(QUALITY[0], k, 64), Role(QUALITY[1], v, 64), ke, ve, 64))
    for config in configs:
        monkeypatch.setattr(kernel, "configs", [config])
        kernel.cache.clear()
        ta._LAUNCH.compiled.clear()
        for q, kr, vr, ke, ve, block in cases:
            out = _attend(q, kr, vr, ke, ve, block=block, scale=0.1, split_k=3)
            close(out, reference(q, kr.decoded, vr.decoded, ke, ve, 0.1))
    kernel.cache.clear()
    ta._LAUNCH.compiled.clear()


# -- real CUDA at benchmark shapes ---------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 8])
def test_bench_shapes_match_sdpa_on_decoded_kv(batch):
    import torch.nn.functional as F

    hq, hkv, dim, n = 32, 8, 128, 8192
    gen = torch.Generator(device="cuda").manual_seed(batch)
    k, v = (torch.randn(batch, hkv, n, dim, device="cuda", generator=gen, dtype=torch.float16)
            for _ in range(2))
    q = torch.randn(batch, hq, dim, device="cuda", generator=gen, dtype=torch.float16)
    kc, kn = triton_cuda.turbo_encode(k, 3, 1)
    vc, vn = triton_cuda.turbo_encode(v, 3, 2)
    out = ta.turbo_decode_attention(q, kc, kn, vc, vn, dim=dim, k_bits=3, k_seed=1, v_bits=3,
                                    v_seed=2, scale=dim ** -0.5)
    kd = triton_cuda.turbo_decode(kc, kn, dim, 3, 1, torch.float32)
    vd = triton_cuda.turbo_decode(vc, vn, dim, 3, 2, torch.float32)
    want = F.scaled_dot_product_attention(q.float()[:, :, None], kd, vd, enable_gqa=True)[:, :, 0]
    err = (out - want).abs().max().item()
    assert err <= 4e-3 * want.abs().max().item(), err


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_quality_codes_at_bench_shape_match_sdpa_on_decoded_kv():
    import torch.nn.functional as F

    batch, hq, hkv, dim, n, block = 1, 32, 8, 128, 8192, 64
    k = torch.randn(batch, hkv, n // block, block, dim, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    q = torch.randn(batch, hq, 1, dim, device="cuda", dtype=torch.float16)
    kcodec, vcodec = get_codec(QUALITY[0]), get_codec(QUALITY[1])
    ka, va = kcodec.encode(k), vcodec.encode(v)
    kd = torch.as_tensor(kcodec.decode(ka), device="cuda").reshape(batch, hkv, n, dim)
    vd = torch.as_tensor(vcodec.decode(va), device="cuda").reshape(batch, hkv, n, dim)
    ka, va = ka.arrays, va.arrays
    out = ta.attend(q, ka["codes"].reshape(batch * hkv, n, -1),
                    ka["norms"].reshape(batch * hkv, n), va["codes"].reshape(batch * hkv, n, -1),
                    va["norms"].reshape(batch * hkv, n), dim=dim, k_bits=4, v_bits=3,
                    k_seeds=seeds(kcodec), v_seeds=seeds(vcodec),
                    scale=dim ** -0.5, k_rotations=ka["rotation"].reshape(batch * hkv, -1),
                    v_rotations=va["rotation"].reshape(batch * hkv, -1),
                    key_means=ka["mean"].reshape(batch * hkv, -1, dim), block=block)
    want = F.scaled_dot_product_attention(q.float(), kd.float(), vd.float(), enable_gqa=True)
    err = (out - want.transpose(1, 2)).abs().max().item()
    assert err <= 4e-3 * want.abs().max().item(), err
