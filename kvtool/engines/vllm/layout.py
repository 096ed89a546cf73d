"""Paged KV layouts: gather one sequence's keys/values from vLLM's paged cache, or scatter them in.

A paged cache holds every layer's K/V in fixed-size blocks; a sequence owns a list of block ids,
and token ``p`` lives in block ``block_ids[p // block_size]`` at offset ``p % block_size``.
What differs between attention backends is the layout *inside* the per-layer tensor:

``cpu``   vLLM's CPU backend (``cpu_attn.py``): ``[num_blocks, kv_heads, block_size, 2*head_dim]``
          where each (block, head) row of ``block_size * 2 * head_dim`` elements holds K first,
          **transposed** as ``[head_dim, block_size]``, then V as ``[block_size, head_dim]``
          (``cpu_attn_reshape_and_cache``, ISAs ``vec`` and ``vec16``).
``cpu_amx`` the same tensor written by the ``amx`` ISA (x86 CPUs with AMX, a bfloat16 cache,
          blocks of a multiple of 32): each (block, head) row holds K packed for AMX tiles as
          ``[block_size/16, head_dim/2, 16, 2]`` (16 tokens a tile, dims in pairs), then V as
          ``[head_dim/16, block_size/2, 16, 2]`` (16 dims a tile, tokens in pairs).
``cpu_probed`` a CPU cache packed as no layout above says (another ISA: ARM's ``neon``, POWER's
          ``vsx``, …; or a vLLM release that changed a packing): each (block, head) row half is
          a permutation of its tokens' elements, read off vLLM's own cache writer
          (:mod:`~kvtool.engines.vllm.layout_probe`) and kept as ``offsets``.
``split`` vLLM ≥ 0.2x's standardized per-layer view ``[num_blocks, kv_heads, block_size,
          2*head_dim]`` (FlashAttention, Triton, FlashInfer): ``[..., :D]`` is K, ``[..., D:]`` V;
          the view's strides hide whether memory is NHD or HND.
``flash`` the classic FlashAttention tensor ``[2, num_blocks, block_size, kv_heads, head_dim]``.

Every function takes and returns K/V as ``[kv_heads, tokens, head_dim]`` (kvtool's
:class:`~kvtool.cache.KVCache` convention). Only torch is needed here, never vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from kvtool.engines.vllm.fp8_cache import Fp8Cache
from kvtool.errors import KvtoolError

LAYOUTS = ("cpu", "cpu_amx", "cpu_probed", "split", "flash")
BLOCK_PACKED = ("cpu_amx", "cpu_probed")  # moved by whole blocks: no strided view of a token
AMX_TILE = 16  # tokens (keys) or dims (values) in one row of an AMX tile
AMX_PAIR_WORDS = {2: torch.int32, 1: torch.int16}  # element size → a pair of them as one word
CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # the caches kvtool reads and writes


class UnsupportedLayoutError(ValueError):
    """A paged KV tensor whose layout kvtool does not know."""


@dataclass(frozen=True)
class PagedLayout:
    """One of :data:`LAYOUTS` plus the head_dim that splits K from V; ``cpu_probed`` also
    takes ``offsets``: per role, where each element of a (block, head) row half goes, a
    permutation of ``block_size * head_dim`` ordered (token, dim). ``fp8``: the cache holds
    fp8 codes of scaled K/V (:class:`~kvtool.engines.vllm.fp8_cache.Fp8Cache`); gather and
    write then take and give real K/V all the same."""

    name: str
    head_dim: int
    offsets: Mapping[str, torch.Tensor] | None = field(default=None, compare=False, repr=False)
    fp8: Fp8Cache | None = None

    def __post_init__(self) -> None:
        if self.name not in LAYOUTS:
            raise UnsupportedLayoutError(f"unknown paged layout {self.name!r}; "
                                         f"known: {', '.join(LAYOUTS)}")
        if (self.name == "cpu_probed") != (self.offsets is not None):
            raise ValueError("offsets are what a cpu_probed layout, and only one, is made of")
        if self.offsets is not None:
            size = {int(o.numel()) for o in self.offsets.values()}
            if set(self.offsets) != {"key", "value"} or len(size) != 1 or \
                    any(not torch.equal(o.sort().values, torch.arange(o.numel()))
                        for o in self.offsets.values()):
                raise ValueError("a cpu_probed layout's offsets must be one permutation per "
                                 "role (key, value) of one row size")

    @cached_property
    def _positions(self) -> dict[str, torch.Tensor]:
        """``cpu_probed``: the inverse of ``offsets`` (row position → (token, dim) index)."""
        return {role: o.argsort() for role, o in (self.offsets or {}).items()}

    # -- geometry -------------------------------------------------------------------------------
    def block_size(self, kv: torch.Tensor) -> int:
        return int(kv.shape[2])

    def num_blocks(self, kv: torch.Tensor) -> int:
        return int(kv.shape[1] if self.name == "flash" else kv.shape[0])

    def num_heads(self, kv: torch.Tensor) -> int:
        return int(kv.shape[3] if self.name == "flash" else kv.shape[1])

    def values_dtype(self, kv: torch.Tensor) -> torch.dtype:
        """The dtype of the K/V :meth:`gather` gives (an fp8 cache's: the model's)."""
        return getattr(torch, self.fp8.dtype) if self.fp8 is not None else kv.dtype

    def check(self, kv: torch.Tensor) -> None:
        """Raise :class:`UnsupportedLayoutError` when ``kv`` is not shaped like this layout."""
        d = self.head_dim
        ok = (kv.ndim == 5 and kv.shape[0] == 2 and kv.shape[4] == d if self.name == "flash"
              else kv.ndim == 4 and kv.shape[3] == 2 * d)
        if not ok:
            raise UnsupportedLayoutError(f"a paged KV tensor of shape {tuple(kv.shape)} is not "
                                         f"the {self.name!r} layout with head_dim {d}")
        if self.fp8 is not None:
            if kv.dtype not in (torch.uint8, self.fp8.code_dtype):
                raise UnsupportedLayoutError(
                    f"a paged KV cache of {str(kv.dtype).removeprefix('torch.')} does not hold "
                    f"fp8 {self.fp8.format} codes")
        elif kv.dtype not in CACHE_DTYPES:  # fp8 caches come as uint8: bytes, not values
            raise UnsupportedLayoutError(
                f"a paged KV cache of {str(kv.dtype).removeprefix('torch.')} (an fp8 "
                "--kv-cache-dtype?) holds scaled codes, and its layer named no fp8 format and "
                "scales to read them with")
        if self.offsets is not None and \
                int(self.offsets["key"].numel()) != kv.shape[2] * d:
            raise UnsupportedLayoutError(
                f"a CPU packing read off blocks of {int(self.offsets['key'].numel()) // d} "
                f"tokens cannot place a cache with blocks of {kv.shape[2]}")
        if self.name == "cpu_amx" and (kv.element_size() not in AMX_PAIR_WORDS
                                       or kv.shape[2] % AMX_TILE or d % AMX_TILE):
            raise UnsupportedLayoutError(
                f"an AMX-packed CPU cache of {str(kv.dtype).removeprefix('torch.')}, blocks of "
                f"{kv.shape[2]} and head_dim {d}: kvtool knows 8- and 16-bit caches whose "
                f"block size and head_dim are multiples of {AMX_TILE}")

    # -- where one role's tokens are -----------------------------------------------------------
    def _slots_of(self, kv: torch.Tensor, role: str, blk: torch.Tensor,
                  off: torch.Tensor) -> tuple[torch.Tensor, tuple, tuple[int, ...]]:
        """(view of ``kv``, index, trailing shape): ``view[index]`` is ``role``'s tokens at
        (``blk``, ``off``) as ``[T, heads, *trailing]``, ``prod(trailing) == head_dim``, and
        writes through it land in ``kv``."""
        d, n = self.head_dim, self.block_size(kv)
        key = role == "key"
        if self.name == "flash":
            return kv[0 if key else 1], (blk, off), (d,)  # [B, N, H, D]
        if self.name == "split":
            view = (kv[..., :d] if key else kv[..., d:]).transpose(1, 2)  # [B, N, H, D]
            return view, (blk, off), (d,)
        if self.name in BLOCK_PACKED:  # no strided view reaches one token: see _unpack
            raise NotImplementedError(f"the {self.name} layout moves whole blocks")
        row = self._cpu_rows(kv, role)
        every = slice(None)
        if key:  # transposed: [B, H, D, N]
            return row.unflatten(2, (d, n)), (blk, every, every, off), (d,)
        return row.unflatten(2, (n, d)).transpose(1, 2), (blk, off), (d,)  # [B, N, H, D]

    def _cpu_rows(self, kv: torch.Tensor, role: str) -> torch.Tensor:
        """``role``'s half of each (block, head) row of a CPU cache, ``[B, H, N*D]`` (a view)."""
        b, h, n, _ = kv.shape
        try:  # each (block, head) row of 2*N*D elements must be contiguous
            rows = kv.view(b, h, 2 * n * self.head_dim)
        except RuntimeError:
            raise UnsupportedLayoutError("the CPU paged KV tensor is not contiguous per "
                                         "(block, head)") from None
        half = n * self.head_dim
        return rows[:, :, :half] if role == "key" else rows[:, :, half:]

    def _unpack(self, packed: torch.Tensor, role: str) -> torch.Tensor:
        """Contiguous packed rows ``[B, H, N*D]`` of ``role`` → ``[H, B*N, D]``."""
        if self.name == "cpu_amx":
            return self._amx_unpack(packed, role)
        b, h, size = packed.shape  # elements made rows: a gather of rows is 2-3x one of columns
        by_element = packed.view(b * h, size).t().contiguous()
        tokens = by_element.index_select(0, self.offsets[role].to(packed.device))  # (token, dim)
        return tokens.view(-1, self.head_dim, b, h).permute(3, 2, 0, 1) \
            .reshape(h, -1, self.head_dim)

    def _pack(self, x: torch.Tensor, role: str, block_size: int) -> torch.Tensor:
        """The inverse of :meth:`_unpack`: ``[H, B*N, D]`` → packed rows ``[B, H, N*D]``."""
        if self.name == "cpu_amx":
            return self._amx_pack(x, role, block_size)
        h = x.shape[0]
        by_element = x.reshape(h, -1, block_size * self.head_dim).permute(2, 1, 0).contiguous()
        packed = by_element.index_select(0, self._positions[role].to(x.device))  # [N*D, B, H]
        return packed.permute(1, 2, 0).contiguous()

    def _amx_unpack(self, packed: torch.Tensor, role: str) -> torch.Tensor:
        """Contiguous AMX-packed rows ``[B, H, N*D]`` of ``role`` → ``[H, B*N, D]``.

        Keys are ``[N/16, D/2, 16, 2]`` per row and values ``[D/16, N/2, 16, 2]``; the pairs
        move as one 4-byte word (a key's two dims stay together, as do a value's two tokens),
        which permutes 2-3x faster than 2-byte elements."""
        b, h, size = packed.shape
        d, t = self.head_dim, AMX_TILE
        n = size // d
        words = packed.view(AMX_PAIR_WORDS[packed.element_size()])
        if role == "key":
            tokens = words.view(b, h, n // t, d // 2, t).permute(1, 0, 2, 4, 3).contiguous()
            return tokens.view(packed.dtype).view(h, b * n, d)
        pairs = words.view(b, h, d // t, n // 2, t).permute(1, 0, 3, 2, 4).contiguous()
        return pairs.view(packed.dtype).view(h, b, n // 2, d, 2).transpose(-1, -2) \
            .reshape(h, b * n, d)

    def _amx_pack(self, x: torch.Tensor, role: str, block_size: int) -> torch.Tensor:
        """The inverse of :meth:`_amx_unpack`: ``[H, B*N, D]`` → packed rows ``[B, H, N*D]``."""
        h, _, d = x.shape
        n, t = block_size, AMX_TILE
        b = x.shape[1] // n
        if role == "key":
            words = x.contiguous().view(AMX_PAIR_WORDS[x.element_size()]) \
                .view(h, b, n // t, t, d // 2)
            packed = words.permute(1, 0, 2, 4, 3)
        else:
            pairs = x.reshape(h, b, n // 2, 2, d).transpose(-1, -2).contiguous()
            packed = pairs.view(AMX_PAIR_WORDS[x.element_size()]) \
                .view(h, b, n // 2, d // t, t).permute(1, 0, 3, 2, 4)
        return packed.contiguous().view(x.dtype).view(b, h, n * d)

    def _blocks(self, kv: torch.Tensor, block_ids: Sequence[int], start: int,
                    tokens: int) -> tuple[torch.Tensor, int]:
        """(ids of the blocks holding tokens ``[start, start+tokens)``, offset of ``start`` in
        the first); the ids were checked by :func:`slots`."""
        n = self.block_size(kv)
        first, skip = divmod(start, n)
        return ids_on(block_ids[first:-(-(start + tokens) // n)], kv.device), skip

    # -- gather / scatter -----------------------------------------------------------------------
    def gather(self, kv: torch.Tensor, block_ids: Sequence[int], start: int,
               stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of K and V ``[kv_heads, stop-start, head_dim]`` for tokens ``[start, stop)``
        (an fp8 cache's dequantized)."""
        self.check(kv)
        blk, off = slots(block_ids, self.block_size(kv), start, stop, kv.device,
                         self.num_blocks(kv))
        heads, tokens = self.num_heads(kv), stop - start
        if self.name in BLOCK_PACKED:
            out = list(self._gather_blocks(kv, block_ids, start, tokens))
        else:
            out = []
            for role in ("key", "value"):
                view, index, _ = self._slots_of(kv, role, blk, off)
                out.append(view[index].reshape(tokens, heads, self.head_dim).transpose(0, 1)
                           .contiguous())
        if self.fp8 is not None:
            out = [self.fp8.decode(x, role) for x, role in zip(out, ("key", "value"),
                                                               strict=True)]
        return out[0], out[1]

    def _gather_blocks(self, kv: torch.Tensor, block_ids: Sequence[int], start: int,
                       tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`gather` of a :data:`BLOCK_PACKED` layout: the whole blocks holding the
        tokens, unpacked, then the tokens' range."""
        held, skip = self._blocks(kv, block_ids, start, tokens)
        return tuple(self._unpack(self._cpu_rows(kv, role)[held], role)
                     [:, skip:skip + tokens].contiguous() for role in ("key", "value"))

    def _write_blocks(self, kv: torch.Tensor, block_ids: Sequence[int], start: int, role: str,
                      y: torch.Tensor) -> None:
        """:meth:`write` of a :data:`BLOCK_PACKED` layout, ``y`` ``[H, T, D]`` in the cache's
        dtype: the blocks holding the tokens are unpacked (where the range leaves some of
        their tokens out), written, packed and put back whole."""
        n, tokens = self.block_size(kv), y.shape[1]
        held, skip = self._blocks(kv, block_ids, start, tokens)
        rows = self._cpu_rows(kv, role)
        # the first and last blocks' other tokens must stay as they are
        partial = sorted({i for i, cut in ((0, skip), (len(held) - 1, (skip + tokens) % n))
                          if cut})
        if partial:
            every = y.new_empty(y.shape[0], len(held) * n, y.shape[2])
            kept = self._unpack(rows[held[partial]], role)
            for j, i in enumerate(partial):
                every[:, i * n:(i + 1) * n] = kept[:, j * n:(j + 1) * n]
            every[:, skip:skip + tokens] = y
        else:
            every = y
        rows[held] = self._pack(every, role, n)

    def scatter(self, kv: torch.Tensor, block_ids: Sequence[int], start: int,
                keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write K/V ``[kv_heads, T, head_dim]`` into tokens ``[start, start+T)`` of the blocks."""
        if keys.shape != values.shape or keys.ndim != 3:
            raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} must "
                             "both be [kv_heads, tokens, head_dim]")
        self.write(kv, block_ids, start, "key", keys)
        self.write(kv, block_ids, start, "value", values)

    def write(self, kv: torch.Tensor, block_ids: Sequence[int], start: int, role: str,
              x: torch.Tensor) -> None:
        """Write one role's ``x`` ``[kv_heads, T, head_dim]`` (``role``: "key" or "value")
        into tokens ``[start, start+T)`` of the blocks, cast to the cache's dtype and device
        (quantized, for an fp8 cache); :class:`KvtoolError` where the cast to float16 would
        make inf of a value, before any slot is written."""
        self.check(kv)
        if role not in ("key", "value"):
            raise ValueError(f"role must be 'key' or 'value', got {role!r}")
        if x.ndim != 3:
            raise ValueError(f"{role}s {tuple(x.shape)} must be [kv_heads, tokens, head_dim]")
        heads, tokens, dim = (int(s) for s in x.shape)
        if heads != self.num_heads(kv) or dim != self.head_dim:
            raise ValueError(f"cannot write {heads} heads × head_dim {dim} into a paged cache "
                             f"of {self.num_heads(kv)} heads × head_dim {self.head_dim}")
        blk, off = slots(block_ids, self.block_size(kv), start, start + tokens, kv.device,
                         self.num_blocks(kv))
        if self.fp8 is not None:
            y = self.fp8.encode(x.to(kv.device), role).view(kv.dtype)  # [H, T, D]
        else:
            y = x.to(device=kv.device, dtype=kv.dtype)
        if kv.dtype == torch.float16 and x.dtype != torch.float16 and \
                not bool(torch.isfinite(y).all()):  # the cast made inf of a number
            raise KvtoolError(f"{role}s hold values past float16's 65504 (stored as "
                              f"{str(x.dtype).removeprefix('torch.')}): a float16 cache "
                              "cannot take them")
        if self.name in BLOCK_PACKED:
            self._write_blocks(kv, block_ids, start, role, y)
            return
        view, index, trailing = self._slots_of(kv, role, blk, off)
        view[index] = y.transpose(0, 1).reshape(tokens, heads, *trailing)


def slots(block_ids: Sequence[int], block_size: int, start: int, stop: int,
          device: torch.device | str = "cpu",
          num_blocks: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(block id, offset) index tensors of tokens ``[start, stop)``; ValueError where a block
    they use is not one of the cache's ``num_blocks`` (torch would take -1 as the last block,
    and a CUDA kernel past the end kills the engine)."""
    if not 0 <= start <= stop:
        raise ValueError(f"bad token range [{start}, {stop})")
    if stop > len(block_ids) * block_size:
        raise ValueError(f"tokens up to {stop} need {-(-stop // block_size)} blocks of "
                         f"{block_size}, the sequence has {len(block_ids)}")
    used = block_ids[start // block_size:-(-stop // block_size)] if stop > start else []
    if num_blocks is not None and used and not 0 <= min(used) <= max(used) < num_blocks:
        raise ValueError(f"block ids {min(used)}..{max(used)} for tokens [{start}, {stop}): "
                         f"the paged cache has blocks 0..{num_blocks - 1}")
    pos = torch.arange(start, stop, device=device)
    return ids_on(used, device)[pos // block_size - start // block_size], pos % block_size


def ids_on(ids: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """``ids`` as a long tensor on ``device``; to a GPU through pinned memory, without
    waiting (a pageable copy blocks the host until the stream drains, at every layer)."""
    table = torch.as_tensor(list(ids), dtype=torch.long)
    if torch.device(device).type != "cuda":
        return table
    return table.pin_memory().to(device, non_blocking=True)


def kernel_block_ids(block_ids: Sequence[int], ratio: int) -> list[int]:
    """Scheduler block ids → the kernel block ids when each block is split into ``ratio``."""
    if ratio == 1:
        return list(block_ids)
    return [b * ratio + j for b in block_ids for j in range(ratio)]


def detect_layout(kv: torch.Tensor, head_dim: int, backend: str | None = None,
                  isa: str | None = None, fp8: Fp8Cache | None = None) -> PagedLayout:
    """The layout of a per-layer paged tensor, from the backend name and its shape (``fp8``:
    the cache holds fp8 codes, see :class:`PagedLayout`)."""
    name = (backend or "").upper()
    if name.startswith("CPU"):
        if isa not in (None, "vec", "vec16", "amx"):
            raise UnsupportedLayoutError(f"the CPU attention ISA {isa!r} packs its paged cache "
                                         "in a layout kvtool does not know (vec, vec16, amx)")
        layout = PagedLayout("cpu_amx" if isa == "amx" else "cpu", head_dim, fp8=fp8)
    elif kv.ndim == 5 and kv.shape[0] == 2:
        layout = PagedLayout("flash", head_dim, fp8=fp8)
    elif kv.ndim == 4 and kv.shape[-1] == 2 * head_dim:
        layout = PagedLayout("split", head_dim, fp8=fp8)
    else:
        raise UnsupportedLayoutError(f"unknown paged KV tensor {tuple(kv.shape)} "
                                     f"(backend {backend!r}, head_dim {head_dim})")
    layout.check(kv)
    return layout
