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
from kvtool.kernels.numba_packing import pack_bits, unpack_bits, unpack_lookup
from kvtool.kernels.numba_support import (
    bf16_to_f32,
    empty_like_backend,
    f16_to_f32,
    f32_as_u32,
    f32_to_bf16,
    f32_to_f16,
    jit,
    kernel_view,
    num_threads,
    u32_as_f32,
)
from kvtool.kernels.numpy_ops import FP16_MAX

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


#: float16's finite range, as float32 (a float64 bound would widen the kernels' arithmetic)
_FP16_MAX = np.float32(FP16_MAX)


def from_f32(value, like):  # pragma: no cover
    """``value`` as an output element of ``like``'s type; float16 saturates at ±65504, as
    every backend's decode does."""
    raise NotImplementedError


@overload(from_f32, inline="always")
def _from_f32(value, like):
    if like == types.float32:
        return lambda value, like: value
    if like == types.uint16:
        return lambda value, like: f32_to_f16(min(max(value, -_FP16_MAX), _FP16_MAX))
    if like == types.int16:
        return lambda value, like: numba.int16(f32_to_bf16(value))
    return None


def as_word(value):  # pragma: no cover - replaced by the overload inside compiled code
    raise NotImplementedError


@overload(as_word, inline="always")
def _as_word(value):
    """The bits of an output element (as :func:`from_f32` gives it) in the low end of a uint64."""
    if value == types.float32:
        return lambda value: np.uint64(f32_as_u32(value))
    if value == types.uint16:
        return lambda value: np.uint64(value)
    if value == types.int16:
        return lambda value: np.uint64(np.uint16(value))
    return None


def from_word(word, like):  # pragma: no cover - replaced by the overload inside compiled code
    raise NotImplementedError


@overload(from_word, inline="always")
def _from_word(word, like):
    """The element of ``like``'s type held in the low end of a uint64 (inverse of as_word)."""
    if like == types.float32:
        return lambda word, like: u32_as_f32(np.uint32(word & np.uint64(0xFFFFFFFF)))
    if like == types.uint16:
        return lambda word, like: np.uint16(word & np.uint64(0xFFFF))
    if like == types.int16:
        return lambda word, like: np.int16(np.uint16(word & np.uint64(0xFFFF)))
    return None


# -- shared tile steps ---------------------------------------------------------------------------
@numba.njit(inline="always")
def _fwht(t, signs):
    """Unnormalised Walsh–Hadamard transform of ``signs ⊙ t`` along axis 0 of ``t[dim, TILE]``.

    Radix-8 passes (three butterfly stages per pass over the tile), then one radix-4 or radix-2
    pass for what remains; the sign flips ride on the first pass. Stages act on distinct bits of
    the index, so their order does not change the result.
    """
    dim, width = t.shape  # a runtime width: LLVM vectorises these loops, a constant it unrolls
    h = 1
    while 8 * h <= dim:
        for i in range(0, dim, 8 * h):
            for j in range(i, i + h):
                s0, s1, s2, s3 = np.float32(1), np.float32(1), np.float32(1), np.float32(1)
                s4, s5, s6, s7 = np.float32(1), np.float32(1), np.float32(1), np.float32(1)
                if h == 1:
                    s0, s1, s2, s3 = signs[j], signs[j + 1], signs[j + 2], signs[j + 3]
                    s4, s5, s6, s7 = signs[j + 4], signs[j + 5], signs[j + 6], signs[j + 7]
                for v in range(width):
                    a0, a1 = t[j, v] * s0, t[j + h, v] * s1
                    a2, a3 = t[j + 2 * h, v] * s2, t[j + 3 * h, v] * s3
                    a4, a5 = t[j + 4 * h, v] * s4, t[j + 5 * h, v] * s5
                    a6, a7 = t[j + 6 * h, v] * s6, t[j + 7 * h, v] * s7
                    b0, b1, b2, b3 = a0 + a1, a0 - a1, a2 + a3, a2 - a3
                    b4, b5, b6, b7 = a4 + a5, a4 - a5, a6 + a7, a6 - a7
                    c0, c1, c2, c3 = b0 + b2, b1 + b3, b0 - b2, b1 - b3
                    c4, c5, c6, c7 = b4 + b6, b5 + b7, b4 - b6, b5 - b7
                    t[j, v], t[j + 4 * h, v] = c0 + c4, c0 - c4
                    t[j + h, v], t[j + 5 * h, v] = c1 + c5, c1 - c5
                    t[j + 2 * h, v], t[j + 6 * h, v] = c2 + c6, c2 - c6
                    t[j + 3 * h, v], t[j + 7 * h, v] = c3 + c7, c3 - c7
        h *= 8
    if h == 1:  # dim 4: the signs have not been applied yet
        for j in range(dim):
            s = signs[j]
            for v in range(width):
                t[j, v] *= s
    if 4 * h <= dim:
        for i in range(0, dim, 4 * h):
            for j in range(i, i + h):
                for v in range(width):
                    a, b, c, d = t[j, v], t[j + h, v], t[j + 2 * h, v], t[j + 3 * h, v]
                    ab, amb, cd, cmd = a + b, a - b, c + d, c - d
                    t[j, v] = ab + cd
                    t[j + h, v] = amb + cmd
                    t[j + 2 * h, v] = ab - cd
                    t[j + 3 * h, v] = amb - cmd
    elif 2 * h <= dim:
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


# -- turbo encode ----------------------------------------------------------------------------
@jit(parallel=True, nogil=True)
def turbo_encode_kernel(x, x_words, s1, s2, bounds, bits, codes, code_words, norms, threads,
                        tile_width):
    """codes[r] = packed bucket indices of R x[r] / ‖x[r]‖; norms[r] = ‖x[r]‖ (float32).

    ``x_words``: ``x`` viewed as uint64; ``code_words``: ``codes`` viewed as uint64 where its
    rows are whole words (else empty). Rows move between memory and the transposed tile as 64-bit
    words, a few elements per scalar load or store, and are split or joined across the tile.
    """
    rows, dim = x.shape
    nbytes = codes.shape[1]
    group = 8  # eight codes fill ``bits`` whole bytes, for every bit width
    group_bytes = bits
    ngroups = (dim + group - 1) // group
    nbounds = bounds.shape[0]
    padded = np.full(15, np.inf, np.float32)  # 3, 7 or 15 bounds (bits 2, 3, 4)
    padded[:nbounds] = bounds
    b0, b1, b2, b3, b4, b5, b6, b7 = padded[0], padded[1], padded[2], padded[3], padded[4], \
        padded[5], padded[6], padded[7]
    b8, b9, b10, b11, b12, b13, b14 = padded[8], padded[9], padded[10], padded[11], \
        padded[12], padded[13], padded[14]
    inv_dim = np.float32(1.0) / np.float32(dim)
    itemsize = x.itemsize
    per = 8 // itemsize  # input elements per 64-bit word
    nwords_in = dim // per
    nwords_out = (nbytes + 7) // 8
    whole_words = code_words.shape[0] == rows and code_words.shape[1] * 8 == nbytes
    tiles = (rows + tile_width - 1) // tile_width
    nchunks = max(1, min(tiles, threads * 8))  # several per thread: uneven threads even out
    for c in prange(nchunks):
        t = np.empty((dim, tile_width), np.float32)
        words_in = np.empty((nwords_in, tile_width), np.uint64)
        packed = np.empty((nwords_out, tile_width), np.uint64)  # the tile's codes, transposed
        q = np.empty(tile_width, np.uint32)
        w = np.empty(tile_width, np.uint32)
        inv = np.empty(tile_width, np.float32)
        for tile in range(c * tiles // nchunks, (c + 1) * tiles // nchunks):
            r0 = tile * tile_width
            n = min(tile_width, rows - r0)
            for v in range(n):
                for k in range(nwords_in):
                    words_in[k, v] = x_words[r0 + v, k]
            for v in range(n, tile_width):
                for k in range(nwords_in):
                    words_in[k, v] = 0
            for k in range(nwords_in):
                for e in range(per):
                    d, shift = k * per + e, np.uint64(e * 8 * itemsize)
                    for v in range(tile_width):
                        t[d, v] = to_f32(from_word(words_in[k, v] >> shift, x[0, 0]))
            for v in range(tile_width):
                inv[v] = 0.0
            for d in range(dim):
                for v in range(tile_width):
                    inv[v] += t[d, v] * t[d, v]
            for v in range(tile_width):
                norm = np.float32(np.sqrt(inv[v]))
                if v < n:
                    norms[r0 + v] = norm
                inv[v] = (np.float32(1.0) / (norm if norm > 0 else norm + np.float32(1.0))
                          * inv_dim)
            _fwht(t, s1)
            _fwht(t, s2)
            # bucketize and pack eight codes (``bits`` bytes) at a time, across the tile
            for i in range(nwords_out):
                for v in range(tile_width):
                    packed[i, v] = 0
            for g in range(ngroups):
                for v in range(tile_width):
                    w[v] = 0
                for j in range(min(group, dim - g * group)):
                    d = g * group + j
                    # the bounds as scalars, all compares in registers: one pass per width
                    if nbounds == 3:
                        for v in range(tile_width):
                            y = t[d, v] * inv[v]
                            q[v] = (np.uint32(y > b0) + np.uint32(y > b1) + np.uint32(y > b2))
                    elif nbounds == 7:
                        for v in range(tile_width):
                            y = t[d, v] * inv[v]
                            q[v] = (np.uint32(y > b0) + np.uint32(y > b1) + np.uint32(y > b2)
                                    + np.uint32(y > b3) + np.uint32(y > b4) + np.uint32(y > b5)
                                    + np.uint32(y > b6))
                    else:
                        for v in range(tile_width):
                            y = t[d, v] * inv[v]
                            q[v] = (np.uint32(y > b0) + np.uint32(y > b1) + np.uint32(y > b2)
                                    + np.uint32(y > b3) + np.uint32(y > b4) + np.uint32(y > b5)
                                    + np.uint32(y > b6) + np.uint32(y > b7) + np.uint32(y > b8)
                                    + np.uint32(y > b9) + np.uint32(y > b10)
                                    + np.uint32(y > b11) + np.uint32(y > b12)
                                    + np.uint32(y > b13) + np.uint32(y > b14))
                    shift = np.uint32(j * bits)
                    for v in range(tile_width):
                        w[v] |= q[v] << shift
                bit0 = g * group_bytes * 8
                i, off = bit0 // 64, np.uint64(bit0 % 64)
                for v in range(tile_width):
                    packed[i, v] |= np.uint64(w[v]) << off
                if bit0 % 64 + group_bytes * 8 > 64:  # the group straddles two words
                    back = np.uint64(64) - off
                    for v in range(tile_width):
                        packed[i + 1, v] |= np.uint64(w[v]) >> back
            if whole_words:
                for v in range(n):
                    for i in range(nwords_out):
                        code_words[r0 + v, i] = packed[i, v]
            else:  # rows of fewer than 8 bytes (or not a multiple of 8): byte by byte
                for v in range(n):
                    for b in range(nbytes):
                        shift = np.uint64(8 * (b % 8))
                        codes[r0 + v, b] = np.uint8((packed[b // 8, v] >> shift) & 255)


# -- turbo decode ----------------------------------------------------------------------------
@jit(parallel=True, nogil=True)
def turbo_decode_kernel(codes, code_words, norms, s1, s2, centroids, bits, out, threads,
                        tile_width):
    """out[r] = norm[r] · Rᵀ centroids[unpack(codes[r])], converted to out's dtype.

    ``code_words``: ``codes`` viewed as uint64 where its rows are whole words (else empty).
    """
    rows, dim = out.shape
    nbytes = codes.shape[1]
    nwords_in = (nbytes + 7) // 8
    whole_words = code_words.shape[0] == rows and code_words.shape[1] * 8 == nbytes
    group = 8  # eight codes fill ``bits`` whole bytes, for every bit width
    group_bytes = bits
    ngroups = (dim + group - 1) // group
    mask = np.uint32((1 << bits) - 1)
    inv_dim = np.float32(1.0) / np.float32(dim)
    itemsize = out.itemsize
    per = 8 // itemsize  # output values per 64-bit word
    nwords = dim // per
    out_words = out.view(np.uint64)
    tiles = (rows + tile_width - 1) // tile_width
    nchunks = max(1, min(tiles, threads * 8))  # several per thread: uneven threads even out
    for c in prange(nchunks):
        t = np.empty((dim, tile_width), np.float32)
        words = np.empty((nwords, tile_width), np.uint64)
        packed = np.empty((nwords_in, tile_width), np.uint64)
        w = np.empty(tile_width, np.uint32)
        scale = np.empty(tile_width, np.float32)
        sd = s1 * inv_dim
        ones = np.ones(dim, np.float32)
        for tile in range(c * tiles // nchunks, (c + 1) * tiles // nchunks):
            r0 = tile * tile_width
            n = min(tile_width, rows - r0)
            # the tile's codes as 64-bit little-endian words, transposed: packed[i, v]
            for v in range(n):
                scale[v] = to_f32(norms[r0 + v])
            if whole_words:
                for v in range(n):
                    for i in range(nwords_in):
                        packed[i, v] = code_words[r0 + v, i]
            else:  # rows of fewer than 8 bytes (or not a multiple of 8): assemble byte by byte
                for v in range(n):
                    for i in range(nwords_in):
                        packed[i, v] = 0
                    for b in range(nbytes):
                        packed[b // 8, v] |= np.uint64(codes[r0 + v, b]) << np.uint64(8 * (b % 8))
            for v in range(n, tile_width):
                scale[v] = 0.0
                for i in range(nwords_in):
                    packed[i, v] = 0
            # unpack eight codes (``bits`` bytes) at a time across the tile, and look them up
            for g in range(ngroups):
                bit0 = g * group_bytes * 8
                i, off = bit0 // 64, np.uint64(bit0 % 64)
                if bit0 % 64 + group_bytes * 8 <= 64:
                    for v in range(tile_width):
                        w[v] = np.uint32(packed[i, v] >> off)
                else:  # the group straddles two words
                    back = np.uint64(64) - off
                    for v in range(tile_width):
                        w[v] = np.uint32((packed[i, v] >> off) | (packed[i + 1, v] << back))
                for j in range(min(group, dim - g * group)):
                    d = g * group + j
                    shift = np.uint32(j * bits)
                    for v in range(tile_width):
                        t[d, v] = centroids[(w[v] >> shift) & mask]
            _fwht(t, ones)
            _fwht(t, s2)
            # scale and convert across the tile, gather ``per`` values of a row into one 64-bit
            # word (vectorised), then store the words row by row: ``per`` times fewer scalar
            # stores than transposing element by element
            for k in range(nwords):
                for v in range(tile_width):
                    words[k, v] = 0
                for e in range(per):
                    d = k * per + e
                    sdd, shift = sd[d], np.uint64(e * 8 * itemsize)
                    for v in range(tile_width):
                        value = from_f32((t[d, v] * sdd) * scale[v], out[0, 0])
                        words[k, v] |= as_word(value) << shift
            for v in range(n):
                for k in range(nwords):
                    out_words[r0 + v, k] = words[k, v]


# -- Python entry points: views in, views out ---------------------------------------------------
@cache
def _signs(dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    signs = tuple(s.astype(np.float32) for s in hadamard_signs(dim, seed))
    for s in signs:
        s.setflags(write=False)
    return signs


def _words(a: np.ndarray) -> np.ndarray:
    """A C-contiguous 2-D array viewed as uint64 words, or an empty one where rows are not whole
    words (the kernels then go byte by byte)."""
    if a.shape[0] and a.shape[1] * a.itemsize % 8 == 0:
        return a.view(np.uint64)
    return np.empty((0, 0), np.uint64)


def turbo_encode(x: Any, bits: int, seed: int) -> tuple[Any, Any]:
    """(codes uint8 [rows, nbytes], norms float32 [rows]) of ``x[rows, dim]``."""
    rows, dim = x.shape
    view = np.ascontiguousarray(kernel_view(x))
    codes, codes_v = empty_like_backend(x, (rows, (dim * bits + 7) // 8), "uint8")
    norms, norms_v = empty_like_backend(x, (rows,), "float32")
    if view.dtype not in (np.float32, np.uint16, np.int16):
        view = view.astype(np.float32)
    s1, s2 = _signs(dim, seed)
    bounds = sphere_marginal_codebook(dim, 1 << bits).boundaries
    turbo_encode_kernel(view, _words(view), s1, s2, bounds, bits, codes_v, _words(codes_v),
                        norms_v, num_threads(), TILE)
    return codes, norms


def turbo_decode(codes: Any, norms: Any, dim: int, bits: int, seed: int, dtype: str) -> Any:
    """``[rows, dim]`` in ``dtype`` from packed ``codes[rows, nbytes]`` and fp16 ``norms``."""
    rows = codes.shape[0]
    out, out_v = empty_like_backend(codes, (rows, dim), dtype)
    s1, s2 = _signs(dim, seed)
    codes_v = np.ascontiguousarray(kernel_view(codes))
    turbo_decode_kernel(codes_v, _words(codes_v), np.ascontiguousarray(kernel_view(norms)), s1, s2,
                        sphere_marginal_codebook(dim, 1 << bits).centroids, bits, out_v,
                        num_threads(), TILE)
    return out


__all__ = ["name", "supported", "turbo_encode", "turbo_decode", "pack_bits", "unpack_bits",
           "unpack_lookup", "kernel_view", "TILE"]
