"""Triton autotuning in the GPU tests: one launch configuration per kernel and key.

An autotuned kernel meeting a new key (its ``key`` arguments and the dtypes of its tensors)
compiles every configuration its pruning keeps and times each: 4-6 compiles of 0.3-4 s
(``triton.compile`` for sm_90, measured on a 2-core EPYC: turbo encode/decode 0.3-2.9 s,
turbomix 0.9-4.1 s) per key. Paid on every key of every case, that was most of a GPU case's
minute. The GPU cases pin each autotuned kernel to one configuration: one compile per key.
Where the pruning depends only on arguments a case knows (triton_cuda: ``D``), cases rotate
through the configurations it keeps (:func:`pin_kept_config`); elsewhere they take the first,
the smallest row block, which no pruning drops (:func:`pin_first_config`). Each case file runs
every configuration of its kernels, and the autotuner itself, in one case. Under
``TRITON_INTERPRET=1`` there is nothing to pin (the kernels are not autotuned there).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any


def autotuned(*modules: ModuleType) -> list[Any]:
    """The autotuned Triton kernels defined in ``modules``."""
    from triton.runtime import Autotuner

    return [v for m in modules for v in vars(m).values() if isinstance(v, Autotuner)]


def pin_first_config(monkeypatch: Any, *modules: ModuleType) -> None:
    """Run every autotuned kernel of ``modules`` with its first configuration, untimed (an
    autotuner with one configuration launches it as given)."""
    for kernel in autotuned(*modules):
        monkeypatch.setattr(kernel, "configs", kernel.configs[:1])


def pin_config(monkeypatch: Any, kernel: Any, config: Any) -> None:
    """Run ``kernel`` with ``config`` only."""
    monkeypatch.setattr(kernel, "configs", [config])


def kept_configs(kernel: Any, **named_args: Any) -> list[Any]:
    """The configurations ``kernel``'s pruning keeps for launches with ``named_args``."""
    prune = getattr(kernel, "early_config_prune", None)
    return list(prune(kernel.configs, named_args) if prune else kernel.configs)


def pin_kept_config(monkeypatch: Any, module: ModuleType, index: int, **named_args: Any) -> None:
    """Pin each autotuned kernel of ``module`` to configuration ``index`` (modulo their number)
    of those its pruning keeps for ``named_args``."""
    for kernel in autotuned(module):
        kept = kept_configs(kernel, **named_args)
        pin_config(monkeypatch, kernel, kept[index % len(kept)])


def compile_workers(**env: str) -> list[str]:
    """``-n N`` for a compiled (not interpreted) case run where pytest-xdist is installed and
    the machine has cores to spare: Triton compiles on the CPU, one kernel at a time per
    process, and that is most of a GPU case's time (a stock CUDA image ships xdist; CI has no
    GPU, and its 2 cores already run two xdist workers of the suite)."""
    cores = os.cpu_count() or 1
    if env.get("TRITON_INTERPRET") or cores < 4 or importlib.util.find_spec("xdist") is None:
        return []
    return ["-n", str(min(8, cores // 2))]


def kernel_module(name: str, cuda: bool) -> tuple[ModuleType, ModuleType, bool]:
    """``(triton, the kernel module, in_process)`` for a case file: on CUDA, the module as
    installed; else a private copy compiled for the interpreter. ``TRITON_INTERPRET`` must be
    set when ``@triton.jit`` decorates (triton's library when triton is first imported, ours
    when the module is), so it is set around both imports and then restored: set in the main
    test process it would interpret every later kernel, vLLM's included. ``in_process``: the
    kernels can run here (compiled, or triton itself interpreted: the case file was run in a
    fresh process, :func:`run_case_file`)."""
    import pytest

    saved = os.environ.get("TRITON_INTERPRET")
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        triton = pytest.importorskip("triton")
        from triton.runtime.interpreter import InterpretedFunction

        if cuda:
            module = importlib.import_module(name)
        else:
            origin = importlib.util.find_spec(name).origin
            spec = importlib.util.spec_from_file_location(f"_{name.replace('.', '_')}"
                                                          "_interpreted", origin)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
    return triton, module, cuda or isinstance(triton.language.max, InterpretedFunction)


def use_interpreter(monkeypatch: Any, cuda: bool, in_process: bool, runner: str) -> None:
    """A case file's autouse fixture: without CUDA, fail unless triton is interpreted in this
    process (``runner``: the test that runs the file in a fresh one), and set
    ``TRITON_INTERPRET`` for the case (triton also reads it at launch)."""
    import pytest

    if cuda:
        return
    if not in_process:
        pytest.fail(f"triton was imported without TRITON_INTERPRET=1 before this module: run "
                    f"this file through {runner}")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def run_case_file(cases: Path, *args: str, **env: str) -> str:
    """pytest's output for a Triton case file run in a fresh process (``TRITON_INTERPRET``
    must be set before triton is imported); fails with its output unless it passed."""
    run = subprocess.run([sys.executable, "-m", "pytest", str(cases), "-q", "-p",
                          "no:cacheprovider", *compile_workers(**env), *args],
                         env={**os.environ, **env},
                         capture_output=True, text=True, cwd=cases.parent.parent, timeout=1200)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    return run.stdout


def assert_every_case_ran(out: str, at_least: int) -> None:
    """The run's summary: passed, none skipped or failed, at least ``at_least`` cases."""
    summary = out.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, summary
    assert int(summary.split()[0]) >= at_least, summary


def host_reads(fn: Any) -> int:
    """How many times ``fn`` reads a tensor's value back to the host (``bool``, ``item``: on
    CUDA, each one waits for every queued kernel)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    reads = {"aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.item.default"}

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += str(func) in reads
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def defer_cpu_checks(monkeypatch: Any) -> None:
    """Queue the checks of CPU tensors too, as :mod:`kvtool.kernels.device_checks` queues those
    of CUDA tensors inside ``deferred()`` (what runs on a GPU, here)."""
    import torch

    from kvtool.kernels import device_checks

    monkeypatch.setattr(device_checks, "deferrable", lambda ok: isinstance(ok, torch.Tensor))


def assert_checks_deferred(encode: Any, good: Any, bad: Any) -> None:
    """Inside ``deferred()`` (what CompressedCache does) ``encode(x)`` queues its one input
    check instead of reading a flag back; resolved, the check passes ``good`` and refuses
    ``bad`` (NaN/Inf). A first encode outside builds the host-side tables."""
    import pytest

    from kvtool.errors import CodecError
    from kvtool.kernels.device_checks import Checks, deferred

    encode(good)
    for x, fails in ((good, False), (bad, True)):
        checks = Checks()
        with deferred() as queued:
            assert host_reads(lambda x=x: encode(x)) == 0
        assert len(queued) == 1
        checks.add(queued)
        if fails:
            with pytest.raises(CodecError, match="NaN or Inf"):
                checks.wait()
        else:
            checks.wait()
        assert len(checks) == 0
