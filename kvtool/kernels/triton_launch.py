"""Repeated launches of a Triton kernel without Triton's per-call Python dispatch, scratch
shared by the launches of a stream (:class:`StreamScratch`), and the launch plans a caller
works out once per call signature (:class:`Plans`).

At decode sizes a kernel's host launch cost, not the device, sets the time of a call. Triton's
dispatch binds and specialises every argument, builds the autotuner's key and hashes the
options on each call: for :func:`kvtool.kernels.triton_attention.attend` (35 arguments) that
was ~145 µs of host time per call on an H200, against ~40 µs of kernel time at 8K tokens.

:class:`Launcher` sends the first call of each *specialisation key* through Triton (which
compiles, autotunes and specialises) and keeps the compiled kernel it returns, with the
autotuner's chosen config; later calls with the same key call that kernel's launcher directly.
The key holds what Triton specialises on, so a reused kernel is always the one Triton itself
would pick: each tensor's dtype and 16-byte alignment, each integer's divisibility by 16,
equality to 1 and width, the constexpr values, the current device, and the caller's
``tuned`` values (the autotuner's key arguments, which select its config). A caller that
knows all of that but the tensors' alignment from a plan of its own passes it as ``fixed``
(a plan per call signature, say): then, while every tensor is 16-byte aligned (one OR over
their addresses), the key is the number of what the first launch of ``fixed`` specialised on,
and the full key otherwise.

Triton's own path is used throughout under the interpreter, with launch hooks set (profilers
such as proton see every launch) and, from then on, wherever this Triton's compiled kernels do
not take the call this module makes (checked on first use).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from functools import lru_cache, reduce
from itertools import count
from operator import itemgetter, or_
from typing import Any

import torch

from kvtool.kernels.triton_support import INTERPRET, triton

_I32 = 2**31
#: a launch grid: programs per axis, or a function of the launch's meta-parameters
Grid = Sequence[int] | Callable[[dict[str, Any]], Sequence[int]]


def _getter(positions: list[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    if not positions:
        return lambda args: ()
    if len(positions) == 1:
        return lambda args, at=positions[0]: (args[at],)
    return itemgetter(*positions)


@lru_cache(maxsize=256)
def _kinds(types: tuple[type, ...]) -> tuple[Callable[[Sequence[Any]], tuple[Any, ...]], ...]:
    """Getters of the tensors, the ints and the flags (bools, None) among arguments of these
    types (floats are not specialised on); TypeError for any other type."""
    tensors, ints, flags = [], [], []
    for at, kind in enumerate(types):
        if issubclass(kind, torch.Tensor):
            tensors.append(at)
        elif kind is int:
            ints.append(at)
        elif kind is bool or kind is type(None):
            flags.append(at)
        elif kind is not float:
            raise TypeError(f"no launch key for a {kind.__name__} argument")
    return _getter(tensors), _getter(ints), _getter(flags)


def launch_key(args: Sequence[Any]) -> tuple[Hashable, ...]:
    """What Triton specialises ``args`` on: their types, each tensor's dtype and 16-byte
    alignment, each int's equality to 1, divisibility by 16 and 32-bit width, each flag's
    value. Built per kind in bulk: it runs for every launch (~35 arguments for attention)."""
    types = tuple(map(type, args))
    tensors, ints, flags = (get(args) for get in _kinds(types))
    return (types, tuple([t.dtype for t in tensors]),
            tuple([t.data_ptr() & 15 == 0 for t in tensors]),
            tuple([(v == 1, v & 15 == 0, -_I32 <= v < _I32) for v in ints]), flags)


def _spec(args: Sequence[Any], constants: dict[str, Any], tuned: Hashable) -> Hashable:
    """A launch's full key but the device and its tensors' alignment."""
    types, dtypes, _, ints, flags = launch_key(args)
    return tuned, tuple(constants.values()), types, dtypes, ints, flags


def _other_device(args: Sequence[Any]) -> int | None:
    """The CUDA device of the first tensor argument when it is not the current one (a model
    spread over GPUs): the launch must run there, on that device's stream. None otherwise."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.is_cuda and (at := a.get_device()) != torch.cuda.current_device():
                return at
            return None
    return None


def _hooks_set() -> bool:
    """Whether a launch hook is installed (newer Tritons hold them in chains, empty by
    default; older ones in attributes that are None when unset)."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None:
        return True
    hooks = (getattr(runtime, name, None) for name in ("launch_enter_hook", "launch_exit_hook"))
    return any(h is not None and bool(getattr(h, "calls", True)) for h in hooks)


class Launcher:
    """``Launcher(kernel)(grid, args, constants, tuned, fixed)`` runs ``kernel[grid](*args,
    **constants)``; ``args`` are the kernel's leading runtime arguments in order, ``constants``
    its constexprs by name (those an autotuner sets come from its chosen config) and compile
    options; ``grid`` a tuple, or a function of the launch's meta-parameters (an autotuned
    block size: the chosen config's, on direct launches too); ``tuned``: the values of the
    autotuner's key arguments that are not constexprs; ``fixed`` (optional, hashable): the
    caller's promise that it determines ``constants``, ``tuned``, the arguments' types and
    dtypes and every non-tensor argument's specialisation."""

    def __init__(self, kernel: Any):
        self.kernel = kernel
        # a JIT function's and an autotuner's own (the first's ``fn`` is the Python function)
        self.names: list[str] = list(getattr(kernel, "arg_names", ()))
        #: per key: the compiled kernel, its trailing (constexpr) arguments, its meta-parameters
        #: and the autotuner's configs it was chosen among (tests pin others: a new choice)
        self.compiled: dict[Hashable, tuple[Any, tuple[Any, ...], dict[str, Any], Any]] = {}
        #: per ``fixed`` key: the getter of its tensor arguments and the number of its spec
        self._fixed: dict[Hashable, tuple[Callable[[Sequence[Any]], tuple[Any, ...]], int]] = {}
        self._specs: dict[Hashable, int] = {}  # spec -> its number (never reused)
        self.direct = not INTERPRET and triton is not None
        self.fast = 0  # launches that skipped Triton's dispatch (tests read it)

    def __call__(self, grid: Grid, args: Sequence[Any], constants: dict[str, Any],
                 tuned: Hashable = (), fixed: Hashable = None) -> None:
        other = _other_device(args)
        if other is None:
            self._launch(grid, args, constants, tuned, fixed)
            return
        with torch.cuda.device(other):  # Triton launches on the current device's stream
            self._launch(grid, args, constants, tuned, fixed)

    def _launch(self, grid: Grid, args: Sequence[Any], constants: dict[str, Any],
                tuned: Hashable, fixed: Hashable) -> None:
        if not self.direct or _hooks_set():
            self._through_triton(grid, args, constants)
            return
        driver = triton.runtime.driver.active
        device = driver.get_current_device()
        key = self.key(device, args, constants, tuned, fixed)
        if key is None:  # an argument of another type: Triton's own dispatch decides
            self._through_triton(grid, args, constants)
            return
        hit = self.compiled.get(key)
        if hit is None or hit[3] is not getattr(self.kernel, "configs", None):
            self._first(key, grid, args, constants)  # new, or the autotuner's search changed
            return
        kernel, tail, meta, _ = hit
        g = (*(grid(meta) if callable(grid) else grid), 1, 1)
        try:
            kernel.run(g[0], g[1], g[2], driver.get_current_stream(device), kernel.function,
                       kernel.packed_metadata, None, None, None, *args, *tail)
        except TypeError:  # this Triton's launcher takes other arguments: nothing launched
            self.direct = False
            self._through_triton(grid, args, constants)
            return
        self.fast += 1

    def key(self, device: Any, args: Sequence[Any], constants: dict[str, Any],
            tuned: Hashable = (), fixed: Hashable = None) -> Hashable | None:
        """The specialisation key of a launch (None: an argument of a type it cannot key).
        With ``fixed``, while every tensor argument is 16-byte aligned: the device and the
        number of the full key's other parts, worked out at the first launch of ``fixed``
        (plans that differ only where Triton does not specialise — a store grown by a block,
        say — share it, and so their compiled kernel); else the full key."""
        if fixed is not None:
            hit = self._fixed.get(fixed)
            if hit is None:
                try:
                    spec = _spec(args, constants, tuned)
                except TypeError:
                    return None
                if len(self._fixed) >= 512:
                    self._fixed.clear()
                if len(self._specs) >= 512:
                    self._specs.clear()  # numbers are never reused: only sharing is lost
                number = self._specs.get(spec)
                if number is None:
                    number = self._specs[spec] = next(_TOKENS)
                hit = self._fixed[fixed] = (_kinds(spec[2])[0], number)
            tensors, number = hit
            if reduce(or_, [t.data_ptr() for t in tensors(args)], 0) & 15 == 0:
                return (device, _FIXED, number)
        try:
            return (device, tuned, tuple(constants.values()), launch_key(args))
        except TypeError:
            return None

    def _through_triton(self, grid: Grid, args: Sequence[Any],
                        constants: dict[str, Any]) -> Any:
        """Triton's own launch (it compiles, autotunes and specialises); its compiled kernel."""
        return self.kernel[grid if callable(grid) else tuple(grid)](*args, **constants)

    def _first(self, key: Hashable, grid: Grid, args: Sequence[Any],
               constants: dict[str, Any]) -> None:
        """Launch through Triton and keep what it compiled, if its launcher takes our call."""
        kernel = self._through_triton(grid, args, constants)
        kernel = kernel.result() if hasattr(kernel, "result") else kernel
        config = getattr(self.kernel, "best_config", None)
        values = {**constants, **(config.kwargs if config is not None else {})}
        try:
            tail = tuple(values[name] for name in self.names[len(args):])
            kernel.run, kernel.function, kernel.packed_metadata  # noqa: B018
        except (AttributeError, KeyError):
            self.direct = False  # another Triton: its own dispatch from now on
            return
        if len(self.compiled) >= 512:  # shapes come and go; keys stay few per shape
            self.compiled.clear()
        self.compiled[key] = (kernel, tail, values, getattr(self.kernel, "configs", None))


_FIXED = object()  # keeps the keys of ``fixed`` launches apart from full keys
_TOKENS = count()


def plan_token() -> int:
    """A number no other plan of this process gets: a plan's part of its launches' ``fixed``
    keys (the id of a dropped plan comes back; a token never does)."""
    return next(_TOKENS)


class StreamScratch(threading.local):
    """Per-thread scratch for the launches of a kernel on one stream: ``floats`` fp32 values
    and ``counters`` int32 counters at zero, which the kernel must put back to zero before it
    ends (a ticket counter, say). Launches on one stream run one after another, so they can
    share it and no launch needs a memset first. Not shared (fresh buffers per call) while
    ``shared`` is off, for scratch over 32 MiB, and while a CUDA graph is being captured (a
    replay may overlap other work)."""

    def __init__(self, shared: bool):
        self.shared = shared
        self.buffers: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, device: torch.device, floats: int, counters: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.shared or floats > _SHARED_FLOATS or (
                device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return (torch.empty((floats,), dtype=torch.float32, device=device),
                    torch.zeros((counters,), dtype=torch.int32, device=device))
        key = (device, _raw_stream(device.index) if device.type == "cuda" else 0)
        hit = self.buffers.get(key)
        if hit is None or hit[0].numel() < floats or hit[1].numel() < counters:
            floats = max(floats, 0 if hit is None else hit[0].numel())
            counters = max(counters, 0 if hit is None else hit[1].numel())
            hit = (torch.empty((floats,), dtype=torch.float32, device=device),
                   torch.zeros((counters,), dtype=torch.int32, device=device))
            self.buffers[key] = hit
        return hit


_SHARED_FLOATS = 1 << 23  # 32 MiB


def _raw_stream(index: int | None) -> int:
    """The current CUDA stream's handle (what Triton launches on)."""
    try:
        from torch._C import _cuda_getCurrentRawStream
    except ImportError:  # pragma: no cover - older torch
        return torch.cuda.current_stream(index).cuda_stream
    return _cuda_getCurrentRawStream(index)


class Plans:
    """What a call's shapes and options decide (checks, grid, constants), worked out once per
    distinct signature: a decode step calls an attention kernel once per layer with the same
    shapes. The ``limit`` most recent signatures are kept (so a plan must not hold a store's
    tensors: constant tables only)."""

    def __init__(self, limit: int = 64):
        self._plans: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.limit = limit

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The plan of ``key``, made by ``build()`` (which may raise) the first time."""
        plan = self._plans.get(key)
        if plan is None:
            plan = build()
            with self._lock:
                self._plans[key] = plan
                while len(self._plans) > self.limit:
                    self._plans.popitem(last=False)
        return plan

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()


def meta(t: torch.Tensor | None) -> tuple[Any, ...] | None:
    """A tensor argument's part of a plan key: its shape and dtype (None: absent)."""
    return None if t is None else (t.shape, t.dtype)


class Signature:
    """Plan-key parts worked out once, hash included: what a store's shapes and options decide,
    which every call over the store repeats (hashing them per call costs microseconds)."""

    __slots__ = ("parts", "_hash")

    def __init__(self, *parts: Hashable):
        self.parts = parts
        self._hash = hash(parts)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, Signature) and self.parts == other.parts)

    def __repr__(self) -> str:
        return f"Signature{self.parts!r}"


EXACT_SPLIT = 128  # exact tokens per part of the attention kernels


def exact_key(ke: torch.Tensor | None, ve: torch.Tensor | None,
              bias: torch.Tensor | None) -> tuple[Any, ...]:
    """The exact tokens' part of an attention plan key, without their count ``X``: a decode
    step grows it by one, and a plan per ``X`` would be a plan (its checks, and a launch
    spec to work out) per step. What it holds instead: the parts of :data:`EXACT_SPLIT`
    tokens, ``X``'s specialisation (1, a multiple of 16), the other axes and the dtypes, and
    whether the values' and the bias's shapes fit the keys' (so a plan's checks hold for
    every ``X``)."""
    if ke is None:
        x, k = 0, (None, meta(ve))
    else:
        x = ke.shape[2] if ke.ndim == 4 else -1  # [B, Hkv, X, D]; anything else is refused
        k = (ke.ndim, ke.shape[:-2], ke.shape[-1], ke.dtype,
             None if ve is None else (ve.shape == ke.shape, ve.dtype))
    b = None if bias is None else (bias.ndim, bias.shape[:-1],
                                   bias.ndim > 0 and bias.shape[-1] == x, bias.dtype)
    return k, b, -(-x // EXACT_SPLIT), x == 1, x % 16 == 0
