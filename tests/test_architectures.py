"""Architectures beyond Llama and Gemma 3, on tiny random-init models (no weights): a lossless
capture, saved and loaded, continues each exactly; every layer sliding (Mistral-7B-v0.1) holds
only its window of a longer prompt; hybrid (Mamba, gated delta), chunked-attention (Llama 4)
and latent-attention (MLA) models are refused by name; config fields that change the keys
without changing the weights (NoPE layers) are part of the fingerprint."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kvtool  # noqa: E402
from kvtool.engines import hf  # noqa: E402
from kvtool.engines.hf_runtime import CompressedCache, attention_windows  # noqa: E402
from kvtool.errors import KvtoolError  # noqa: E402
from kvtool.formats.header import token_layout_problem  # noqa: E402
from kvtool.identity import kv_layout, model_fingerprint  # noqa: E402
from kvtool.policy import CodecPolicy  # noqa: E402

VOCAB, PROMPT, WINDOW = 128, 40, 16
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            tie_word_embeddings=False, initializer_range=0.1, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
ARCHS = {  # config class, its options beyond BASE
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "qwen2": ("Qwen2Config", {"sliding_window": WINDOW, "use_sliding_window": False}),
    "phi3_every_layer_sliding": ("Phi3Config", {"sliding_window": WINDOW}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "sliding_window": WINDOW}),
    "gpt_oss": ("GptOssConfig", {"head_dim": 16, "sliding_window": WINDOW,
                                 "num_local_experts": 2, "num_experts_per_tok": 1}),
    "smollm3": ("SmolLM3Config", {"no_rope_layers": [1, 0]}),
    "mistral_every_layer_sliding": ("MistralConfig", {"head_dim": 16, "sliding_window": WINDOW}),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", {}),
    "starcoder2": ("Starcoder2Config", {}),
    "cohere2": ("Cohere2Config", {"sliding_window": WINDOW,
                                  "layer_types": ["sliding_attention", "full_attention"]}),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 16, "num_experts": 2, "num_experts_per_tok": 1,
                                     "moe_intermediate_size": 32}),
}


def tiny(config_class: str, **options: Any):
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**BASE, **options})
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def next_logits(model, ids: list[int], past=None) -> torch.Tensor:
    with torch.inference_mode():
        if past is None:
            return model(torch.tensor([ids])).logits[0, -1]
        return model(torch.tensor([ids[-1:]]), past_key_values=past).logits[0, -1]


@pytest.fixture(scope="module")
def ids() -> list[int]:
    return torch.randint(0, VOCAB, (PROMPT + 1,), generator=torch.Generator().manual_seed(1)
                         ).tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_a_lossless_file_continues_every_architecture_exactly(arch, ids, tmp_path):
    """capture → save → load → restore (DynamicCache and a lossless CompressedCache) gives the
    next token's logits of a forward over the whole prompt."""
    model = tiny(ARCHS[arch][0], **ARCHS[arch][1])
    prompt, fresh = ids[:-1], next_logits(model, ids)
    dynamic = [(info or {}).get("sliding_window") for info in hf.layer_types(model) or [{}] * 2]
    assert attention_windows(model.config) == dynamic  # CompressedCache's layers: DynamicCache's
    kvtool.save(hf.capture(model, None, token_ids=prompt), tmp_path / "c.kvz")
    cache = kvtool.load(tmp_path / "c.kvz", backend="torch")
    assert cache.num_tokens == len(cache.token_ids) == PROMPT
    if arch.endswith("every_layer_sliding"):  # every layer kept only its window of the prompt
        assert [int(k.shape[1]) for k in cache.keys] == [WINDOW - 1] * 2
    restored = next_logits(model, ids, hf.to_dynamic_cache(cache, model))
    torch.testing.assert_close(restored, fresh, atol=1e-4, rtol=1e-4)
    compressed = CompressedCache.from_kvcache(cache, CodecPolicy.from_options("raw"), model)
    torch.testing.assert_close(next_logits(model, ids, compressed), fresh, atol=1e-4,
                               rtol=1e-4)


def test_every_layer_sliding_keeps_the_sequence_length_and_refuses_a_prefix(ids, tmp_path):
    """Where no layer holds every token, ``num_tokens`` is the token ids' count (positions
    ``num_tokens - tokens + i``), lossy files too; a prefix the windows do not hold is refused,
    and a file that claims more tokens than its layers without sliding every layer is not
    written."""
    model = tiny("MistralConfig", head_dim=16, sliding_window=WINDOW)
    captured = hf.capture(model, None, token_ids=ids[:-1])
    kvtool.save(captured, tmp_path / "t.kvz", codec="turbo3")
    lossy = kvtool.load(tmp_path / "t.kvz", backend="torch")
    assert lossy.num_tokens == PROMPT and [int(k.shape[1]) for k in lossy.keys] == [15, 15]
    with pytest.raises(ValueError, match="keeps only the last 15 of 40 tokens"):
        lossy.prefix(20)
    runtime = CompressedCache(CodecPolicy.from_options("raw"), config=model.config)
    with torch.inference_mode():  # written as it comes: each layer slides, as DynamicCache's
        chunks = [model(torch.tensor([ids[at:at + 7]]), past_key_values=runtime).logits[0]
                  for at in range(0, len(ids), 7)]
        torch.testing.assert_close(torch.cat(chunks), model(torch.tensor([ids])).logits[0],
                                   atol=1e-4, rtol=1e-4)
    slides = [{"sliding_window": WINDOW}] * 2
    assert token_layout_problem([15, 15], PROMPT, PROMPT, slides) is None
    assert "num_tokens is 40" in token_layout_problem([15, 15], PROMPT, PROMPT,
                                                      [slides[0], None])
    assert "num_tokens is 40" in token_layout_problem([15, 15], PROMPT, None, slides)
    assert "fewer than its sliding window" in token_layout_problem([14, 15], PROMPT, PROMPT,
                                                                   slides)
    captured.layer_info = [slides[0], {}]  # one layer said to be full attention
    with pytest.raises(ValueError, match="token ids for 15 tokens"):
        kvtool.save(captured, tmp_path / "bad.kvz")
    assert not (tmp_path / "bad.kvz").exists()


def test_hybrid_models_are_refused_by_name(ids):
    """A hybrid model's convolution layers keep no K/V: capture, eval's baseline and the
    runtime cache say so instead of failing on a missing attribute."""
    from kvtool.evaluate import run_baseline

    model = tiny("Lfm2Config", layer_types=["conv", "full_attention"], full_attn_idxs=None)
    message = r"full and sliding-window attention layers; this model \(lfm2\) also has \['conv'\]"
    with pytest.raises(KvtoolError, match=message):
        hf.capture(model, None, token_ids=ids)
    with pytest.raises(KvtoolError, match=message):
        CompressedCache(CodecPolicy.from_options("turbo3"), config=model.config)
    tokenizer = lambda text, return_tensors: SimpleNamespace(input_ids=torch.tensor([ids]))  # noqa: E731
    loaded = SimpleNamespace(model=model, tokenizer=tokenizer, name="lfm2")
    with pytest.raises(KvtoolError, match=message):
        run_baseline(loaded, "text", chunk=16)


OTHER_LAYERS = {  # config class, its options beyond BASE, the layer kind refused
    "falcon_h1": ("FalconH1Config", {"head_dim": 16, "mamba_d_ssm": 64, "mamba_n_heads": 4,
                                     "mamba_d_head": 16, "mamba_n_groups": 1,
                                     "mamba_d_state": 16, "mamba_chunk_size": 16}, "hybrid"),
    "jamba": ("JambaConfig", {"attn_layer_period": 2, "attn_layer_offset": 1,
                              "expert_layer_period": 2, "num_experts": 2, "mamba_d_state": 8,
                              "mamba_dt_rank": 8}, "linear_attention"),
    "qwen3_next": ("Qwen3NextConfig", {"head_dim": 16, "num_experts": 2,
                                       "layer_types": ["linear_attention", "full_attention"],
                                       "num_experts_per_tok": 1, "moe_intermediate_size": 32,
                                       "linear_num_value_heads": 2, "linear_num_key_heads": 2,
                                       "linear_key_head_dim": 16, "linear_value_head_dim": 16},
                   "linear_attention"),
    "llama4_chunked": ("Llama4TextConfig", {"head_dim": 16, "attention_chunk_size": 16,
                                            "num_local_experts": 2, "num_experts_per_tok": 1,
                                            "intermediate_size_mlp": 128},
                       "chunked_attention"),
}


@pytest.mark.parametrize("arch", OTHER_LAYERS)
def test_state_space_linear_and_chunked_layers_are_refused_by_name(arch, ids):
    """Mamba and gated-delta layers keep a state, not K/V; Llama 4's chunked layers attend
    within fixed chunks, which no ``layer_info`` says: captured as full attention, a file would
    continue them wrongly. Capture and the runtime cache refuse each, naming the layer kind."""
    config_class, options, kind = OTHER_LAYERS[arch]
    model = tiny(config_class, **options)
    message = rf"full and sliding-window attention layers; .* also has \['{kind}'\] layers"
    with pytest.raises(KvtoolError, match=message):
        hf.capture(model, None, token_ids=ids)
    with pytest.raises(KvtoolError, match=message):
        CompressedCache(CodecPolicy.from_options("turbo3"), config=model.config)


def test_latent_attention_capture_is_refused_by_name(ids):
    """DeepSeek-V3's cache is a compressed latent and a RoPE key part, not per-head K/V."""
    model = tiny("DeepseekV3Config", kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
                 qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=2,
                 num_experts_per_tok=1, first_k_dense_replace=2, n_group=1, topk_group=1)
    with pytest.raises(KvtoolError, match=r"deepseek_v3 uses multi-head latent attention "
                                          r"\(MLA\): its cache is a 32-wide latent"):
        hf.capture(model, None, token_ids=ids)


def test_nope_layers_are_part_of_the_fingerprint():
    """Which layers rotate their keys changes the K/V of the same weights: another fingerprint.
    Models that do not set such fields keep the fingerprint they had (no new keys)."""
    make = transformers.SmolLM3Config
    a, b = (make(**BASE, no_rope_layers=layers) for layers in ([1, 0], [0, 1]))
    assert model_fingerprint(a) != model_fingerprint(b)
    assert kv_layout(a)["no_rope_layers"] == [1, 0]
    llama = kv_layout(transformers.LlamaConfig(**BASE))
    assert not {"no_rope_layers", "use_qk_norm", "attention_chunk_size"} & set(llama)
    cohere = {norm: kv_layout(transformers.CohereConfig(**BASE, use_qk_norm=norm))
              for norm in (False, True)}  # Command-R: False, as every file before
    assert "use_qk_norm" not in cohere[False] and cohere[True]["use_qk_norm"] is True


def test_a_window_shorter_than_the_models_is_refused(ids):
    """A file whose layers claim a smaller window than the model's, and hold only that, would
    be attended as if older tokens were never there: refused by the model's window."""
    from kvtool.cache import KVCache
    from kvtool.errors import ModelMismatchError

    model = tiny("MistralConfig", head_dim=16, sliding_window=WINDOW)
    full = hf.capture(model, None, token_ids=ids[:-1])
    short = KVCache([k[:, -3:] for k in full.keys], [v[:, -3:] for v in full.values],
                    token_ids=full.token_ids, model=full.model,
                    layer_info=[{"sliding_window": 4}] * 2)
    assert short.num_tokens == PROMPT  # the format allows it: windows of 4 hold their last 3
    message = "layer 0 holds 3 of 40 tokens, fewer than the last 15 its sliding window of 16"
    with pytest.raises(ModelMismatchError, match=message):
        hf.to_dynamic_cache(short, model)
    with pytest.raises(ModelMismatchError, match=message):
        CompressedCache.from_kvcache(short, CodecPolicy.from_options("raw"), model)
