"""Array backends for codec math.

Each backend is a module exposing the same small set of functions (the "ops namespace", passed
to codecs as ``xp``): ``numpy_ops`` is the reference, ``torch_ops`` runs on CPU and CUDA,
``mlx_ops`` on ``mlx.core`` arrays. The backend is picked from the type of the input array, so
``codec.encode(torch_tensor)`` returns torch arrays, ``codec.encode(mx_array)`` mlx ones and
``codec.encode(ndarray)`` numpy ones; every backend decodes every other's bytes.

A new backend adds a module with the same functions and a branch in :func:`ops_for`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterable
from types import ModuleType
from typing import Any

from kvtool.errors import CodecError

Array = Any  # numpy.ndarray | torch.Tensor | mlx.core.array

FLOAT_DTYPES = ("float32", "float16", "bfloat16")


KERNELS_ENV = "KVTOOL_KERNELS"
KERNEL_MODES = ("auto", "reference", "compiled")


def kernel_mode() -> str:
    """``KVTOOL_KERNELS``: ``auto`` (default: the fastest installed backend for each op),
    ``reference`` (numpy/torch array ops only, for debugging and for tests that compare
    against them) or ``compiled`` (like auto, but an error where no compiled backend loads)."""
    mode = os.environ.get(KERNELS_ENV, "").strip().lower() or "auto"
    if mode not in KERNEL_MODES:
        raise CodecError(f"{KERNELS_ENV}={mode!r} is not one of {', '.join(KERNEL_MODES)}")
    return mode


_COMPILED: dict[str, ModuleType | None] = {}


def _load_compiled(module: str) -> ModuleType | None:
    """``kvtool.kernels.<module>``, or None where its compiler is not installed (cached)."""
    if module not in _COMPILED:
        import importlib

        try:
            _COMPILED[module] = importlib.import_module(f"kvtool.kernels.{module}")
        except ImportError:
            _COMPILED[module] = None
    return _COMPILED[module]


def compiled_for(x: Array) -> ModuleType | None:
    """The compiled backend serving ``x`` (numba on CPU arrays and tensors, Triton on CUDA),
    or None: reference mode, no compiler installed, or a device with no compiled backend.

    Always None for mlx arrays: numba kernels take numpy buffers only, and mlx's own fused
    paths (``mx.compile``) live inside :mod:`kvtool.kernels.mlx_ops` (Metal kernels would be
    :mod:`kvtool.kernels.mlx_metal`), so ``KVTOOL_KERNELS=compiled`` does not refuse them.
    """
    mode = kernel_mode()
    if mode == "reference" or _is_mlx(x):
        return None
    if _is_torch(x) and x.device.type != "cpu":
        found = _load_compiled("triton_cuda") if x.device.type == "cuda" else None
        found = found if found is not None and found.available() else None
        wanted = "Triton (CUDA)"
    else:
        found, wanted = _load_compiled("numba_cpu"), "numba (CPU)"
    if found is None and mode == "compiled":
        raise CodecError(f"{KERNELS_ENV}=compiled but the {wanted} backend is not installed")
    return found


def cpu_kernels() -> ModuleType | None:
    """The compiled backend serving CPU arrays in this process, or None (never raises)."""
    try:
        import numpy as np

        return compiled_for(np.empty(0))
    except CodecError:
        return None


def packing_ops(*bit_widths: int) -> tuple[str, ...]:
    """The bit-packing ops the compiled CPU backend runs for codes of these widths."""
    from kvtool.kernels import bitpack

    if cpu_kernels() is None:
        return ()
    return tuple(op for op in ("pack_bits", "unpack_bits")
                 if any(bitpack.profitable(op, b) for b in bit_widths))


def _is_torch(x: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _is_mlx(x: object) -> bool:
    """An mlx array (or mlx_ops' float8 wrapper); never imports mlx itself."""
    mx = sys.modules.get("mlx.core")
    if mx is None:
        return False
    ops = sys.modules.get("kvtool.kernels.mlx_ops")
    return isinstance(x, mx.array) or (ops is not None and isinstance(x, ops.Float8))


def ops_for(x: Array) -> ModuleType:
    """The ops namespace for ``x``'s array type."""
    if _is_torch(x):
        from kvtool.kernels import torch_ops

        return torch_ops
    if _is_mlx(x):
        from kvtool.kernels import mlx_ops

        return mlx_ops
    from kvtool.kernels import numpy_ops

    return numpy_ops


def available_backends() -> list[str]:
    """Array-op backends importable in this environment, reference first (compiled kernels
    serve each of them where :func:`compiled_for` finds one)."""
    import importlib.util

    names = ["numpy"]
    if importlib.util.find_spec("torch") is not None:
        names.append("torch")
    if _importable("mlx.core"):
        names.append("mlx")
    return names


def _importable(module: str) -> bool:
    """``module`` imports: an ``mlx`` wheel without its platform backend (``mlx[cpu]`` on
    Linux) installs a ``mlx.core`` that fails to load. Imports it (~20 ms)."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def to_numpy(x: Array):
    """A numpy view/copy of ``x`` (bf16 becomes ``ml_dtypes.bfloat16``)."""
    if _is_torch(x):
        from kvtool.kernels import torch_ops

        return torch_ops.to_numpy(x)
    if _is_mlx(x):
        from kvtool.kernels import mlx_ops

        return mlx_ops.to_numpy(x)
    import numpy as np

    return np.asarray(x)


def to_torch(x: Array, device: Any = None):
    """A torch tensor holding ``x`` (numpy bf16 arrays keep their dtype)."""
    from kvtool.kernels import torch_ops

    return torch_ops.from_numpy(to_numpy(x), device) if not _is_torch(x) else x.to(device)


def to_mlx(x: Array):
    """An mlx array holding ``x`` (bf16 keeps its dtype; mlx arrays are returned as they are)."""
    from kvtool.kernels import mlx_ops

    return x if _is_mlx(x) else mlx_ops.from_numpy(to_numpy(x))


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


def warm_up(codecs: Iterable[Any], dtype: str) -> None:
    """Load (or compile) the compiled kernels ``codecs`` will use on ``dtype`` input, so that a
    later encode or decode does not pay it: loading a cached numba kernel takes about half a
    second, a cold compile ~15 s, and numba holds the GIL meanwhile. numba specialises on array
    types, not shapes, so a tiny array warms the real thing. A no-op where no compiled CPU
    backend is active."""
    if cpu_kernels() is None:
        return
    import numpy as np

    from kvtool.kernels import numpy_ops

    x = np.ones((2, 64), dtype=numpy_ops._DTYPES[dtype])
    for codec in codecs:
        with contextlib.suppress(Exception):  # a warm-up must never break the real job
            codec.decode(codec.encode(x), dtype)


def warm_up_async(codecs: Iterable[Any], dtype: str) -> threading.Thread | None:
    """:func:`warm_up` in a background thread (None where no compiled CPU backend is active),
    to overlap it with other start-up work."""
    if cpu_kernels() is None:
        return None
    codecs = list(codecs)
    thread = threading.Thread(target=warm_up, args=(codecs, dtype),
                              name="kvtool-kernel-warm-up", daemon=True)
    thread.start()
    return thread
