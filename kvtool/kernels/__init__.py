"""Array backends for codec math.

Each backend is a module exposing the same small set of functions (the "ops namespace", passed
to codecs as ``xp``): ``numpy_ops`` is the reference, ``torch_ops`` runs on CPU and CUDA. The
backend is picked from the type of the input array, so ``codec.encode(torch_tensor)`` returns
torch arrays and ``codec.encode(ndarray)`` numpy ones; both decode each other's bytes.

Later backends (Triton, MLX) add a module with the same functions and a branch in
:func:`ops_for`.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from kvtool.errors import CodecError

Array = Any  # numpy.ndarray | torch.Tensor (and later mlx.core.array)

FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def _is_torch(x: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def ops_for(x: Array) -> ModuleType:
    """The ops namespace for ``x``'s array type."""
    if _is_torch(x):
        from kvtool.kernels import torch_ops

        return torch_ops
    from kvtool.kernels import numpy_ops

    return numpy_ops


def available_backends() -> list[str]:
    """Backends importable in this environment, reference first."""
    import importlib.util

    names = ["numpy"]
    if importlib.util.find_spec("torch") is not None:
        names.append("torch")
    return names


def to_numpy(x: Array):
    """A numpy view/copy of ``x`` (bf16 becomes ``ml_dtypes.bfloat16``)."""
    if _is_torch(x):
        from kvtool.kernels import torch_ops

        return torch_ops.to_numpy(x)
    import numpy as np

    return np.asarray(x)


def to_torch(x: Array, device: Any = None):
    """A torch tensor holding ``x`` (numpy bf16 arrays keep their dtype)."""
    from kvtool.kernels import torch_ops

    return torch_ops.from_numpy(to_numpy(x), device) if not _is_torch(x) else x.to(device)


def check_finite(xp: ModuleType, x: Array, who: str) -> None:
    """Raise :class:`CodecError` if ``x`` holds NaN or Inf."""
    if not xp.all_finite(x):
        raise CodecError(f"{who}: input contains NaN or Inf values; refusing to encode")


def row_blocks(xp: ModuleType, like: Array, rows: int, width: int) -> list[slice]:
    """``rows`` split into near-equal blocks of at most ``xp.block_rows(like, width)`` rows.

    Equal blocks leave no small remainder: BLAS rounds a matmul of a few rows differently from
    a large one, and each row should come out as it would from one whole-array matmul.
    """
    count = max(1, -(-rows // xp.block_rows(like, width)))
    return [slice(i * rows // count, (i + 1) * rows // count) for i in range(count)]
