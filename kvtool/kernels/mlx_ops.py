"""mlx ops namespace (``mlx.core.array``): same functions and results as :mod:`numpy_ops`.

Runs on mlx's default device (CPU here; the GPU through Metal on Apple silicon) in unified
memory. Three differences from numpy/torch shape the code:

- results are lazy, like every mlx result: codecs get unevaluated arrays back and mlx computes
  them when something needs the values (``mx.eval``, ``np.array``, printing). Checks that decide
  in Python (:func:`all_finite`, the codecs' fp16 range checks) evaluate through ``bool()``, so
  NaN input is refused before anything is returned;
- a slice is a new array, never a view into its parent: ``matmul(out=...)`` cannot write through
  a slice, so it returns its result and codecs store it with ``a[rows] = x``
  (``slices_are_views = False``; turbo checks it);
- mlx has no float8 dtype: ``float8_e4m3fn`` arrays are :class:`Float8`, their raw bytes,
  converted by ``mx.to_fp8``/``mx.from_fp8`` (the same round-to-nearest-even as ml_dtypes).

The rotation codecs rotate with one ``mx.matmul`` by the rotation matrix, as the reference
does. On Linux the ``mlx[cpu]`` wheel runs it on a bundled reference BLAS: measured once here,
``[8192, 128] @ [128, 128]`` float32 takes 64 ms against numpy's 8 ms, most of a turbo encode
or decode; Apple builds use Accelerate (CPU) or Metal (GPU). Fused Metal kernels are designed
in :mod:`kvtool.kernels.mlx_metal`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cache
from typing import Any

import mlx.core as mx
import numpy as np

from kvtool.kernels.numpy_ops import FP16_MAX

name = "mlx"
slices_are_views = False  # see the module docstring; numpy/torch slices are views

_DTYPES = {
    "float32": mx.float32,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
    "uint8": mx.uint8,
    "uint16": mx.uint16,
    "int8": mx.int8,
    "int16": mx.int16,
    "int32": mx.int32,
    "int64": mx.int64,
    "float64": mx.float64,  # CPU only in mlx; no op here needs it
    "bool": mx.bool_,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
FP8 = "float8_e4m3fn"


@dataclass(frozen=True)
class Float8:
    """An e4m3fn array held as its raw bytes (uint8): mlx has no float8 dtype."""

    bytes: mx.array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.bytes.shape)

    @property
    def ndim(self) -> int:
        return self.bytes.ndim


def mx_dtype(dtype: str) -> Any:
    """The mlx dtype named ``dtype``; a CodecError for one mlx cannot hold."""
    found = _DTYPES.get(dtype)
    if found is None:
        from kvtool.errors import CodecError

        raise CodecError(f"mlx backend: arrays of dtype {dtype} are not supported")
    return found


def dtype_name(x: mx.array | Float8) -> str:
    if isinstance(x, Float8):
        return FP8
    return _NAMES.get(x.dtype, str(x.dtype).removeprefix("mlx.core."))


def astype(x: mx.array | Float8, dtype: str, saturate: bool = False) -> mx.array | Float8:
    if isinstance(x, Float8):
        return x if dtype == FP8 else mx.from_fp8(x.bytes, mx_dtype(dtype)) \
            if dtype in ("float32", "float16", "bfloat16") \
            else mx.from_fp8(x.bytes, mx.float32).astype(mx_dtype(dtype))
    if dtype == FP8:  # mx.to_fp8 saturates past ±448 where ml_dtypes gives NaN: callers clip
        return Float8(mx.to_fp8(x))
    target = mx_dtype(dtype)
    if x.dtype == target:
        return x
    if saturate and target == mx.float16:
        x = mx.clip(x.astype(mx.float32), -FP16_MAX, FP16_MAX)  # bf16 has no 65504
    return x.astype(target)


# -- conversion to and from numpy ------------------------------------------------------------
def to_numpy(x: mx.array) -> np.ndarray:
    """A numpy copy of ``x`` (evaluates it); bf16 becomes ``ml_dtypes.bfloat16``.

    numpy cannot take mlx's bf16 buffer (no PEP 3118 code), so bf16 goes through its bits.
    """
    import ml_dtypes

    if isinstance(x, Float8):
        return np.array(x.bytes).view(ml_dtypes.float8_e4m3fn)
    if x.dtype == mx.bfloat16:
        return np.array(x.view(mx.uint16)).view(ml_dtypes.bfloat16)
    return np.array(x)


def from_numpy(a: np.ndarray) -> mx.array | Float8:
    """An mlx array holding a copy of ``a``; a CodecError for a dtype mlx cannot hold."""
    import ml_dtypes

    a = np.ascontiguousarray(a).reshape(a.shape)  # ascontiguousarray makes a 0-d array 1-d
    if a.dtype == ml_dtypes.bfloat16:
        return mx.array(a.view(np.uint16)).view(mx.bfloat16)
    if a.dtype == ml_dtypes.float8_e4m3fn:
        return Float8(mx.array(a.view(np.uint8)))
    return mx.array(a, dtype=mx_dtype(str(a.dtype)))


# -- constants and allocation ----------------------------------------------------------------
_CONST_CACHE: dict[tuple, tuple[np.ndarray, mx.array]] = {}


def const(values: np.ndarray | mx.array, like: Any, dtype: str = "float32") -> mx.array:
    """A constant (codebook, rotation) as an evaluated mlx array, cached per numpy array and
    dtype like torch_ops' (codecs never write into a constant); holding ``values`` keeps its id
    unique."""
    if isinstance(values, mx.array):
        return astype(values, dtype)
    key = (id(values), dtype)
    hit = _CONST_CACHE.get(key)
    if hit is None or hit[0] is not values:
        array = mx.array(np.asarray(values), dtype=mx_dtype(dtype))
        mx.eval(array)
        hit = _CONST_CACHE[key] = (values, array)
    return hit[1]


def empty(shape, dtype: str, like: Any) -> mx.array:
    return mx.zeros(shape, dtype=mx_dtype(dtype))


def block_rows(like: Any, width: int) -> int:
    """One block: mlx builds a lazy graph and runs each op over the whole array anyway, and a
    blocked write-back (``out[rows] = x``) would copy every block once more."""
    return sys.maxsize


def is_contiguous(x: mx.array) -> bool:
    """Always True: mlx copies strided operands itself where an op needs it (and with one
    block, turbo never asks)."""
    return True


def all_finite(x: mx.array) -> bool:
    """True if ``x`` holds no NaN or ±inf (evaluates ``x``).

    ``sum(x * 0)`` is NaN exactly when some element is NaN or ±inf: one reduction with IEEE
    propagation, 1.6 ms per 1M values here against 3.9 ms for ``all(isfinite(x))``.
    """
    return bool(mx.isfinite(mx.sum(x * 0)))


# -- arithmetic --------------------------------------------------------------------------------
def matmul(a: mx.array, b: mx.array, out: Any = None) -> mx.array:
    """``a @ b``. ``out`` is ignored: an mlx slice is a copy, so nothing could be written
    through it (codecs check ``slices_are_views`` and store the result themselves)."""
    return mx.matmul(a, b)


def swap_last(x: mx.array) -> mx.array:
    return mx.swapaxes(x, -1, -2)


def norm(x: mx.array) -> mx.array:
    """L2 norm over the last axis, keepdims."""
    return mx.sqrt(mx.sum(x * x, axis=-1, keepdims=True))


def amax_abs(x: mx.array, axis: int) -> mx.array:
    return mx.max(mx.abs(x), axis=axis, keepdims=True)


def amin(x: mx.array, axis: int) -> mx.array:
    return mx.min(x, axis=axis, keepdims=True)


def amax(x: mx.array, axis: int) -> mx.array:
    return mx.max(x, axis=axis, keepdims=True)


def mean(x: mx.array, axis: int) -> mx.array:
    """float32 mean over ``axis``, keepdims; 0 (not NaN) over an empty axis."""
    if not x.shape[axis]:
        return mx.sum(x.astype(mx.float32), axis=axis, keepdims=True)
    return mx.mean(x.astype(mx.float32), axis=axis, keepdims=True)


def where(cond, a, b):
    return mx.where(cond, a, b)


def round_clip(x: mx.array, lo: float, hi: float, dtype: str) -> mx.array:
    """Round half to even (as ``mx.round`` does), clip, cast."""
    return mx.clip(mx.round(x), lo, hi).astype(mx_dtype(dtype))


def clip(x: mx.array, lo: float, hi: float) -> mx.array:
    return mx.clip(x, lo, hi)


@cache
def _bucketizer(count: int) -> Any:
    """Compiled compare-and-add over ``count`` boundaries (passed as an array, so one kernel
    serves every codebook of that size).

    mx.compile fuses the 2·count elementwise ops into one pass. Measured once on this CPU
    (2M float32 values, 15 boundaries): 19-21 ms eager, 6-7 ms compiled shapeless (14 ms
    compiled per shape); numpy's loop takes 6 ms. Shapeless, so a new token count does not
    retrace. On CPU mlx builds each fused kernel with the system C++ compiler on first use
    (seconds, cached on disk under $TMPDIR/mlx) and runs uncompiled where there is none.
    """

    def run(x: mx.array, bounds: mx.array) -> mx.array:
        codes = (x > bounds[0]).astype(mx.uint8)
        for i in range(1, count):
            codes = codes + (x > bounds[i])
        return codes

    return mx.compile(run, shapeless=True)


def bucketize(x: mx.array, boundaries: np.ndarray | mx.array) -> mx.array:
    """uint8 count of the sorted ``boundaries`` strictly below each element (numpy's rule:
    ``searchsorted(side="left")``), compared in float32 as numpy compares float32 input."""
    if isinstance(boundaries, mx.array):
        bounds = boundaries.astype(mx.float32)
    else:  # codebooks hand the same cached float32 array each call: const caches it
        bounds = const(np.asarray(boundaries, dtype=np.float32), x)
    if bounds.size == 0:
        return mx.zeros(x.shape, dtype=mx.uint8)
    return _bucketizer(bounds.size)(x, bounds)


def take(table: mx.array, idx: mx.array) -> mx.array:
    return mx.take(table, idx)


def pad_last(x: mx.array, pad: int, value: float = 0) -> mx.array:
    if pad == 0:
        return x
    return mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=value)


def pad_axis(x: mx.array, axis: int, pad: int) -> mx.array:
    if pad == 0:
        return x
    width = [(0, 0)] * x.ndim
    width[axis] = (0, pad)
    return mx.pad(x, width, mode="edge")


def take_rows(x: mx.array, idx: np.ndarray) -> mx.array:
    """``x[idx]`` along the first axis (``idx``: a numpy integer array)."""
    return mx.take(x, mx.array(idx.astype(np.int32)), axis=0)


def concat_rows(parts) -> mx.array:
    return mx.concatenate(list(parts), axis=0)


def reshape(x: mx.array, shape) -> mx.array:
    return mx.reshape(x, tuple(shape))


def view(x: mx.array | Float8, dtype: str) -> mx.array | Float8:
    """The same bytes as ``dtype`` (float8: the :class:`Float8` wrapper of uint8 bytes)."""
    if isinstance(x, Float8):
        return x if dtype == FP8 else view(x.bytes, dtype)
    if dtype == FP8:
        return Float8(view(x, "uint8"))
    target = mx_dtype(dtype)
    return x if x.dtype == target else x.view(target)


def copy(x: mx.array) -> mx.array:
    """A new contiguous array: later writes to ``x`` (``x[i] = v`` rebinds ``x``) leave it be."""
    return mx.contiguous(x)


def atan2(y: mx.array, x: mx.array) -> mx.array:
    return mx.arctan2(y, x)


def sqrt(x: mx.array) -> mx.array:
    return mx.sqrt(x)


def cos(x: mx.array) -> mx.array:
    return mx.cos(x)


def sin(x: mx.array) -> mx.array:
    return mx.sin(x)


def stack_last(parts) -> mx.array:
    return mx.stack(list(parts), axis=-1)


# -- bit packing (the shared plans of kvtool.kernels.bitpack, in mlx ops) ----------------------
def pack_bits(codes: mx.array, bits: int) -> mx.array:
    from kvtool.kernels import bitpack

    return bitpack.pack_bits(sys.modules[__name__], codes, bits)


def unpack_bits(packed: mx.array, bits: int, n: int) -> mx.array:
    from kvtool.kernels import bitpack

    return bitpack.unpack_bits(sys.modules[__name__], packed, bits, n)


def unpack_lookup(packed: mx.array, bits: int, n: int, values: np.ndarray) -> mx.array:
    """``values[unpack_bits(packed, bits, n)]`` as float32, without an array of codes.

    bitpack's chunk plan (one gather per chunk of codes), gathering rows of a
    ``[2**(c*bits), c/2]`` uint64 table (two float32 values per item; float32 for c = 1) where
    numpy gathers float64/complex128 items, which mlx lacks on the GPU. Measured once on this
    CPU (2M codes): 13 ms (3-bit) and 15 ms (4-bit) against 33 and 31 ms for unpack_bits + a
    per-code ``mx.take``; uint64 items took the 4-bit gather from 15 to 10 ms (float32 rows).
    """
    from kvtool.kernels import bitpack

    values = np.ascontiguousarray(values, dtype=np.float32)
    if values.shape != (1 << bits,):
        raise ValueError(f"need {1 << bits} table values for {bits}-bit codes, got {values.shape}")
    codes, nbytes = bitpack.group_shape(bits)
    per_chunk, _ = bitpack._chunk_plan(bits)
    ngroups = -(-n // codes)
    lead = tuple(packed.shape[:-1])
    p = pad_last(packed, ngroups * nbytes - packed.shape[-1])
    idx = bitpack._chunk_indices(sys.modules[__name__], p, bits)  # [..., groups, chunks]
    table = _chunk_rows(bitpack._chunk_table(bits, values.tobytes()), per_chunk)
    rows = mx.take(table, idx, axis=0).view(mx.float32)  # [..., groups, chunks, per_chunk]
    out = mx.reshape(rows, (*lead, ngroups * codes))
    return out if ngroups * codes == n else out[..., :n]


_ROWS_CACHE: dict[int, tuple[np.ndarray, mx.array]] = {}


def _chunk_rows(wide: np.ndarray, per_chunk: int) -> mx.array:
    """bitpack's (cached) chunk table as ``[rows, items]`` uint64 or float32, cached per table."""
    hit = _ROWS_CACHE.get(id(wide))
    if hit is None or hit[0] is not wide:
        item = np.uint64 if per_chunk % 2 == 0 else np.float32
        rows = mx.array(wide.view(np.float32).reshape(-1, per_chunk).view(item))
        mx.eval(rows)
        hit = _ROWS_CACHE[id(wide)] = (wide, rows)
    return hit[1]


def byte_pairs(p: mx.array, nbytes: int, starts) -> list[mx.array]:
    """Same as :func:`numpy_ops.byte_pairs` (as uint16): bytes ``b``, ``b + 1`` of each group."""
    q = mx.pad(p.astype(mx.uint16), [(0, 0)] * (p.ndim - 1) + [(0, 1)])
    end = p.shape[-1]
    return [q[..., b:end:nbytes] | (q[..., b + 1:end + 1:nbytes] << 8) for b in starts]
