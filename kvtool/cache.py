"""KVCache: the engine-neutral container every part of kvtool speaks.

Per layer, keys and values are arrays ``[kv_heads, tokens, head_dim]`` (numpy or torch) of one
sequence. Alongside them: the token ids the cache was computed for, the identity of the model
(``model``: a JSON-safe dict with at least a ``fingerprint`` of the fields that decide KV layout)
and a fingerprint of the tokenizer, so a reload can refuse a foreign cache; and the lossy steps its
K/V went through (``lossy_sources``), so that a decoded lossy cache never passes for exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvtool.kernels import Array, ops_for, to_numpy, to_torch


def check_prefix(layer: int, stored: int, num_tokens: int, tokens: int | None) -> None:
    """ValueError if a prefix of ``tokens`` cannot be cut from a layer holding ``stored`` of
    ``num_tokens`` tokens: a sliding-window layer keeps the last ones, so its first stored
    tokens are not the prefix's (taking them would label later positions as earlier ones)."""
    if tokens is not None and tokens < num_tokens and stored < num_tokens:
        raise ValueError(f"layer {layer} keeps only the last {stored} of {num_tokens} tokens "
                         f"(a sliding window): a prefix of {tokens} tokens cannot be cut from it")


def has_sliding_layers(layer_info: Sequence[Any] | None) -> bool:
    """Whether ``layer_info`` names a sliding window for any layer (``{}`` and
    ``{"sliding_window": None}`` are full attention)."""
    return any(isinstance(info, dict) and info.get("sliding_window") is not None
               for info in layer_info or ())


def layer_windows(layer_info: Sequence[Any] | None, num_layers: int) -> list[int | None]:
    """Per layer, the sliding window ``layer_info`` names (None: full attention)."""
    return [(info or {}).get("sliding_window") for info in layer_info or [None] * num_layers]


def windows_layer_info(windows: Sequence[int | None]) -> list[dict[str, Any]] | None:
    """``layer_info`` naming ``windows`` per layer; None where every layer is full attention."""
    info = [{"sliding_window": int(w)} if w is not None else {} for w in windows]
    return info if any(info) else None


def every_layer_slides(layer_info: Sequence[Any] | None, num_layers: int) -> bool:
    """Whether ``layer_info`` names a sliding window (an integer ≥ 1) for each of
    ``num_layers`` layers (Mistral-7B-v0.1, Phi-3-mini-4k): then no layer holds every token,
    and the token ids count the sequence."""
    infos = list(layer_info) if layer_info is not None else []
    return num_layers > 0 and len(infos) == num_layers and all(
        isinstance(info, dict) and isinstance(w := info.get("sliding_window"), int)
        and not isinstance(w, bool) and w >= 1 for info in infos)


def holds(stored: str, computed: str) -> bool:
    """Whether ``stored`` keeps every ``computed`` value exactly (float32 holds all three)."""
    return stored in (computed, "float32")


def cast_label(computed: str | None, stored: str | None) -> str | None:
    """The lossy source ``"float32->bfloat16"`` of K/V computed in ``computed`` and stored in
    ``stored``; None when that keeps every value (or either is unknown)."""
    if computed is None or stored is None or holds(stored, computed):
        return None
    return f"{computed}->{stored}"


def is_cast(source: str) -> bool:
    """Whether a lossy source is a dtype cast (:func:`cast_label`), not a codec."""
    return source.count("->") == 1 and all(
        d in ("float32", "float16", "bfloat16") for d in source.split("->"))


def merge_sources(*groups: Iterable[str | None]) -> list[str]:
    """Lossy sources, sorted and distinct (Nones dropped)."""
    return sorted({s for group in groups for s in group if s is not None})


@dataclass
class KVCache:
    keys: list[Array]
    values: list[Array]
    token_ids: np.ndarray | None = None
    model: dict[str, Any] = field(default_factory=dict)
    tokenizer_fingerprint: str | None = None
    layer_info: list[dict[str, Any]] | None = None  # e.g. {"sliding_window": 512} per layer
    # codec ids and dtype casts ("float32->bfloat16") its K/V went through: not exact
    lossy_sources: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.keys, self.values = list(self.keys), list(self.values)
        if len(self.keys) != len(self.values):
            raise ValueError(f"{len(self.keys)} key layers but {len(self.values)} value layers")
        for i, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            if k.ndim != 3 or v.ndim != 3:
                raise ValueError(f"layer {i}: keys/values must be [kv_heads, tokens, head_dim]")
            if k.shape[:2] != v.shape[:2]:
                raise ValueError(f"layer {i}: keys {tuple(k.shape)} and values "
                                 f"{tuple(v.shape)} disagree on heads or tokens")
        if self.token_ids is not None:
            ids = np.asarray(self.token_ids)
            if ids.size and (ids.dtype.kind not in "iu" or ids.max() > np.iinfo(np.int64).max):
                raise ValueError(f"token_ids must be integers within int64, got {ids.dtype}")
            self.token_ids = ids.astype(np.int64).reshape(-1)
        if self.layer_info is not None and (len(self.layer_info) != len(self.keys) or not all(
                info is None or isinstance(info, dict) for info in self.layer_info)):
            raise ValueError("layer_info must hold one dict (or None) per layer")
        if isinstance(self.lossy_sources, str) or not isinstance(self.lossy_sources, Iterable) \
                or not all(isinstance(x, str) and x for x in self.lossy_sources):
            raise ValueError("lossy_sources must be a list of non-empty strings")
        self.lossy_sources = merge_sources(self.lossy_sources)

    # -- shape ---------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        """Tokens of the longest layer (sliding-window layers may hold fewer); where every
        layer slides, the sequence's, which its token ids count."""
        longest = max((int(k.shape[1]) for k in self.keys), default=0)
        if self.token_ids is not None and len(self.token_ids) > longest \
                and every_layer_slides(self.layer_info, self.num_layers):
            return len(self.token_ids)
        return longest

    @property
    def dtype(self) -> str:
        return ops_for(self.keys[0]).dtype_name(self.keys[0]) if self.keys else "float32"

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (*self.keys, *self.values))

    def layer(self, i: int) -> tuple[Array, Array]:
        return self.keys[i], self.values[i]

    # -- conversions ---------------------------------------------------------------------------
    def map_arrays(self, fn) -> KVCache:
        """A copy with ``fn`` applied to every key and value array."""
        return replace(self, keys=[fn(k) for k in self.keys], values=[fn(v) for v in self.values])

    def to_numpy(self) -> KVCache:
        return self.map_arrays(to_numpy)

    def to_torch(self, device: Any = None) -> KVCache:
        return self.map_arrays(lambda a: to_torch(a, device))

    def astype(self, dtype: str) -> KVCache:
        """A copy in ``dtype``; ValueError where a value does not fit (fp16: ±65504). A cast
        that loses precision is added to ``lossy_sources``."""
        from kvtool.identity import identity_dtype

        if dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")
        out = self.map_arrays(lambda a: ops_for(a).astype(a, dtype))
        if self.keys:
            computed = identity_dtype(self.model) or self.dtype
            out.lossy_sources = merge_sources(self.lossy_sources, [
                cast_label(computed, self.dtype), cast_label(computed, dtype)])
        if dtype == "float16":  # bf16 and fp32 reach 3.4e38: the cast would make inf
            for i, (src, dst) in enumerate(zip((*self.keys, *self.values),
                                               (*out.keys, *out.values), strict=True)):
                xp = ops_for(dst)
                if xp.dtype_name(src) != "float16" and not xp.all_finite(dst):
                    raise ValueError(f"layer {i % self.num_layers} holds values past float16's "
                                     "65504 (or not finite): keep it as bfloat16 or float32")
        return out

    def prefix(self, tokens: int) -> KVCache:
        """The cache of the first ``tokens`` tokens (full-attention layers)."""
        if isinstance(tokens, bool) or not hasattr(tokens, "__index__"):
            raise TypeError(f"prefix takes an integer number of tokens, got {tokens!r}")
        tokens = tokens.__index__()
        if not 0 <= tokens <= self.num_tokens:
            raise ValueError(f"prefix of {tokens} tokens from a cache of {self.num_tokens}")
        for i, k in enumerate(self.keys):
            check_prefix(i, int(k.shape[1]), self.num_tokens, tokens)
        ids = None if self.token_ids is None else self.token_ids[:tokens]
        return replace(self, keys=[k[:, :tokens] for k in self.keys],
                       values=[v[:, :tokens] for v in self.values], token_ids=ids)

    def to_hf(self, **kwargs: Any):
        """A transformers ``DynamicCache`` that ``model.generate`` continues from."""
        from kvtool.engines.hf import to_dynamic_cache

        return to_dynamic_cache(self, **kwargs)

    @classmethod
    def from_layers(cls, layers: Sequence[tuple[Array, Array]], **kwargs: Any) -> KVCache:
        return cls([k for k, _ in layers], [v for _, v in layers], **kwargs)

