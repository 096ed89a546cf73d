"""The mlx-lm engine: capture a prefill's KV cache with mlx-lm and continue from a restored one.

* :func:`load_mlx` loads ``default`` (the converted SmolLM2 directory) or a local HF model
  directory with ``mlx_lm.load`` and casts it to ``dtype``. Its identity is
  :func:`kvtool.identity.model_identity` of the directory's HF config with that dtype, and the
  tokenizer fingerprint of the same HF tokenizer, so a .kvz captured by the HF or vLLM engine
  for the same model (in any dtype: cast, with a logged note) is accepted here, and one
  captured here is accepted there.
* :func:`capture` prefills a prompt and returns a :class:`~kvtool.cache.KVCache` (numpy
  ``[kv_heads, tokens, head_dim]`` in the model's dtype, token ids, identity); a
  sliding-window layer (mlx-lm's ``RotatingKVCache``: Gemma 3) gives the window's last tokens,
  as transformers keeps them, and :func:`to_prompt_cache` refills one from them.
* :func:`to_prompt_cache` rebuilds an mlx-lm prompt cache (``KVCache`` layers, or
  :class:`~kvtool.engines.mlx_cache.KvtoolMLXCache` ones under a policy, sliding-window
  layers exact);
  :func:`continue_generation` feeds only the tokens after the cached prefix to
  ``mlx_lm.generate_step`` and generates greedily; :func:`recompute_generation` is the baseline.
* :func:`import_prompt_cache` / :func:`export_prompt_cache` convert mlx-lm prompt-cache
  ``.safetensors`` files (``save_prompt_cache``) to and from a KVCache
  (:mod:`~kvtool.engines.mlx_files`).

Importing this module registers ``KvtoolMLXCache`` with mlx-lm's ``load_prompt_cache``. The
model/prefix checks and the result type are every engine's (:mod:`kvtool.engines.common`): this
engine runs without torch installed.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_cache

from kvtool.cache import KVCache, layer_windows, windows_layer_info
from kvtool.engines.common import check_window
from kvtool.engines.mlx_cache import (
    DEFAULT_BLOCK_SIZE,
    KvtoolMLXCache,
    fill_ring,
    kv_shape,
    make_kvtool_cache,
    ring_tokens,
    sliding_windows,
    to_numpy,
)
from kvtool.engines.mlx_files import (  # noqa: F401  (METADATA_KEY re-exported)
    METADATA_KEY,
    export_prompt_cache,
    import_prompt_cache,
    prompt_cache_codecs,
)
from kvtool.errors import KvtoolError, ModelMismatchError, ModelNotFoundError
from kvtool.policy import CodecPolicy

MX_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
PREFILL_STEP = 2048  # tokens per prefill forward, as mlx_lm.generate_step


@dataclass
class MLXModel:
    """An mlx-lm model with its tokenizers, where it came from and its identity."""

    model: Any
    tokenizer: Any  # the Hugging Face tokenizer: token ids exactly as the HF engine's
    wrapper: Any  # mlx-lm's TokenizerWrapper (eos ids, detokenizer) of the same tokenizer
    name: str
    path: str
    dtype: str
    info: dict[str, Any] = field(default_factory=dict)  # model_identity(), as the HF engine
    fingerprints: dict[str, str] = field(default_factory=dict)
    load_seconds: float = 0.0


def load_mlx(model_name: str = "default", dtype: str | None = "auto") -> MLXModel:
    """Load ``default`` or a local HF model directory with mlx-lm, weights cast to ``dtype``
    (``"auto"``/None: the model's own, :func:`kvtool.models.native_dtype`)."""
    from kvtool.checkpoint import weights_fingerprint
    from kvtool.identity import model_identity, tokenizer_fingerprint
    from kvtool.models import resolve_dtype, resolve_model

    name, location = resolve_model(model_name)
    dtype = resolve_dtype(dtype, location)
    if location.suffix.lower() == ".gguf":
        raise KvtoolError(f"mlx-lm needs a Hugging Face model directory, not a GGUF file "
                          f"({location}); use --model default or convert it first")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import mlx_lm
    from transformers import AutoConfig

    start = time.perf_counter()
    try:
        model, wrapper = mlx_lm.load(str(location), model_config=rope_config(location))
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(f"mlx-lm cannot load {location}: {e}") from e
    model.set_dtype(MX_DTYPES[dtype])
    mx.eval(model.parameters())
    seconds = time.perf_counter() - start
    config = AutoConfig.from_pretrained(location, local_files_only=True)
    info = model_identity(config, name=name, dtype=dtype,
                          weights=weights_fingerprint(location))
    tokenizer = wrapper._tokenizer
    fps = {"model": info["fingerprint"], "tokenizer": tokenizer_fingerprint(tokenizer)}
    return MLXModel(model, tokenizer, wrapper, name, str(location), dtype, info, fps, seconds)


def rope_config(location: Any) -> dict[str, Any]:
    """``model_config`` overrides for ``mlx_lm.load``: transformers 5 writes RoPE settings as
    ``rope_parameters`` (the converted default model has no ``rope_theta``), which mlx-lm's
    llama-family models do not read; without this they run with theta 10000 instead of the
    config's (SmolLM2: 100000) and every key after the first position differs from HF's."""
    try:
        config = json.loads((Path(location) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    rope = config.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" not in rope:
        return {}  # absent, or per layer type (models that read it themselves)
    out: dict[str, Any] = {}
    if "rope_theta" not in config:
        out["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default" and not config.get("rope_scaling"):
        out["rope_scaling"] = rope
    return out


def model_dtype(model: Any) -> Any:
    """The mx dtype of the model's first floating-point parameter."""
    from mlx.utils import tree_flatten

    for _, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            return p.dtype
    return mx.float32


# -- capture ----------------------------------------------------------------------------------
def capture(loaded: MLXModel, text: str | None = None, *, token_ids: Any = None) -> KVCache:
    """Prefill ``text`` (or ``token_ids``) with mlx-lm and return the resulting KV cache."""
    from kvtool.engines.common import encode_text

    if (text is None) == (token_ids is None):
        raise KvtoolError("capture needs exactly one of text or token_ids")
    ids = encode_text(loaded.tokenizer, text) if text is not None else [int(t) for t in token_ids]
    if not ids:
        raise KvtoolError("nothing to capture: the prompt has no tokens")
    check_within_window(loaded, len(ids), "the prompt")
    windows = sliding_windows(loaded.model)
    layers = mlx_cache.make_prompt_cache(loaded.model)
    for i in range(0, len(ids), PREFILL_STEP):
        # the logits stay unevaluated: only what the cache needs is computed
        loaded.model(mx.array([ids[i:i + PREFILL_STEP]]), cache=layers)
        mx.eval([c.state for c in layers])
    keys, values = zip(*(_held(c) for c in layers), strict=True)
    return KVCache(list(keys), list(values), token_ids=np.asarray(ids, dtype=np.int64),
                   model=dict(loaded.info), tokenizer_fingerprint=loaded.fingerprints["tokenizer"],
                   layer_info=windows_layer_info(windows))


def check_within_window(loaded: MLXModel, tokens: int, what: str) -> None:
    """A :class:`KvtoolError` where ``tokens`` go past a sliding window of the model that
    mlx-lm ignores (:func:`~kvtool.engines.mlx_cache.ignored_window`)."""
    from kvtool.engines.mlx_cache import ignored_window
    from kvtool.engines.vllm.windows import model_windows

    ours = sliding_windows(loaded.model)
    window = ignored_window(model_windows(loaded.info, len(ours)), ours)
    if window is not None and tokens > window:
        raise KvtoolError(
            f"{what}: {tokens} tokens, past the sliding window of {window} tokens of "
            f"{loaded.name}'s layers, which mlx-lm ignores (it attends to every token there): "
            f"past it mlx-lm's K/V are not the model's; use --engine hf or vllm, or stay "
            f"within {window} tokens")


# -- sliding-window layers (mlx-lm's RotatingKVCache) ----------------------------------------
def _held(layer: Any) -> tuple[np.ndarray, np.ndarray]:
    """A layer's K/V ``[kv_heads, tokens, head_dim]`` in position order: a sliding-window
    layer's last ``max_size - 1`` (what the next token attends to, as transformers keeps)."""
    if type(layer) is mlx_cache.KVCache:
        return tuple(to_numpy(a[0, :, :layer.offset, :]) for a in (layer.keys, layer.values))
    return tuple(to_numpy(a[0]) for a in ring_tokens(layer))


def _attention(window: int | None) -> str:
    return "full attention" if window is None else f"a sliding window of {window}"


# -- restore ----------------------------------------------------------------------------------
def _to_mx(a: Any, dtype: Any = None) -> mx.array:
    """A KVCache array (numpy or torch) as mx ``[1, heads, tokens, dim]`` (in ``dtype``)."""
    from kvtool.kernels import to_mlx as any_to_mlx

    x = any_to_mlx(a)[None]
    return x if dtype is None or x.dtype == dtype else x.astype(dtype)


def to_prompt_cache(cache: KVCache, model: Any, policy: CodecPolicy | None = None, *,
                    block_size: int = DEFAULT_BLOCK_SIZE, mirror: bool = False,
                    config_windows: list[int | None] | None = None) -> list[Any]:
    """An mlx-lm prompt cache holding ``cache`` (batch 1) for ``model``.

    Without ``policy``: the model's own layers; with one: :func:`make_kvtool_cache`'s
    (``KvtoolMLXCache`` full-attention layers that encode the restored tokens now, exact
    sliding-window rings). Raises :class:`ModelMismatchError` when the cache cannot
    fit the model's layers. ``config_windows``: the model's windows by its config, where
    mlx-lm may compute a sliding layer with full attention (the caller keeps to the window):
    such a layer takes a file's layer of that window that holds every token.
    """
    windows = sliding_windows(model)
    n = len(windows)
    if cache.num_layers != n:
        raise ModelMismatchError(f"cache has {cache.num_layers} layers, model has {n}")
    want, dtype = kv_shape(model), model_dtype(model)
    total = len(cache.token_ids) if cache.token_ids is not None else cache.num_tokens
    layers = (make_kvtool_cache(model, policy, block_size=block_size, mirror=mirror)
              if policy is not None else mlx_cache.make_prompt_cache(model))
    stored_windows = layer_windows(cache.layer_info, n)
    for i, (layer, window, stored) in enumerate(zip(layers, windows, stored_windows,
                                                    strict=True)):
        k, v = (_to_mx(a, dtype) for a in cache.layer(i))
        if want is not None and (k.shape[1], k.shape[3]) != want:
            raise ModelMismatchError(f"layer {i}: cache has {k.shape[1]} KV heads × head_dim "
                                     f"{k.shape[3]}, model has {want[0]} × {want[1]}")
        # a layer stored whole fills a ring (earlier vLLM captures named no windows), and a
        # layer mlx-lm computes with full attention though it slides takes one stored whole
        whole = int(k.shape[2]) == total
        ignored = window is None and config_windows is not None and config_windows[i] == stored
        if stored != window and not (whole and (stored is None or ignored)):
            raise ModelMismatchError(f"layer {i}: the cache has {_attention(stored)}, the "
                                     f"model {_attention(window)}")
        if window is not None:
            check_window(i, int(k.shape[2]), total, window)
            fill_ring(layer, k, v, total)
        elif k.shape[2] != total:
            raise ModelMismatchError(f"layer {i} holds {k.shape[2]} of {total} tokens")
        else:
            layer.update_and_fetch(k, v)
    mx.eval([c.state for c in layers])
    return layers


# -- generation ---------------------------------------------------------------------------------
def _greedy(loaded: MLXModel, ids: list[int], prompt_cache: list[Any], max_new_tokens: int,
            start: float) -> tuple[list[int], float, float, np.ndarray | None]:
    """Feed ``ids`` after ``prompt_cache`` and generate greedily (mlx-lm's generate_step);
    (new ids, time to first token, total time — both from ``start`` —, first log-probs)."""
    from mlx_lm.generate import generate_step

    eos = set(loaded.wrapper.eos_token_ids)
    new: list[int] = []
    first_at, first = None, None
    for token, logprobs in generate_step(mx.array(ids), loaded.model, max_tokens=max_new_tokens,
                                         prompt_cache=prompt_cache):
        if first_at is None:
            first_at, first = time.perf_counter(), np.array(logprobs.astype(mx.float32))
        new.append(int(token))
        if token in eos:
            break
    end = time.perf_counter()
    return new, (first_at or end) - start, end - start, first


def continue_generation(loaded: MLXModel, cache: KVCache, prompt: str | None = None,
                        max_new_tokens: int = 32, *, input_ids: Any = None, force: bool = False,
                        policy: CodecPolicy | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
                        mirror: bool = False):
    """Restore ``cache`` and greedily continue the cached ids + ``prompt`` (or ``input_ids``).

    Only the tokens after the cached prefix are fed to the model (when the prompt adds none, the
    last cached token is fed again, as the HF engine does). ``policy`` keeps the restored cache
    compressed in :class:`KvtoolMLXCache` layers. Returns the HF engine's
    :class:`~kvtool.engines.common.GenerationResult`; its ``first_logits`` are mlx-lm's
    log-probabilities (numpy float32) of the first new token.
    """
    from kvtool.engines.common import (
        GenerationResult,
        check_compatible,
        full_ids_for,
        holds_every_token,
    )

    check_compatible(cache, loaded, force=force)
    full = full_ids_for(cache, loaded.tokenizer, prompt, input_ids)
    check_within_window(loaded, len(full) + max_new_tokens,
                        "the cached tokens, the prompt and the tokens to generate")
    if len(full) == len(cache.token_ids):  # generation needs one uncached token
        if not holds_every_token(cache):
            raise KvtoolError("the prompt adds no tokens to a sliding-window cache; "
                              "give a prompt to continue from")
        cache = cache.prefix(len(full) - 1)
    start = time.perf_counter()
    from kvtool.engines.vllm.windows import model_windows

    layers = to_prompt_cache(cache, loaded.model, policy, block_size=block_size, mirror=mirror,
                             config_windows=model_windows(loaded.info, cache.num_layers))
    restore = time.perf_counter() - start
    cached = len(cache.token_ids)
    new, ttft, total, first = _greedy(loaded, full[cached:], layers, max_new_tokens, start)
    return GenerationResult(_decode(loaded, new), new, len(full), cached, restore, ttft, total,
                            first)


def recompute_generation(loaded: MLXModel, input_ids: Any = None, max_new_tokens: int = 32, *,
                         prompt: str | None = None, prompt_cache: list[Any] | None = None):
    """Greedy generation from scratch with mlx-lm's own ``KVCache`` (the baseline), or into
    ``prompt_cache`` (fresh :func:`make_kvtool_cache` layers: ``--runtime-codec``)."""
    from kvtool.engines.common import GenerationResult, recompute_ids

    ids = recompute_ids(loaded.tokenizer, input_ids, prompt)
    check_within_window(loaded, len(ids) + max_new_tokens,
                        "the prompt and the tokens to generate")
    start = time.perf_counter()
    layers = prompt_cache if prompt_cache is not None else mlx_cache.make_prompt_cache(
        loaded.model)
    new, ttft, total, first = _greedy(loaded, ids, layers, max_new_tokens, start)
    return GenerationResult(_decode(loaded, new), new, len(ids), 0, 0.0, ttft, total, first)


def _decode(loaded: MLXModel, ids: list[int]) -> str:
    return loaded.tokenizer.decode(ids, skip_special_tokens=True)


def generate_report(loaded: MLXModel, cache_path: str | None, prompt: str, max_new_tokens: int,
                    *, force: bool = False, compare: bool = True,
                    policy: CodecPolicy | None = None,
                    input_ids: list[int] | None = None) -> dict[str, Any]:
    """What ``kvtool generate --engine mlx`` prints (the HF path's report, same keys).
    Without a cache, ``input_ids`` (else ``prompt`` tokenized fresh) is the whole prompt."""
    from kvtool.engines.common import check_compatible, full_ids_for

    report: dict[str, Any] = {"model": loaded.name, "engine": "mlx"}
    if cache_path is None:
        layers = None if policy is None else make_kvtool_cache(loaded.model, policy)
        result = recompute_generation(loaded, input_ids, max_new_tokens, prompt=prompt,
                                      prompt_cache=layers)
        report |= {"text": result.text, "recompute": result.to_json()}
        if layers is not None:  # what the compressed layers held, as the HF engine reports
            report["runtime_codec"] = {
                "tokens": layers[0].offset,
                "encoded_tokens": max((s.stored for c in layers if isinstance(c, KvtoolMLXCache)
                                       for s in c.streams), default=0)}
        return report
    from kvtool.formats import load

    start = time.perf_counter()
    cache = load(cache_path, backend="numpy")
    read_s = time.perf_counter() - start
    report["warnings"] = [f"{p}; restoring anyway (--force)"
                          for p in check_compatible(cache, loaded, force=force)]
    restored = continue_generation(loaded, cache, prompt, max_new_tokens, force=True,
                                   policy=policy)
    report |= {"cache": os.fspath(cache_path), "text": restored.text,
               "read_file_s": round(read_s, 4),
               "restore": restored.to_json() | {"ttft_with_read_s": restored.ttft_s + read_s}}
    if compare:
        baseline = recompute_generation(loaded, full_ids_for(cache, loaded.tokenizer, prompt),
                                        max_new_tokens)
        report["recompute"] = baseline.to_json()
        report["same_text"] = baseline.new_token_ids == restored.new_token_ids
    return report


__all__ = ["MLXModel", "KvtoolMLXCache", "capture", "continue_generation", "export_prompt_cache",
           "generate_report", "import_prompt_cache", "load_mlx", "make_kvtool_cache",
           "prompt_cache_codecs", "recompute_generation", "to_prompt_cache"]
