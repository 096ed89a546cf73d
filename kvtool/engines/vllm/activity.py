"""Store activity: the connector's counters and latencies, for logs, Prometheus and the store.

Nothing here imports vLLM (``kvtool store stats`` reads a store at rest without it).

* **Totals** (:func:`totals`): this process's :func:`~kvtool.engines.vllm.common.stats`
  counters, plus what this module counts itself (requests and prompt tokens that hit or
  missed the store, bytes loaded, evictions) and the count and sum of load / save latencies.
* **Deltas** (:func:`drain`): what changed since the last drain, with every latency observed
  since; the connector hands them to vLLM as its ``KVConnectorStats`` (see
  :mod:`~kvtool.engines.vllm.metrics`). One drain per process takes everything once, however
  many connector halves (scheduler, worker) the process holds.
* **In the store**: :mod:`~kvtool.engines.vllm.stats_files` keeps them under ``<root>/stats/``.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from kvtool.engines.vllm.common import COUNTER_NAMES, log, stats

MAX_OBSERVATIONS = 4096  # latencies kept between two drains
EXTRA_NAMES = ("requests_hit", "requests_missed", "prompt_tokens_hit", "prompt_tokens_missed",
               "bytes_loaded", "chunks_evicted", "bytes_evicted")
OPS = ("lookup", "load", "save")
_EXTRA: dict[str, int] = dict.fromkeys(EXTRA_NAMES, 0)
_LATENCY: dict[str, list[float]] = {op: [0, 0.0] for op in OPS}  # count, seconds
_OBSERVED: dict[str, list[float]] = {op: [] for op in OPS}  # since the last drain
_LAST: dict[str, float] = {}
_LOCK = threading.Lock()
_POLICIES_LOGGED: set[str] = set()


def record(name: str, n: int = 1) -> None:
    """Add ``n`` to one of :data:`EXTRA_NAMES`."""
    with _LOCK:
        _EXTRA[name] += n


def observe(op: str, seconds: float) -> None:
    """One load (a request's prefix) or save (a batch of chunks) and how long it took."""
    with _LOCK:
        _LATENCY[op][0] += 1
        _LATENCY[op][1] += seconds
        if len(_OBSERVED[op]) < MAX_OBSERVATIONS:
            _OBSERVED[op].append(seconds)


def totals() -> dict[str, float]:
    """This process's counters since it started (latencies as ``<op>_count``/``<op>_seconds``)."""
    current = stats()
    out: dict[str, float] = {k: current[k] for k in COUNTER_NAMES}
    with _LOCK:
        out.update(_EXTRA)
        for op in OPS:
            out[f"{op}_count"], out[f"{op}_seconds"] = _LATENCY[op]
    return out


def counter_keys() -> list[str]:
    """Every key of :func:`totals`."""
    return [*COUNTER_NAMES, *EXTRA_NAMES, *(f"{op}_{x}" for op in OPS for x in ("count",
                                                                               "seconds"))]


def minus(now: dict[str, float], base: dict[str, float]) -> dict[str, float]:
    """``now - base`` per key; a counter below its base was reset, so it counts from zero."""
    return {k: v - base.get(k, 0) if v >= base.get(k, 0) else v for k, v in now.items()}


def drain() -> dict[str, Any] | None:
    """What changed since the last drain in this process (None: nothing): ``counters`` (the
    nonzero deltas) and ``load_seconds``/``save_seconds`` (each latency observed)."""
    global _LAST
    now = totals()
    with _LOCK:
        delta = minus(now, _LAST)
        _LAST = now
        observed = {op: _OBSERVED[op][:] for op in OPS}
        for op in OPS:
            _OBSERVED[op].clear()
    counters = {k: v for k, v in delta.items() if v}
    if not counters and not any(observed.values()):
        return None
    return {"counters": counters, **{f"{op}_seconds": observed[op] for op in OPS}}


def lookup(request_id: str, matched: int, prompt_tokens: int, files: int,
           seconds: float, computed: int = 0) -> None:
    """Count and log a request's lookup: ``matched`` of its tokens are stored (a hit counts
    what the store holds; ``loaded_tokens`` what it loaded), ``computed`` of them already in
    vLLM's own prefix cache (not loaded); it took ``seconds``."""
    record("requests_hit" if matched else "requests_missed")
    record("prompt_tokens_hit", matched)
    record("prompt_tokens_missed", prompt_tokens - matched)
    observe("lookup", seconds)
    if matched:
        local = min(computed, matched)
        log.info("kvtool store: hit: request %s: %d of %d prompt tokens stored in %d file(s)%s, "
                 "found in %.0f ms (%s)", request_id, matched, prompt_tokens, files,
                 f", {local} of them already in vLLM's prefix cache" if local else "",
                 seconds * 1e3, summary())
    else:
        log.info("kvtool store: miss: request %s (%d prompt tokens) in %.0f ms (%s)",
                 request_id, prompt_tokens, seconds * 1e3, summary())


def file_bytes(path: str) -> int:
    """A loaded file's size (0 when it cannot be told, e.g. an object-store URL)."""
    try:
        return os.stat(path).st_size
    except (OSError, ValueError):
        return 0


def summary() -> str:
    """Running totals for log lines: hit rate and failures."""
    t = totals()
    seen = t["requests_hit"] + t["requests_missed"]
    timeouts = t["lookup_timeouts"] + t["load_timeouts"]
    return (f"{t['requests_hit']:.0f} of {seen:.0f} requests hit; failures: "
            f"{t['load_failures']:.0f} load, {t['save_failures']:.0f} save, "
            f"{t['invalid_files']:.0f} bad files"
            + (f", {timeouts:.0f} timeouts" if timeouts else ""))


def log_policy(policy: Any, dtype: str | None) -> None:
    """Say once per process and policy which policy the store uses, and if it is lossy."""
    label = policy.describe()
    if label in _POLICIES_LOGGED:
        return
    _POLICIES_LOGGED.add(label)
    if policy.is_lossy(dtype):
        log.info("kvtool store: policy %s is lossy: answers served from the store may differ "
                 "slightly from recomputing them (codec raw keeps them exact)", label)
    else:
        log.info("kvtool store: policy %s (lossless)", label)
