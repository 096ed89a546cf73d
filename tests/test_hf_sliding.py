"""CompressedCache on sliding-window layers (Gemma 3 style), on a tiny random Gemma 3."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from kvz_util import FlatRaw

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig  # noqa: E402

from kvtool.engines import hf  # noqa: E402
from kvtool.engines.hf_runtime import CompressedCache, CompressedLayer  # noqa: E402
from kvtool.errors import KvtoolError  # noqa: E402
from kvtool.policy import CodecPolicy  # noqa: E402

WINDOW, BLOCK = 8, 4
CHUNKS = (5, 1, 13, 1, 1, 9, 2, 1, 1, 7)  # 41 tokens: the window slides many times


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=32, sliding_window=WINDOW, max_position_embeddings=256,
                           layer_types=["sliding_attention"] * 3 + ["full_attention"])
    return Gemma3ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def ids():
    torch.manual_seed(1)
    return torch.randint(0, 128, (1, sum(CHUNKS)))


@pytest.fixture(scope="module")
def fresh_logits(model, ids):
    with torch.inference_mode():
        return model(ids).logits[0]


def _chunked(model, ids, past) -> torch.Tensor:
    out, at = [], 0
    with torch.inference_mode():
        for n in CHUNKS:
            out.append(model(ids[:, at:at + n], past_key_values=past).logits[0])
            at += n
    return torch.cat(out)


def _policy(spec: str, **kw: Any) -> CodecPolicy:
    return CodecPolicy.from_options(spec, sink_tokens=2, recent_tokens=2, **kw)


def test_exact_codec_through_sliding_layers_matches_a_full_forward(model, ids, fresh_logits):
    # raw:dtype=float32 is not the lossless codec, so blocks are encoded, then dropped
    past = CompressedCache(_policy("raw:dtype=float32", protect_layers=1),
                           config=model.config, block_size=BLOCK)
    got = _chunked(model, ids, past)
    assert (got - fresh_logits).abs().max().item() < 1e-4
    sliding = [layer for layer in past.layers if layer.is_sliding]
    assert len(sliding) == 3 and not past.layers[3].is_sliding
    # the protected (lossless) layer 0 and the encoded ones let go of the same tokens
    assert {layer.dropped for layer in sliding} == {sum(CHUNKS) - WINDOW + 1 - 2}
    for layer in sliding:
        held = layer.k.stored + layer.k.tail.shape[-2]
        assert held == sum(CHUNKS) - layer.dropped < WINDOW + BLOCK
        assert layer.k.sink is None  # the window never sees sinks
    assert past.layers[1].k.stored > 0  # something is still encoded
    assert past.layers[0].k.codec is None and past.layers[3].k.codec is None  # protected


def test_full_attention_layers_keep_their_sinks(model, ids, fresh_logits):
    past = CompressedCache(_policy("raw:dtype=float32"), config=model.config, block_size=BLOCK)
    assert (_chunked(model, ids, past) - fresh_logits).abs().max().item() < 1e-4
    full = past.layers[3].k
    assert full.sink.shape[-2] == 2 and full.stored > 0
    assert full.stored + 2 + full.tail.shape[-2] == sum(CHUNKS)


def test_generate_matches_dynamic_cache(model, ids):
    prompt = ids[:, :30]
    kw = dict(max_new_tokens=8, do_sample=False)
    with torch.inference_mode():
        want = model.generate(input_ids=prompt, past_key_values=DynamicCache(config=model.config),
                              **kw)
        past = CompressedCache(_policy("raw:dtype=float32"), config=model.config,
                               block_size=BLOCK)
        got = model.generate(input_ids=prompt, past_key_values=past, **kw)
    assert got.tolist() == want.tolist()
    assert past.get_seq_length() == 30 + 8 - 1


def test_lossy_codec_on_sliding_layers_stays_close(model, ids, fresh_logits):
    past = CompressedCache(_policy("int8"), config=model.config, block_size=BLOCK)
    err = (_chunked(model, ids, past) - fresh_logits).abs().max().item()
    assert 0 < err < 0.05
    assert past.layers[1].dropped > 0 and past.layers[1].k.stored > 0


def test_the_mask_offset_matters(model, ids, fresh_logits, monkeypatch):
    """A sliding layer that dropped tokens but told the mask it had not is visibly wrong."""
    monkeypatch.setattr(CompressedLayer, "get_mask_sizes",
                        lambda self, q: (self.cumulative_length - self.dropped + q, 0))
    past = CompressedCache(_policy("raw:dtype=float32"), config=model.config, block_size=BLOCK)
    assert (_chunked(model, ids, past) - fresh_logits).abs().max().item() > 1e-2


def test_from_kvcache_of_a_captured_sliding_cache_continues_exactly(model, ids, fresh_logits):
    cache = hf.capture(model, None, token_ids=ids[0, :30].tolist())
    assert [int(k.shape[1]) for k in cache.keys] == [WINDOW - 1] * 3 + [30]
    policy = _policy("raw:dtype=float32")
    for past in (CompressedCache.from_kvcache(cache, policy, model, block_size=BLOCK),
                 CompressedCache.from_kvcache(cache, policy, block_size=BLOCK)):  # layer_info
        assert past.layers[0].is_sliding and past.layers[0].sliding_window == WINDOW
        assert past.get_seq_length() == 30
        with torch.inference_mode():
            got = model(ids[:, 30:], past_key_values=past).logits[0]
        assert (got - fresh_logits[30:]).abs().max().item() < 1e-4


def test_a_layout_without_a_block_axis_is_kept_one_chunk_per_block(model, ids, fresh_logits):
    past = CompressedCache(_policy("raw"), config=model.config, block_size=BLOCK)
    past.layers[:] = [CompressedLayer(FlatRaw("float32"), FlatRaw("float32"), 2, 2, BLOCK,
                                      layer.sliding_window) for layer in past.layers]
    got = _chunked(model, ids, past)
    assert (got - fresh_logits).abs().max().item() < 1e-4
    layer = past.layers[0]
    assert layer.k.chunks and all(c.shape[-3] == 1 for c in layer.k.chunks)
    assert layer.dropped == past.layers[1].dropped > 0


def test_unknown_layer_types_are_refused(model):
    cfg = model.config.__class__(**{**model.config.to_dict(),
                                    "layer_types": ["chunked_attention"] * 4})
    with pytest.raises(KvtoolError, match="chunked_attention"):
        CompressedCache(_policy("turbo3"), config=cfg)
    with pytest.raises(KvtoolError, match="2 sliding windows for 4 layers"):
        CompressedCache(_policy("turbo3"), num_layers=4, sliding_windows=[8, None])


class _Tokenizer:
    """What kvtool's generation reads of a tokenizer: the model's 128 ids, each its own text."""

    special_tokens_map: dict[str, str] = {}
    pad_token_id = 0

    def get_vocab(self) -> dict[str, int]:
        return {f"t{i}": i for i in range(128)}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(f"t{i}" for i in ids)


def _loaded(model) -> SimpleNamespace:
    """The tiny model as ``kvtool generate`` holds a loaded one."""
    from kvtool.identity import model_identity, tokenizer_fingerprint

    tok = _Tokenizer()
    return SimpleNamespace(model=model, tokenizer=tok, name="tiny-gemma",
                           info=model_identity(model.config, dtype="float32",
                                               architecture=type(model).__name__),
                           fingerprints={"tokenizer": tokenizer_fingerprint(tok)})


def test_a_cache_whose_windows_kept_every_token_continues_with_no_new_prompt(model, ids):
    loaded = _loaded(model)
    short = ids[0, :WINDOW - 2].tolist()  # no window has slid: the last token can be fed again
    cache = hf.capture(model, loaded.tokenizer, token_ids=short, model_info=loaded.info)
    got = hf.continue_generation(loaded, cache, max_new_tokens=4)
    want = hf.recompute_generation(loaded, short, 4)
    assert got.new_token_ids == want.new_token_ids and got.cached_tokens == len(short) - 1
    torch.testing.assert_close(got.first_logits, want.first_logits, rtol=0, atol=1e-4)
    slid = hf.capture(model, loaded.tokenizer, token_ids=ids[0, :20].tolist(),
                      model_info=loaded.info)
    with pytest.raises(KvtoolError, match="adds no tokens to a sliding-window cache"):
        hf.continue_generation(loaded, slid, max_new_tokens=4)


@pytest.mark.parametrize("runtime_codec", [None, "raw:dtype=float32"])
def test_prompt_cache_of_a_sliding_window_model_saves_then_restores(model, ids, tmp_path,
                                                                   runtime_codec):
    """``kvtool generate --prompt-cache``: the same prompt again restores the file (a cache
    whose windows slid cannot give its last token back, so the file keeps it out)."""
    from kvtool.cli.generate import _with_prompt_cache

    loaded, prompt, path = _loaded(model), ids[0, :20].tolist(), str(tmp_path / "pc.kvz")
    runs = [_with_prompt_cache(loaded, path, prompt, 4, hf.GREEDY, False, runtime_codec)
            for _ in range(2)]
    assert [r["prompt_cache"]["action"] for r in runs] == ["saved", "restored"]
    assert runs[1]["prompt_cache"]["cached_tokens"] == len(prompt) - 1
    want = hf.recompute_generation(loaded, prompt, 4)
    assert [r["restore"]["new_token_ids"] for r in runs] == [want.new_token_ids] * 2


def test_a_prompt_cache_holding_the_whole_prompt_past_its_window_is_captured_again(
        model, ids, tmp_path, capsys):
    """A file that holds every token of the prompt although its windows slid (what an older
    kvtool wrote) cannot give its last token back: captured again, and said so, not called
    "another prompt"; the next run restores the new file."""
    from kvtool.cli.generate import _with_prompt_cache
    from kvtool.formats import save

    loaded, prompt, path = _loaded(model), ids[0, :20].tolist(), tmp_path / "pc.kvz"
    save(hf.capture(model, loaded.tokenizer, token_ids=prompt, model_info=loaded.info), path)
    capsys.readouterr()
    runs = [_with_prompt_cache(loaded, str(path), prompt, 4, hf.GREEDY, False, None)
            for _ in range(2)]
    assert [r["prompt_cache"]["action"] for r in runs] == ["saved", "restored"]
    said = capsys.readouterr().err
    assert "a sliding window let go of its oldest tokens" in said and "another" not in said
    want = hf.recompute_generation(loaded, prompt, 4)
    assert [r["restore"]["new_token_ids"] for r in runs] == [want.new_token_ids] * 2
