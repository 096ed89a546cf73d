"""What every numba kernel module shares: a ``jit`` that caches compiled code when it can, and
float16 conversions.

numba has no CPU float16 type, so kernels take fp16 and bf16 arrays as ``uint16`` views and
convert one value at a time: fp16 with LLVM's ``fpext``/``fptrunc`` on ``half`` (one F16C
instruction each on x86-64 CPUs that have it, which every AVX2 CPU does), bf16 with shifts.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numba
from llvmlite import ir
from numba import types
from numba.extending import intrinsic


def _llvmlite_refuses_dunders() -> None:
    """Make llvmlite's FFI library object answer ``__dict__`` and other dunders like any object.

    ``llvmlite.binding.ffi.lib`` resolves *every* missing attribute as a C function, so
    ``hasattr(lib, "__dict__")`` is true and ``vars(lib)`` returns a function wrapper. vLLM's
    Triton kernel-override scan (``vllm/triton_utils/dispatcher.py``) walks every module's
    namespace and calls ``vars(value).get(...)``: with numba imported first, vLLM fails to start
    (``'_lib_fn_wrapper' object has no attribute 'get'``). No C function's name is a dunder.
    """
    from llvmlite.binding import ffi

    lookup = ffi._lib_wrapper.__getattr__
    if getattr(lookup, "_kvtool_dunders", False):
        return

    def __getattr__(self, name: str):  # noqa: N807
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return lookup(self, name)

    __getattr__._kvtool_dunders = True
    ffi._lib_wrapper.__getattr__ = __getattr__


_llvmlite_refuses_dunders()


def jit(**options: Any) -> Callable[[Callable], Callable]:
    """``numba.njit`` with ``cache=True`` where a cache directory is writable, without where not.

    numba refuses ``cache=True`` at decoration time when neither the package's ``__pycache__``
    nor a user cache directory is writable; the kernels must still work there (compiled on each
    first call). ``NUMBA_CACHE_DIR`` picks another cache directory.
    """
    def wrap(fn: Callable) -> Callable:
        try:
            return numba.njit(cache=True, **options)(fn)
        except RuntimeError:  # "cannot cache function ...: no locator available"
            return numba.njit(cache=False, **options)(fn)

    return wrap


@intrinsic
def f16_to_f32(typingctx, bits):  # noqa: ARG001  (numba's intrinsic signature)
    """float32 value of the IEEE half whose bits are the ``uint16`` ``bits``."""
    def codegen(context, builder, signature, args):
        half = builder.bitcast(args[0], ir.HalfType())
        return builder.fpext(half, ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def f32_to_f16(typingctx, value):  # noqa: ARG001
    """``uint16`` bits of the IEEE half nearest ``value`` (round half to even, like numpy)."""
    def codegen(context, builder, signature, args):
        half = builder.fptrunc(args[0], ir.HalfType())
        return builder.bitcast(half, ir.IntType(16))

    return types.uint16(types.float32), codegen


@intrinsic
def u32_as_f32(typingctx, bits):  # noqa: ARG001
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def f32_as_u32(typingctx, value):  # noqa: ARG001
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@numba.njit(inline="always")
def bf16_to_f32(bits):
    return u32_as_f32(numba.uint32(bits) << numba.uint32(16))


@numba.njit(inline="always")
def f32_to_bf16(value):
    """``uint16`` bits of the bfloat16 nearest the finite float32 ``value`` (half to even)."""
    u = f32_as_u32(value)
    u = u + numba.uint32(0x7FFF) + ((u >> numba.uint32(16)) & numba.uint32(1))
    return numba.uint16(u >> numba.uint32(16))


def warn_fallback(what: str, error: BaseException) -> None:
    """One warning when a compiled kernel fails to build: the caller then uses the reference."""
    warnings.warn(f"kvtool: compiled CPU kernel for {what} unavailable ({error}); "
                  "using the reference path", RuntimeWarning, stacklevel=3)
