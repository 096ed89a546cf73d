"""Sliding-window files in vLLM's paged blocks (Gemma 3). HF and mlx-lm keep a local layer's
last ``window - 1`` tokens; under a KV connector vLLM runs without its hybrid KV cache manager,
which promotes a mix of local and global layers to full attention, so every layer's blocks hold
every position. (A model whose every layer slides, Mistral-7B-v0.1, keeps vLLM's window manager,
which frees blocks outside the window: kvtool runs it within a context of the window,
:func:`context_for_windows`.) Such a
file serves only a prompt that continues all of it: its kept tokens go to their own positions
and zeros before them (:func:`~kvtool.engines.vllm.paged_io.load_source`), which no query past
its end attends. Nothing here imports vLLM.
"""

from __future__ import annotations

from typing import Any

from kvtool.cache import has_sliding_layers


def partial_windows(f: Any) -> bool:
    """Whether a sliding-window layer of an open .kvz or a loaded :class:`~kvtool.cache.KVCache`
    keeps only its last tokens (HF and mlx-lm captures keep ``window - 1``). Such a
    file serves only a prompt that continues all of it: a query past its end attends only the
    tokens that layer kept, where one inside it would need tokens that are gone. Paged blocks
    hold every position, so the positions before a layer's window are written as zeros (no
    query past the end attends them), and vLLM's own prefix cache must not share those
    blocks with a shorter prompt."""
    if not has_sliding_layers(f.layer_info):
        return False
    return any(t < f.num_tokens for t in layer_tokens(f))


def model_windows(model: dict[str, Any], num_layers: int) -> list[int | None]:
    """Per layer, the sliding window of the model whose identity is ``model`` (its
    ``layout``: ``sliding_window`` and ``layer_types``), None for full attention."""
    layout = model.get("layout") or {}
    window, types = layout.get("sliding_window"), layout.get("layer_types")
    if types is None:
        types = ["sliding_attention" if window else "full_attention"] * num_layers
    ok = isinstance(window, int) and not isinstance(window, bool) and window >= 1
    return [window if ok and i < len(types) and types[i] == "sliding_attention" else None
            for i in range(num_layers)]


def every_layer_window(model: dict[str, Any]) -> int | None:
    """The smallest window of a model whose every layer slides (Mistral-7B-v0.1,
    Phi-3-mini-4k), else None. vLLM keeps such a model's window spec under a KV connector and
    frees blocks outside the window, which the connector refuses past a context of that many
    tokens (:func:`~kvtool.engines.vllm.served_model.refuse_dropped_blocks`)."""
    layers = model.get("num_layers")
    if not isinstance(layers, int) or layers < 1:
        return None
    windows = model_windows(model, layers)
    return None if None in windows else min(windows)


def context_for_windows(model: dict[str, Any], max_model_len: int | None,
                        default: int) -> int:
    """The context vLLM runs with kvtool's connector: ``max_model_len`` as given (a
    :class:`KvtoolError` past a model's every-layer window), else ``default`` capped at it."""
    from kvtool.errors import KvtoolError

    window = every_layer_window(model)
    if window is None:
        return default if max_model_len is None else max_model_len
    if max_model_len is None:
        return min(default, window)
    if max_model_len > window:
        raise KvtoolError(
            f"--max-model-len {max_model_len}: every layer of this model has a sliding window "
            f"of {window}, and past it vLLM frees a request's blocks that kvtool's store and "
            f"captures read; give --max-model-len {window} or less")
    return max_model_len


def window_problem(f: Any, model: dict[str, Any]) -> str | None:
    """Why a file's layers that keep fewer than all its tokens do not fit the served
    ``model``'s sliding windows (:func:`model_windows`, not the file's own ``layer_info``,
    which could claim a window for a full-attention layer or a smaller one), or None: each
    such layer must slide in the model and keep the last ``window - 1`` tokens, all a query
    past the file's end attends."""
    held = layer_tokens(f)
    total = int(f.num_tokens)
    for i, (n, w) in enumerate(zip(held, model_windows(model, len(held)), strict=True)):
        if n >= total:
            continue
        if w is None:
            return f"layer {i} holds {n} of {total} tokens, but is full attention in this model"
        if n < min(total, w - 1):
            return (f"layer {i} holds {n} of {total} tokens, fewer than the last {w - 1} its "
                    f"sliding window of {w} attends to")
    return None


def layer_tokens(f: Any) -> list[int]:
    """Tokens each layer holds, of an open .kvz or a loaded :class:`~kvtool.cache.KVCache`."""
    from kvtool.formats import constants as C

    if hasattr(f, "keys"):
        return [int(k.shape[1]) for k in f.keys]
    return [int(layer["key"]["shape"][1]) for layer in f.header[C.H_LAYERS]]
