"""One layer of a :class:`~kvtool.engines.hf_runtime.CompressedCache`: exact sinks, encoded
blocks and an exact recent window of its keys and values (the layout, the attention from codes
and the trade-offs are in :mod:`kvtool.engines.hf_runtime`'s docstring)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from kvtool.codecs import Codec
from kvtool.engines.hf_attention import (
    ATTR,
    CodesTag,
    CodesView,
    codes_codec,
    device_codes,
    device_path,
    scalar_codes,
)
from kvtool.engines.hf_stream import _Stream
from kvtool.errors import KvtoolError

DEFAULT_BLOCK_SIZE = 64


def _at(encoded: tuple[Any, ...], field: int, index: int) -> Any:
    """``encoded[field][index]``: a stream's array of keys or values (None: absent)."""
    arrays = encoded[field]
    return None if arrays is None else arrays[index]


class CompressedLayer(DynamicLayer):
    """One layer of a :class:`CompressedCache` (``key_codec``/``value_codec`` None: lossless).

    When both roles use the same (lossy) codec, keys and values live stacked in one stream, so
    each step decodes the layer in one call; otherwise each role has its own stream.
    ``update(..., from_codes=True)`` (what :class:`CompressedCache` asks for when attention can
    read codes) returns only the exact tokens, the key tagged with a
    :class:`~kvtool.engines.hf_attention.CodesTag` of the encoded ones.
    """

    #: transformers' "a crop leaves no trace" (read by its deferred stop on MPS): a crop into
    #: encoded blocks re-encodes what it keeps of the last one, so not here
    is_croppable = False

    def __init__(self, key_codec: Codec | None, value_codec: Codec | None, sink_tokens: int = 0,
                 recent_tokens: int = 0, block_size: int = DEFAULT_BLOCK_SIZE,
                 sliding_window: int | None = None):
        super().__init__()
        if block_size < 1:
            raise KvtoolError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 2:
            raise KvtoolError(f"sliding_window must be >= 2, got {sliding_window}")
        self.joint = key_codec is not None and key_codec == value_codec
        codecs = [key_codec] if self.joint else [key_codec, value_codec]
        #: a sliding-window layer (Gemma 3 style) keeps no sinks: the window never sees them
        self.sliding_window, self.is_sliding = sliding_window, sliding_window is not None
        sinks = 0 if self.is_sliding else sink_tokens
        self.streams = [_Stream(c, sinks, recent_tokens, block_size, self.is_sliding)
                        for c in codecs]
        self.block_size = block_size
        self.cumulative_length = 0
        self.dropped = 0  # the oldest tokens a sliding layer has let go of
        #: set by transformers' assisted decoding (``activate_past_recording``) before steps it
        #: may undo: a sliding layer then lets go of tokens at the next crop, not at updates
        self.record_past = False
        #: whether attention may read this layer's codes (see ``codes_codec``; a sliding
        #: window's mask hides encoded tokens, which the kernel does not do)
        self.codes_capable = codes_codec(key_codec, "key") and codes_codec(value_codec) \
            and not self.is_sliding
        for stream in self.streams:  # the kernel of every turbomix option reads both roles
            stream.parts = self.codes_capable and not (
                scalar_codes(key_codec, "key") and scalar_codes(value_codec))
        self.codecs = (key_codec, value_codec)
        self._device_dims: dict[int, bool] = {}  # head_dim -> whether the Triton kernels read it
        self._pending: CodesTag | None = None
        #: the view of the store as the streams last returned it (until the store changes)
        self._view: tuple[Any, Any, CodesView] | None = None
        self._refused: str | None = None  # why an update failed: the layer takes no more
        #: (batch, kv_heads), key and value head_dim of the first update: later ones match
        self._held_shapes: tuple[tuple[int, ...], int, int] | None = None

    @property
    def k(self) -> _Stream:
        """The stream holding the keys (shared with the values when ``joint``)."""
        return self.streams[0]

    @property
    def v(self) -> _Stream:
        return self.streams[-1]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        if self.joint and key_states.shape[-1] != value_states.shape[-1]:
            # one stream stacks keys on values: of two head_dims they need a stream each
            self.joint = False
            self.streams = [self.streams[0], copy.deepcopy(self.streams[0])]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               from_codes: bool = False, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this forward's K/V; return what attention should see (see the class doc)."""
        self._check_states(key_states, value_states)  # before: a refused call changes nothing
        with self._unless_refused():
            return self._update(key_states, value_states, from_codes)

    def _check_states(self, key_states: Any, value_states: Any) -> None:
        """Refuse states that cannot extend this layer, by name: not 4-D torch tensors
        (batch, kv heads, tokens, head_dim), keys and values of other batch, heads, tokens,
        dtype or device, or another batch, heads or head_dim than the layer holds."""
        for name, x in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(x, torch.Tensor) or x.dim() != 4:
                what = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise KvtoolError(f"CompressedCache.update: {name} must be a 4-D tensor "
                                  f"(batch, kv_heads, tokens, head_dim), got {what}")
        k, v = key_states, value_states
        if k.shape[:-1] != v.shape[:-1] or k.dtype != v.dtype or k.device != v.device:
            raise KvtoolError(f"CompressedCache.update: keys {tuple(k.shape)} {k.dtype} on "
                              f"{k.device} and values {tuple(v.shape)} {v.dtype} on "
                              f"{v.device} differ in batch, heads, tokens, dtype or device")
        held = self._held_shapes
        if held is None:
            self._held_shapes = (tuple(k.shape[:2]), k.shape[-1], v.shape[-1])
        elif held != (tuple(k.shape[:2]), k.shape[-1], v.shape[-1]):
            raise KvtoolError(f"CompressedCache.update: this layer holds batch x kv_heads "
                              f"{held[0]}, head_dims {held[1]}/{held[2]}; got keys "
                              f"{tuple(k.shape)} and values {tuple(v.shape)}")

    @contextlib.contextmanager
    def _unless_refused(self):
        """Refuse to change a layer whose update (or crop) failed part-way, and mark it so when
        the change inside fails: what it holds may no longer match the sequence."""
        if self._refused is not None:
            raise KvtoolError(f"this CompressedCache layer refused an earlier update "
                              f"({self._refused}); what it holds no longer matches the "
                              "sequence: start a new cache")
        try:
            yield
        except Exception as e:
            self._refused = f"{type(e).__name__}: {str(e)[:120]}"
            raise

    def _update(self, key_states: torch.Tensor, value_states: torch.Tensor,
                from_codes: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._pending is not None and not self._pending.consumed:
            raise KvtoolError("the last attention call of this CompressedCache layer did not "
                              "read its encoded tokens (the model's attention function is not "
                              "kvtool's); use CompressedCache(..., attention_from_codes=False)")
        self._pending = None
        dim = key_states.shape[-1]
        on_device = device_path(key_states.device)  # the Triton kernel reads the codes
        from_codes = from_codes and self.codes_capable and value_states.shape[-1] == dim and (
            self._reads_on_device(dim) if on_device else
            key_states.device.type == "cpu" and dim >= 8 and dim & (dim - 1) == 0)
        self.cumulative_length += key_states.shape[-2]
        if self.joint:
            out, enc = self.streams[0].update(torch.stack([key_states, value_states]),
                                              from_codes, on_device)
            keys, values = out.unbind(0)
            encs = [(enc, 0), (enc, 1)]
        else:
            (keys, kenc), (values, venc) = (s.update(x, from_codes, on_device) for s, x in
                                            zip(self.streams, (key_states, value_states),
                                                strict=True))
            encs = [(kenc, None), (venc, None)]
        if encs[0][0] is not None and encs[1][0] is not None:
            (ke, ki), (ve, vi) = encs
            memo = self._view
            if memo is not None and memo[0] is ke and memo[1] is ve:
                view = memo[2]
            else:
                view = self._make_view(ke, ki, ve, vi, key_states.shape[0], on_device)
                self._view = (ke, ve, view)
            keys = keys.view_as(keys)  # a fresh alias: the tag must not stick to the window
            self._pending = tag = CodesTag(view)
            setattr(keys, ATTR, tag)
        if self.is_sliding and not self.record_past:
            self._slide()
        if self.streams[0].changed() or self.streams[-1].changed():  # the view must not pin
            self._view = None  # chunks an encode has replaced
        return keys, values

    def _make_view(self, ke: tuple[Any, ...], ki: int | None, ve: tuple[Any, ...],
                   vi: int | None, batch: int, on_device: bool) -> CodesView:
        """The :class:`CodesView` of the streams' ``encoded`` (index ``ki``/``vi`` in keys and
        values stacked in one stream, else None)."""
        k, v = ki or 0, vi or 0
        return CodesView(codecs=(self.k.codec, self.v.codec),
                         codes=(_at(ke, 0, k), _at(ve, 0, v)),
                         norms=(_at(ke, 1, k), _at(ve, 1, v)),
                         chunks=((ke[5], ki), (ve[5], vi)), sinks=ke[6], batch=batch,
                         rotations=(_at(ke, 2, k), _at(ve, 2, v))
                         if on_device or ke[2] is not None else None,
                         key_means=_at(ke, 3, k), block=self.block_size,
                         roles=None if ke[4] is None else (ke[4][k], ve[4][v]),
                         on_device=on_device)

    def _reads_on_device(self, dim: int) -> bool:
        """:func:`~kvtool.engines.hf_attention.device_codes` of this layer's codecs, kept."""
        hit = self._device_dims.get(dim)
        if hit is None:
            hit = self._device_dims[dim] = device_codes(*self.codecs, dim)
        return hit

    def _slide(self) -> None:
        """Drop what the next query cannot see (older than ``sliding_window - 1`` tokens back), in
        whole blocks counted from the first token held, so every sliding layer of a cache —
        lossless or encoded — holds the same tokens and one mask fits them all."""
        excess = self.cumulative_length - (self.sliding_window - 1) - self.dropped
        drop = excess // self.block_size * self.block_size
        if drop > 0:
            for s in self.streams:
                s.drop_front(drop)
            self.dropped += drop

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset): the tokens held plus the query's, after those dropped."""
        return self.cumulative_length - self.dropped + query_length, self.dropped

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def nbytes(self) -> tuple[int, int]:
        """(encoded bytes, full-precision bytes) held by this layer."""
        parts = [s.nbytes() for s in self.streams]
        return sum(e for e, _ in parts), sum(f for _, f in parts)

    def materialize(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Every cached token's keys and values as the model would see them (decoded)."""
        if self.joint:
            full = self.streams[0].full()
            return (None, None) if full is None else (full[0], full[1])
        return self.streams[0].full(), self.streams[1].full()

    def reset(self) -> None:
        for s in self.streams:
            s.reset()
        self.cumulative_length = self.dropped = 0
        self._pending = self._view = self._refused = None  # empty again: it may take updates
        self._held_shapes = None
        self.is_initialized = False

    def activate_past_recording(self) -> None:
        """Keep what a sliding layer would let go of until the next :meth:`crop`, so a crop
        of the steps since then always leaves the window whole (transformers' assisted
        decoding calls it through ``Cache.activate_past_recording``)."""
        self.record_past = True

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the newest ``-tokens_to_remove`` tokens (a positive value: keep that many),
        as assisted and prompt-lookup decoding do with rejected draft tokens. A crop into
        encoded blocks decodes the kept part of the last one back into the window (it is
        encoded again when the window flushes): a ``recent_tokens`` window at least as long as
        the drafts keeps every crop in the window, exact. A sliding layer then lets go of what
        the next query cannot see, as after an update."""
        n = self._to_crop(tokens_to_remove)
        if not n and not (self.is_sliding and self.record_past and self.is_initialized):
            return
        with self._unless_refused():
            for stream in self.streams if n else ():
                stream.crop_back(n)  # waits for the encodes' checks: one may fail here
            self.cumulative_length -= n
            self._view = None  # (the pending tag stays: the next update checks it was read)
            if self.is_sliding:
                self._slide()

    def _to_crop(self, tokens_to_remove: int) -> int:
        """How many tokens ``crop(tokens_to_remove)`` removes; a sliding layer refuses when
        it has let go of a token the kept ones' next query still sees."""
        if not self.is_initialized:
            return 0
        n = -tokens_to_remove if tokens_to_remove <= 0 \
            else max(self.cumulative_length - tokens_to_remove, 0)
        n = min(n, self.cumulative_length)
        kept = self.cumulative_length - n
        if n > 0 and self.is_sliding and self.dropped > max(kept - self.sliding_window + 1, 0):
            raise KvtoolError(
                f"CompressedCache cannot crop {n} tokens from a sliding-window layer: it has "
                "let go of tokens the kept ones still attend to; call the cache's "
                "activate_past_recording() before the steps to undo (transformers' assisted "
                "decoding does)")
        return n

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._view = None
        if self.is_initialized:
            for s in self.streams:
                s.map_batch(fn, 1 if self.joint else 0)
        if self._held_shapes is not None:  # the batch it now holds (beams repeated, selected)
            (batch, heads), kdim, vdim = self._held_shapes
            batch = fn(torch.empty(batch, 0)).shape[0]
            self._held_shapes = ((batch, heads), kdim, vdim)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda a: a.index_select(0, beam_idx.to(a.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda a: a.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda a: a[indices.to(a.device)])
