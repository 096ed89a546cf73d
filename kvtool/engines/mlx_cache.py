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

from kvtool.codecs import Codec, Encoded, get_codec
from kvtool.errors import FormatError, KvtoolError
from kvtool.kernels.mlx_ops import from_numpy as to_mlx
from kvtool.kernels.mlx_ops import to_numpy
from kvtool.policy import CodecPolicy

DEFAULT_BLOCK_SIZE = 64
STATE_VERSION = 1
CONFIG_KEY = "kvtool"
_VIEW = {1: np.uint8, 2: np.uint16, 4: np.uint32}


# -- numpy <-> mlx ----------------------------------------------------------------------------
def _np_dtype(name: str) -> np.dtype:
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)


def _raw_to_mlx(a: np.ndarray) -> mx.array:
    """``a``'s bits as an mx array (bf16/float8 as unsigned ints: mx cannot hold every dtype)."""
    a = np.ascontiguousarray(a)
    if a.dtype.kind == "V" or a.dtype.name in ("bfloat16",) or a.dtype.name.startswith("float8"):
        a = a.view(_VIEW[a.dtype.itemsize])
    return mx.array(a)


# -- encoded chunks ----------------------------------------------------------------------------
def _blocked(enc: Encoded, axis: int) -> bool:
    """Whether every array of ``enc`` has its ``axis`` (the block axis) of ``enc.shape``."""
    n = enc.shape[axis]
    return all(a.ndim > axis and a.shape[:axis + 1] == enc.shape[:axis] + (n,)
               for a in enc.arrays.values())


def _join(a: Encoded, b: Encoded, axis: int) -> Encoded | None:
    """``a`` and ``b`` joined along the block ``axis``, or None when their layouts differ."""
    if a.arrays.keys() != b.arrays.keys() or a.dtype != b.dtype \
            or a.shape[axis + 1:] != b.shape[axis + 1:] \
            or not (_blocked(a, axis) and _blocked(b, axis)):
        return None
    if any(x.shape[axis + 1:] != b.arrays[k].shape[axis + 1:] for k, x in a.arrays.items()):
        return None
    arrays = {k: np.concatenate([x, b.arrays[k]], axis=axis) for k, x in a.arrays.items()}
    return Encoded(arrays, (*a.shape[:axis], a.shape[axis] + b.shape[axis], *a.shape[axis + 1:]),
                   a.dtype)


def _blocks(enc: Encoded, axis: int, start: int, stop: int) -> Encoded:
    """Blocks ``[start, stop)`` of ``enc``."""
    if not _blocked(enc, axis):
        raise KvtoolError("this codec's encoded arrays have no block axis, so KvtoolMLXCache "
                          "cannot trim into its encoded tokens")
    index = (slice(None),) * axis + (slice(start, stop),)
    arrays = {k: np.ascontiguousarray(a[index]) for k, a in enc.arrays.items()}
    return Encoded(arrays, (*enc.shape[:axis], stop - start, *enc.shape[axis + 1:]), enc.dtype)


def _put(buffer: mx.array, x: mx.array, start: int) -> mx.array:
    """``buffer`` with tokens ``start...`` replaced by ``x``, as a new array: mlx-lm's
    ``KVCache`` hands out its buffer itself when it is full, and an in-place write would
    change K/V the current forward already holds (its own tokens, exact) to decoded ones."""
    return mx.slice_update(buffer, x.astype(buffer.dtype), mx.array([start]),
                           axes=(buffer.ndim - 2,))


def _cat(parts: list[mx.array]) -> mx.array | None:
    parts = [p for p in parts if p is not None and p.shape[-2]]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-2)


class _Stream:
    """Sinks, encoded chunks and recent window of one layer's keys, values, or both stacked.

    mx arrays are ``[*lead, tokens, dim]`` with ``lead`` = (batch, heads), or (2, batch, heads)
    when keys and values share the stream; each chunk encodes ``[*lead, n_blocks, block, dim]``
    (numpy arrays). ``codec`` None: lossless, every token stays in the window.
    """

    def __init__(self, codec: Codec | None, sink_tokens: int, recent_tokens: int, block: int):
        self.codec, self.sink_tokens = codec, sink_tokens if codec is not None else 0
        self.recent_tokens, self.block = recent_tokens, block
        self.sink: mx.array | None = None
        self.chunks: list[Encoded] = []
        self.stored = 0  # tokens in ``chunks``
        self.tail: mx.array | None = None

    @property
    def num_tokens(self) -> int:
        return sum(0 if p is None else p.shape[-2] for p in (self.sink, self.tail)) + self.stored

    def nbytes(self) -> int:
        exact = sum(p.nbytes for p in (self.sink, self.tail) if p is not None)
        return exact + sum(c.nbytes for c in self.chunks)

    def decode(self, enc: Encoded) -> mx.array:
        """``enc`` as ``[*lead, tokens, dim]`` (its original dtype)."""
        x = self.codec.decode(enc)
        return to_mlx(x.reshape(*x.shape[:-3], -1, x.shape[-1]))

    def full(self) -> mx.array | None:
        """Every token's states: sinks, the store decoded, the window."""
        return _cat([self.sink, *(self.decode(c) for c in self.chunks), self.tail])

    def append(self, x: mx.array) -> tuple[int, Encoded] | None:
        """Add ``x`` after the held tokens; return ``(first token, encoding)`` of newly encoded
        blocks, if any."""
        have = 0 if self.sink is None else self.sink.shape[-2]
        take = min(self.sink_tokens - have, x.shape[-2])
        if take > 0:  # the sinks fill first (nothing else is held until they are full)
            self.sink = _cat([self.sink, x[..., :take, :]])
            x = x[..., take:, :]
        if not x.shape[-2]:
            return None
        self.tail = _cat([self.tail, x])
        return self._flush()

    def _flush(self) -> tuple[int, Encoded] | None:
        """Encode the window's oldest whole blocks beyond ``recent_tokens``."""
        if self.codec is None:
            return None
        n_blocks = (self.tail.shape[-2] - self.recent_tokens) // self.block
        if n_blocks <= 0:
            return None
        cut, lead = n_blocks * self.block, tuple(self.tail.shape[:-2])
        x = to_numpy(self.tail[..., :cut, :]).reshape(*lead, n_blocks, self.block, -1)
        enc = self.codec.encode(x)
        # a copy: a slice could keep the whole buffer it came from (e.g. a prefill's) alive
        self.tail = mx.contiguous(self.tail[..., cut:, :]) if self.tail.shape[-2] > cut else None
        start = (0 if self.sink is None else self.sink.shape[-2]) + self.stored
        joined = _join(self.chunks[-1], enc, len(lead)) if self.chunks else None
        if joined is not None:
            self.chunks[-1] = joined
        else:
            self.chunks.append(enc)
        self.stored += cut
        return start, enc

    def trim(self, n: int) -> None:
        """Drop the last ``n`` tokens. Cutting into the store keeps the cut block's first tokens
        in the window, decoded (they are encoded again when the window flushes)."""
        held = 0 if self.tail is None else self.tail.shape[-2]
        k = min(n, held)
        if k:
            self.tail = self.tail[..., :held - k, :] if held > k else None
            n -= k
        if n and self.stored:
            keep = max(self.stored - n, 0)
            n -= self.stored - keep
            whole, rest = divmod(keep, self.block)
            axis = len(self.chunks[0].shape) - 3
            chunks, seen, partial = [], 0, None
            for enc in self.chunks:
                count = enc.shape[axis]
                if seen + count <= whole:
                    chunks.append(enc)
                else:
                    if whole > seen:
                        chunks.append(_blocks(enc, axis, 0, whole - seen))
                    if rest and partial is None:
                        block = self.decode(_blocks(enc, axis, whole - seen, whole - seen + 1))
                        partial = block[..., :rest, :]
                    break
                seen += count
            self.chunks, self.stored, self.tail = chunks, whole * self.block, partial
        if n and self.sink is not None:
            left = self.sink.shape[-2] - min(n, self.sink.shape[-2])
            self.sink = self.sink[..., :left, :] if left else None

    # -- state ---------------------------------------------------------------------------------
    def state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(mx arrays, JSON meta) of this stream."""
        arrays: dict[str, Any] = {}
        if self.sink is not None:
            arrays["sink"] = self.sink
        if self.tail is not None:
            arrays["tail"] = self.tail
        if self.chunks:
            arrays["chunks"] = [{k: _raw_to_mlx(a) for k, a in c.arrays.items()}
                                for c in self.chunks]
        meta = {"stored": self.stored,
                "chunks": [{"shape": list(c.shape), "dtype": c.dtype,
                            "arrays": {k: a.dtype.name for k, a in c.arrays.items()}}
                           for c in self.chunks]}
        return arrays, meta

    def load(self, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
        self.sink, self.tail = arrays.get("sink"), arrays.get("tail")
        chunks = arrays.get("chunks") or []
        if len(chunks) != len(meta["chunks"]):
            raise FormatError(f"KvtoolMLXCache state: {len(chunks)} encoded chunks, its config "
                              f"describes {len(meta['chunks'])}")
        self.chunks = []
        for got, want in zip(chunks, meta["chunks"], strict=True):
            if set(got) != set(want["arrays"]):
                raise FormatError("KvtoolMLXCache state: an encoded chunk's arrays do not match "
                                  "its config")
            arrays_np = {k: np.array(got[k]).view(_np_dtype(d)) for k, d in want["arrays"].items()}
            self.chunks.append(Encoded(arrays_np, tuple(want["shape"]), want["dtype"]))
        self.stored = int(meta["stored"])
        self._check_loaded()

    def _check_loaded(self) -> None:
        """A FormatError unless the loaded stream is one :meth:`append`, :meth:`_flush` and
        :meth:`trim` could have left: whole blocks of ``block`` tokens (``stored`` of them) in
        the codec's own arrays, sinks filled before anything else, a window shorter than
        ``recent_tokens`` + one block, and one shape of heads and dim throughout (a crafted
        state would otherwise decode into the wrong tokens or positions)."""
        def bad(why: str) -> FormatError:
            return FormatError(f"KvtoolMLXCache state: {why}")

        exact = [p for p in (self.sink, self.tail) if p is not None]
        if self.codec is None and self.chunks:
            raise bad("encoded chunks in a lossless stream")
        lead = {(tuple(p.shape[:-2]), p.shape[-1]) for p in exact}
        blocks = 0
        for enc in self.chunks:
            shape = tuple(int(n) for n in enc.shape)
            if len(shape) < 3 or shape[-2] != self.block:
                raise bad(f"an encoded chunk of shape {list(shape)} is not whole blocks of "
                          f"{self.block} tokens")
            lead.add((shape[:-3], shape[-1]))
            blocks += shape[-3]
            try:
                self.codec.check_encoded(enc)
            except KvtoolError as e:
                raise bad(str(e)[:200]) from None
        if len(lead) > 1 or len({p.dtype for p in exact}) > 1:
            raise bad("its sinks, chunks and window differ in heads, dim or dtype")
        if self.stored != blocks * self.block:
            raise bad(f"stored says {self.stored} tokens, its chunks hold {blocks * self.block}")
        sink = 0 if self.sink is None else self.sink.shape[-2]
        if sink > self.sink_tokens or (sink < self.sink_tokens and (self.chunks or self.tail
                                                                      is not None)):
            raise bad(f"{sink} sink tokens of {self.sink_tokens} with tokens held after them")
        tail = 0 if self.tail is None else self.tail.shape[-2]
        if self.codec is not None and tail >= self.recent_tokens + self.block:
            raise bad(f"a window of {tail} tokens, which would have been encoded")


# -- the cache layer ---------------------------------------------------------------------------
class KvtoolMLXCache(mlx_cache._BaseCache):
    """One layer of an mlx-lm prompt cache, K/V compressed by kvtool codecs (module docstring).

    ``key_codec``/``value_codec`` None means lossless (both None: a plain ``KVCache`` inside).
    Build a whole prompt cache with :func:`make_kvtool_cache`; pass it as ``prompt_cache=`` to
    ``mlx_lm.generate``/``stream_generate``. ``mirror=True`` keeps a decoded copy for speed.
    Batch merging (``BatchGenerator``) and ``to_quantized`` are not supported.
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
        self.streams = [_Stream(c, self.sink_tokens, self.recent_tokens, block) for c in codecs]
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
            out = (_cat([held[0], keys]), _cat([held[1], values]))
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
        raise KvtoolError("KvtoolMLXCache does not support batched generation (merge)")

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
            if any(k.startswith("s") and k[1:].isdigit() for k in v) or (
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


def check_layers(model: Any) -> int:
    """The model's layer count; a KvtoolError unless every layer is a full-attention KVCache."""
    if hasattr(model, "make_cache"):
        kinds = sorted({type(c).__name__ for c in model.make_cache()})
        if kinds != ["KVCache"]:
            raise KvtoolError(f"kvtool's mlx engine supports full-attention KVCache layers only; "
                              f"this model's cache uses {', '.join(kinds)}")
    return len(model.layers)


def make_kvtool_cache(model: Any, policy: CodecPolicy, *, block_size: int = DEFAULT_BLOCK_SIZE,
                      mirror: bool = False) -> list[KvtoolMLXCache]:
    """A compressed prompt cache for ``model`` (one :class:`KvtoolMLXCache` per layer)::

        cache = make_kvtool_cache(model, CodecPolicy.from_options("turbo4", recent_tokens=64))
        mlx_lm.generate(model, tokenizer, prompt, prompt_cache=cache)
    """
    n = check_layers(model)
    return [KvtoolMLXCache.for_layer(policy, i, n, block_size=block_size, mirror=mirror)
            for i in range(n)]


mlx_cache.KvtoolMLXCache = KvtoolMLXCache  # load_prompt_cache resolves classes by name there

__all__ = ["DEFAULT_BLOCK_SIZE", "KvtoolMLXCache", "make_kvtool_cache", "to_mlx", "to_numpy"]
