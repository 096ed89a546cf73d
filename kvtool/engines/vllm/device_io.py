"""The connector's CUDA path: chunks encoded on the GPU, codes (never raw K/V) through pinned
host memory, stored codes decoded on the GPU straight into the paged blocks.

Save (:class:`~kvtool.engines.vllm.connector.KvtoolConnector` ``wait_for_save``, through
:func:`~kvtool.engines.vllm.paged_io.copy_out`): the chunk's K/V gathered on the device
(:meth:`PagedLayout.gather`) → :func:`encode_chunk` (the policy's segments, each
``codec.encode`` of device tensors: the Triton kernels) → :func:`to_host` (the codes packed
into one buffer, copied into pinned memory on a side stream; an event the saver thread waits
on) → :meth:`PrefixStore.write_encoded` (the same bytes :meth:`PrefixStore.write` writes for
the same codes, through :class:`ReplayPolicy`).

Load (``start_load_kv``, through :func:`~kvtool.engines.vllm.paged_io.load_source`):
:func:`load_file`: every code of the tokens to load read and checksum-verified on the host
(:func:`read_codes`), packed into one pinned buffer and copied to the device once
(:func:`upload`, non-blocking), each segment decoded there in the cache's dtype and written
into the blocks (:func:`decode_into`, :meth:`PagedLayout.write`).

Everything is device-agnostic torch: on CPU tensors the pinning and stream steps are skipped,
so the path runs without a GPU (the connector takes it for CUDA caches; tests set
:data:`FORCE_ON_CPU`). Nothing here imports vLLM.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from kvtool.codecs import Codec, Encoded
from kvtool.engines.vllm.layout import PagedLayout
from kvtool.errors import FormatError, not_the_files
from kvtool.formats.constants import ROLES
from kvtool.kernels import FLOAT_DTYPES, to_torch
from kvtool.policy import CodecPolicy, Segment

#: tests: take the device path for CPU caches too (the connector's choice is
#: ``kv_cache.device.type == "cuda"``)
FORCE_ON_CPU = False
_ALIGN = 16  # bytes: each array of a packed buffer starts at a multiple (for dtype views)
_SIDE_STREAMS: dict[torch.device, Any] = {}


def on_device(kv: torch.Tensor) -> bool:
    """Whether the connector saves and loads ``kv`` (a paged cache) through this module."""
    return kv.device.type == "cuda" or FORCE_ON_CPU


# -- encoded chunks -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Part:
    """One segment of one layer's role: tokens ``[start, stop)`` encoded by ``codec``."""

    layer: int
    role: str
    start: int
    stop: int
    codec: Codec
    encoded: Encoded


@dataclasses.dataclass
class EncodedChunk:
    """A chunk's K/V as its policy's segments (:class:`Part`, in file order: layer, key then
    value, segment), on the device or the host. ``ready``: a CUDA event after which host
    arrays hold their values (None: they do now)."""

    parts: list[Part]
    num_layers: int
    ready: Any = None

    def wait(self) -> None:
        """Block until the host arrays are filled (the saver thread, before writing)."""
        if self.ready is not None:
            self.ready.synchronize()

    @property
    def nbytes(self) -> int:
        """Bytes of the codes (what a queued save holds)."""
        return sum(p.encoded.nbytes for p in self.parts)

    @property
    def source_bytes(self) -> int:
        """Bytes of the K/V the codes encode (an upper bound of the file, as ``raw_bytes``)."""
        return sum(_numel(p.encoded.shape) * _itemsize(p.encoded.dtype) for p in self.parts)


def encode_chunk(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                 policy: CodecPolicy) -> EncodedChunk:
    """Encode a chunk's per-layer K/V ``[kv_heads, tokens, head_dim]`` as the .kvz writer does
    (``policy.segments``, each ``codec.encode(x[:, start:stop])``), where the tensors are."""
    if len(keys) != len(values):
        raise ValueError(f"{len(keys)} key layers but {len(values)} value layers")
    parts = []
    for i, pair in enumerate(zip(keys, values, strict=True)):
        for role, x in zip(ROLES, pair, strict=True):
            for seg in policy.segments(role, i, len(keys), int(x.shape[1])):
                parts.append(Part(i, role, seg.start, seg.stop, seg.codec,
                                  seg.codec.encode(x[:, seg.start:seg.stop])))
    return EncodedChunk(parts, len(keys))


def to_host(chunk: EncodedChunk, stream: Any = None) -> EncodedChunk:
    """The chunk with its arrays in host memory: packed into one buffer on the device (in the
    current stream's order), copied into pinned memory on ``stream`` (default: a side stream
    of the device) without blocking; the result's ``ready`` event says when. CPU tensors are
    packed the same way, at once."""
    arrays = [a for p in chunk.parts for a in p.encoded.arrays.values()]
    if not arrays:
        return chunk
    device = arrays[0].device if isinstance(arrays[0], torch.Tensor) else torch.device("cpu")
    pieces, spans, total = _flatten([to_torch(a, device) for a in arrays])
    packed, ready = torch.cat(pieces), None
    if device.type == "cuda":
        stream = stream if stream is not None else side_stream(device)
        host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(device))  # after the encode kernels
        with torch.cuda.stream(stream):
            host.copy_(packed, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
        packed.record_stream(stream)  # not reused by the allocator before the copy is done
        packed = host
    return EncodedChunk(_rebuild(chunk.parts, _views(packed, spans)), chunk.num_layers, ready)


def side_stream(device: torch.device) -> Any:
    """The device's stream for copies to the host (one per device, made on first use)."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


# -- writing encoded chunks (PrefixStore.write_encoded) -----------------------------------------
class ReplayPolicy:
    """The policy stand-in :func:`kvtool.formats.writer.write_kvz` writes an
    :class:`EncodedChunk` with: its segments are ``policy``'s (checked), each with a codec that
    hands back the chunk's codes instead of encoding (:class:`Replayed`); so the file is the
    one ``write_kvz`` writes from the K/V that gave those codes, byte for byte."""

    def __init__(self, chunk: EncodedChunk, policy: CodecPolicy):
        self.policy = policy
        self.num_layers = chunk.num_layers
        self._parts: dict[tuple[int, str], list[Part]] = {}
        for p in chunk.parts:
            self._parts.setdefault((p.layer, p.role), []).append(p)

    @property
    def layers(self) -> tuple:
        """The policy's per-layer codecs (the writer keys the header on them)."""
        return self.policy.layers

    def check_layers(self, num_layers: int) -> None:
        self.policy.check_layers(num_layers)

    def resolve(self, cache: Any = None) -> ReplayPolicy:
        """Itself: the chunk was encoded with ``policy``'s sinks (a store's are resolved)."""
        return self

    def meta_layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys, values) as ``meta`` tensors: their shapes and dtypes, no data."""
        return [tuple(self._shape_of(i, role) for role in ROLES) for i in range(self.num_layers)]

    def _shape_of(self, layer: int, role: str) -> torch.Tensor:
        parts = self._parts.get((layer, role))
        if not parts:
            raise ValueError(f"the encoded chunk has no layer {layer} {role}s")
        heads, _, dim = parts[0].encoded.shape
        dtype = getattr(torch, parts[0].encoded.dtype)
        return torch.empty((heads, parts[-1].stop, dim), dtype=dtype, device="meta")

    def segments(self, role: str, layer: int, num_layers: int, num_tokens: int) -> list[Segment]:
        parts = self._parts.get((layer, role), [])
        want = self.policy.segments(role, layer, num_layers, num_tokens)
        if [(s.start, s.stop, s.codec) for s in want] != [(p.start, p.stop, p.codec)
                                                          for p in parts]:
            raise ValueError(f"layer {layer} {role}s were encoded with another policy than "
                             f"the store's ({self.policy.describe()})")
        return [Segment(p.start, p.stop, Replayed(p.codec, p.encoded)) for p in parts]

    def to_json(self) -> dict[str, Any]:
        return self.policy.to_json()

    def describe(self) -> str:
        return self.policy.describe()


class Replayed:
    """``codec`` whose :meth:`encode` returns ``encoded`` (made earlier by that codec)."""

    def __init__(self, codec: Codec, encoded: Encoded):
        self.codec, self.encoded = codec, encoded

    def encode(self, x: Any) -> Encoded:
        if tuple(x.shape) != tuple(self.encoded.shape):
            raise ValueError(f"codes of shape {self.encoded.shape} replayed for {tuple(x.shape)}")
        return self.encoded

    def __getattr__(self, name: str) -> Any:
        return getattr(self.codec, name)


# -- loading ------------------------------------------------------------------------------------
def load_file(f: Any, targets: Sequence[tuple[torch.Tensor, PagedLayout, Sequence[int]]],
              origin: int, lo: int, hi: int) -> None:
    """Write tokens ``[lo, hi)`` of an open .kvz file (:class:`~kvtool.formats.KvzFile`) into
    paged caches, one ``(kv_cache, layout, block_ids)`` per layer, at sequence positions
    ``origin + t``: every code read and verified on the host first (a damaged file fails before
    the caches are touched), copied to the device once, decoded there in the cache's dtype."""
    if len(targets) != f.num_layers:
        raise ValueError(f"{f.num_layers} layers, the paged cache has {len(targets)}")
    parts = read_codes(f, lo, hi)
    for part, encoded in zip(parts, upload([p.encoded for p in parts], targets[0][0].device),
                             strict=True):
        kv, layout, block_ids = targets[part.layer]
        decode_into(kv, layout, block_ids, origin, part, encoded, lo, hi, f.path)


def read_codes(f: Any, lo: int, hi: int) -> list[Part]:
    """The segments of every layer and role holding tokens of ``[lo, hi)``, their arrays read
    (numpy) and checked as ``load(tokens=hi)`` reads them: every segment before ``hi``, so a
    damaged one is refused the same way."""
    parts = []
    for i in range(f.num_layers):
        for role in ROLES:
            covered = 0
            for seg, encoded in f.encoded(i, role, tokens=hi):
                covered = int(seg["stop"])
                if covered > lo:
                    parts.append(Part(i, role, int(seg["start"]), covered,
                                      f.codec(seg["codec"]), encoded))
            if covered < hi:
                raise FormatError(f"{f.path}: layer {i} {role}s hold {covered} tokens, "
                                  f"not {hi}")
    return parts


def upload(encoded: Sequence[Encoded], device: torch.device) -> list[Encoded]:
    """``encoded`` (host arrays) on ``device``: packed into one pinned buffer, copied without
    blocking (the copy and the kernels after it share the current stream)."""
    arrays = [to_torch(a) for e in encoded for a in e.arrays.values()]
    if not arrays:
        return list(encoded)
    pieces, spans, total = _flatten(arrays)
    host = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    torch.cat(pieces, out=host)
    views = iter(_views(host.to(device, non_blocking=True), spans))
    return [Encoded({k: next(views) for k in e.arrays}, e.shape, e.dtype) for e in encoded]


def decode_into(kv: torch.Tensor, layout: PagedLayout, block_ids: Sequence[int], origin: int,
                part: Part, encoded: Encoded, lo: int, hi: int, where: str = "") -> None:
    """Decode ``part`` (its arrays ``encoded``, on the cache's device) in the cache's dtype and
    write its tokens within ``[lo, hi)`` at positions ``origin + t``. A failure to decode is a
    :class:`FormatError`, as the reader's."""
    a, b = max(lo, part.start), min(hi, part.stop)
    if a >= b:
        return
    dtype = str(layout.values_dtype(kv)).removeprefix("torch.")
    if dtype == "float16" and part.encoded.dtype != "float16":
        dtype = "float32"  # not saturated: PagedLayout.write refuses what fp16 cannot hold
    try:
        x = part.codec.decode(encoded, dtype if dtype in FLOAT_DTYPES else None)
    except Exception as e:
        if not_the_files(e):
            raise
        raise FormatError(f"{where}: layer {part.layer} {part.role}: codec "
                          f"{part.codec.codec_id!r} could not decode tokens {part.start}.."
                          f"{part.stop}: {type(e).__name__}: {str(e)[:120]}") from None
    if tuple(x.shape) != tuple(part.encoded.shape):
        raise FormatError(f"{where}: layer {part.layer} {part.role}: codec "
                          f"{part.codec.codec_id!r} decoded shape {tuple(x.shape)}, expected "
                          f"{tuple(part.encoded.shape)}")
    layout.write(kv, block_ids, origin + a, part.role, x[:, a - part.start:b - part.start])


def warm_up(policy: CodecPolicy, kv: torch.Tensor, layout: PagedLayout, tokens: int) -> None:
    """Compile (on GPUs: autotune) the kernels of the policy's codecs for a chunk of
    ``tokens`` of the paged cache ``kv``, so that the first save or load does not pay it within
    a step. Failures are ignored: a warm-up never stops the engine."""
    shape = (layout.num_heads(kv), tokens, layout.head_dim)
    x = torch.randn(shape, device=kv.device).to(layout.values_dtype(kv))
    name = str(x.dtype).removeprefix("torch.")
    for codec in policy.codecs():
        with contextlib.suppress(Exception):
            codec.decode(codec.encode(x), name if name in FLOAT_DTYPES else None)


# -- packing ------------------------------------------------------------------------------------
def _flatten(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[tuple], int]:
    """(byte pieces to concatenate, each tensor's (offset, dtype, shape), total bytes); each
    tensor starts at a multiple of :data:`_ALIGN` bytes."""
    pieces, spans, offset = [], [], 0
    for t in tensors:
        flat = t.contiguous().reshape(-1).view(torch.uint8)
        pieces.append(flat)
        spans.append((offset, t.dtype, tuple(t.shape)))
        offset += flat.numel()
        pad = -offset % _ALIGN
        if pad:
            pieces.append(flat.new_zeros(pad))
            offset += pad
    return pieces, spans, offset


def _views(buffer: torch.Tensor, spans: list[tuple]) -> list[torch.Tensor]:
    """The tensors :func:`_flatten` packed, as views of ``buffer``."""
    out = []
    for offset, dtype, shape in spans:
        n = _numel(shape) * torch.empty(0, dtype=dtype).element_size()
        out.append(buffer[offset:offset + n].view(dtype).view(shape))
    return out


def _rebuild(parts: list[Part], arrays: list[torch.Tensor]) -> list[Part]:
    """``parts`` with their arrays replaced, in order, by ``arrays``."""
    it = iter(arrays)
    return [dataclasses.replace(p, encoded=Encoded({k: next(it) for k in p.encoded.arrays},
                                                   p.encoded.shape, p.encoded.dtype))
            for p in parts]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _itemsize(dtype: str) -> int:
    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()
