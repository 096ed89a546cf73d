"""mlx-lm prompt-cache files (``mlx_lm``'s ``save_prompt_cache``) to and from a KVCache.

:func:`export_prompt_cache` writes ``KVCache`` layers (stock mlx-lm loads them) or
:class:`~kvtool.engines.mlx_cache.KvtoolMLXCache` ones holding codes (a sliding-window layer:
mlx-lm's ``RotatingKVCache`` ring of the window's last tokens, either way), with kvtool's identity,
tokenizer fingerprint, token ids and lossy sources in a ``kvtool`` metadata entry, and the
``model`` and ``tokenizer_config`` entries ``mlx_lm.generate --prompt-cache-file`` reads
(:func:`mlx_model`: what it loads the model from). :func:`import_prompt_cache` reads either
kind back, refusing what no writer makes.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
from mlx_lm.models import cache as mlx_cache

from kvtool.cache import KVCache, layer_windows, merge_sources, windows_layer_info
from kvtool.codecs.params import is_digits
from kvtool.engines.common import check_window
from kvtool.engines.mlx_cache import (
    DEFAULT_BLOCK_SIZE,
    KvtoolMLXCache,
    fill_ring,
    ring_problem,
    ring_tokens,
    to_numpy,
)
from kvtool.errors import FormatError, KvtoolError
from kvtool.formats.constants import H_LOSSY_SOURCES
from kvtool.formats.header import check_lossy_sources, token_layout_problem
from kvtool.policy import CodecPolicy

METADATA_KEY = "kvtool"  # the user-metadata entry of an exported prompt cache


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
                                       key=lambda k: int(k[2:]) if is_digits(k[2:]) else -1)]
    if not classes or meta.get("2.0") != "":
        raise FormatError(f"{path}: not an mlx-lm prompt cache (its metadata names no cache "
                          "classes the way mlx-lm's save_prompt_cache writes them)")
    for i, name in enumerate(classes):
        if name not in ("KVCache", "KvtoolMLXCache", "RotatingKVCache"):
            raise FormatError(f"{path}: layer {i} is a {name}; kvtool reads KVCache, "
                              "RotatingKVCache and KvtoolMLXCache layers only")
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
    keys, values, windows = [], [], []
    offsets = [getattr(layer, "offset", None) for layer in layers]
    if any(type(o) is not int for o in offsets) or len(set(offsets)) != 1:
        raise FormatError(f"{path}: its layers hold {sorted(set(map(str, offsets)))[:4]} tokens,"
                          " not one count")
    for i, layer in enumerate(layers):
        k, v = _layer_tokens(path, i, layer)
        if k.shape[0] != 1:
            raise FormatError(f"{path}: layer {i} holds a batch of {k.shape[0]} (kvtool reads "
                              "batch 1)")
        keys.append(to_numpy(k[0]))
        values.append(to_numpy(v[0]))
        windows.append(int(layer.max_size) if type(layer) is mlx_cache.RotatingKVCache else None)
    _check_arrays(path, keys, values)
    extra = _kvtool_metadata(path, user or {}, meta)
    if any(windows):
        extra["layer_info"] = windows_layer_info(windows)
    if any(isinstance(layer, KvtoolMLXCache) for layer in layers):  # decoded codes: lossy
        extra["lossy_sources"] = merge_sources(extra.get("lossy_sources", []), [
            c for c in prompt_cache_codecs(path) if c != "raw"])
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
    ids = cache.token_ids
    if ids is not None and len(ids) and int(np.min(ids)) < 0:
        raise FormatError(f"{path}: token id {int(np.min(ids))} is negative")
    problem = token_layout_problem([int(k.shape[1]) for k in keys], cache.num_tokens,
                                   None if ids is None else len(ids), cache.layer_info)
    if problem:
        raise FormatError(f"{path}: {problem}")
    if (len(ids) if ids is not None else cache.num_tokens) != offsets[0]:
        raise FormatError(f"{path}: its layers hold {offsets[0]} tokens, but "
                          + (f"it names {len(ids)} token ids" if ids is not None else
                             "every layer's ring slid past its window and no token ids say "
                             "how many came before"))
    return cache


def _layer_tokens(path: str, i: int, layer: Any) -> tuple[Any, Any]:
    """A layer's keys and values ``[B, heads, tokens, dim]`` in position order (a ring's:
    the last tokens of its window); a FormatError for one that holds none or not its offset's."""
    if type(layer) is mlx_cache.RotatingKVCache:
        problem = ring_problem(layer, None, layer.offset)
        if problem:
            raise FormatError(f"{path}: layer {i}: a sliding-window layer with {problem}")
        k, v = ring_tokens(layer)
    else:
        k, v = (layer.materialize() if isinstance(layer, KvtoolMLXCache)
                else (None, None) if layer.empty() else layer.keys_and_values())
        if k is not None and k.shape[2] != layer.offset:
            raise FormatError(f"{path}: layer {i} holds {k.shape[2]} tokens, its offset says "
                              f"{layer.offset}")
    if k is None or k.shape[2] == 0:
        raise FormatError(f"{path}: layer {i} holds no tokens")
    return k, v


def _check_arrays(path: str, keys: list[np.ndarray], values: list[np.ndarray]) -> None:
    """K/V as mlx-lm writes them: one dtype for every layer and role (a tensor relabelled to
    another reads as garbage), every value finite."""
    dtypes = sorted({str(a.dtype) for a in (*keys, *values)})
    if len(dtypes) > 1:
        raise FormatError(f"{path}: its layers hold K/V of several dtypes ({', '.join(dtypes)}),"
                          " which mlx-lm never writes")
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        if not (np.isfinite(k).all() and np.isfinite(v).all()):
            raise FormatError(f"{path}: layer {i} holds NaN or Inf")


def prompt_cache_codecs(path: str | os.PathLike) -> list[str]:
    """The codec ids that the ``KvtoolMLXCache`` layers of an mlx-lm prompt-cache file hold
    (sorted; ``KVCache`` layers and lossless roles hold none): what ``compress --from mlx``
    would quantize a second time. Read from each layer's config array, nothing decoded."""
    from safetensors import safe_open

    from kvtool.engines.mlx_cache import CONFIG_KEY, _read_config

    path = os.fspath(path)
    meta = _read_header(path)
    layers = [int(k[2:]) for k, v in meta.items()
              if k.startswith("1.") and is_digits(k[2:]) and v == "KvtoolMLXCache"]
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
        out = {"model": dict(data["model"]), "token_ids": data.get("token_ids"),
               "tokenizer_fingerprint": data.get("tokenizer_fingerprint")}
    except (TypeError, ValueError, KeyError) as e:
        raise FormatError(f"{path}: unreadable kvtool metadata ({e})") from None
    from kvtool.identity import dtype_problem

    problem = dtype_problem(out["model"])  # what a writer of .kvz files would refuse later
    fingerprint = out["tokenizer_fingerprint"]
    if problem or not isinstance(fingerprint, str | None):
        raise FormatError(f"{path}: kvtool metadata: " + (
            f"model info: {problem}" if problem else
            f"tokenizer_fingerprint must be a string, not {type(fingerprint).__name__}"))
    if H_LOSSY_SOURCES in data:  # as in a .kvz header
        check_lossy_sources(data[H_LOSSY_SOURCES], f"{path}: kvtool metadata")
        out["lossy_sources"] = data[H_LOSSY_SOURCES]
    return out


def mlx_model(cache: KVCache, model: str | None = None) -> str:
    """What ``mlx_lm.generate --prompt-cache-file`` loads the model from: the file's ``model``
    entry, which a ``--model`` given there must also equal. ``model`` (a directory, a Hub id
    or ``default``), refused unless ``cache`` is of it, as the Hub id or the directory's path;
    without it, the embedded default model's directory for a cache of that model (where it is
    converted already), else the cache's model name (a Hub id where kvtool loaded one). A
    cache that names no model is checked by its shape."""
    from pathlib import Path

    from transformers import AutoConfig

    from kvtool.checkpoint import weights_fingerprint
    from kvtool.errors import ModelMismatchError
    from kvtool.identity import kv_layout, model_identity, other_weights, same_model
    from kvtool.models import DEFAULT_MODEL_NAME, HUB_ID, converted_default, resolve_model

    name = str((cache.model or {}).get("name", ""))
    if model is None:
        location = converted_default() if name == DEFAULT_MODEL_NAME else None
        if location is None:
            return name
    else:
        _, location = resolve_model(model)
        if not location.is_dir():
            raise KvtoolError(f"--model {model}: mlx-lm loads a model directory or a Hub id, "
                              f"not {location}")
    config = AutoConfig.from_pretrained(location, local_files_only=True)
    identity = model_identity(config, weights=weights_fingerprint(location))
    layout = kv_layout(config)
    k = cache.keys[0]
    shape = (cache.num_layers, int(k.shape[0]), int(k.shape[-1]))
    if (cache.model or {}).get("fingerprint"):
        other = not same_model(cache.model, identity)
    else:  # a cache that names no model: its shape at least
        other = shape != (layout["num_layers"], layout["num_kv_heads"], layout["head_dim"])
    if other:
        if model is None:
            return name
        why = other_weights(cache.model or {}, identity) or (
            f" ({shape[0]} layers of {shape[1]} KV heads × {shape[2]}, the model "
            f"{layout['num_layers']} of {layout['num_kv_heads']} × {layout['head_dim']})")
        raise ModelMismatchError(f"--model {model}: the cache belongs to another model{why}")
    hub = model is not None and HUB_ID.match(model) and not Path(model).expanduser().exists()
    return model if hub else str(location)



def export_prompt_cache(cache: KVCache, path: str | os.PathLike, *,
                        policy: CodecPolicy | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
                        model: str | None = None) -> dict[str, Any]:
    """Write ``cache`` as an mlx-lm prompt-cache file (atomically: temp file, then rename).

    Layers are ``KVCache`` (stock mlx-lm loads them); with ``policy``, ``KvtoolMLXCache`` layers
    holding the codes (loading needs kvtool imported). The identity, tokenizer fingerprint and
    token ids go into the ``kvtool`` metadata entry; where mlx-lm loads the model from (see
    :func:`mlx_model`, of ``model``) into mlx-lm's own ``model`` entry, as
    ``mlx_lm.cache_prompt`` writes its ``--model``. Returns a short report.
    """
    from kvtool.fileio import atomic_write
    from kvtool.kernels import to_mlx

    if not os.fspath(path).endswith(".safetensors"):
        raise KvtoolError(f"{os.fspath(path)}: name an mlx-lm prompt cache *.safetensors "
                          "(mlx-lm picks the file format by that extension)")
    loads_from = mlx_model(cache, model)
    n = cache.num_layers
    total = len(cache.token_ids) if cache.token_ids is not None else cache.num_tokens
    windows = layer_windows(cache.layer_info, n)
    layers: list[Any] = [
        mlx_cache.RotatingKVCache(max_size=w) if w is not None  # as the model's make_cache
        else KvtoolMLXCache.for_layer(policy, i, n, block_size=block_size) if policy is not None
        else mlx_cache.KVCache() for i, w in enumerate(windows)]
    for i, (layer, window) in enumerate(zip(layers, windows, strict=True)):
        k, v = (to_mlx(a)[None] for a in cache.layer(i))
        if window is not None:
            check_window(i, int(k.shape[2]), total, window)
            fill_ring(layer, k, v, total)
        elif k.shape[2] != total:
            raise KvtoolError(f"layer {i} holds {k.shape[2]} of {total} tokens")
        elif policy is None:
            layer.state = (k, v, total)  # exactly the tokens (update_and_fetch pads to 256)
        else:
            layer.update_and_fetch(k, v)
    data = {"model": cache.model or {}, "tokenizer_fingerprint": cache.tokenizer_fingerprint,
            "token_ids": None if cache.token_ids is None else [int(t) for t in cache.token_ids]}
    if cache.lossy_sources:  # decoded from a lossy file: an import says so again
        data[H_LOSSY_SOURCES] = cache.lossy_sources
    # "model" and "tokenizer_config" as mlx_lm.cache_prompt writes them (mlx_lm.generate
    # --prompt-cache-file reads both)
    metadata = {METADATA_KEY: json.dumps(data, sort_keys=True),
                "model": loads_from, "tokenizer_config": "{}"}

    def write(f: Any) -> int:
        mlx_cache.save_prompt_cache(f, layers, metadata)
        return f.tell()

    file_bytes = atomic_write(path, write)
    return {"path": os.fspath(path), "file_bytes": file_bytes, "num_layers": n,
            "model": metadata["model"],
            "num_tokens": total, "format": "mlx-lm prompt cache",
            "policy": policy.describe() if policy is not None else "KVCache (lossless)"}
