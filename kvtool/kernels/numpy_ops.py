"""numpy ops namespace: the reference backend for codec math."""

from __future__ import annotations

from math import gcd

import ml_dtypes
import numpy as np

name = "numpy"

_DTYPES = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "uint8": np.dtype(np.uint8),
    "int8": np.dtype(np.int8),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(x: np.ndarray) -> str:
    return _NAMES.get(x.dtype, str(x.dtype))


def astype(x: np.ndarray, dtype: str) -> np.ndarray:
    target = _DTYPES[dtype]
    return x if x.dtype == target else x.astype(target)


def const(values: np.ndarray, like: np.ndarray, dtype: str = "float32") -> np.ndarray:
    """A constant (codebook, rotation) on the same backend/device as ``like``."""
    return np.asarray(values).astype(_DTYPES[dtype])


def all_finite(x: np.ndarray) -> bool:
    return bool(np.isfinite(x.astype(np.float32, copy=False)).all())


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.matmul(a, b)


def swap_last(x: np.ndarray) -> np.ndarray:
    return np.swapaxes(x, -1, -2)


def norm(x: np.ndarray) -> np.ndarray:
    """L2 norm over the last axis, keepdims."""
    return np.sqrt(np.einsum("...d,...d->...", x, x))[..., None]


def amax_abs(x: np.ndarray, axis: int) -> np.ndarray:
    return np.abs(x).max(axis=axis, keepdims=True)


def amin(x: np.ndarray, axis: int) -> np.ndarray:
    return x.min(axis=axis, keepdims=True)


def amax(x: np.ndarray, axis: int) -> np.ndarray:
    return x.max(axis=axis, keepdims=True)


def mean(x: np.ndarray, axis: int) -> np.ndarray:
    return x.mean(axis=axis, keepdims=True, dtype=np.float32)


def where(cond, a, b):
    return np.where(cond, a, b)


def round_clip(x: np.ndarray, lo: float, hi: float, dtype: str) -> np.ndarray:
    """Round half to even, clip, cast."""
    return np.clip(np.rint(x), lo, hi).astype(_DTYPES[dtype])


def bucketize(x: np.ndarray, boundaries: np.ndarray) -> np.ndarray:
    """Index of the cell of each element given sorted inner boundaries (uint8)."""
    return np.searchsorted(boundaries, x, side="left").astype(np.uint8)


def take(table: np.ndarray, idx: np.ndarray) -> np.ndarray:
    return table[idx]


def pad_last(x: np.ndarray, pad: int, value: float = 0) -> np.ndarray:
    if pad == 0:
        return x
    width = [(0, 0)] * (x.ndim - 1) + [(0, pad)]
    return np.pad(x, width, constant_values=value)


def pad_axis(x: np.ndarray, axis: int, pad: int) -> np.ndarray:
    if pad == 0:
        return x
    width = [(0, 0)] * x.ndim
    width[axis] = (0, pad)
    return np.pad(x, width, mode="edge")


def reshape(x: np.ndarray, shape) -> np.ndarray:
    return x.reshape(shape)


def view(x: np.ndarray, dtype: str) -> np.ndarray:
    return x.view(_DTYPES[dtype])


def atan2(y: np.ndarray, x: np.ndarray) -> np.ndarray:
    return np.arctan2(y, x)


def sqrt(x: np.ndarray) -> np.ndarray:
    return np.sqrt(x)


def cos(x):
    return np.cos(x)


def sin(x):
    return np.sin(x)


def stack_last(parts) -> np.ndarray:
    return np.stack(parts, axis=-1)


# -- bit packing ---------------------------------------------------------------------------------
def _pack_word_dtype(bits: int):
    return np.uint32 if (8 // gcd(8, bits)) * bits <= 32 else np.uint64


def pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack ``codes[..., n]`` (values < 2**bits) LSB-first into ``ceil(n*bits/8)`` bytes."""
    n = codes.shape[-1]
    group = 8 // gcd(8, bits)  # codes per whole number of bytes
    group_bytes = group * bits // 8
    word_t = _pack_word_dtype(bits)
    c = pad_last(codes, (-n) % group).astype(word_t)
    c = c.reshape(*codes.shape[:-1], -1, group)
    shifts = (np.arange(group, dtype=word_t) * bits).astype(word_t)
    word = np.bitwise_or.reduce(c << shifts, axis=-1)
    byte_shifts = (np.arange(group_bytes, dtype=word_t) * 8).astype(word_t)
    out = ((word[..., None] >> byte_shifts) & 0xFF).astype(np.uint8)
    out = out.reshape(*codes.shape[:-1], -1)
    return out[..., : (n * bits + 7) // 8]


def unpack_bits(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """Inverse of :func:`pack_bits`: ``n`` codes per row."""
    group = 8 // gcd(8, bits)
    group_bytes = group * bits // 8
    word_t = _pack_word_dtype(bits)
    ngroups = -(-n // group)
    p = pad_last(packed, ngroups * group_bytes - packed.shape[-1]).astype(word_t)
    p = p.reshape(*packed.shape[:-1], ngroups, group_bytes)
    byte_shifts = (np.arange(group_bytes, dtype=word_t) * 8).astype(word_t)
    word = np.bitwise_or.reduce(p << byte_shifts, axis=-1)
    shifts = (np.arange(group, dtype=word_t) * bits).astype(word_t)
    mask = word_t((1 << bits) - 1)
    codes = ((word[..., None] >> shifts) & mask).astype(np.uint8)
    return codes.reshape(*packed.shape[:-1], -1)[..., :n]
