"""Shared pieces of ``benchmarks/gpu.py``: size parsing, the timing clock, time budgets, tables.

Imported by ``gpu.py``, ``gpu_sections.py`` and ``gpu_cache.py`` (``benchmarks/`` is the
script's directory); nothing here imports torch or triton.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def count(text: str) -> int:
    """'4M' → 4194304, '1K' → 1024, '300' → 300."""
    text = text.strip().upper()
    return int(text[:-1]) * SUFFIX[text[-1]] if text[-1] in SUFFIX else int(text)


def counts(text: str) -> list[int]:
    return [count(t) for t in text.split(",") if t.strip()]


def words(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def human(n: int) -> str:
    for s in ("G", "M", "K"):
        if n >= SUFFIX[s] and n % SUFFIX[s] == 0:
            return f"{n // SUFFIX[s]}{s}"
    return str(n)


def ratio(num: float, den: float) -> float:
    """``num / den``, 0 where ``den`` is 0 (a JSON-safe, finite number)."""
    return num / den if den else 0.0


class Clock:
    """Times callables: CUDA events on CUDA, ``time.perf_counter`` on the CPU.

    With ``cold_l2`` (CUDA) each timed call starts with an L2 cache that holds none of its
    inputs, as ``triton.testing.do_bench`` times kernels: a buffer several times the L2 is
    zeroed and waited for before the start event. In a model's decode step a layer's K/V were
    last read a whole forward pass earlier; calls repeated back to back on the same tensors
    read them from L2 instead (an H100's or H200's 50 MB hold the turbo3 codes of 8 KV heads
    up to ~32K tokens, and their fp16 K/V up to ~8K), which flatters the smaller input."""

    #: bytes zeroed to evict the L2: several times an H100's or H200's 50 MB (a B200's 126 MB)
    FLUSH_BYTES = 256 << 20

    def __init__(self, torch: Any, device: str, repeats: int, warmup: int = 2,
                 cold_l2: bool = False):
        self.torch, self.cuda = torch, device == "cuda"
        self.repeats, self.warmup = max(1, repeats), warmup
        self.last: Any = None  # what the last call timed by median_ms returned
        self._flush = torch.empty(self.FLUSH_BYTES, dtype=torch.int8, device="cuda") \
            if self.cuda and cold_l2 else None

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def once(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        """(``fn()``, its seconds), the device's queue drained on both sides (and the L2
        flushed first, with ``cold_l2``: outside the timing, and before the host starts
        issuing ``fn``'s work, so its launch cost still counts)."""
        self.sync()
        if not self.cuda:
            start = time.perf_counter()
            out = fn()
            return out, time.perf_counter() - start
        if self._flush is not None:
            self._flush.zero_()
            self.sync()
        start, end = (self.torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        return out, start.elapsed_time(end) / 1e3

    def median_ms(self, fn: Callable[[], Any]) -> float:
        """Median milliseconds of ``fn`` over ``repeats`` calls after ``warmup`` calls (the
        first calls also compile and autotune); :attr:`last` keeps the last call's result."""
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.repeats):
            self.last = None  # let go of the last output first: two may not fit at once
            self.last, seconds = self.once(fn)
            times.append(seconds * 1e3)
        return sorted(times)[len(times) // 2]


    def host_us(self, fn: Callable[[], Any]) -> float:
        """CPU microseconds per call of ``fn`` issued back to back without waiting for the
        device: what launching its work costs the host (on CUDA; all of it on the CPU). One call
        first where the clock warms up, and always on CUDA (the first call compiles and tunes)."""
        if self.cuda or self.warmup:
            fn()
        self.sync()
        start = time.perf_counter()
        for _ in range(self.repeats):
            fn()
        spent = time.perf_counter() - start
        self.sync()
        return spent / self.repeats * 1e6

    def graph_ms(self, fn: Callable[[], Any]) -> float | None:
        """Median milliseconds of ``fn`` replayed from a CUDA graph: its device time without
        the host's launch overhead. None off CUDA, or where ``fn`` cannot be captured."""
        if not self.cuda:
            return None
        torch = self.torch
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
        except RuntimeError as error:
            Table.note(f"not capturable in a CUDA graph: {str(error)[:200]}")
            return None
        return self.median_ms(graph.replay)


def us(ms: float | None) -> str:
    """A microseconds cell from milliseconds (— where there is no measurement)."""
    return "—" if ms is None else f"{ms * 1e3:.1f}"


@dataclass
class Deadline:
    """A section's deadline (``time.monotonic()`` seconds; None: no limit) and its record of
    skipped and failed rows. A row starts only if the last row's duration still fits."""

    at: float | None
    last: float = 0.0
    skipped: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def allows(self, label: str) -> bool:
        if self.at is None or time.monotonic() + self.last <= self.at:
            return True
        self.skipped.append(label)
        Table.note(f"{label}: skipped, over the section's time budget")
        return False

    def attempt(self, label: str) -> Attempt:
        return Attempt(self, label)


class Attempt:
    """``with deadline.attempt(label) as row:`` times a row; an exception inside is printed and
    recorded in ``deadline.errors`` (the benchmark goes on) and sets ``row.failed``."""

    def __init__(self, deadline: Deadline, label: str):
        self.deadline, self.label, self.failed = deadline, label, False

    def __enter__(self) -> Attempt:
        self.start = time.monotonic()
        return self

    def __exit__(self, kind: Any, error: Any, tb: Any) -> bool:
        self.deadline.last = time.monotonic() - self.start
        if error is None or not isinstance(error, Exception):
            return False
        self.failed = True
        self.deadline.errors.append(f"{self.label}: {type(error).__name__}: {error}")
        Table.note(f"{self.label}: FAILED, {type(error).__name__}: {str(error)[:300]}")
        return True


class Budget:
    """Cumulative section deadlines: section ``i`` must end ``sum(shares[:i + 1])`` seconds
    after ``start``, so time a section leaves unused passes on to the next ones."""

    def __init__(self, total_s: float | None, shares: dict[str, float], start: float):
        self.total_s, self.start = total_s, start
        scale = total_s / sum(shares.values()) if total_s else 0.0
        self.ends, acc = {}, 0.0
        for name, share in shares.items():
            acc += share * scale
            self.ends[name] = start + acc

    def deadline(self, section: str) -> Deadline:
        return Deadline(self.ends[section] if self.total_s else None)


class Table:
    """Prints a title, a header and then each row as soon as it is given."""

    def __init__(self, title: str, columns: list[str], widths: list[int]):
        self.widths = widths
        print(f"\n{title}")
        self._line(columns)
        print("-+-".join("-" * w for w in widths), flush=True)

    def _line(self, cells: list[str]) -> None:
        print(" | ".join(f"{c:>{w}}" for c, w in zip(cells, self.widths, strict=True)),
              flush=True)

    def row(self, cells: list[str]) -> None:
        self._line(cells)

    @staticmethod
    def note(text: str) -> None:
        print(f"  {text}", flush=True)


def rate(gbs: float, pct: float) -> str:
    """A throughput cell: GB/s and its share of the device copy."""
    return f"{gbs:.0f} ({pct:.0f}%)" if gbs >= 10 else f"{gbs:.2f} ({pct:.0f}%)"


def device_work(b: Bench, fn: Any) -> tuple[Any, float, list[list[Any]], list[list[Any]]]:
    """``fn()`` run once under ``torch.profiler``: (its result, milliseconds of work the device
    ran meanwhile — CUDA kernels and copies; aten ops' self time on the CPU —, the five
    costliest [name, ms], the host's waits on CUDA (:func:`host_waits`)). Far under the call's
    wall time, the host (Python, launches, a sync) is the limit; near it, the kernels are."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = b.device == "cuda"
    b.clock.sync()
    with profile(activities=[ProfilerActivity.CPU]
                 + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        out = fn()
        b.clock.sync()
    events = prof.events()  # built from the trace on each call
    spent: dict[str, float] = {}
    for event in events:
        if cuda and event.device_type == DeviceType.CUDA:
            us = event.time_range.elapsed_us()
        elif not cuda and event.device_type == DeviceType.CPU and event.name.startswith("aten::"):
            us = event.self_cpu_time_total
        else:
            continue
        spent[event.name] = spent.get(event.name, 0.0) + us / 1e3
    top = sorted(spent.items(), key=lambda item: -item[1])[:5]
    waits = host_waits(events, DeviceType.CPU) if cuda else []
    return out, sum(spent.values()), [[name[:100], round(ms, 4)] for name, ms in top], waits


def host_waits(events: Any, cpu: Any, most: int = 4) -> list[list[Any]]:
    """The CUDA runtime and driver calls (``cuda*``/``cu*`` host events, launches left out)
    that took the host longest: [name, ms, calls], costliest first. A host-bound phase that
    leaves the device idle shows here what it waited on — synchronisations, blocking copies,
    pinned or device allocations (the profiled function's own closing
    ``cudaDeviceSynchronize`` is one call among them)."""
    spent: dict[str, list[float]] = {}
    for event in events:
        name = event.name
        if event.device_type != cpu or not name.startswith("cu") or "Launch" in name:
            continue
        ms_calls = spent.setdefault(name, [0.0, 0])
        ms_calls[0] += event.time_range.elapsed_us() / 1e3
        ms_calls[1] += 1
    ranked = sorted(spent.items(), key=lambda item: -item[1][0])[:most]
    return [[name, round(ms, 3), int(calls)] for name, (ms, calls) in ranked]


def waits_text(waits: list[list[Any]]) -> str:
    return ", ".join(f"{name} {ms:.2f} ms x{calls:g}" for name, ms, calls in waits) or "none"


@dataclass
class Bench:
    """What every section needs: torch, the Triton turbo kernels, the device, a clock, the
    parsed options and the section's deadline."""

    torch: Any
    tc: Any
    device: str
    clock: Clock
    args: argparse.Namespace
    deadline: Deadline
