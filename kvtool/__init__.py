"""kvtool: KV-cache compression and persistence for LLM inference."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "KVCache": "kvtool.cache",
    "get_codec": "kvtool.codecs",
    "list_codecs": "kvtool.codecs",
    "save": "kvtool.formats",
    "load": "kvtool.formats",
    "open_kvz": "kvtool.formats",
    "transcode": "kvtool.formats",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtool' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
