"""What every Triton kernel module of kvtool shares: the ``triton`` import, interpreter mode,
decoration, autotune persistence, launches without Triton's per-call dispatch, and the host
arithmetic of launch grids.

Kernels are decorated when their module is imported: they run under the interpreter only if
``TRITON_INTERPRET=1`` was set then (:data:`INTERPRET`), and only if it was also set when
triton itself was first imported (its ``tl.sum``/``tl.max`` are decorated then).
"""

from __future__ import annotations

import inspect
import os
from functools import lru_cache
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None

#: whether kernels decorated now run in interpreter mode (then on CPU tensors)
INTERPRET = triton is not None and os.environ.get("TRITON_INTERPRET", "") == "1"
# the interpreter multiplies bf16 dot operands as their raw uint16 bits: widen them first (exact)
_INTERP = tl.constexpr(INTERPRET) if triton is not None else None


def available() -> bool:
    """Triton is importable and its kernels can run here (CUDA, or the interpreter)."""
    return triton is not None and (INTERPRET or torch.cuda.is_available())


def _jit(fn: Any) -> Any:
    return fn if triton is None else triton.jit(fn)


def _persisted() -> dict[str, Any]:
    """``cache_results=True`` where this Triton's autotuner can keep its results on disk, unless
    ``KVTOOL_AUTOTUNE_CACHE=0``: a process whose timings should not decide for later ones (one
    of several sharing a GPU, or calls far smaller than the real ones) still compiles every
    config into Triton's cache, but leaves no choice behind (Triton's own
    ``TRITON_CACHE_AUTOTUNING=1`` would turn it back on: it is dropped). Read when the kernels
    are decorated (at import)."""
    if os.environ.get("KVTOOL_AUTOTUNE_CACHE", "") == "0":
        os.environ.pop("TRITON_CACHE_AUTOTUNING", None)
        return {}
    params = inspect.signature(triton.autotune).parameters
    return {"cache_results": True} if "cache_results" in params else {}


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for launch grids: plain integer arithmetic (``triton.cdiv`` is a traced
    constexpr function in newer Tritons, ~5 µs a host call; ``attend`` made seven)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two ≥ ``n`` (1 for n ≤ 1), on the host."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    """The device's SMs (4 for CPU tensors under the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count \
        if device.type == "cuda" else 4


#: each kernel's :class:`~kvtool.kernels.triton_launch.Launcher`, made at its first launch
_LAUNCHERS: dict[Any, Any] = {}


def launch(kernel: Any, grid: Any, args: tuple[Any, ...], constants: dict[str, Any],
           tuned: tuple[Any, ...] = ()) -> None:
    """``kernel[grid](*args, **constants)``, repeat launches of a specialisation without
    Triton's per-call dispatch (a Launcher per kernel; ``tuned``: the autotune key's runtime
    arguments): an encode or decode of a cache block is a few µs of kernel time, and Triton's
    dispatch of ~25 arguments costs tens of µs of host time on a GPU host."""
    launcher = _LAUNCHERS.get(kernel)
    if launcher is None:
        from kvtool.kernels.triton_launch import Launcher  # it imports this module

        launcher = _LAUNCHERS[kernel] = Launcher(kernel)
    launcher(grid, args, constants, tuned)


__all__ = ["INTERPRET", "available", "cdiv", "launch", "next_power_of_2", "tl", "triton"]
