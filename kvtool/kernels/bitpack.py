"""LSB-first bit packing shared by every backend.

Codes of ``bits`` bits are laid out back to back, the first code in the lowest bits of the first
byte; a code may straddle two bytes (3-bit codes do). A row of ``n`` codes takes exactly
``ceil(n * bits / 8)`` bytes.

Packing works on whole groups of ``g = 8 / gcd(8, bits)`` codes (``g * bits / 8`` bytes): each
output byte is the OR of a few shifted uint8 columns, given by a static plan. That keeps every
operation on uint8 at 1/g of the data size, which is several times faster than widening to
integers, and the same code serves numpy and torch (their uint8 shifts truncate alike).
"""

from __future__ import annotations

from functools import cache
from math import gcd
from types import ModuleType
from typing import Any


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
