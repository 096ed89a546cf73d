"""Tiny random-init sliding-window models written as HF model directories (no weights
downloaded), with the default model's tokenizer: a Gemma 3 whose layers 0-4 slide and layer 5 is
global (mlx-lm's gemma3_text puts a global layer every 6), shared by the sliding-window tests of
each engine; a Mistral whose every layer slides (Mistral-7B-v0.1's layout)."""

from __future__ import annotations

import shutil
from pathlib import Path


def write_tiny_gemma(path: Path, window: int) -> Path:
    """Write the model (seeded: the same weights every time) at ``path``; ``path``."""
    import torch
    import transformers

    from kvtool.models import ensure_default_converted

    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        tie_word_embeddings=False, initializer_range=0.1, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, head_dim=32, sliding_window=window,
        layer_types=["sliding_attention"] * 5 + ["full_attention"])
    transformers.Gemma3ForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ensure_default_converted() / name, path)
    return path


def write_tiny_mistral(path: Path, window: int, positions: int = 1024) -> Path:
    """A two-layer Mistral, every layer sliding over ``window`` tokens, at ``path``; ``path``."""
    import torch
    import transformers

    from kvtool.models import ensure_default_converted

    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=positions,
        tie_word_embeddings=False, initializer_range=0.1, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, head_dim=32, sliding_window=window)
    transformers.MistralForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ensure_default_converted() / name, path)
    return path
