"""numpy ops namespace: the reference backend for codec math."""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

name = "numpy"

#: float16's largest finite value
FP16_MAX = 65504.0

_DTYPES = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "uint8": np.dtype(np.uint8),
    "int8": np.dtype(np.int8),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float64": np.dtype(np.float64),  # also the 8-byte items of packed lookup tables
    "complex128": np.dtype(np.complex128),  # 16-byte items of packed lookup tables
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(x: np.ndarray) -> str:
    return _NAMES.get(x.dtype, str(x.dtype))


def astype(x: np.ndarray, dtype: str, saturate: bool = False) -> np.ndarray:
    """``x`` in ``dtype``; with ``saturate``, float16 values past ±65504 become ±65504, not
    ±inf (decoders: a lossy reconstruction can land a little past a value its input held)."""
    target = _DTYPES[dtype]
    if x.dtype == target:
        return x
    if target != np.float16:
        return x.astype(target)
    with np.errstate(over="ignore"):  # past fp16's range: ±inf, which the callers check for
        y = x.astype(target)
    if not saturate:
        return y
    # x is finite, so y holds no NaN: +inf (0x7C00) is the largest int16 and -inf (0xFC00) the
    # largest uint16 its bits can be; two reductions cost a fraction of a float32 clip
    bits = y.view(np.uint16)
    if bits.size and (int(bits.max()) >= 0xFC00 or int(bits.view(np.int16).max()) >= 0x7C00):
        np.clip(y, -FP16_MAX, FP16_MAX, out=y)
    return y


def const(values: np.ndarray, like: np.ndarray, dtype: str = "float32") -> np.ndarray:
    """A constant (codebook, rotation) on the same backend/device as ``like``.

    Read-only arrays of the right dtype (cached rotations, lookup tables) are returned as they
    are; anything else is copied, so no caller can alter a cached constant through the result.
    """
    values = np.asarray(values)
    if values.dtype == _DTYPES[dtype] and not values.flags.writeable:
        return values
    return values.astype(_DTYPES[dtype])


def empty(shape, dtype: str, like: np.ndarray) -> np.ndarray:
    return np.empty(shape, dtype=_DTYPES[dtype])


def block_rows(like: np.ndarray, width: int) -> int:
    """Rows per block for codecs that walk a ``[rows, width]`` array in blocks.

    ~256K values (1 MiB of float32): each block's temporaries stay in cache and are recycled by
    the allocator, where whole-array temporaries of a few MB are fresh pages on every call.
    """
    return max(1, (1 << 18) // max(width, 1))


def is_contiguous(x: np.ndarray) -> bool:
    return bool(x.flags.c_contiguous)


def all_finite(x: np.ndarray) -> bool:
    if x.dtype.kind != "f":  # ml_dtypes' bfloat16: checked through float32
        x = x.astype(np.float32)
    return bool(np.isfinite(x).all())


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    return np.matmul(a, b, out=out)


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
    """float32 mean over ``axis``, keepdims; 0 (not NaN) over an empty axis."""
    if not x.shape[axis]:
        return x.sum(axis=axis, keepdims=True, dtype=np.float32)
    return x.mean(axis=axis, keepdims=True, dtype=np.float32)


def where(cond, a, b):
    return np.where(cond, a, b)


def round_clip(x: np.ndarray, lo: float, hi: float, dtype: str) -> np.ndarray:
    """Round half to even, clip, cast."""
    return np.clip(np.rint(x), lo, hi).astype(_DTYPES[dtype])


def clip(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    return np.clip(x, lo, hi)


def bucketize(x: np.ndarray, boundaries: np.ndarray) -> np.ndarray:
    """uint8 cell index of each element: the number of sorted ``boundaries`` strictly below it.

    Equals ``searchsorted(side="left")``; a compare-and-add per boundary is several times faster
    than a binary search for the ≤ 15 boundaries codebooks have.
    """
    bounds = boundaries.tolist()
    if not bounds:
        return np.zeros(x.shape, dtype=np.uint8)
    codes = (x > bounds[0]).view(np.uint8)
    for b in bounds[1:]:
        codes += (x > b).view(np.uint8)
    return codes


def take(table: np.ndarray, idx: np.ndarray) -> np.ndarray:
    return np.take(table, idx)  # same as table[idx], with less per-call work


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


def take_rows(x: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``x[idx]`` along the first axis (``idx``: a numpy integer array)."""
    return x[idx]


def concat_rows(parts) -> np.ndarray:
    return np.concatenate(parts, axis=0)


def reshape(x: np.ndarray, shape) -> np.ndarray:
    return x.reshape(shape)


def view(x: np.ndarray, dtype: str) -> np.ndarray:
    return x.view(_DTYPES[dtype])


def copy(x: np.ndarray) -> np.ndarray:
    """A C-contiguous copy that shares no memory with ``x``."""
    return np.array(x, copy=True, order="C")


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


# -- bit packing (one implementation for every backend: kvtool.kernels.bitpack) ---------------
def pack_bits(codes, bits: int):
    from kvtool.kernels import bitpack

    return bitpack.run(sys.modules[__name__], "pack_bits", codes, bits)


def unpack_bits(packed, bits: int, n: int):
    from kvtool.kernels import bitpack

    return bitpack.run(sys.modules[__name__], "unpack_bits", packed, bits, n)


def unpack_lookup(packed, bits: int, n: int, values: np.ndarray):
    from kvtool.kernels import bitpack

    return bitpack.run(sys.modules[__name__], "unpack_lookup", packed, bits, n, values)


def byte_pairs(p: np.ndarray, nbytes: int, starts) -> list[np.ndarray]:
    """For each start ``b``: uint16 ``[..., groups]``, bytes ``b`` and ``b + 1`` of every
    ``nbytes``-byte group of uint8 ``p`` read little-endian (a byte past the end reads as 0).

    Unaligned strided views (numpy allows them) of one padded copy: no shifting or ORing.
    """
    flat = np.empty(p.size + nbytes + 1, dtype=np.uint8)  # slack: reads may overrun the end
    flat[: p.size] = p.reshape(-1)
    flat[p.size :] = 0
    groups = p.size // nbytes
    return [np.ndarray((groups,), dtype="<u2", buffer=flat, offset=b, strides=(nbytes,))
            .reshape(*p.shape[:-1], p.shape[-1] // nbytes) for b in starts]
