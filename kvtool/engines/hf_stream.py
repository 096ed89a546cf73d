"""One layer's keys, values, or both stacked, as :class:`~kvtool.engines.hf_runtime.
CompressedCache` holds them: exact sinks, encoded chunks of whole blocks, exact recent window
(the layout and the trade-offs are in :mod:`kvtool.engines.hf_runtime`'s docstring)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvtool.codecs import Codec, Encoded
from kvtool.errors import CodecError, KvtoolError
from kvtool.kernels.device_checks import Checks, deferred, own_arrays


def _blocked(shapes: Any, lead: tuple[int, ...]) -> bool:
    """Whether every array shape (of an ``Encoded`` or a codec's declared arrays) starts with
    the ``lead`` axes (…, n_blocks)."""
    return all(len(s) > len(lead) and tuple(s[: len(lead)]) == lead for s in shapes)


def _shapes(enc: Encoded) -> list[tuple[int, ...]]:
    return [tuple(a.shape) for a in enc.arrays.values()]


def _concat(a: Encoded, b: Encoded, axis: int) -> Encoded | None:
    """``a`` and ``b`` joined along the block ``axis``, or None when their layouts differ."""
    if a.arrays.keys() != b.arrays.keys() or a.shape[axis + 1:] != b.shape[axis + 1:] \
            or a.dtype != b.dtype:
        return None
    if any(x.shape[axis + 1:] != b.arrays[k].shape[axis + 1:] for k, x in a.arrays.items()):
        return None
    arrays = {k: torch.cat([x, b.arrays[k]], dim=axis) for k, x in a.arrays.items()}
    shape = (*a.shape[:axis], a.shape[axis] + b.shape[axis], *a.shape[axis + 1:])
    return Encoded(arrays, shape, a.dtype)


def _blocks(enc: Encoded, axis: int, start: int, stop: int) -> Encoded:
    """Blocks ``[start, stop)`` of ``enc`` (its arrays declare the block ``axis``), copied."""
    arrays = {k: a.narrow(axis, start, stop - start).clone() for k, a in enc.arrays.items()}
    return Encoded(arrays, (*enc.shape[:axis], stop - start, *enc.shape[axis + 1:]), enc.dtype)


def _per_index(out: tuple[Any, ...]) -> tuple[Any, ...]:
    """:meth:`_Stream.codes_np`'s first four arrays ``[L, ...]`` as tuples of their ``L``
    views, indexed once per store change rather than at every step and layer."""
    return (*(None if a is None else tuple(a[i] for i in range(len(a))) for a in out[:4]),
            *out[4:])


class _Stream:
    """Sinks, encoded chunks and recent window of one layer's keys, values, or both stacked.

    Tensors are ``[*lead, tokens, dim]`` with ``lead`` = (batch, heads), or (2, batch, heads)
    when keys and values share a codec and are encoded and decoded together (one call each).
    """

    def __init__(self, codec: Codec | None, sink_tokens: int, recent_tokens: int, block: int,
                 sliding: bool = False):
        self.codec = codec  # None: lossless, everything stays in ``tail``
        self.sink_tokens, self.recent_tokens, self.block = sink_tokens, recent_tokens, block
        self.sliding = sliding  # blocks must be droppable one by one (see drop_front)
        self.parts = False  # codes_np for the kernel of every turbomix option (see there)
        self.reset()

    def reset(self) -> None:
        self.sink: torch.Tensor | None = None
        self.chunks: list[Encoded] = []  # each encodes [*lead, n_blocks, block, dim]
        self.stored = 0  # tokens in ``chunks``
        self.tail: torch.Tensor | None = None
        self._np: tuple[Any, ...] | None = None  # memo of :meth:`codes_np`
        self._dev: tuple[Any, ...] | None = None  # memo of :meth:`codes_torch`
        self._enc: tuple[bool, tuple[Any, ...]] | None = None  # memo of update's ``encoded``
        #: the encodes' input checks on CUDA, read back without a host sync (see ``_flush``)
        self.checks = Checks()

    def settle(self, wait: bool = False) -> None:
        """Raise the error of an encoded block whose device check failed (a NaN/Inf input or
        a norm past fp16's range): what has arrived, or (``wait``) every queued check."""
        try:
            self.checks.wait() if wait else self.checks.poll()
        except CodecError as e:
            raise CodecError(f"{e} (a block this CompressedCache encoded at an earlier step; "
                             "discard the cache)") from None

    def nbytes(self) -> tuple[int, int]:
        """(encoded bytes, full-precision bytes) actually held."""
        full = sum(p.numel() * p.element_size() for p in (self.sink, self.tail) if p is not None)
        return sum(c.nbytes for c in self.chunks), full

    def decoded(self) -> list[torch.Tensor]:
        """The encoded store as full tensors ``[*lead, tokens, dim]`` (transient)."""
        with own_arrays():  # this stream's encodes: no value checks (on CUDA, host syncs)
            return [self.codec.decode(enc).flatten(-3, -2) for enc in self.chunks]

    def full(self) -> torch.Tensor | None:
        self.settle(wait=True)
        parts = [p for p in (self.sink, *self.decoded(), self.tail) if p is not None]
        return torch.cat(parts, dim=-2) if len(parts) > 1 else (parts[0] if parts else None)

    def codes_np(self) -> tuple[Any, ...]:
        """The store's codes ``[L, B·H, E, bytes]`` (uint8), norms ``[L, B·H, E]`` (fp16 bits
        as uint16), each block's rotation ``[L, B·H, blocks]`` (uint8; zeros without one) and
        mean ``[L, B·H, blocks, D]`` (float32; None: uncentered), ``L`` = 2 when keys and
        values are stacked, else 1, each as a tuple of its ``L`` views: zero-copy numpy views of
        the single chunk where they can be (several chunks are joined, transiently). With
        ``parts`` (the attention kernel for every ``turbomix`` option reads this layer),
        instead (None × 4, then one :class:`~kvtool.kernels.numba_attention_parts.RoleCodes`
        per ``L``)."""
        if self._np is not None:
            return self._np
        joined, axis = self._joined()
        codes = joined["codes"]
        lead = codes.shape[:-3]  # (batch, heads) or (2, batch, heads)
        heads, blocks = lead[-2] * lead[-1], codes.shape[-3]
        if self.parts:
            from kvtool.engines.hf_attention_calls import role_codes

            per_role = {name: a.contiguous().numpy().reshape(-1, heads, *a.shape[axis:])
                        for name, a in joined.items()}
            dim = self.chunks[0].shape[-1]
            out: tuple[Any, ...] = (None, None, None, None, [
                role_codes(self.codec, {name: a[i] for name, a in per_role.items()}, heads,
                           blocks * codes.shape[-2], codes.shape[-2], dim)
                for i in range(len(per_role["codes"]))])
        else:
            norms = joined["norms"]
            flat = (-1, heads, blocks * codes.shape[-2])
            codes_np = codes.contiguous().reshape(*flat, codes.shape[-1]).numpy()
            rotation = (joined["rotation"].contiguous().reshape(-1, heads, blocks).numpy()
                        if "rotation" in joined
                        else np.zeros((codes_np.shape[0], heads, blocks), np.uint8))
            mean = (joined["mean"].float().reshape(-1, heads, blocks, joined["mean"].shape[-1])
                    .numpy() if "mean" in joined else None)
            out = (codes_np,
                   norms.contiguous().reshape(flat).view(torch.int16).numpy().view(np.uint16),
                   rotation, mean, None)
        out = _per_index(out)
        if len(self.chunks) == 1 or self.parts:
            self._np = out
        return out

    def _joined(self) -> tuple[dict[str, torch.Tensor], int]:
        """(every array of the chunks joined along the blocks' axis — the single chunk's own
        arrays when there is one —, that axis)."""
        first = self.chunks[0].arrays
        axis = first["codes"].ndim - 3  # the blocks' axis of every array
        return {name: torch.cat([c.arrays[name] for c in self.chunks], dim=axis)
                if len(self.chunks) > 1 else first[name] for name in first}, axis

    def codes_torch(self) -> tuple[Any, ...]:
        """:meth:`codes_np` as tensors where the store lives, for the Triton kernel: codes
        ``[L, B·H, E, bytes]``, fp16 norms ``[L, B·H, E]``, rotations ``[L, B·H, blocks]``
        (None without candidates), fp16 means ``[L, B·H, blocks, D]`` (None: uncentered), None;
        views of the single chunk (several chunks are joined, transiently). With ``parts``,
        instead (None × 4, then one :class:`~kvtool.kernels.triton_attention_parts.RoleTensors`
        per ``L``)."""
        if self._dev is not None:
            return self._dev
        joined, axis = self._joined()
        codes = joined["codes"]
        lead = codes.shape[:-3]
        heads, blocks = lead[-2] * lead[-1], codes.shape[-3]
        flat = (-1, heads, blocks * codes.shape[-2])
        if self.parts:
            from kvtool.kernels.triton_attention_parts import role_tensors

            per_role = {name: a.reshape(-1, heads, *a.shape[axis:]) for name, a in joined.items()}
            out: tuple[Any, ...] = (None, None, None, None, [
                role_tensors(self.codec, {name: a[i] for name, a in per_role.items()}, heads,
                             blocks * codes.shape[-2], codes.shape[-2], self.chunks[0].shape[-1])
                for i in range(len(per_role["codes"]))])
            self._dev = out  # built once per store change
            return out
        mean = joined.get("mean")
        out = _per_index((
            codes.reshape(*flat, codes.shape[-1]), joined["norms"].reshape(flat),
            joined["rotation"].reshape(-1, heads, blocks) if "rotation" in joined else None,
            None if mean is None else mean.reshape(-1, heads, blocks, mean.shape[-1]), None))
        if len(self.chunks) == 1:
            self._dev = out
        return out

    def update(self, x: torch.Tensor, from_codes: bool = False, on_device: bool = False
               ) -> tuple[torch.Tensor, tuple[Any, ...] | None]:
        """Append ``x`` [*lead, new, dim]; return (states, encoded).

        Default: every token's states (the store decoded, ``x`` exact) and None. With
        ``from_codes`` and a non-empty store: only the exact tokens (sinks, window, ``x``) and
        ``(codes, norms, rotations, means, roles, chunks, sinks)`` of the store as it was before
        ``x``
        (:meth:`codes_np`, or :meth:`codes_torch` ``on_device``; the encoded tokens go after
        the first ``sinks`` exact ones).
        """
        if self.codec is None:
            self.tail = x if self.tail is None else torch.cat([self.tail, x], dim=-2)
            return self.tail, None
        if self.checks:
            self.settle()
        have = 0 if self.sink is None else self.sink.shape[-2]
        if from_codes and self.chunks:  # the sinks are full: x goes to the window
            memo = self._enc
            if memo is not None and memo[0] == on_device:
                encoded = memo[1]  # the same object until the store changes
            else:
                encoded = (*(self.codes_torch() if on_device else self.codes_np()),
                           list(self.chunks), have)
                if (self._dev if on_device else self._np) is not None:  # views kept: memo too
                    self._enc = (on_device, encoded)
            self.tail = x if self.tail is None else torch.cat([self.tail, x], dim=-2)
            # the window is never changed in place (only replaced), so it can be returned
            out = self.tail if self.sink is None else torch.cat([self.sink, self.tail], dim=-2)
            self._flush()
            return out, encoded
        parts = [p for p in (self.sink, *self.decoded(), self.tail) if p is not None]
        out = torch.cat([*parts, x], dim=-2) if parts else x
        take = min(self.sink_tokens - have, x.shape[-2])
        if take > 0:
            head = x[..., :take, :]
            self.sink = head.clone() if self.sink is None else torch.cat([self.sink, head], -2)
            x = x[..., take:, :].clone()  # a view would pin the sink tokens' buffer too
        if x.shape[-2]:
            self.tail = x if self.tail is None else torch.cat([self.tail, x], dim=-2)
            self._flush()
        return out, None

    def forget_views(self) -> None:
        """Drop what was worked out of the store (it changed)."""
        self._np = self._dev = self._enc = None

    def changed(self) -> bool:
        """Whether the store changed since :meth:`update` last returned its ``encoded``
        (which is the same object until then)."""
        return self._enc is None

    def _flush(self) -> None:
        """Encode the window's oldest whole blocks beyond ``recent_tokens``."""
        n_blocks = (self.tail.shape[-2] - self.recent_tokens) // self.block
        if n_blocks <= 0:
            return
        cut, lead = n_blocks * self.block, tuple(self.tail.shape[:-2])
        x = self.tail[..., :cut, :].reshape(*lead, n_blocks, self.block, self.tail.shape[-1])
        self.tail = self.tail[..., cut:, :].clone()  # a slice would pin the old buffer
        self.forget_views()
        self.stored += cut
        # on CUDA the encodes' checks are read back later (settle): a sync here would stall
        # the host in the middle of every layer's forward
        with deferred() as queued:
            if self.sliding and n_blocks > 1 and not self._declares_blocks(x):
                # a layout without a block axis cannot be cut: one chunk per block, dropped whole
                self.chunks.extend(self.codec.encode(x[..., i:i + 1, :, :])
                                   for i in range(n_blocks))
                enc = None
            else:
                enc = self.codec.encode(x)
        self.checks.add(queued)
        if enc is None:
            return
        merged = None
        if self.chunks and _blocked(_shapes(enc), (*lead, n_blocks)):
            merged = _concat(self.chunks[-1], enc, len(lead))
        if merged is not None:
            self.chunks[-1] = merged
        else:
            self.chunks.append(enc)

    def _declares_blocks(self, x: torch.Tensor) -> bool:
        """Whether the codec declares every array of ``x`` [*lead, n_blocks, block, dim] with
        the block axis (so encoded blocks can later be dropped one by one)."""
        spec = self.codec.expected_arrays(tuple(x.shape), str(x.dtype).removeprefix("torch."))
        return _blocked((a.shape for a in spec.values()), tuple(x.shape[:-2]))

    def drop_front(self, n: int) -> None:
        """Let go of the ``n`` oldest tokens (a multiple of ``block`` while any are encoded):
        whole encoded blocks first, then window tokens. Sliding layers keep no sinks."""
        while n and self.chunks:
            enc = self.chunks[0]
            axis = len(enc.shape) - 3
            total, k = enc.shape[axis], min(n // self.block, enc.shape[axis])
            if k == total:
                self.chunks.pop(0)
            else:
                self.chunks[0] = _blocks(enc, axis, k, total)
            n -= k * self.block
            self.stored -= k * self.block
            self.forget_views()
        if n:
            self.tail = self.tail[..., n:, :].clone()

    def crop_back(self, n: int) -> None:
        """Remove the ``n`` newest tokens: the window's, then encoded blocks from the end, then
        sinks. Cutting into a block keeps its first tokens in the window, decoded (they are
        encoded again when the window flushes), as does popping a chunk that declares no block
        axis whole."""
        held = 0 if self.tail is None else self.tail.shape[-2]
        k = min(n, held)
        if k:
            self.tail = self.tail[..., :held - k, :].clone()
            n -= k
        if n and self.chunks:
            self.settle(wait=True)
            back: list[torch.Tensor] = []  # decoded tokens, oldest first
            have = 0  # tokens in ``back``
            while self.chunks and n > have:
                last = self.chunks[-1]
                axis = len(last.shape) - 3
                total = last.shape[axis]
                want = min(total, -(-(n - have) // self.block))
                if want < total and _blocked(_shapes(last), tuple(last.shape[:axis + 1])):
                    self.chunks[-1] = _blocks(last, axis, 0, total - want)
                    gone = _blocks(last, axis, total - want, total)
                else:
                    gone = self.chunks.pop()
                with own_arrays():
                    back.insert(0, self.codec.decode(gone).flatten(-3, -2))
                have += gone.shape[axis] * self.block
                self.stored -= gone.shape[axis] * self.block
            self.forget_views()
            decoded = torch.cat(back, dim=-2)
            k = min(n, decoded.shape[-2])
            self.tail, n = decoded[..., :decoded.shape[-2] - k, :].clone(), n - k
        if n and self.sink is not None:
            left = self.sink.shape[-2] - min(n, self.sink.shape[-2])
            self.sink = self.sink[..., :left, :].clone() if left else None

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor], axis: int) -> None:
        """Apply ``fn`` (which works on axis 0) to the batch ``axis`` of every part."""
        def on_axis(a: torch.Tensor) -> torch.Tensor:
            return fn(a.movedim(axis, 0)).movedim(0, axis)

        self.sink = None if self.sink is None else on_axis(self.sink)
        self.tail = None if self.tail is None else on_axis(self.tail)
        chunks = []
        for enc in self.chunks:
            if not _blocked(_shapes(enc), tuple(enc.shape[:axis + 3])):
                raise KvtoolError(f"{self.codec.codec_id}: its encoded arrays have no leading "
                                  "batch axis, so this cache cannot reorder or expand batches")
            arrays = {k: on_axis(a) for k, a in enc.arrays.items()}
            batch = next(iter(arrays.values())).shape[axis]
            shape = (*enc.shape[:axis], batch, *enc.shape[axis + 1:])
            chunks.append(Encoded(arrays, shape, enc.dtype))
        self.chunks = chunks
        self.forget_views()
