"""Compiled CPU bit packing (numba): the same bytes as :mod:`kvtool.kernels.bitpack`.

Eight codes of ``bits`` bits fill ``bits`` whole bytes, so rows are packed and unpacked a group
of eight at a time through one 64-bit word; rows are spread over numba's threads.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import prange

from kvtool.kernels.numba_support import (
    empty_like_backend,
    jit,
    kernel_view,
    read_group,
    write_group,
)


@jit(parallel=True, nogil=True)
def pack_kernel(codes, bits, out):
    rows, n = codes.shape
    nbytes = out.shape[1]
    group = 8  # eight codes fill ``bits`` whole bytes, for every bit width
    group_bytes = bits
    ngroups = (n + group - 1) // group
    for r in prange(rows):
        for g in range(ngroups):
            word = np.uint64(0)
            for j in range(min(group, n - g * group)):
                word |= np.uint64(codes[r, g * group + j]) << np.uint64(j * bits)
            first = g * group_bytes
            write_group(out, r, first, min(group_bytes, nbytes - first), word)


@jit(parallel=True, nogil=True)
def unpack_kernel(packed, bits, out):
    rows, n = out.shape
    nbytes = packed.shape[1]
    group = 8  # eight codes fill ``bits`` whole bytes, for every bit width
    group_bytes = bits
    ngroups = (n + group - 1) // group
    mask = np.uint64((1 << bits) - 1)
    for r in prange(rows):
        for g in range(ngroups):
            first = g * group_bytes
            word = read_group(packed, r, first, min(group_bytes, nbytes - first))
            for j in range(min(group, n - g * group)):
                out[r, g * group + j] = np.uint8((word >> np.uint64(j * bits)) & mask)


@jit(parallel=True, nogil=True)
def unpack_lookup_kernel(packed, bits, values, out):
    rows, n = out.shape
    nbytes = packed.shape[1]
    group = 8  # eight codes fill ``bits`` whole bytes, for every bit width
    group_bytes = bits
    ngroups = (n + group - 1) // group
    mask = np.uint64((1 << bits) - 1)
    for r in prange(rows):
        for g in range(ngroups):
            first = g * group_bytes
            word = read_group(packed, r, first, min(group_bytes, nbytes - first))
            for j in range(min(group, n - g * group)):
                out[r, g * group + j] = values[(word >> np.uint64(j * bits)) & mask]


def _rows(a: Any) -> Any:
    return a.reshape(-1, a.shape[-1]) if a.ndim != 2 else a


def pack_bits(codes: Any, bits: int) -> Any:
    """Same bytes as :func:`kvtool.kernels.bitpack.pack_bits`."""
    lead, n = tuple(codes.shape[:-1]), codes.shape[-1]
    out, out_v = empty_like_backend(codes, (*lead, (n * bits + 7) // 8), "uint8")
    if out.size:
        pack_kernel(np.ascontiguousarray(_rows(kernel_view(codes))), bits, _rows(out_v))
    return out


def unpack_bits(packed: Any, bits: int, n: int) -> Any:
    lead = tuple(packed.shape[:-1])
    out, out_v = empty_like_backend(packed, (*lead, n), "uint8")
    if out.size:
        unpack_kernel(np.ascontiguousarray(_rows(kernel_view(packed))), bits, _rows(out_v))
    return out


def unpack_lookup(packed: Any, bits: int, n: int, values: np.ndarray) -> Any:
    lead = tuple(packed.shape[:-1])
    out, out_v = empty_like_backend(packed, (*lead, n), "float32")
    if out.size:
        unpack_lookup_kernel(np.ascontiguousarray(_rows(kernel_view(packed))), bits,
                             np.ascontiguousarray(values, dtype=np.float32), _rows(out_v))
    return out


__all__ = ["pack_bits", "unpack_bits", "unpack_lookup"]
