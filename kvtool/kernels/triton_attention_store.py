"""The encoded tokens of one layer as :mod:`kvtool.kernels.triton_attention` reads them: a
:class:`Store` (:func:`prepare`) checks the code and norm arrays once, makes them contiguous,
groups blocks by rotation candidate and keys the plans of every call over it, since a store
serves every attention call of a layer until it changes."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from kvtool.kernels.triton_cuda import BITS, DIMS, supported
from kvtool.kernels.triton_launch import Signature, meta


class Store(NamedTuple):
    """One layer's encoded keys and values as
    :func:`~kvtool.kernels.triton_attention.attend_store` reads them, made by
    :func:`prepare`: checked, made contiguous, grouped by rotation and keyed once, since a
    store serves every attention call of a layer until it changes (a decode step's layers
    share the shapes, so they share a plan too)."""

    k_codes: torch.Tensor
    k_norms: torch.Tensor
    v_codes: torch.Tensor
    v_norms: torch.Tensor
    dim: int
    k_bits: int
    v_bits: int
    k_seeds: tuple[int, ...]
    v_seeds: tuple[int, ...]
    key_means: torch.Tensor | None  # fp16
    block: int
    blocks: int
    order: torch.Tensor  # with several candidates, else ``k_codes`` (unread)
    offsets: torch.Tensor
    words: tuple[bool, bool]  # each role's codes start on a 32-bit word
    signature: Signature  # what a plan depends on
    heads: int  # B·Hkv (the codes may be [B, Hkv, N, bytes]: the kernel reads pointers)
    tokens: int  # N


_GROUPS: OrderedDict[tuple[Any, ...], tuple[Any, ...]] = OrderedDict()
_GROUPS_LOCK = threading.Lock()


def _groups(k_rot: torch.Tensor | None, v_rot: torch.Tensor | None, ck: int, cv: int,
            heads: int, blocks: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(order int32 [BH, blocks], offsets int32 [BH, CK·CV + 1]): each row's blocks sorted
    (stably) by group ``v_rot · CK + k_rot``; group g's blocks are ``order[offsets[g]:
    offsets[g + 1]]``. Memoised on the rotation tensors' memory (a store changes once per new
    block); the entry keeps them alive, so their addresses cannot be reused while it stands.
    Tensors written in place must not come again (inference tensors count no versions)."""
    def ident(t: torch.Tensor | None) -> tuple[Any, ...]:
        if t is None:
            return (None,)
        version = -1 if t.is_inference() else t._version
        return t.data_ptr(), version, tuple(t.shape), t.stride()

    key = (*ident(k_rot), *ident(v_rot), ck, cv, heads, blocks, str(device))
    with _GROUPS_LOCK:
        hit = _GROUPS.get(key)
        if hit is not None:
            _GROUPS.move_to_end(key)
            return hit[2], hit[3]
    group = torch.zeros((heads, blocks), dtype=torch.int64, device=device)
    if k_rot is not None:
        group += k_rot.reshape(heads, blocks).long()
    if v_rot is not None:
        group += v_rot.reshape(heads, blocks).long() * ck
    values, order = torch.sort(group, dim=1, stable=True)
    bounds = torch.arange(ck * cv + 1, device=device).expand(heads, -1).contiguous()
    entry = (k_rot, v_rot, order.to(torch.int32).contiguous(),
             torch.searchsorted(values, bounds).to(torch.int32))
    with _GROUPS_LOCK:
        _GROUPS[key] = entry
        while len(_GROUPS) > 256:
            _GROUPS.popitem(last=False)
    return entry[2], entry[3]


def _check_codes(name: str, codes: torch.Tensor, norms: torch.Tensor, heads: int, n: int,
                 nbytes: int) -> None:
    if tuple(codes.shape) != (heads, n, nbytes) or tuple(norms.shape) != (heads, n) \
            or codes.dtype != torch.uint8 or not norms.is_floating_point():
        raise ValueError(f"attention from codes: {name} codes {tuple(codes.shape)} "
                         f"{codes.dtype} / norms {tuple(norms.shape)} {norms.dtype} are not "
                         f"uint8 [{heads}, {n}, {nbytes}] / float [{heads}, {n}]")


def prepare(k_codes: torch.Tensor, k_norms: torch.Tensor, v_codes: torch.Tensor,
            v_norms: torch.Tensor, *, dim: int, k_bits: int, v_bits: int,
            k_seeds: Sequence[int], v_seeds: Sequence[int],
            k_rotations: torch.Tensor | None = None, v_rotations: torch.Tensor | None = None,
            key_means: torch.Tensor | None = None, block: int = 0) -> Store:
    """The :class:`Store` of encoded tokens (arguments as
    :func:`~kvtool.kernels.triton_attention.attend`'s); ValueError for
    arrays no encode writes."""
    k_seeds, v_seeds = tuple(k_seeds), tuple(v_seeds)
    for bits in (k_bits, v_bits):
        if not supported(dim, bits):
            raise ValueError(f"attention from codes supports dims {DIMS} and bits {BITS}, "
                             f"got dim={dim} bits={bits}")
    if k_codes.ndim != 3:
        raise ValueError(f"attention from codes: key codes must be [B·Hkv, N, bytes], got "
                         f"{tuple(k_codes.shape)}")
    heads, n = k_codes.shape[0], k_codes.shape[1]
    _check_codes("key", k_codes, k_norms, heads, n, dim * k_bits // 8)
    _check_codes("value", v_codes, v_norms, heads, n, dim * v_bits // 8)
    ck, cv = len(k_seeds), len(v_seeds)
    sorted_ = ck > 1 or cv > 1
    if (sorted_ or key_means is not None) and (block < 1 or n % block):
        raise ValueError(f"attention from codes: {n} encoded tokens are not whole blocks of "
                         f"{block}")
    blocks = n // block if block >= 1 else 1
    for name_, t, want in (("k_rotations", k_rotations, (heads, blocks)),
                           ("v_rotations", v_rotations, (heads, blocks)),
                           ("key_means", key_means, (heads, blocks, dim))):
        if t is not None and tuple(t.shape) != want:
            raise ValueError(f"attention from codes: {name_} {tuple(t.shape)}, expected {want}")
    k_codes, v_codes = k_codes.contiguous(), v_codes.contiguous()
    if sorted_:
        order, offsets = _groups(k_rotations, v_rotations, ck, cv, heads, blocks,
                                 k_codes.device)
    else:
        order = offsets = k_codes
    signature = Signature(meta(k_codes), meta(k_norms), meta(v_codes), meta(v_norms),
                          key_means is not None, dim, k_bits, v_bits, k_seeds, v_seeds, block,
                          k_codes.device)
    return Store(k_codes, k_norms.contiguous(), v_codes, v_norms.contiguous(), dim, k_bits,
                 v_bits, k_seeds, v_seeds,
                 None if key_means is None else key_means.to(torch.float16).contiguous(),
                 block, blocks, order, offsets,
                 (k_codes.data_ptr() % 4 == 0, v_codes.data_ptr() % 4 == 0), signature, heads, n)


__all__ = ["Store", "prepare"]
