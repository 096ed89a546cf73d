"""torch ops namespace (CPU and CUDA): same functions and results as :mod:`numpy_ops`.

On CPU, the few integer-heavy kernels where numpy is several times faster than torch (the fused
unpack + lookup, bucketize) run numpy's implementation on a view sharing the tensor's memory.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from kvtool.kernels.numpy_ops import FP16_MAX

name = "torch"

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int32": torch.int32,
    "int64": torch.int64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float64": torch.float64,  # also the 8-byte items of packed lookup tables
    "complex128": torch.complex128,  # 16-byte items of packed lookup tables
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(x: torch.Tensor) -> str:
    return _NAMES.get(x.dtype, str(x.dtype).removeprefix("torch."))


def astype(x: torch.Tensor, dtype: str, saturate: bool = False) -> torch.Tensor:
    target = _DTYPES[dtype]
    if saturate and target == torch.float16 and x.dtype != target:
        x = x.float().clamp(-FP16_MAX, FP16_MAX)  # bf16 has no 65504 (it rounds up)
    return x.to(target)


_CONST_CACHE: dict[tuple, tuple[np.ndarray, torch.Tensor]] = {}


def const(values: np.ndarray, like: torch.Tensor, dtype: str = "float32") -> torch.Tensor:
    """A constant (codebook, rotation) on ``like``'s device, cached per (array, device)."""
    key = (id(values), like.device, dtype)
    hit = _CONST_CACHE.get(key)
    if hit is None or hit[0] is not values:
        tensor = torch.from_numpy(np.array(values, copy=True)).to(like.device, _DTYPES[dtype])
        hit = _CONST_CACHE[key] = (values, tensor)  # holding ``values`` keeps its id unique
    return hit[1]


def to_numpy(x: torch.Tensor) -> np.ndarray:
    import ml_dtypes

    x = x.detach().cpu().contiguous()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if x.dtype == torch.float8_e4m3fn:
        return x.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return x.numpy()


def from_numpy(a: np.ndarray, device=None) -> torch.Tensor:
    """A tensor sharing ``a``'s memory; a CodecError for a dtype torch cannot hold."""
    import ml_dtypes

    from kvtool.errors import CodecError

    shape = np.shape(a)
    a = np.ascontiguousarray(a)  # (a 0-d array comes back 1-d: ``shape`` restores it)
    if a.dtype == ml_dtypes.bfloat16:
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    elif a.dtype == ml_dtypes.float8_e4m3fn:
        t = torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn)
    elif a.dtype == ml_dtypes.float8_e5m2:
        t = torch.from_numpy(a.view(np.uint8)).view(torch.float8_e5m2)
    else:
        try:
            t = torch.from_numpy(a)
        except TypeError:
            raise CodecError(f"torch backend: arrays of dtype {a.dtype} are not supported") \
                from None
    if t.shape != shape:
        t = t.reshape(shape)
    return t if device is None else t.to(device)


def empty(shape, dtype: str, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(shape, dtype=_DTYPES[dtype], device=like.device)


def block_rows(like: torch.Tensor, width: int) -> int:
    """Rows per block for codecs that walk a ``[rows, width]`` array in blocks.

    On CPU, ~256K values (1 MiB of float32) per thread: each block's temporaries stay in cache
    and are recycled by the allocator, where whole-array temporaries of a few MB are fresh pages
    every call (a 2K-token layer decode paid ~1000 page faults); more threads take bigger blocks,
    so that each op still has a thread's worth of work per synchronisation. GPUs take everything
    in one block.
    """
    if like.device.type != "cpu":
        return sys.maxsize
    return max(1, (torch.get_num_threads() << 18) // max(width, 1))


def is_contiguous(x: torch.Tensor) -> bool:
    return x.is_contiguous()


def all_finite(x: torch.Tensor) -> bool:
    """One reduction without temporaries: min and max propagate NaN and expose ±inf.

    (``isfinite(x).all()`` writes a bool copy first and is ~15x slower on CPU.)
    """
    if x.numel() == 0:
        return True
    lo, hi = torch.aminmax(x)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def matmul(a, b, out=None):
    return torch.matmul(a, b, out=out)


def swap_last(x):
    return x.transpose(-1, -2)


def norm(x):
    return torch.linalg.vector_norm(x, dim=-1, keepdim=True)


def amax_abs(x, axis: int):
    return x.abs().amax(dim=axis, keepdim=True)


def amin(x, axis: int):
    return x.amin(dim=axis, keepdim=True)


def amax(x, axis: int):
    return x.amax(dim=axis, keepdim=True)


def mean(x, axis: int):
    """float32 mean over ``axis``, keepdims; 0 (not NaN) over an empty axis."""
    if not x.shape[axis]:
        return x.float().sum(dim=axis, keepdim=True)
    return x.float().mean(dim=axis, keepdim=True)


def where(cond, a, b):
    return torch.where(cond, a, b)


def round_clip(x, lo: float, hi: float, dtype: str):
    return torch.round(x).clamp_(lo, hi).to(_DTYPES[dtype])


def clip(x, lo: float, hi: float):
    return torch.clamp(x, lo, hi)


def bucketize(x, boundaries):
    """Same as numpy_ops.bucketize (compare-and-add beats torch.bucketize here too).

    CPU tensors run numpy's on a shared view: torch's CPU comparisons into bool are ~6x slower.
    """
    from kvtool.kernels import numpy_ops

    if x.device.type == "cpu":
        return torch.from_numpy(numpy_ops.bucketize(to_numpy(x), boundaries))
    return compare_add(x, boundaries)


def compare_add(x, boundaries):
    """The count of ``boundaries`` below each element, in torch (GPUs)."""
    codes = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for b in boundaries.tolist():
        codes += (x > b).view(torch.uint8)
    return codes


def take(table, idx):
    return table.index_select(0, idx.reshape(-1).to(torch.int32)).reshape(idx.shape)


def pad_last(x, pad: int, value: float = 0):
    if pad == 0:
        return x
    return torch.nn.functional.pad(x, (0, pad), value=value)


def pad_axis(x, axis: int, pad: int):
    if pad == 0:
        return x
    axis = axis % x.ndim
    edge = x.narrow(axis, x.shape[axis] - 1, 1)
    reps = [1] * x.ndim
    reps[axis] = pad
    return torch.cat([x, edge.repeat(reps)], dim=axis)


def take_rows(x, idx: np.ndarray):
    """``x[idx]`` along the first axis (``idx``: a numpy integer array), on ``x``'s device."""
    return x.index_select(0, torch.as_tensor(idx, dtype=torch.int64, device=x.device))


def concat_rows(parts):
    return torch.cat(list(parts), dim=0)


def reshape(x, shape):
    return x.reshape(shape)


def view(x, dtype: str):
    return x.view(_DTYPES[dtype])


def copy(x):
    """A contiguous copy that shares no memory with ``x``."""
    return x.clone(memory_format=torch.contiguous_format)


def atan2(y, x):
    return torch.atan2(y, x)


def sqrt(x):
    return torch.sqrt(x)


def cos(x):
    return torch.cos(x)


def sin(x):
    return torch.sin(x)


def stack_last(parts):
    return torch.stack(parts, dim=-1)


# -- bit packing (one implementation for every backend: kvtool.kernels.bitpack) ---------------
def pack_bits(codes, bits: int):
    from kvtool.kernels import bitpack

    return bitpack.run(sys.modules[__name__], "pack_bits", codes, bits)


def unpack_bits(packed, bits: int, n: int):
    from kvtool.kernels import bitpack

    return bitpack.run(sys.modules[__name__], "unpack_bits", packed, bits, n)


def unpack_lookup(packed, bits: int, n: int, values: np.ndarray):
    """See :func:`bitpack.unpack_lookup`. CPU tensors run it through numpy on a shared view:
    numpy reads byte pairs as unaligned integers (:func:`numpy_ops.byte_pairs`), which makes the
    whole lookup about twice as fast as torch's shifts on strided columns."""
    from kvtool.kernels import bitpack, numpy_ops

    fused = bitpack.compiled(packed, "unpack_lookup", bits)
    if fused is not None:
        return fused(packed, bits, n, values)
    if packed.device.type == "cpu":
        return torch.from_numpy(bitpack.unpack_lookup(numpy_ops, packed.numpy(), bits, n, values))
    return bitpack.unpack_lookup(sys.modules[__name__], packed, bits, n, values)


def byte_pairs(p, nbytes: int, starts) -> list:
    """Same as :func:`numpy_ops.byte_pairs` (as int32): bytes ``b``, ``b + 1`` of each group."""
    q = torch.nn.functional.pad(p.to(torch.int32), (0, 1))
    end = p.shape[-1]
    return [q[..., b:end:nbytes] | (q[..., b + 1:end + 1:nbytes] << 8) for b in starts]
