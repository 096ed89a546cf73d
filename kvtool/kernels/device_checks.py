"""Input checks whose answer is on a GPU, read back without stalling the host.

An encode refuses NaN/Inf input and vector norms past fp16's range by reading one flag of
its result. On CUDA, ``bool(flag)`` waits for every kernel queued before it: the host stops
issuing work until the device has drained, and the device then idles while the host issues
the next layer. :class:`~kvtool.engines.hf_runtime.CompressedCache` encodes each layer's blocks
in the middle of a model forward (every layer in prefill, every ``block_size`` decode steps),
so those waits were one per layer and role.

Inside :func:`deferred`, :func:`require` queues a CUDA flag instead of reading it: the caller
hands the queue to a :class:`Checks`, which copies each flag to pinned host memory behind the
encode (non-blocking, an event marks its arrival) and raises the check's error from
:meth:`Checks.poll` once the copy has landed — at the cache layer's next update, normally a
decode step later — or from :meth:`Checks.wait`. The data is refused all the same, a step late;
everywhere else (numpy, CPU tensors, any caller outside :func:`deferred`) checks run at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NoReturn

#: the checks queued by :func:`require` inside :func:`deferred` (None: check at once)
_QUEUE: ContextVar[list[tuple[Any, Callable[[], NoReturn]]] | None] = ContextVar(
    "kvtool_deferred_checks", default=None)


def deferrable(ok: Any) -> bool:
    """Whether reading ``ok`` would stall the host: a tensor on a CUDA device."""
    return getattr(getattr(ok, "device", None), "type", None) == "cuda"


#: whether the decodes of this context read arrays this process encoded (see :func:`own_arrays`)
_OWN: ContextVar[bool] = ContextVar("kvtool_own_arrays", default=False)


@contextmanager
def own_arrays() -> Iterator[None]:
    """Decodes inside read arrays this process's encodes wrote (a ``CompressedCache``'s store):
    the value checks a decode makes of arrays from elsewhere (rotation indices, outlier masks,
    norm ranges), which on CUDA read a device value back and stall the host, are skipped."""
    token = _OWN.set(True)
    try:
        yield
    finally:
        _OWN.reset(token)


def check_values() -> bool:
    """Whether a decode here must check its arrays' values (outside :func:`own_arrays`)."""
    return not _OWN.get()


def require(ok: Any, fail: Callable[[], NoReturn]) -> None:
    """Call ``fail`` (which raises) unless the 0-d boolean ``ok`` holds; inside
    :func:`deferred`, a :func:`deferrable` flag is queued for the caller instead."""
    queue = _QUEUE.get()
    if queue is not None and deferrable(ok):
        queue.append((ok, fail))
        return
    if not bool(ok):
        fail()


@contextmanager
def deferred() -> Iterator[list[tuple[Any, Callable[[], NoReturn]]]]:
    """Queue the device checks of the code inside (a list, for :meth:`Checks.add`)."""
    queue: list[tuple[Any, Callable[[], NoReturn]]] = []
    token = _QUEUE.set(queue)
    try:
        yield queue
    finally:
        _QUEUE.reset(token)


class Checks:
    """Queued device checks of one owner, resolved in order without waiting on the device."""

    def __init__(self) -> None:
        self._pending: deque[tuple[Any, Any, Callable[[], NoReturn]]] = deque()

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, queue: list[tuple[Any, Callable[[], NoReturn]]]) -> None:
        """Start reading back the flags of a :func:`deferred` queue (one pinned copy, one event
        per flag; nothing on the host waits)."""
        import torch

        for ok, fail in queue:
            cuda = ok.device.type == "cuda"
            flag = torch.empty((), dtype=torch.bool, pin_memory=cuda)
            flag.copy_(ok.reshape(()), non_blocking=cuda)
            event = None
            if cuda:
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(ok.device))
            self._pending.append((flag, event, fail))
        queue.clear()

    def poll(self) -> None:
        """Raise the first failed check whose flag has arrived; keep the rest queued."""
        while self._pending and (self._pending[0][1] is None or self._pending[0][1].query()):
            flag, _, fail = self._pending.popleft()
            if not bool(flag):
                self._pending.clear()
                fail()

    def wait(self) -> None:
        """Resolve every queued check (waits for their flags)."""
        for _, event, _ in self._pending:
            if event is not None:
                event.synchronize()
        self.poll()

    def clear(self) -> None:
        """Forget the queued checks (their data was dropped)."""
        self._pending.clear()


__all__ = ["Checks", "deferrable", "deferred", "require"]
