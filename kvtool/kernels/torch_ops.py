"""torch ops namespace (CPU and CUDA): same functions and results as :mod:`numpy_ops`."""

from __future__ import annotations

import sys

import numpy as np
import torch

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
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(x: torch.Tensor) -> str:
    return _NAMES.get(x.dtype, str(x.dtype).removeprefix("torch."))


def astype(x: torch.Tensor, dtype: str) -> torch.Tensor:
    return x.to(_DTYPES[dtype])


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
    import ml_dtypes

    a = np.ascontiguousarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    elif a.dtype == ml_dtypes.float8_e4m3fn:
        t = torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn)
    else:
        t = torch.from_numpy(a)
    return t if device is None else t.to(device)


def all_finite(x: torch.Tensor) -> bool:
    return bool(torch.isfinite(x).all())


def matmul(a, b):
    return torch.matmul(a, b)


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
    return x.float().mean(dim=axis, keepdim=True)


def where(cond, a, b):
    return torch.where(cond, a, b)


def round_clip(x, lo: float, hi: float, dtype: str):
    return torch.round(x).clamp_(lo, hi).to(_DTYPES[dtype])


def clip(x, lo: float, hi: float):
    return torch.clamp(x, lo, hi)


def bucketize(x, boundaries):
    """Same as numpy_ops.bucketize (compare-and-add beats torch.bucketize here too)."""
    codes = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for b in boundaries.tolist():
        codes += x > b
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

    return bitpack.pack_bits(sys.modules[__name__], codes, bits)


def unpack_bits(packed, bits: int, n: int):
    from kvtool.kernels import bitpack

    return bitpack.unpack_bits(sys.modules[__name__], packed, bits, n)
