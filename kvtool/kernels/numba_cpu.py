"""Compiled CPU backend (numba): fused turbo encode/decode and bit packing.

Each kernel does in one pass over memory what the reference does in a dozen array ops. Rows are
processed in tiles of :data:`TILE` vectors stored transposed (``[dim, TILE]``), so every step —
the sign flips, the Walsh–Hadamard butterflies (radix 4), the scaling, the bucketizing, the
centroid lookup — is a loop over a contiguous run of ``TILE`` floats that LLVM vectorises.
Tiles are spread over numba's threads (``numba.set_num_threads`` / ``NUMBA_NUM_THREADS``).

The rotation is the reference's :func:`~kvtool.codecs.rotation.rotation_matrix` applied as
butterflies: ``R x = H(s₂ ⊙ H(s₁ ⊙ x)) / D``. Sums run in another order than the reference's
matmul, so a coordinate lying within float rounding of a bin boundary may land in the other bin;
every other code is identical, and decoded values agree within float rounding.

Arrays arrive as numpy arrays or CPU torch tensors (zero-copy numpy views of them); fp16 is
passed to the kernels as ``uint16`` and bf16 as ``int16`` (see :mod:`numba_support`).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numba
import numpy as np
from numba import prange, types
from numba.extending import overload

from kvtool.codecs.lloyd_max import sphere_marginal_codebook
from kvtool.codecs.rotation import hadamard_signs, is_power_of_two
from kvtool.kernels import _is_torch
from kvtool.kernels.numba_support import (
    bf16_to_f32,
    f16_to_f32,
    f32_to_bf16,
    f32_to_f16,
    jit,
)

name = "numba"
TILE = 64  # vectors per tile: a [128, 64] float32 tile (32 KiB) stays in L1
MAX_DIM = 1024


def supported(dim: int, bits: int) -> bool:
    """Whether the fused turbo kernels handle this head_dim and bit width."""
    return is_power_of_two(dim) and 4 <= dim <= MAX_DIM and bits in (2, 3, 4)


# -- element conversions, chosen by the array's dtype at compile time ----------------------------
def to_f32(v):  # pragma: no cover - replaced by the overload inside compiled code
    raise NotImplementedError


@overload(to_f32, inline="always")
def _to_f32(v):
    if v == types.float32:
        return lambda v: v
    if v == types.uint16:  # fp16 bits
        return lambda v: f16_to_f32(v)
    if v == types.int16:  # bf16 bits
        return lambda v: bf16_to_f32(numba.uint16(v))
    return None


def from_f32(value, like):  # pragma: no cover
    raise NotImplementedError


@overload(from_f32, inline="always")
def _from_f32(value, like):
    if like == types.float32:
        return lambda value, like: value
    if like == types.uint16:
        return lambda value, like: f32_to_f16(value)
    if like == types.int16:
        return lambda value, like: numba.int16(f32_to_bf16(value))
    return None


# -- shared tile steps ---------------------------------------------------------------------------
@numba.njit(inline="always")
def _fwht(t):
    """Unnormalised Walsh–Hadamard transform along axis 0 of the tile ``t[dim, TILE]``."""
    dim, width = t.shape  # a runtime width: LLVM vectorises these loops, a constant it unrolls
    h = 1
    while 4 * h <= dim:  # radix 4: two butterfly stages per pass over the tile
        for i in range(0, dim, 4 * h):
            for j in range(i, i + h):
                for v in range(width):
                    a, b, c, d = t[j, v], t[j + h, v], t[j + 2 * h, v], t[j + 3 * h, v]
                    ab, amb, cd, cmd = a + b, a - b, c + d, c - d
                    t[j, v] = ab + cd
                    t[j + h, v] = amb + cmd
                    t[j + 2 * h, v] = ab - cd
                    t[j + 3 * h, v] = amb - cmd
        h *= 4
    if h < dim:  # one radix-2 stage left when log2(dim) is odd
        for j in range(h):
            for v in range(width):
                a, b = t[j, v], t[j + h, v]
                t[j, v] = a + b
                t[j + h, v] = a - b


@numba.njit(inline="always")
def _transpose(src, dst):
    """dst[j, i] = src[i, j] (reads strided, writes contiguous: the cheaper way round)."""
    rows, cols = src.shape
    for j in range(cols):
        for i in range(rows):
            dst[j, i] = src[i, j]


@numba.njit(inline="always")
def _scale_rows(t, signs):
    dim, width = t.shape
    for d in range(dim):
        s = signs[d]
        for v in range(width):
            t[d, v] *= s


@numba.njit(inline="always")
def _read_group(packed, r, first, count):
    """The ``count`` bytes of row ``r`` from byte ``first`` as one little-endian word."""
    word = np.uint64(0)
    for k in range(count):
        word |= np.uint64(packed[r, first + k]) << np.uint64(8 * k)
    return word


@numba.njit(inline="always")
def _write_group(out, r, first, count, word):
    for k in range(count):
        out[r, first + k] = np.uint8((word >> np.uint64(8 * k)) & 255)


# -- turbo encode ----------------------------------------------------------------------------
@jit(parallel=True, nogil=True)
def turbo_encode_kernel(x, s1, s2, bounds, bits, codes, norms, threads, tile_width):
    """codes[r] = packed bucket indices of R x[r] / ‖x[r]‖; norms[r] = ‖x[r]‖ (float32)."""
    rows, dim = x.shape
    nbytes = codes.shape[1]
    group = 8  # eight codes fill ``bits`` whole bytes, for every bit width
    group_bytes = bits
    ngroups = (dim + group - 1) // group
    nbounds = bounds.shape[0]
    inv_dim = np.float32(1.0) / np.float32(dim)
    tiles = (rows + tile_width - 1) // tile_width
    nchunks = max(1, min(tiles, threads * 8))  # several per thread: uneven threads even out
    for c in prange(nchunks):
        t = np.empty((dim, tile_width), np.float32)
        buf = np.empty((tile_width, dim), np.float32)
        q = np.empty((dim, tile_width), np.uint8)
        inv = np.empty(tile_width, np.float32)
        w = np.empty(tile_width, np.uint64)
        for tile in range(c * tiles // nchunks, (c + 1) * tiles // nchunks):
            r0 = tile * tile_width
            n = min(tile_width, rows - r0)
            # convert rows as stored (vectorised), then transpose: 3x faster than converting
            # straight into the transposed tile
            for v in range(n):
                for d in range(dim):
                    buf[v, d] = to_f32(x[r0 + v, d])
            for v in range(n, tile_width):
                for d in range(dim):
                    buf[v, d] = 0.0
            _transpose(buf, t)
            for v in range(tile_width):
                inv[v] = 0.0
            for d in range(dim):
                for v in range(tile_width):
                    inv[v] += t[d, v] * t[d, v]
            for v in range(tile_width):
                norm = np.float32(np.sqrt(inv[v]))
                if v < n:
                    norms[r0 + v] = norm
                inv[v] = np.float32(1.0) / (norm if norm > 0 else norm + np.float32(1.0))
            _scale_rows(t, s1)
            _fwht(t)
            _scale_rows(t, s2)
            _fwht(t)
            for d in range(dim):
                for v in range(tile_width):
                    t[d, v] = (t[d, v] * inv_dim) * inv[v]
                    q[d, v] = 0
                for b in range(nbounds):
                    bound = bounds[b]
                    for v in range(tile_width):
                        q[d, v] += np.uint8(t[d, v] > bound)
            for g in range(ngroups):
                for v in range(tile_width):
                    w[v] = 0
                for j in range(group):
                    d = g * group + j
                    if d < dim:
                        shift = np.uint64(j * bits)
                        for v in range(tile_width):
                            w[v] |= np.uint64(q[d, v]) << shift
                first = g * group_bytes
                for v in range(n):
                    _write_group(codes, r0 + v, first, min(group_bytes, nbytes - first), w[v])


# -- turbo decode ----------------------------------------------------------------------------
@jit(parallel=True, nogil=True)
def turbo_decode_kernel(codes, norms, s1, s2, centroids, bits, out, threads, tile_width):
    """out[r] = norm[r] · Rᵀ centroids[unpack(codes[r])], converted to out's dtype."""
    rows, dim = out.shape
    nbytes = codes.shape[1]
    group = 8  # eight codes fill ``bits`` whole bytes, for every bit width
    group_bytes = bits
    ngroups = (dim + group - 1) // group
    mask = np.uint64((1 << bits) - 1)
    inv_dim = np.float32(1.0) / np.float32(dim)
    tiles = (rows + tile_width - 1) // tile_width
    nchunks = max(1, min(tiles, threads * 8))  # several per thread: uneven threads even out
    for c in prange(nchunks):
        t = np.empty((dim, tile_width), np.float32)
        buf = np.empty((tile_width, dim), np.float32)
        scale = np.empty(tile_width, np.float32)
        sd = s1 * inv_dim
        for tile in range(c * tiles // nchunks, (c + 1) * tiles // nchunks):
            r0 = tile * tile_width
            n = min(tile_width, rows - r0)
            for v in range(n):
                for g in range(ngroups):
                    first = g * group_bytes
                    word = _read_group(codes, r0 + v, first, min(group_bytes, nbytes - first))
                    for j in range(group):
                        d = g * group + j
                        if d < dim:
                            t[d, v] = centroids[(word >> np.uint64(j * bits)) & mask]
                scale[v] = to_f32(norms[r0 + v])
            for v in range(n, tile_width):
                scale[v] = 0.0
                for d in range(dim):
                    t[d, v] = 0.0
            _fwht(t)
            _scale_rows(t, s2)
            _fwht(t)
            for d in range(dim):
                sdd = sd[d]
                for v in range(tile_width):
                    t[d, v] = (t[d, v] * sdd) * scale[v]
            _transpose(t, buf)
            for v in range(n):  # converted row by row (vectorised)
                for d in range(dim):
                    out[r0 + v, d] = from_f32(buf[v, d], out[0, 0])


# -- generic bit packing (every codec's codes) ------------------------------------------------
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
            _write_group(out, r, first, min(group_bytes, nbytes - first), word)


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
            word = _read_group(packed, r, first, min(group_bytes, nbytes - first))
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
            word = _read_group(packed, r, first, min(group_bytes, nbytes - first))
            for j in range(min(group, n - g * group)):
                out[r, g * group + j] = values[(word >> np.uint64(j * bits)) & mask]


# -- Python entry points: views in, views out ---------------------------------------------------
@cache
def _signs(dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    signs = tuple(s.astype(np.float32) for s in hadamard_signs(dim, seed))
    for s in signs:
        s.setflags(write=False)
    return signs


def kernel_view(x: Any) -> np.ndarray:
    """A zero-copy numpy view in the kernels' element types (fp16 → uint16, bf16 → int16)."""
    if _is_torch(x):
        import torch

        x = x.detach()
        if x.dtype in (torch.float16, torch.bfloat16):
            view = x.view(torch.int16).numpy()
            return view.view(np.uint16) if x.dtype == torch.float16 else view
        return x.numpy()
    x = np.asarray(x)
    if x.dtype == np.float16:
        return x.view(np.uint16)
    if x.dtype.name == "bfloat16":
        return x.view(np.int16)
    return x


def _empty_like_backend(like: Any, shape: tuple[int, ...], dtype: str) -> tuple[Any, np.ndarray]:
    """(array of ``like``'s type, its kernel view)."""
    if _is_torch(like):
        import torch

        t = torch.empty(shape, dtype=getattr(torch, dtype))
        return t, kernel_view(t)
    from kvtool.kernels import numpy_ops

    a = np.empty(shape, dtype=numpy_ops._DTYPES[dtype])
    return a, kernel_view(a)


def turbo_encode(x: Any, bits: int, seed: int) -> tuple[Any, Any]:
    """(codes uint8 [rows, nbytes], norms float32 [rows]) of ``x[rows, dim]``."""
    rows, dim = x.shape
    view = np.ascontiguousarray(kernel_view(x))
    codes, codes_v = _empty_like_backend(x, (rows, (dim * bits + 7) // 8), "uint8")
    norms, norms_v = _empty_like_backend(x, (rows,), "float32")
    if view.dtype not in (np.float32, np.uint16, np.int16):
        view = view.astype(np.float32)
    s1, s2 = _signs(dim, seed)
    bounds = sphere_marginal_codebook(dim, 1 << bits).boundaries
    turbo_encode_kernel(view, s1, s2, bounds, bits, codes_v, norms_v,
                        numba.get_num_threads(), TILE)
    return codes, norms


def turbo_decode(codes: Any, norms: Any, dim: int, bits: int, seed: int, dtype: str) -> Any:
    """``[rows, dim]`` in ``dtype`` from packed ``codes[rows, nbytes]`` and fp16 ``norms``."""
    rows = codes.shape[0]
    out, out_v = _empty_like_backend(codes, (rows, dim), dtype)
    s1, s2 = _signs(dim, seed)
    turbo_decode_kernel(np.ascontiguousarray(kernel_view(codes)),
                        np.ascontiguousarray(kernel_view(norms)), s1, s2,
                        sphere_marginal_codebook(dim, 1 << bits).centroids, bits, out_v,
                        numba.get_num_threads(), TILE)
    return out


def _rows(a: Any) -> Any:
    return a.reshape(-1, a.shape[-1]) if a.ndim != 2 else a


def pack_bits(codes: Any, bits: int) -> Any:
    """Same bytes as :func:`kvtool.kernels.bitpack.pack_bits`."""
    lead, n = tuple(codes.shape[:-1]), codes.shape[-1]
    out, out_v = _empty_like_backend(codes, (*lead, (n * bits + 7) // 8), "uint8")
    if out.size:
        pack_kernel(np.ascontiguousarray(_rows(kernel_view(codes))), bits, _rows(out_v))
    return out


def unpack_bits(packed: Any, bits: int, n: int) -> Any:
    lead = tuple(packed.shape[:-1])
    out, out_v = _empty_like_backend(packed, (*lead, n), "uint8")
    if out.size:
        unpack_kernel(np.ascontiguousarray(_rows(kernel_view(packed))), bits, _rows(out_v))
    return out


def unpack_lookup(packed: Any, bits: int, n: int, values: np.ndarray) -> Any:
    lead = tuple(packed.shape[:-1])
    out, out_v = _empty_like_backend(packed, (*lead, n), "float32")
    if out.size:
        unpack_lookup_kernel(np.ascontiguousarray(_rows(kernel_view(packed))), bits,
                             np.ascontiguousarray(values, dtype=np.float32), _rows(out_v))
    return out


__all__ = ["name", "supported", "turbo_encode", "turbo_decode", "pack_bits", "unpack_bits",
           "unpack_lookup", "kernel_view", "TILE"]
