"""``kvtool.kernels.device_checks``: a queued check raises once its flag has arrived, in order,
never before; outside ``deferred()`` (or for host arrays) it raises at once."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gpu_util import defer_cpu_checks  # noqa: E402

from kvtool.errors import CodecError  # noqa: E402
from kvtool.kernels.device_checks import Checks, deferred, require  # noqa: E402


def _fail(message: str):
    def fail():
        raise CodecError(message)

    return fail


class _Event:
    """A stand-in for a CUDA event: ``query`` says whether the copy before it has landed."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_immediate_outside_deferred_and_for_host_arrays():
    require(torch.tensor(True), _fail("never"))
    with pytest.raises(CodecError, match="now"):
        require(torch.tensor(False), _fail("now"))
    with deferred() as queued:  # CPU tensors and numpy are read at once: nothing to stall
        with pytest.raises(CodecError, match="host"):
            require(np.bool_(False), _fail("host"))
        with pytest.raises(CodecError, match="cpu"):
            require(torch.tensor(False), _fail("cpu"))
    assert queued == []


def test_queued_checks_raise_in_order_once_arrived(monkeypatch):
    defer_cpu_checks(monkeypatch)
    with deferred() as queued:
        require(torch.tensor(True), _fail("first"))
        require(torch.tensor(False), _fail("second"))
        require(torch.tensor(False), _fail("third"))
    assert len(queued) == 3
    checks = Checks()
    checks.add(queued)
    assert queued == [] and len(checks) == 3
    events = [_Event() for _ in range(3)]
    checks._pending = type(checks._pending)(  # as if on CUDA: each flag behind an event
        (flag, event, fail)
        for (flag, _, fail), event in zip(checks._pending, events, strict=True))
    checks.poll()  # nothing has arrived: no wait, no error
    assert len(checks) == 3
    events[0].done = True
    checks.poll()  # the passing check resolves; the failing one has not arrived
    assert len(checks) == 2
    with pytest.raises(CodecError, match="second"):
        checks.wait()  # waits for the flags, raises the first failure, forgets the rest
    assert len(checks) == 0
    checks.poll()


def test_nested_deferred_queues_stay_apart(monkeypatch):
    defer_cpu_checks(monkeypatch)
    with deferred() as outer:
        with deferred() as inner:
            require(torch.tensor(False), _fail("inner"))
        require(torch.tensor(True), _fail("outer"))
    assert len(inner) == 1 and len(outer) == 1
