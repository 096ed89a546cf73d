"""An mlx-lm prompt-cache layer that keeps K/V compressed by a :class:`~kvtool.policy.CodecPolicy`.

:class:`KvtoolMLXCache` is the mlx-lm counterpart of
:class:`kvtool.engines.hf_runtime.CompressedCache`: one object per model layer (what
``make_prompt_cache`` returns), each holding keys and values as

``[ sinks (exact) | encoded blocks (policy codec) | recent window (exact) ]``

New tokens land in the window; once it holds ``recent_tokens + block_size`` tokens or more, its
oldest whole blocks are encoded (one ``encode`` call) and joined to the encoded store. Keys and
values share one stacked stream when they share a codec (one encode/decode call per layer).
Protected layers, and a lossless policy, hold a plain mlx-lm ``KVCache`` (bit-identical output).
Tokens of the current forward are returned exactly; they are compressed for later steps.
A sliding-window layer (Gemma 3's local layers) stays mlx-lm's own exact ``RotatingKVCache``
(:func:`make_kvtool_cache`): it holds at most its window and a prefill step whatever the
context, so the full-attention layers hold what grows (unlike the HF ``CompressedCache``, which
encodes sliding layers too).

Codecs run on numpy (mx arrays go through ``np.array`` and back through ``mx.array``): the
numba kernels decode a layer's store in milliseconds, where mlx's reference BLAS on Linux runs
the turbo rotation several times slower than numpy (see :mod:`kvtool.kernels.mlx_ops`).

Decode-on-fetch (default) vs a decoded mirror (``mirror=True``). Measured on this project's
2-core Linux CPU (``mlx[cpu]``, reference BLAS) with SmolLM2-135M in float32 (30 layers, 3 KV
heads × 64), turbo4 keys and values, ``recent_tokens=64``, a restored context of random K/V,
median of 8 decode steps (noisy: the machine was shared):

=========  ===========================  ===========================  ===========================
context    mlx-lm KVCache               decode-on-fetch              mirror
=========  ===========================  ===========================  ===========================
512        0.22 s/token, 33.8 MiB       0.31 s/token, 5.8 MiB        0.26 s/token, 39.6 MiB
2048       0.29 s/token, 101 MiB        0.49 s/token, 14.8 MiB       0.31 s/token, 116 MiB
4096       0.43 s/token, 191 MiB        0.72 s/token, 26.7 MiB       0.32 s/token, 218 MiB
=========  ===========================  ===========================  ===========================

Decode-on-fetch decodes every layer's store at every step (one numba decode per layer, then a
copy into mx and a concatenation), so a step costs ~1.4-1.7x ``KVCache``'s, growing with the
context; its resident memory is the codes plus the exact sinks/window (~7x less than
``KVCache`` here). The mirror keeps a ``KVCache``-style buffer of every token's decoded (or
exact) states, written once when a block is encoded: ``KVCache``'s speed, but *more* memory
than ``KVCache`` (buffer + codes). Memory is the reason to use this class, so decode-on-fetch is
the default; the mirror is for when speed matters more (its ``state`` still saves only the
codes, so saved files stay small).

Attention from codes (what the HF cache does on CPU) is not done here: mlx-lm models call
``mx.fast.scaled_dot_product_attention`` on what ``update_and_fetch`` returns, so reading codes
would need a numpy round trip inside mlx-lm's attention for every layer and step.

Saving: ``state`` holds only mx arrays (the layer's config is a uint8 JSON array inside it), so
mlx-lm's ``save_prompt_cache``/``load_prompt_cache`` round-trip it, as do older mlx-lm versions
that also pass ``meta_state``. Importing this module registers the class in
``mlx_lm.models.cache`` (``load_prompt_cache`` resolves class names there).
"""

from __future__ import annotations

import json
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_cache

from kvtool.codecs import Codec, get_codec
from kvtool.codecs.params import is_digits
from kvtool.engines.mlx_stream import Stream, cat_tokens
from kvtool.errors import FormatError, KvtoolError
from kvtool.kernels.mlx_ops import dtype_name, to_numpy
from kvtool.kernels.mlx_ops import from_numpy as to_mlx
from kvtool.policy import CodecPolicy

DEFAULT_BLOCK_SIZE = 64
STATE_VERSION = 1
CONFIG_KEY = "kvtool"


def _put(buffer: mx.array, x: mx.array, start: int) -> mx.array:
    """``buffer`` with tokens ``start...`` replaced by ``x``, as a new array: mlx-lm's
    ``KVCache`` hands out its buffer itself when it is full, and an in-place write would
    change K/V the current forward already holds (its own tokens, exact) to decoded ones."""
    return mx.slice_update(buffer, x.astype(buffer.dtype), mx.array([start]),
                           axes=(buffer.ndim - 2,))


# -- the cache layer ---------------------------------------------------------------------------
class KvtoolMLXCache(mlx_cache._BaseCache):
    """One layer of an mlx-lm prompt cache, K/V compressed by kvtool codecs (module docstring).

    ``key_codec``/``value_codec`` None means lossless (both None: a plain ``KVCache`` inside).
    Build a whole prompt cache with :func:`make_kvtool_cache`; pass it as ``prompt_cache=`` to
    ``mlx_lm.generate``/``stream_generate``. ``mirror=True`` keeps a decoded copy for speed.
    Batched generation (``BatchGenerator``) merges layers into a
    :class:`~kvtool.engines.mlx_batch.KvtoolBatchCache`; ``to_quantized`` is not supported.
    """

    def __init__(self, key_codec: Codec | None = None, value_codec: Codec | None = None,
                 sink_tokens: int = 0, recent_tokens: int = 0,
                 block_size: int = DEFAULT_BLOCK_SIZE, mirror: bool = False):
        self._configure({
            "key": None if key_codec is None else key_codec.get_config(),
            "value": None if value_codec is None else value_codec.get_config(),
            "sink_tokens": sink_tokens, "recent_tokens": recent_tokens,
            "block_size": block_size, "mirror": mirror})

    @classmethod
    def for_layer(cls, policy: CodecPolicy, layer: int, num_layers: int,
                  **kwargs: Any) -> KvtoolMLXCache:
        """The layer ``layer`` of ``num_layers`` under ``policy`` (protected layers lossless)."""
        policy.check_runtime()
        policy = policy.resolve()  # sink=auto (no cache to count on): every scanned token exact
        key, value = (policy.codec_for(role, layer, num_layers) for role in ("key", "value"))
        return cls(None if key == policy.lossless else key,
                   None if value == policy.lossless else value,
                   policy.sink_tokens, policy.recent_tokens, **kwargs)

    def _configure(self, config: dict[str, Any]) -> None:
        block = int(config["block_size"])
        if block < 1:
            raise KvtoolError(f"block_size must be >= 1, got {block}")
        self.key_codec = None if config["key"] is None else get_codec(config["key"])
        self.value_codec = None if config["value"] is None else get_codec(config["value"])
        self.sink_tokens, self.recent_tokens = int(config["sink_tokens"]), \
            int(config["recent_tokens"])
        self.block_size, self.mirror = block, bool(config["mirror"])
        self.offset = 0
        lossless = self.key_codec is None and self.value_codec is None
        self._plain = mlx_cache.KVCache() if lossless else None
        self.joint = not lossless and self.key_codec == self.value_codec
        codecs = [] if lossless else ([self.key_codec] if self.joint
                                      else [self.key_codec, self.value_codec])
        self.streams = [Stream(c, self.sink_tokens, self.recent_tokens, block) for c in codecs]
        self._decoded = mlx_cache.KVCache() if self.mirror and not lossless else None

    def _config(self) -> dict[str, Any]:
        return {"version": STATE_VERSION,
                "key": None if self.key_codec is None else self.key_codec.get_config(),
                "value": None if self.value_codec is None else self.value_codec.get_config(),
                "sink_tokens": self.sink_tokens, "recent_tokens": self.recent_tokens,
                "block_size": self.block_size, "mirror": self.mirror}

    # -- the mlx-lm protocol -------------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append this forward's K/V ``[B, heads, new, dim]``; return every token's states."""
        self.offset += keys.shape[2]
        if self._plain is not None:
            return self._plain.update_and_fetch(keys, values)
        if self._decoded is not None:
            out = self._decoded.update_and_fetch(keys, values)
        else:
            held = self._held()
            out = (cat_tokens([held[0], keys]), cat_tokens([held[1], values]))
        self._append(keys, values)
        return out

    def _held(self) -> tuple[mx.array | None, mx.array | None]:
        """Keys and values held so far (the store decoded)."""
        if self.joint:
            full = self.streams[0].full()
            return (None, None) if full is None else (full[0], full[1])
        return self.streams[0].full(), self.streams[1].full()

    def _append(self, keys: mx.array, values: mx.array) -> None:
        if self.joint:
            done = [(self.streams[0].append(mx.stack([keys, values])), None)]
        else:
            done = [(s.append(x), i) for i, (s, x) in enumerate(zip(self.streams,
                                                                   (keys, values), strict=True))]
        for stream, (flushed, role) in zip(self.streams, done, strict=True):
            if flushed is None or self._decoded is None:
                continue
            start, enc = flushed
            x = stream.decode(enc)
            if role is None or role == 0:
                self._decoded.keys = _put(self._decoded.keys, x[0] if role is None else x, start)
            if role is None or role == 1:
                self._decoded.values = _put(self._decoded.values, x[1] if role is None else x,
                                            start)

    def materialize(self) -> tuple[mx.array | None, mx.array | None]:
        """Every cached token's keys and values ``[B, heads, tokens, dim]`` as attention sees
        them (decoded)."""
        if self._plain is not None:
            return (None, None) if self._plain.empty() else self._plain.keys_and_values()
        if self._decoded is not None:
            return (None, None) if self._decoded.empty() else self._decoded.keys_and_values()
        return self._held()

    def layout_problem(self, kv: tuple[int, int, str]) -> str | None:
        """Why this layer's tokens are not batch 1 of the model's (KV heads, head_dim, dtype
        name) ``kv``, or None (a crafted state of other heads would attend silently wrong)."""
        want = {((1, kv[0]), kv[1], kv[2])}
        if self._plain is not None:
            if self._plain.empty():
                return None
            k, v = self._plain.keys_and_values()
            got = {(tuple(a.shape[:2]), int(a.shape[3]), dtype_name(a))
                   for a in (k, v)}
        else:
            got = set().union(*(s.layout() for s in self.streams))
            if self.joint:
                got = {(lead[1:] if lead[:1] == (2,) else lead, d, t) for lead, d, t in got}
        if got - want:
            (lead, dim, dtype), *_ = sorted(got - want)
            return (f"tokens of batch × heads {list(lead)} × head_dim {dim} ({dtype}), the "
                    f"model's are [1, {kv[0]}] × {kv[1]} ({kv[2]})")
        return None

    make_mask = mlx_cache.KVCache.make_mask  # the same mask rules as a plain KVCache

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        if self._plain is not None:
            self._plain.trim(n)
        else:
            for s in self.streams:
                s.trim(n)
            if self._decoded is not None:
                self._decoded.trim(n)
        self.offset -= n
        return n

    @property
    def nbytes(self) -> int:
        """Resident bytes: codes, exact sinks/windows, and the mirror or plain buffer."""
        buffers = sum(c.nbytes for c in (self._plain, self._decoded) if c is not None)
        return buffers + sum(s.nbytes() for s in self.streams)

    @classmethod
    def merge(cls, caches: Any) -> Any:
        """mlx-lm's batched generation: one batch cache of these layers
        (:class:`~kvtool.engines.mlx_batch.KvtoolBatchCache`)."""
        from kvtool.engines.mlx_batch import KvtoolBatchCache

        return KvtoolBatchCache.merge(caches)

    # -- state: arrays only, the config as a uint8 JSON array ----------------------------------
    @property
    def state(self) -> dict[str, Any]:
        config = self._config() | {"offset": self.offset, "streams": []}
        out: dict[str, Any] = {}
        if self._plain is not None and not self._plain.empty():
            out["plain"] = list(self._plain.keys_and_values())
        for i, s in enumerate(self.streams):
            arrays, meta = s.state()
            config["streams"].append(meta)
            if arrays:
                out[f"s{i}"] = arrays
        blob = np.frombuffer(json.dumps(config, sort_keys=True).encode(), dtype=np.uint8)
        return {CONFIG_KEY: mx.array(blob), **out}

    @state.setter
    def state(self, v: Any) -> None:
        config = _read_config(v)
        self._configure(config)
        offset = int(config["offset"])
        if self._plain is not None:
            if any(k.startswith("s") and is_digits(k[1:]) for k in v) or (
                    offset and "plain" not in v):
                raise FormatError("KvtoolMLXCache state: a lossless layer (no codecs) holds "
                                  "encoded streams, or not its plain K/V")
            if offset:
                keys, values = v["plain"]
                if keys.ndim != 4 or keys.shape[2] != offset or values.shape[:3] != keys.shape[:3]:
                    raise FormatError(f"KvtoolMLXCache state: plain keys {tuple(keys.shape)} and "
                                      f"values {tuple(values.shape)} do not hold its offset of "
                                      f"{offset} tokens")
                self._plain.state = (keys, values, offset)
        else:
            metas = config.get("streams") or []
            if len(metas) != len(self.streams):
                raise FormatError(f"KvtoolMLXCache state: {len(metas)} streams, expected "
                                  f"{len(self.streams)}")
            for i, (s, meta) in enumerate(zip(self.streams, metas, strict=True)):
                s.load(v.get(f"s{i}") or {}, meta)
                if s.num_tokens != offset:
                    raise FormatError(f"KvtoolMLXCache state: stream {i} holds {s.num_tokens} "
                                      f"tokens, its offset says {offset}")
        self.offset = offset
        if self._decoded is not None and offset:
            keys, values = self._held()
            self._decoded.state = (keys, values, offset)

    @property
    def meta_state(self) -> tuple[str, ...]:
        """For mlx-lm versions that save ``meta_state`` strings: the layer's config (``state``
        carries it as well, so newer versions need nothing else)."""
        return (json.dumps(self._config(), sort_keys=True),)

    @meta_state.setter
    def meta_state(self, v: Any) -> None:
        text = v[0] if isinstance(v, (list, tuple)) and v else v
        try:
            config = json.loads(text) if text else None
        except (TypeError, ValueError):
            config = None
        if not isinstance(config, dict) or config.get("version") != STATE_VERSION:
            raise FormatError("KvtoolMLXCache: meta_state is not a kvtool cache config "
                              f"(version {STATE_VERSION})")

    @classmethod
    def from_state(cls, state: Any, meta_state: Any = None) -> KvtoolMLXCache:
        """A layer from ``state`` (and, from older mlx-lm, ``meta_state``)."""
        obj = cls.__new__(cls)
        obj.state = state
        if meta_state:
            obj.meta_state = meta_state
        return obj


def _read_config(v: Any) -> dict[str, Any]:
    """The config JSON inside a state dict (a FormatError when it is not one of ours)."""
    if not isinstance(v, dict) or CONFIG_KEY not in v:
        raise FormatError("not a KvtoolMLXCache state (no kvtool config array)")
    try:
        config = json.loads(np.array(v[CONFIG_KEY]).astype(np.uint8).tobytes().decode())
    except (ValueError, UnicodeDecodeError) as e:
        raise FormatError(f"KvtoolMLXCache state: unreadable config ({e})") from None
    if not isinstance(config, dict) or config.get("version") != STATE_VERSION:
        raise FormatError(f"KvtoolMLXCache state: config version {config.get('version')!r} "
                          f"is not {STATE_VERSION}" if isinstance(config, dict)
                          else "KvtoolMLXCache state: the config is not an object")
    return config


def sliding_windows(model: Any) -> list[int | None]:
    """Per layer: the window of an mlx-lm ``RotatingKVCache`` layer (Gemma 3's local layers),
    None for a full-attention ``KVCache``; a :class:`KvtoolError` for other cache layers."""
    if not hasattr(model, "make_cache"):
        return [None] * len(model.layers)
    windows: list[int | None] = []
    for layer in model.make_cache():
        if type(layer) is mlx_cache.KVCache:
            windows.append(None)
        elif type(layer) is mlx_cache.RotatingKVCache and layer.keep == 0:
            windows.append(int(layer.max_size))
        else:
            raise KvtoolError("kvtool's mlx engine supports KVCache and sliding-window "
                              f"RotatingKVCache layers; this model's cache uses "
                              f"{type(layer).__name__}")
    return windows


def ignored_window(model_windows: list[int | None], windows: list[int | None]) -> int | None:
    """The smallest of the model's sliding windows (``model_windows``, from its config) in a
    layer that mlx-lm computes with full attention (``windows``: :func:`sliding_windows`;
    mlx-lm's llama, mistral and phi3 ignore ``sliding_window``), else None. Up to that many
    tokens full attention is the window's; past it mlx-lm's K/V are not the model's."""
    ignored = [w for w, o in zip(model_windows, windows, strict=True)
               if w is not None and o is None]
    return min(ignored) if ignored else None


def kv_shape(model: Any) -> tuple[int, int] | None:
    """(KV heads, head_dim) of the model's attention, where its modules expose them."""
    attn = getattr(model.layers[0], "self_attn", None) if len(model.layers) else None
    heads, dim = getattr(attn, "n_kv_heads", None), getattr(attn, "head_dim", None)
    return (int(heads), int(dim)) if heads and dim else None


def ring_tokens(layer: Any) -> tuple[mx.array, mx.array]:
    """A ``RotatingKVCache``'s keys and values ``[B, heads, tokens, dim]`` in position order:
    the last ``max_size - 1`` tokens (all the next token attends to, as transformers keeps
    them), or every token before the window fills."""
    size, idx = int(layer.keys.shape[2]), layer._idx
    kept = min(layer.offset, layer.max_size - 1)

    def ordered(a: mx.array) -> mx.array:
        if idx < size and idx < layer.offset:  # a ring that has wrapped: oldest from idx
            a = mx.concatenate([a[..., idx:, :], a[..., :idx, :]], axis=2)
        else:
            a = a[..., :idx, :]
        return a[..., a.shape[2] - kept:, :]

    return ordered(layer.keys), ordered(layer.values)


def fill_ring(layer: Any, keys: mx.array, values: mx.array, total: int) -> None:
    """Fill an empty ``RotatingKVCache`` with the last tokens ``[B, heads, tokens, dim]`` of a
    ``total``-token sequence as its own prefill leaves it: a ring of ``max_size`` slots, the
    next one free, ``offset`` total (the caller checks they are the window's last tokens)."""
    window = int(layer.max_size)
    if total < window - 1:  # nothing slid yet
        layer.update_and_fetch(keys, values)
        return
    keys, values = (a[:, :, a.shape[2] - (window - 1):] for a in (keys, values))
    free = mx.zeros((*keys.shape[:2], 1, keys.shape[3]), keys.dtype)
    layer.state = (mx.concatenate([keys, free], axis=2), mx.concatenate([values, free], axis=2),
                   total, 0, window, window - 1)


def ring_problem(layer: Any, window: int | None, tokens: int,
                 kv: tuple[int, int, str] | None = None) -> str | None:
    """Why ``layer`` (a ``RotatingKVCache`` read from a file) is not a ring that mlx-lm leaves
    in a sliding-window layer of ``window`` (None: not known) after ``tokens`` tokens, or None.
    ``kv``: the model's (KV heads, head_dim, dtype name), where known. A ring past its window
    is either ``max_size`` slots, the oldest at the ring index (an in-place step's), or more,
    in order (a prefill's); another layout, a ring holding too few of its window's tokens, or
    another window, would attend to the wrong tokens (or fail at the next step)."""
    keys, values = layer.keys, layer.values
    if not (isinstance(keys, mx.array) and isinstance(values, mx.array) and keys.ndim == 4
            and values.ndim == 4 and values.shape[:3] == keys.shape[:3]
            and keys.dtype == values.dtype and keys.shape[0] == 1):
        return "keys and values that are not [1, heads, tokens, dim] of one length and dtype"
    dtype = dtype_name(keys)
    if kv is not None and (keys.shape[1], keys.shape[3], values.shape[3], dtype) != (
            kv[0], kv[1], kv[1], kv[2]):
        return (f"{keys.shape[1]} KV heads × head_dim {keys.shape[3]} ({dtype}), the "
                f"model's are {kv[0]} × {kv[1]} ({kv[2]})")
    numbers = (layer.offset, layer.keep, layer.max_size, layer._idx)
    if any(type(n) is not int for n in numbers):
        return f"offset, keep, window and ring index {numbers} that are not all integers"
    size, (offset, keep, window_held, idx) = int(keys.shape[2]), numbers
    if keep != 0:
        return f"keep {keep} (mlx-lm's sliding-window layers keep 0)"
    if window_held < 2 or window not in (None, window_held):
        return f"a window of {window_held}" + ("" if window is None else
                                                f"; the model's is {window}")
    if offset != tokens:
        return f"offset {offset} for {tokens} tokens"
    if offset < window_held:
        sound = idx == offset <= size <= window_held
    else:
        sound = (size == window_held and 0 <= idx <= size) or (
            window_held < size <= offset and idx == size)
    return None if sound else f"ring index {idx} of {size} slots for {offset} tokens"


def make_kvtool_cache(model: Any, policy: CodecPolicy, *, block_size: int = DEFAULT_BLOCK_SIZE,
                      mirror: bool = False) -> list[Any]:
    """A compressed prompt cache for ``model``: a :class:`KvtoolMLXCache` per full-attention
    layer and, per sliding-window layer (Gemma 3's local layers), mlx-lm's own exact
    ``RotatingKVCache`` of the model's window, which never holds more than that window
    (and the last prefill step), whatever the context::

        cache = make_kvtool_cache(model, CodecPolicy.from_options("turbo4", recent_tokens=64))
        mlx_lm.generate(model, tokenizer, prompt, prompt_cache=cache)
    """
    windows = sliding_windows(model)
    n = len(windows)
    return [mlx_cache.RotatingKVCache(max_size=w) if w is not None else
            KvtoolMLXCache.for_layer(policy, i, n, block_size=block_size, mirror=mirror)
            for i, w in enumerate(windows)]


mlx_cache.KvtoolMLXCache = KvtoolMLXCache  # load_prompt_cache resolves classes by name there

__all__ = ["DEFAULT_BLOCK_SIZE", "KvtoolMLXCache", "fill_ring", "kv_shape", "make_kvtool_cache",
           "ring_problem", "ring_tokens", "sliding_windows", "to_mlx", "to_numpy"]
