"""Hugging Face transformers engine: capture a prefill's KV cache and restore it.

* :func:`capture` runs one prefill and returns a :class:`~kvtool.cache.KVCache` (torch tensors
  ``[kv_heads, tokens, head_dim]`` in the model's dtype, token ids, model identity, tokenizer
  fingerprint).
* :func:`to_dynamic_cache` rebuilds a ``transformers.DynamicCache`` that
  ``model.generate(input_ids=full_ids, past_key_values=cache)`` continues from.
* :func:`check_compatible` refuses a cache from another model or tokenizer; a cache computed in
  another dtype of the same model is accepted, cast, with a logged note
  (:func:`kvtool.identity.log_cast`).
* :func:`continue_generation` / :func:`recompute_generation` generate greedily from a restored
  cache or from scratch, timing restore and time to first token.

Sliding-window layers (Gemma 3 style): a ``DynamicSlidingWindowLayer`` keeps only the last
``sliding_window - 1`` tokens after a prefill (the most the next step can attend to besides
itself) and counts the total in ``cumulative_length``. Capture stores exactly what the layer
holds (so such a layer has fewer tokens than ``token_ids``) and records
``{"sliding_window": W}`` in ``layer_info``; restore refills the layer and resets
``cumulative_length`` to the full token count.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtool.cache import KVCache
from kvtool.engines.common import (  # noqa: F401 (kvtool.engines.hf.* names callers use)
    GenerationResult,
    chat_prompt,
    check_compatible,
    check_window,
    encode_text,
    full_ids_for,
    holds_every_token,
    prompt_ids,
    recompute_ids,
)
from kvtool.errors import KvtoolError, ModelMismatchError
from kvtool.kernels import to_torch


# -- capture ----------------------------------------------------------------------------------
def _identity(model: Any, tokenizer: Any, model_info: dict | None) -> tuple[dict, str | None]:
    from kvtool.identity import model_identity, tokenizer_fingerprint

    # no model.weights: the weights in memory need not be the directory's it names (a merged
    # LoRA, training steps, another Hub revision); kvtool's loaders pass ``model_info``
    info = model_info or model_identity(model.config, dtype=_dtype_name(model.dtype),
                                        architecture=type(model).__name__)
    return info, tokenizer_fingerprint(tokenizer) if tokenizer is not None else None


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def layer_types(model: Any) -> list[dict[str, Any]] | None:
    """``layer_info`` for the model's cache: ``{"sliding_window": W}`` or ``{}`` per layer;
    ``None`` when every layer is full attention (:func:`hf_runtime.attention_windows`)."""
    from kvtool.cache import windows_layer_info
    from kvtool.engines.hf_runtime import attention_windows

    return windows_layer_info(attention_windows(model.config))


def check_capturable(config: Any) -> None:
    """A :class:`KvtoolError` for a model whose cache a ``.kvz`` file cannot hold: a hybrid
    model's non-attention layers, or multi-head latent attention (DeepSeek-V2/V3, Kimi K2),
    whose cache is a compressed latent and its RoPE part, not per-head keys and values."""
    from kvtool.engines.hf_runtime import _text_config, attention_windows

    attention_windows(config)
    text = _text_config(config)
    if getattr(text, "kv_lora_rank", None):
        raise KvtoolError(f"{getattr(config, 'model_type', 'this model')} uses multi-head latent "
                          f"attention (MLA): its cache is a {text.kv_lora_rank}-wide latent and "
                          "a RoPE key part, not per-head keys and values, which a .kvz file "
                          "does not hold yet (--runtime-codec and kvtool eval work on it)")


@torch.inference_mode()
def capture(model: Any, tokenizer: Any, text: str | None = None, *,
            token_ids: Any = None, model_info: dict | None = None) -> KVCache:
    """Prefill ``text`` (or ``token_ids``) and return the resulting KV cache."""
    from transformers import DynamicCache

    if (text is None) == (token_ids is None):
        raise KvtoolError("capture needs exactly one of text or token_ids")
    ids = encode_text(tokenizer, text) if text is not None else [int(t) for t in token_ids]
    if not ids:
        raise KvtoolError("nothing to capture: the prompt has no tokens")
    check_capturable(model.config)
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    past = DynamicCache(config=model.config)
    kwargs = {"logits_to_keep": 1} if "logits_to_keep" in _forward_params(model) else {}
    model(input_ids=input_ids, past_key_values=past, use_cache=True, **kwargs)
    keys = [layer.keys[0].contiguous() for layer in past.layers]
    values = [layer.values[0].contiguous() for layer in past.layers]
    info, tok_fp = _identity(model, tokenizer, model_info)
    return KVCache(keys, values, token_ids=np.asarray(ids, dtype=np.int64), model=dict(info),
                   tokenizer_fingerprint=tok_fp, layer_info=layer_types(model))


def _forward_params(model: Any) -> set[str]:
    import inspect

    return set(inspect.signature(model.forward).parameters)


# -- restore ----------------------------------------------------------------------------------
def _total_tokens(cache: KVCache) -> int:
    return len(cache.token_ids) if cache.token_ids is not None else cache.num_tokens


def to_dynamic_cache(cache: KVCache, model: Any = None, dtype: Any = None,
                     device: Any = None):
    """A ``DynamicCache`` holding ``cache`` (batch 1), shaped for ``model`` when given.

    ``dtype``/``device`` default to the model's (else the cache's own). Raises
    :class:`ModelMismatchError` when the cache cannot fit the model's layers.
    """
    from transformers import DynamicCache

    want = None
    if model is not None:
        want = kv_shape(model)
        dtype = dtype or model.dtype
        device = device or next(model.parameters()).device
        out = DynamicCache(config=model.config)
        if len(out.layers) != cache.num_layers:
            raise ModelMismatchError(f"cache has {cache.num_layers} layers, model has "
                                     f"{len(out.layers)}")
    else:
        info = cache.layer_info or [{}] * cache.num_layers
        data = [(None, None, torch.tensor(i["sliding_window"])) if (i or {}).get("sliding_window")
                else (None, None) for i in info]
        out = DynamicCache(ddp_cache_data=data)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    total = _total_tokens(cache)
    for i, layer in enumerate(out.layers):
        k, v = (to_torch(a) for a in cache.layer(i))
        check_layer(i, k, v, want, dtype)
        sliding = getattr(layer, "sliding_window", None) if layer.is_sliding else None
        if sliding:
            check_window(i, int(k.shape[1]), total, int(sliding))
            k, v = k[:, -(sliding - 1):], v[:, -(sliding - 1):]
        elif k.shape[1] != total:
            raise ModelMismatchError(f"layer {i} holds {k.shape[1]} of {total} tokens (a "
                                     "sliding-window cache?) but is full attention here")
        layer.update(k[None].to(device=device, dtype=dtype or k.dtype),
                     v[None].to(device=device, dtype=dtype or v.dtype))
        if sliding:
            layer.cumulative_length = total
    return out


def kv_shape(model: Any) -> tuple[int, int]:
    """(KV heads, head_dim) of the model's attention layers."""
    from kvtool.identity import kv_layout

    layout = kv_layout(model.config)
    return layout["num_kv_heads"], layout["head_dim"]


def check_layer(i: int, k: torch.Tensor, v: torch.Tensor, want: tuple[int, int] | None,
                dtype: Any) -> None:
    """Refuse layer ``i``'s K/V ``[kv_heads, tokens, head_dim]`` when not shaped ``want``
    (:class:`ModelMismatchError`; None: any) or past float16's range when cast to ``dtype``."""
    if want is not None and (int(k.shape[0]), int(k.shape[2])) != want:
        raise ModelMismatchError(f"layer {i}: cache has {k.shape[0]} KV heads × head_dim "
                                 f"{k.shape[2]}, model has {want[0]} × {want[1]}")
    if dtype == torch.float16 and k.dtype != torch.float16:
        _check_fits_fp16(i, k, v)


def _check_fits_fp16(i: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """A bf16/fp32 cache cast to fp16 must not overflow: an inf in the cache would be attended
    silently (bf16 reaches 3.4e38, fp16 65504)."""
    top = max(float(k.abs().max()) if k.numel() else 0.0,
              float(v.abs().max()) if v.numel() else 0.0)
    if top > torch.finfo(torch.float16).max:
        raise KvtoolError(f"layer {i} holds values up to {top:.4g}, past float16's 65504: "
                          "restore it as bfloat16 or float32 (--dtype)")


# -- generation ---------------------------------------------------------------------------------
class _FirstTokenTimer:
    """A generate() streamer that notes when the first new token arrives."""

    def __init__(self) -> None:
        self.calls, self.first = 0, None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # call 1 is the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


@dataclass(frozen=True)
class Sampling:
    """How to pick tokens: greedy (``temperature`` 0, the default) or sampled with
    ``temperature``/``top_p``; ``seed`` makes a sampled run repeatable."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def generate_kwargs(self) -> dict[str, Any]:
        if self.temperature <= 0:
            return {"do_sample": False, "top_k": None, "top_p": None, "temperature": None}
        return {"do_sample": True, "top_k": None, "top_p": self.top_p,
                "temperature": self.temperature}


GREEDY = Sampling()


@torch.inference_mode()
def _greedy(loaded: Any, ids: list[int], past: Any, max_new_tokens: int,
            start: float, sampling: Sampling = GREEDY) -> tuple[list[int], float, float, Any]:
    model, tok = loaded.model, loaded.tokenizer
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    timer = _FirstTokenTimer()
    eos = getattr(model.generation_config, "eos_token_id", None)
    pad = getattr(model.generation_config, "pad_token_id", None)
    pad = pad if pad is not None else (eos[0] if isinstance(eos, list) else eos)
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                         past_key_values=past, max_new_tokens=max_new_tokens, num_beams=1,
                         **sampling.generate_kwargs(),
                         pad_token_id=pad if pad is not None else tok.pad_token_id,
                         streamer=timer, output_logits=True, return_dict_in_generate=True)
    end = time.perf_counter()
    if out.logits and not bool(torch.isfinite(torch.stack(out.logits)).all()):
        raise KvtoolError("the model's next-token scores were not finite (NaN or Inf): the "
                          "restored K/V are past anything the model computes (a crafted or "
                          "damaged file?), so its text would be noise")
    new = out.sequences[0, len(ids):].tolist()
    first = out.logits[0][0].float() if out.logits else None
    return new, (timer.first or end) - start, end - start, first


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def continue_generation(loaded: Any, cache: KVCache, prompt: str | None = None,
                        max_new_tokens: int = 32, *, input_ids: Any = None,
                        force: bool = False, past_factory: Any = None,
                        sampling: Sampling = GREEDY) -> GenerationResult:
    """Restore ``cache`` and greedily continue the cached ids + ``prompt`` (or ``input_ids``).

    ``past_factory(cache, model)`` may build another ``transformers`` Cache than the default
    :func:`to_dynamic_cache` (e.g. a runtime-compressed cache).
    """
    check_compatible(cache, loaded, force=force)
    full = full_ids_for(cache, loaded.tokenizer, prompt, input_ids)
    if len(full) == len(cache.token_ids):  # generate needs one uncached token: recompute it
        if not holds_every_token(cache):
            raise KvtoolError("the prompt adds no tokens to a sliding-window cache; "
                              "give a prompt to continue from")
        cache = cache.prefix(len(full) - 1)
    start = time.perf_counter()
    past = (past_factory or (lambda c, m: to_dynamic_cache(c, model=m)))(cache, loaded.model)
    restore = time.perf_counter() - start
    new, ttft, total, first = _greedy(loaded, full, past, max_new_tokens, start, sampling)
    return GenerationResult(_decode(loaded.tokenizer, new), new, len(full), len(cache.token_ids),
                            restore, ttft, total, first)


def recompute_generation(loaded: Any, input_ids: Any = None, max_new_tokens: int = 32, *,
                         prompt: str | None = None, past: Any = None,
                         sampling: Sampling = GREEDY) -> GenerationResult:
    """Generation from scratch (the baseline a restore is compared with); ``past``: an empty
    cache to fill instead of a ``DynamicCache`` (e.g. a runtime-compressed one)."""
    ids = recompute_ids(loaded.tokenizer, input_ids, prompt)
    from transformers import DynamicCache

    start = time.perf_counter()
    past = past if past is not None else DynamicCache(config=loaded.model.config)
    new, ttft, total, first = _greedy(loaded, ids, past, max_new_tokens, start, sampling)
    return GenerationResult(_decode(loaded.tokenizer, new), new, len(ids), 0, 0.0, ttft, total,
                            first)
