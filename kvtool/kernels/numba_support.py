"""What every numba kernel module shares: a ``jit`` that caches compiled code when it can,
float16 conversions, zero-copy kernel views of numpy arrays and torch tensors, and packed-group
access.

numba has no CPU float16 type, so kernels take fp16 and bf16 arrays as ``uint16`` views and
convert one value at a time: fp16 with LLVM's ``fpext``/``fptrunc`` on ``half`` (one F16C
instruction each on x86-64 CPUs that have it, which every AVX2 CPU does), bf16 with shifts.
"""

from __future__ import annotations

import os
import threading
import types as types_module
import warnings
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from kvtool.kernels import _is_torch
from kvtool.kernels.numba_cache import cache_location, install_stamped_locators


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
install_stamped_locators()


def jit(**options: Any) -> Callable[[Callable], Callable]:
    """``numba.njit`` with ``cache=True`` where a cache directory is writable, without where not.

    Where the cache lives, and why a change to any kernel or codec source recompiles every
    kernel: :mod:`kvtool.kernels.numba_cache`. Where nothing is writable numba refuses
    ``cache=True`` at decoration time; the kernels still work there (compiled on each first
    call).

    A ``parallel=True`` kernel comes wrapped in :class:`ParallelKernel` (it must be called from
    Python, not from other compiled code), and is cached under a name of its own: numba's cache
    keys an entry by the function's name, line and argument types, not by its options, so a
    serial and a parallel kernel of one function would load whichever compiled first (measured:
    the attention kernels ran on one thread after a serial call had filled the cache).
    """
    def wrap(fn: Callable) -> Callable:
        if options.get("parallel"):
            fn = _renamed(fn, fn.__qualname__ + "__parallel")
        try:
            with cache_location(os.path.dirname(os.path.abspath(fn.__code__.co_filename))):
                kernel = numba.njit(cache=True, **options)(fn)
        except RuntimeError:  # "cannot cache function ...: no locator available"
            kernel = numba.njit(cache=False, **options)(fn)
        return ParallelKernel(kernel) if options.get("parallel") else kernel

    return wrap


def _renamed(fn: Callable, qualname: str) -> Callable:
    """A copy of the function ``fn`` under another qualified name (the same code and globals)."""
    copy = types_module.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                                     fn.__closure__)
    copy.__qualname__, copy.__module__, copy.__doc__ = qualname, fn.__module__, fn.__doc__
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


_LAUNCHED = threading.Event()
_LAUNCH_LOCK = threading.Lock()


def launch_threading_layer() -> None:
    """Start numba's threading layer on a thread of its own (once per process).

    numba starts its layer on the first parallel call, in the calling thread, and the OpenMP
    layer's start calls ``omp_set_num_threads(NUMBA_NUM_THREADS)`` and ``omp_set_nested(1)``
    there. torch and vLLM load the same ``libgomp.so.1``, whose settings are per thread: an
    engine thread that ran a kernel first would find its OpenMP thread count changed under it
    (vLLM's CPU attention then aborts with ``thread_num == thread_num (2 vs. 1)``). Started on
    a short-lived thread, the layer changes only that thread's settings; the parallel regions
    of the kernels name their thread count explicitly and change none.
    """
    if _LAUNCHED.is_set():
        return
    with _LAUNCH_LOCK:
        if _LAUNCHED.is_set():
            return
        from numba.np.ufunc import parallel

        failed: list[BaseException] = []

        def launch() -> None:
            try:
                parallel._launch_threads()
            except BaseException as e:  # re-raised in the caller: no layer, no kernels
                failed.append(e)

        thread = threading.Thread(target=launch, name="kvtool-numba-launch", daemon=True)
        thread.start()
        thread.join()
        if failed:
            raise failed[0]
        _LAUNCHED.set()


def num_threads() -> int:
    """``numba.get_num_threads()``, the layer started aside first (numba's own call would start
    it in the calling thread)."""
    launch_threading_layer()
    return numba.get_num_threads()


class ParallelKernel:
    """A ``parallel=True`` numba dispatcher that starts the threading layer aside
    (:func:`launch_threading_layer`) before its first call; other attributes are the
    dispatcher's (``signatures``, ``py_func``, ...)."""

    def __init__(self, dispatcher: Any):
        self.dispatcher = dispatcher

    def __call__(self, *args: Any) -> Any:
        launch_threading_layer()
        return self.dispatcher(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dispatcher, name)


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


# -- arrays in, views out, and packed-group access shared by the kernels -----------------------
def kernel_view(x: Any) -> np.ndarray:
    """A zero-copy numpy view in the kernels' element types (fp16 → uint16, bf16 → int16)."""
    if _is_torch(x):
        import torch

        x = x.detach()
        if x.dtype in (torch.float16, torch.bfloat16):
            view = x.view(torch.int16).numpy()
            return view.view(np.uint16) if x.dtype == torch.float16 else view
        return x.numpy()
    x = np.asarray(x)
    if x.dtype == np.float16:
        return x.view(np.uint16)
    if x.dtype.name == "bfloat16":
        return x.view(np.int16)
    return x


def empty_like_backend(like: Any, shape: tuple[int, ...], dtype: str) -> tuple[Any, np.ndarray]:
    """(array of ``like``'s type, its kernel view)."""
    from kvtool.kernels import numpy_ops

    if _is_torch(like):
        # numpy's allocator asks for huge pages on large arrays; torch.empty's 4 KiB page faults
        # cost a large output as much as the decode itself
        import torch

        kind = np.int16 if dtype == "bfloat16" else numpy_ops._DTYPES[dtype]
        a = np.empty(shape, dtype=kind)
        t = torch.from_numpy(a)
        return (t.view(torch.bfloat16) if dtype == "bfloat16" else t), kernel_view(a)
    a = np.empty(shape, dtype=numpy_ops._DTYPES[dtype])
    return a, kernel_view(a)


@numba.njit(inline="always")
def read_group(packed, r, first, count):
    """The ``count`` bytes of row ``r`` from byte ``first`` as one little-endian word."""
    word = np.uint64(0)
    for k in range(count):
        word |= np.uint64(packed[r, first + k]) << np.uint64(8 * k)
    return word


@numba.njit(inline="always")
def write_group(out, r, first, count, word):
    for k in range(count):
        out[r, first + k] = np.uint8((word >> np.uint64(8 * k)) & 255)
