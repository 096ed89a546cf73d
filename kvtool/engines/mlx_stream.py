"""One stream of a :class:`~kvtool.engines.mlx_cache.KvtoolMLXCache` layer: its sinks, encoded
blocks and recent window, how tokens move between them (append, flush, trim) and how it is saved
and checked on load. Codecs run on numpy; the exact parts are mx arrays."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from kvtool.codecs import Codec, Encoded
from kvtool.errors import FormatError, KvtoolError
from kvtool.kernels.mlx_ops import dtype_name, to_numpy
from kvtool.kernels.mlx_ops import from_numpy as to_mlx

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


def cat_tokens(parts: list[mx.array]) -> mx.array | None:
    parts = [p for p in parts if p is not None and p.shape[-2]]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-2)


class Stream:
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

    def layout(self) -> set[tuple[tuple[int, ...], int, str]]:
        """Each held part's (``lead``, dim, dtype name): one entry for a sound stream."""
        exact = {(tuple(p.shape[:-2]), int(p.shape[-1]), dtype_name(p))
                 for p in (self.sink, self.tail) if p is not None}
        return exact | {(tuple(int(n) for n in c.shape[:-3]), int(c.shape[-1]), str(c.dtype))
                        for c in self.chunks}

    def decode(self, enc: Encoded) -> mx.array:
        """``enc`` as ``[*lead, tokens, dim]`` (its original dtype)."""
        x = self.codec.decode(enc)
        return to_mlx(x.reshape(*x.shape[:-3], -1, x.shape[-1]))

    def full(self) -> mx.array | None:
        """Every token's states: sinks, the store decoded, the window."""
        return cat_tokens([self.sink, *(self.decode(c) for c in self.chunks), self.tail])

    def append(self, x: mx.array) -> tuple[int, Encoded] | None:
        """Add ``x`` after the held tokens; return ``(first token, encoding)`` of newly encoded
        blocks, if any."""
        have = 0 if self.sink is None else self.sink.shape[-2]
        take = min(self.sink_tokens - have, x.shape[-2])
        if take > 0:  # the sinks fill first (nothing else is held until they are full)
            self.sink = cat_tokens([self.sink, x[..., :take, :]])
            x = x[..., take:, :]
        if not x.shape[-2]:
            return None
        self.tail = cat_tokens([self.tail, x])
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
