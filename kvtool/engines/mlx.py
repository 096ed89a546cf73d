"""The mlx-lm engine: capture a prefill's KV cache with mlx-lm and continue from a restored one.

* :func:`load_mlx` loads ``default`` (the converted SmolLM2 directory) or a local HF model
  directory with ``mlx_lm.load`` and casts it to ``dtype``. Its identity is
  :func:`kvtool.identity.model_identity` of the directory's HF config with that dtype, and the
  tokenizer fingerprint of the same HF tokenizer, so a .kvz captured by the HF or vLLM engine
  for the same model (in any dtype: cast, with a logged note) is accepted here, and one
  captured here is accepted there.
* :func:`capture` prefills a prompt and returns a :class:`~kvtool.cache.KVCache` (numpy
  ``[kv_heads, tokens, head_dim]`` in the model's dtype, token ids, identity).
* :func:`to_prompt_cache` rebuilds an mlx-lm prompt cache (``KVCache`` layers, or
  :class:`~kvtool.engines.mlx_cache.KvtoolMLXCache` ones under a policy);
  :func:`continue_generation` feeds only the tokens after the cached prefix to
  ``mlx_lm.generate_step`` and generates greedily; :func:`recompute_generation` is the baseline.
* :func:`import_prompt_cache` / :func:`export_prompt_cache` convert mlx-lm prompt-cache
  ``.safetensors`` files (``save_prompt_cache``) to and from a KVCache.

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

from kvtool.cache import KVCache
from kvtool.engines.mlx_cache import (
    DEFAULT_BLOCK_SIZE,
    KvtoolMLXCache,
    check_layers,
    make_kvtool_cache,
    to_numpy,
)
from kvtool.errors import FormatError, KvtoolError, ModelMismatchError, ModelNotFoundError
from kvtool.policy import CodecPolicy

MX_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
PREFILL_STEP = 2048  # tokens per prefill forward, as mlx_lm.generate_step
METADATA_KEY = "kvtool"  # the user-metadata entry of an exported prompt cache


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
    check_layers(loaded.model)
    layers = mlx_cache.make_prompt_cache(loaded.model)
    for i in range(0, len(ids), PREFILL_STEP):
        # the logits stay unevaluated: only what the cache needs is computed
        loaded.model(mx.array([ids[i:i + PREFILL_STEP]]), cache=layers)
        mx.eval([c.state for c in layers])
    keys = [to_numpy(c.keys[0, :, :c.offset, :]) for c in layers]
    values = [to_numpy(c.values[0, :, :c.offset, :]) for c in layers]
    return KVCache(keys, values, token_ids=np.asarray(ids, dtype=np.int64),
                   model=dict(loaded.info), tokenizer_fingerprint=loaded.fingerprints["tokenizer"])


# -- restore ----------------------------------------------------------------------------------
def _kv_shape(model: Any) -> tuple[int, int] | None:
    """(KV heads, head_dim) of the model's attention, where its modules expose them."""
    attn = getattr(model.layers[0], "self_attn", None) if len(model.layers) else None
    heads, dim = getattr(attn, "n_kv_heads", None), getattr(attn, "head_dim", None)
    return (int(heads), int(dim)) if heads and dim else None


def _to_mx(a: Any, dtype: Any = None) -> mx.array:
    """A KVCache array (numpy or torch) as mx ``[1, heads, tokens, dim]`` (in ``dtype``)."""
    from kvtool.kernels import to_mlx as any_to_mlx

    x = any_to_mlx(a)[None]
    return x if dtype is None or x.dtype == dtype else x.astype(dtype)


def to_prompt_cache(cache: KVCache, model: Any, policy: CodecPolicy | None = None, *,
                    block_size: int = DEFAULT_BLOCK_SIZE, mirror: bool = False) -> list[Any]:
    """An mlx-lm prompt cache holding ``cache`` (batch 1) for ``model``.

    Without ``policy``: plain ``KVCache`` layers; with one: ``KvtoolMLXCache`` layers that
    encode the restored tokens now. Raises :class:`ModelMismatchError` when the cache cannot
    fit the model's layers.
    """
    n = check_layers(model)
    if cache.layer_info and any(cache.layer_info):
        raise KvtoolError("the mlx engine does not support sliding-window caches")
    if cache.num_layers != n:
        raise ModelMismatchError(f"cache has {cache.num_layers} layers, model has {n}")
    want, dtype = _kv_shape(model), model_dtype(model)
    total = len(cache.token_ids) if cache.token_ids is not None else cache.num_tokens
    layers = (make_kvtool_cache(model, policy, block_size=block_size, mirror=mirror)
              if policy is not None else [mlx_cache.KVCache() for _ in range(n)])
    for i, layer in enumerate(layers):
        k, v = (_to_mx(a, dtype) for a in cache.layer(i))
        if want is not None and (k.shape[1], k.shape[3]) != want:
            raise ModelMismatchError(f"layer {i}: cache has {k.shape[1]} KV heads × head_dim "
                                     f"{k.shape[3]}, model has {want[0]} × {want[1]}")
        if k.shape[2] != total:
            raise ModelMismatchError(f"layer {i} holds {k.shape[2]} of {total} tokens")
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
    from kvtool.engines.common import GenerationResult, check_compatible, full_ids_for

    check_compatible(cache, loaded, force=force)
    full = full_ids_for(cache, loaded.tokenizer, prompt, input_ids)
    if len(full) == len(cache.token_ids):  # generation needs one uncached token
        cache = cache.prefix(len(full) - 1)
    start = time.perf_counter()
    layers = to_prompt_cache(cache, loaded.model, policy, block_size=block_size, mirror=mirror)
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
                "encoded_tokens": max((s.stored for c in layers for s in c.streams), default=0)}
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


# -- mlx-lm prompt-cache files ------------------------------------------------------------------
def _read_header(path: str) -> dict[str, str]:
    """The safetensors metadata of ``path``; a FormatError unless it is an mlx-lm prompt cache
    whose layers kvtool can read."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="numpy") as f:
            meta = f.metadata() or {}
    except Exception as e:  # safetensors raises its own error types for a damaged header
        raise FormatError(f"{path}: not an mlx-lm prompt cache (unreadable safetensors: "
                          f"{e})") from None
    classes = [meta[k] for k in sorted((k for k in meta if k.startswith("1.")),
                                       key=lambda k: int(k[2:]) if k[2:].isdigit() else -1)]
    if not classes or meta.get("2.0") != "":
        raise FormatError(f"{path}: not an mlx-lm prompt cache (its metadata names no cache "
                          "classes the way mlx-lm's save_prompt_cache writes them)")
    for i, name in enumerate(classes):
        if name not in ("KVCache", "KvtoolMLXCache"):
            raise FormatError(f"{path}: layer {i} is a {name}; kvtool reads KVCache and "
                              "KvtoolMLXCache layers only")
    return meta


def import_prompt_cache(path: str | os.PathLike) -> KVCache:
    """The KVCache in an mlx-lm prompt-cache file (``mlx_lm``'s ``save_prompt_cache``).

    Model identity, tokenizer fingerprint and token ids come from the ``kvtool`` metadata that
    :func:`export_prompt_cache` writes; a file from mlx-lm itself has none (its ``model``
    metadata becomes the identity's name), so kvtool cannot check what it continues.
    """
    from kvtool.fileio import check_input_file

    path = os.fspath(path)
    check_input_file(path)
    meta = _read_header(path)
    if not path.endswith(".safetensors"):
        raise FormatError(f"{path}: mlx-lm reads prompt caches named *.safetensors only")
    try:
        layers, user = mlx_cache.load_prompt_cache(path, return_metadata=True)
    except KvtoolError:
        raise
    except Exception as e:
        raise FormatError(f"{path}: damaged mlx-lm prompt cache ({type(e).__name__}: "
                          f"{e})") from None
    keys, values = [], []
    for i, layer in enumerate(layers):
        k, v = (layer.materialize() if isinstance(layer, KvtoolMLXCache)
                else (None, None) if layer.empty() else layer.keys_and_values())
        if k is None or k.shape[2] == 0:
            raise FormatError(f"{path}: layer {i} holds no tokens")
        if k.shape[0] != 1:
            raise FormatError(f"{path}: layer {i} holds a batch of {k.shape[0]} (kvtool reads "
                              "batch 1)")
        if k.shape[2] != layer.offset:
            raise FormatError(f"{path}: layer {i} holds {k.shape[2]} tokens, its offset says "
                              f"{layer.offset}")
        keys.append(to_numpy(k[0]))
        values.append(to_numpy(v[0]))
    extra = _kvtool_metadata(path, user or {}, meta)
    try:
        cache = KVCache(keys, values, **extra)
    except ValueError as e:
        raise FormatError(f"{path}: {e}") from None
    model = cache.model or {}
    from kvtool.identity import canonical_sha256, valid_weights

    if isinstance(model.get("layout"), dict) and "fingerprint" in model:
        if canonical_sha256(model["layout"]) != model["fingerprint"]:
            raise FormatError(f"{path}: its model fingerprint does not match its layout")
    if not valid_weights(model.get("weights")):
        raise FormatError(f"{path}: its model.weights is not a sha256 hex digest")
    if cache.token_ids is not None and len(cache.token_ids) != cache.num_tokens:
        raise FormatError(f"{path}: {len(cache.token_ids)} token ids for {cache.num_tokens} "
                          "cached tokens")
    return cache


def prompt_cache_codecs(path: str | os.PathLike) -> list[str]:
    """The codec ids that the ``KvtoolMLXCache`` layers of an mlx-lm prompt-cache file hold
    (sorted; ``KVCache`` layers and lossless roles hold none): what ``compress --from mlx``
    would quantize a second time. Read from each layer's config array, nothing decoded."""
    from safetensors import safe_open

    from kvtool.engines.mlx_cache import CONFIG_KEY, _read_config

    path = os.fspath(path)
    meta = _read_header(path)
    layers = [int(k[2:]) for k, v in meta.items()
              if k.startswith("1.") and k[2:].isdigit() and v == "KvtoolMLXCache"]
    ids: set[str] = set()
    try:
        with safe_open(path, framework="numpy") as f:
            for i in layers:
                config = _read_config({CONFIG_KEY: f.get_tensor(f"{i}.{CONFIG_KEY}")})
                ids.update(str(c["id"]) for c in (config.get("key"), config.get("value"))
                           if isinstance(c, dict) and "id" in c)
    except KvtoolError:
        raise
    except Exception as e:  # a missing config tensor, a damaged file
        raise FormatError(f"{path}: damaged mlx-lm prompt cache ({type(e).__name__}: "
                          f"{e})") from None
    return sorted(ids)


def _kvtool_metadata(path: str, user: dict[str, Any], meta: dict[str, str]) -> dict[str, Any]:
    """KVCache fields from an exported file's ``kvtool`` metadata entry."""
    text = user.get(METADATA_KEY)
    if text is None:
        name = user.get("model")
        return {"model": {"name": name} if name else {}}
    try:
        data = json.loads(text)
        return {"model": dict(data["model"]), "token_ids": data.get("token_ids"),
                "tokenizer_fingerprint": data.get("tokenizer_fingerprint")}
    except (TypeError, ValueError, KeyError) as e:
        raise FormatError(f"{path}: unreadable kvtool metadata ({e})") from None


def export_prompt_cache(cache: KVCache, path: str | os.PathLike, *,
                        policy: CodecPolicy | None = None,
                        block_size: int = DEFAULT_BLOCK_SIZE) -> dict[str, Any]:
    """Write ``cache`` as an mlx-lm prompt-cache file (atomically: temp file, then rename).

    Layers are ``KVCache`` (stock mlx-lm loads them); with ``policy``, ``KvtoolMLXCache`` layers
    holding the codes (loading needs kvtool imported). The identity, tokenizer fingerprint and
    token ids go into the ``kvtool`` metadata entry (``model`` holds the model's name, as
    ``mlx_lm.cache_prompt`` writes). Returns a short report.
    """
    from kvtool.fileio import atomic_write

    if not os.fspath(path).endswith(".safetensors"):
        raise KvtoolError(f"{os.fspath(path)}: name an mlx-lm prompt cache *.safetensors "
                          "(mlx-lm picks the file format by that extension)")
    if cache.layer_info and any(cache.layer_info):
        raise KvtoolError("mlx-lm prompt caches of sliding-window layers are not supported")
    n, total = cache.num_layers, cache.num_tokens
    if policy is not None:
        layers: list[Any] = [KvtoolMLXCache.for_layer(policy, i, n, block_size=block_size)
                             for i in range(n)]
    else:
        layers = [mlx_cache.KVCache() for _ in range(n)]
    for i, layer in enumerate(layers):
        k, v = (_to_mx(a) for a in cache.layer(i))
        if k.shape[2] != total:
            raise KvtoolError(f"layer {i} holds {k.shape[2]} of {total} tokens")
        if policy is None:
            layer.state = (k, v, total)  # exactly the tokens (update_and_fetch pads to 256)
        else:
            layer.update_and_fetch(k, v)
    data = {"model": cache.model or {}, "tokenizer_fingerprint": cache.tokenizer_fingerprint,
            "token_ids": None if cache.token_ids is None else [int(t) for t in cache.token_ids]}
    # "model" and "tokenizer_config" as mlx_lm.cache_prompt writes them (mlx_lm.generate
    # --prompt-cache-file reads both)
    metadata = {METADATA_KEY: json.dumps(data, sort_keys=True),
                "model": str((cache.model or {}).get("name", "")), "tokenizer_config": "{}"}

    def write(f: Any) -> int:
        mlx_cache.save_prompt_cache(f, layers, metadata)
        return f.tell()

    file_bytes = atomic_write(path, write)
    return {"path": os.fspath(path), "file_bytes": file_bytes, "num_layers": n,
            "num_tokens": total, "format": "mlx-lm prompt cache",
            "policy": policy.describe() if policy is not None else "KVCache (lossless)"}


__all__ = ["MLXModel", "KvtoolMLXCache", "capture", "continue_generation", "export_prompt_cache",
           "generate_report", "import_prompt_cache", "load_mlx", "make_kvtool_cache",
           "prompt_cache_codecs", "recompute_generation", "to_prompt_cache"]
