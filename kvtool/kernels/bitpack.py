"""LSB-first bit packing shared by every backend.

Codes of ``bits`` bits are laid out back to back, the first code in the lowest bits of the first
byte; a code may straddle two bytes (3-bit codes do). A row of ``n`` codes takes exactly
``ceil(n * bits / 8)`` bytes.

Packing works on whole groups of ``g = 8 / gcd(8, bits)`` codes (``g * bits / 8`` bytes): each
output byte is the OR of a few shifted uint8 columns, given by a static plan. That keeps every
operation on uint8 at 1/g of the data size, which is several times faster than widening to
integers, and the same code serves numpy and torch (their uint8 shifts truncate alike).

Codecs that only need each code's table value (turbo's centroids) use :func:`unpack_lookup`,
which goes from packed bytes to values without an array of codes.
"""

from __future__ import annotations

from functools import cache, lru_cache
from math import gcd
from types import ModuleType
from typing import Any

import numpy as np


@cache
def group_shape(bits: int) -> tuple[int, int]:
    """(codes per group, bytes per group)."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bit width must be in 1..8, got {bits}")
    codes = 8 // gcd(8, bits)
    return codes, codes * bits // 8


@cache
def _plan(bits: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """For each byte of a group: (code index, left shift; negative = right shift) terms."""
    codes, nbytes = group_shape(bits)
    plan = []
    for k in range(nbytes):
        terms = tuple((j, j * bits - 8 * k) for j in range(codes)
                      if j * bits < 8 * k + 8 and j * bits + bits > 8 * k)
        plan.append(terms)
    return tuple(plan)


def profitable(op: str, bits: int) -> bool:
    return {"pack_bits": bits % 2 == 1, "unpack_bits": bits % 2 == 1, "unpack_lookup": True}[op]


def compiled(x: Any, op: str, bits: int) -> Any:
    """The compiled CPU kernel for ``op`` ("pack_bits", "unpack_bits", "unpack_lookup") on
    ``x`` where it beats the array-op plan (measured by ``benchmarks/codecs.py``), else None.

    Even widths stay on the array ops (measured: as fast or faster inside int4/kivi codecs,
    whose packing is a few whole-byte shifts); the compiled kernels serve straddling (odd)
    widths and every table lookup.
    """
    from kvtool.kernels import compiled_for

    if not profitable(op, bits):
        return None
    kernels = compiled_for(x)
    return getattr(kernels, op, None) if kernels is not None and kernels.name == "numba" \
        else None


def run(xp: ModuleType, op: str, x: Any, bits: int, *rest: Any) -> Any:
    """``op`` ("pack_bits", "unpack_bits", "unpack_lookup") on ``x``: the compiled CPU kernel
    where :func:`compiled` picks one, else this module's array-op plan on backend ``xp``."""
    fused = compiled(x, op, bits)
    if fused is not None:
        return fused(x, bits, *rest)
    return globals()[op](xp, x, bits, *rest)


def _shift(a: Any, shift: int) -> Any:
    return a << shift if shift > 0 else a >> -shift if shift < 0 else a


def pack_bits(xp: ModuleType, codes: Any, bits: int) -> Any:
    """Pack uint8 ``codes[..., n]`` (values < 2**bits) into ``ceil(n*bits/8)`` bytes per row."""
    n = codes.shape[-1]
    group, nbytes = group_shape(bits)
    ngroups = -(-n // group)
    c = xp.pad_last(codes, ngroups * group - n)
    c = c.reshape(*codes.shape[:-1], ngroups, group)
    out_bytes = []
    for terms in _plan(bits):
        acc = None
        for j, shift in terms:
            t = _shift(c[..., j], shift)
            acc = t if acc is None else acc | t
        out_bytes.append(acc)
    out = xp.stack_last(out_bytes).reshape(*codes.shape[:-1], ngroups * nbytes)
    return out[..., : (n * bits + 7) // 8]


def unpack_bits(xp: ModuleType, packed: Any, bits: int, n: int) -> Any:
    """Inverse of :func:`pack_bits`: ``n`` uint8 codes per row."""
    group, nbytes = group_shape(bits)
    ngroups = -(-n // group)
    p = xp.pad_last(packed, ngroups * nbytes - packed.shape[-1])
    p = p.reshape(*packed.shape[:-1], ngroups, nbytes)
    mask = (1 << bits) - 1
    per_code: list[Any] = [None] * group
    for k, terms in enumerate(_plan(bits)):
        for j, shift in terms:
            t = _shift(p[..., k], -shift)
            per_code[j] = t if per_code[j] is None else per_code[j] | t
    codes = xp.stack_last([c & mask if bits < 8 else c for c in per_code])
    return codes.reshape(*packed.shape[:-1], ngroups * group)[..., :n]


# -- fused unpack + table lookup ----------------------------------------------------------------
# Decoding codes straight to their table values (centroids) skips the uint8 code array and the
# per-code gather: each group's bits are cut into chunks of ``c`` codes (``c * bits`` ≤ 12 bits),
# and one gather per chunk from a ``2**(c*bits)``-row table returns all ``c`` values at once as a
# single wide item (float32, float64 or complex128 holding 1, 2 or 4 float32 values).

_WIDE = {1: "float32", 2: "float64", 4: "complex128"}  # item holding c float32 values


@cache
def _chunk_plan(bits: int) -> tuple[int, tuple[int, ...]]:
    """(codes per chunk, bit offset of each chunk in its group): the fewest chunks whose tables
    stay small (≤ 4096 rows, cache resident) and whose values fit one wide item."""
    codes, _ = group_shape(bits)
    per_chunk = next(c for c in (4, 2, 1) if codes % c == 0 and c * bits <= 12)
    return per_chunk, tuple(range(0, codes * bits, per_chunk * bits))


@lru_cache(maxsize=64)
def _chunk_table(bits: int, values: bytes) -> np.ndarray:
    """Row r: the float32 values of the codes packed in chunk r, viewed as one wide item per row.

    Keyed by the value bytes, so a codec hands the same (cached) array to ``xp.const`` each call.
    """
    per_chunk, _ = _chunk_plan(bits)
    vals = np.frombuffer(values, dtype=np.float32)
    rows = np.arange(1 << (per_chunk * bits))[:, None]
    table = vals[(rows >> (bits * np.arange(per_chunk))) & ((1 << bits) - 1)]
    table = np.ascontiguousarray(table).view(_WIDE[per_chunk]).reshape(-1)
    table.setflags(write=False)
    return table


def _chunk_indices(xp: ModuleType, p: Any, bits: int) -> Any:
    """Integer chunk indices ``[..., groups, chunks]`` of whole-group packed bytes ``p``.

    Every chunk lies within 16 bits starting at a byte boundary, so it is a shift and a mask of
    one little-endian byte pair (``xp.byte_pairs``).
    """
    per_chunk, offsets = _chunk_plan(bits)
    _, nbytes = group_shape(bits)
    width = per_chunk * bits
    if width == 8:  # 2, 4 and 8 bits: the chunk is the byte
        return p[..., None]
    pairs = xp.byte_pairs(p, nbytes, [o // 8 for o in offsets])
    chunks = []
    for pair, shift in zip(pairs, (o % 8 for o in offsets), strict=True):
        c = pair >> shift if shift else pair
        chunks.append(c & ((1 << width) - 1) if shift + width < 16 else c)
    return xp.stack_last(chunks)


def unpack_lookup(xp: ModuleType, packed: Any, bits: int, n: int, values: Any) -> Any:
    """``values[unpack_bits(packed, bits, n)]`` as float32, without materialising the codes.

    ``values`` is a numpy array of ``2**bits`` table entries (e.g. a codebook's centroids).
    """
    values = np.ascontiguousarray(values, dtype=np.float32)
    if values.shape != (1 << bits,):
        raise ValueError(f"need {1 << bits} table values for {bits}-bit codes, got {values.shape}")
    codes, nbytes = group_shape(bits)
    per_chunk, _ = _chunk_plan(bits)
    ngroups = -(-n // codes)
    lead = tuple(packed.shape[:-1])
    p = xp.pad_last(packed, ngroups * nbytes - packed.shape[-1])
    idx = _chunk_indices(xp, p, bits)
    table = xp.const(_chunk_table(bits, values.tobytes()), packed, _WIDE[per_chunk])
    rows = xp.take(table, idx)  # [..., groups, chunks] wide items
    out = xp.reshape(xp.view(rows, "float32"), (*lead, ngroups * codes))
    # contiguous, as a gather returns it: numpy multiplies strided matrices without BLAS
    return out if ngroups * codes == n else xp.copy(out[..., :n])
