"""Writing computed chunks into the prefix store (the connector's saver thread).

A write never takes the engine down and never wedges the store:

* a chunk that fails to write is a future miss, logged and counted (``save_failures``);
* a full disk or quota (``ENOSPC``, ``EDQUOT``) makes room first: the budget drops stale
  temp files, the oldest quarantined files and then least recently hit chunks
  (:meth:`~kvtool.engines.vllm.store_budget.StoreBudget.relieve`), and the write is tried once
  more;
* before each chunk, the budget makes room for it (:meth:`~kvtool.engines.vllm.store_budget.
  StoreBudget.reserve`), so that the store, the file being written included, stays under
  ``max_bytes``; where it cannot (a scan failed moments ago and the store is over its bound),
  the chunk and the rest of the prompt's are dropped (``saves_dropped``), not written; after
  it, the budget accounts for it and keeps the quarantine under its bounds
  (:meth:`~kvtool.engines.vllm.store_budget.StoreBudget.added`).

Nothing here imports vLLM.
"""

from __future__ import annotations

import errno
import time
from typing import Any

from kvtool.engines.vllm import activity
from kvtool.engines.vllm.common import add_time, count, log

DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


def write_chunks(store: Any, budget: Any, copies: list, token_ids: list[int],
                 guard: Any = None) -> int:
    """Encode and write ``copies`` (in prompt order; stops at the first failure, since later
    chunks are keyed by it); bytes written. Each is ``(chunk, keys, values)`` (K/V copied out
    of a CPU cache, encoded here) or ``(chunk, encoded)`` (encoded on the GPU, see
    :mod:`~kvtool.engines.vllm.device_io`: written once its host copy is done). A failure that
    says the store is down is reported to ``guard`` (saves are then dropped for a while)."""
    start = time.perf_counter()
    total = 0
    for i, (chunk, *data) in enumerate(copies):
        if guard is not None and guard.is_down:  # out of service: dropped, not waited on
            count("saves_dropped", len(copies) - i)
            break
        if budget is not None and not _evict(budget.reserve,
                                             budget.expected(source_bytes(data))):
            count("saves_dropped", len(copies) - i)  # room first: no room, no write
            break
        try:
            written = write_one(store, budget, chunk, data, token_ids)
        except Exception as e:  # full disk, permissions, a dead endpoint: a future miss
            save_failed(chunk, e)
            if guard is not None:
                guard.report(e)
            break
        if written:
            total += written
            count("chunks_saved")
            count("tokens_saved", chunk.stop - chunk.start)
            count("bytes_saved", written)
            if budget is not None:
                _evict(budget.added, written)
    seconds = time.perf_counter() - start
    if total:
        activity.observe("save", seconds)
        log.info("kvtool store: saved %d chunk(s), %d bytes, in %.0f ms (%s)", len(copies),
                 total, seconds * 1e3, activity.summary())
    add_time("write_seconds", time.perf_counter() - start)
    return total


def write_one(store: Any, budget: Any, chunk: Any, data: list, token_ids: list[int]) -> int:
    """One chunk's write (``data``: ``[keys, values]`` or ``[encoded]``, see
    :func:`write_chunks`); on a full disk, room is made and the write tried once more."""
    try:
        return _write(store, chunk, data, token_ids)
    except OSError as e:
        if e.errno not in DISK_FULL or budget is None:
            raise
        count("disk_full")
        files, freed = budget.relieve(budget.expected(source_bytes(data)))
        log.warning("kvtool store: %s is full (%s); removed %d files (%d bytes) to make room, "
                    "writing again", store.root, e.strerror or e, files, freed)
        if files:
            _evicted(files, freed)
        return _write(store, chunk, data, token_ids)


def _write(store: Any, chunk: Any, data: list, token_ids: list[int]) -> int:
    if len(data) == 1:  # codes made on the GPU
        return store.write_encoded(chunk, data[0], token_ids)
    keys, values = data
    return store.write(chunk, keys, values, token_ids)


def raw_bytes(keys: list, values: list) -> int:
    """Bytes of a chunk's K/V as computed (an upper bound of its file before the first one)."""
    return sum(int(t.nelement() * t.element_size()) if hasattr(t, "element_size")
               else int(t.nbytes) for t in (*keys, *values))


def source_bytes(data: list) -> int:
    """:func:`raw_bytes` of a chunk's ``data`` (``[keys, values]`` or ``[encoded]``)."""
    return int(data[0].source_bytes) if len(data) == 1 else raw_bytes(*data)


def held_bytes(data: list) -> int:
    """Bytes a queued save of ``data`` holds in memory: the K/V copies, or the codes."""
    return int(data[0].nbytes) if len(data) == 1 else raw_bytes(*data)


def _evict(make_room: Any, nbytes: int) -> bool:
    """``make_room(nbytes)`` (the budget's ``reserve`` or ``added``), its evictions counted;
    False when the budget says there is no room (:class:`~kvtool.engines.vllm.store_budget.
    NoRoom`: the write must be dropped). Any other failure is logged and True: eviction must
    never stop a write nor take the saver down."""
    from kvtool.engines.vllm.store_budget import NoRoom

    try:
        files, freed = make_room(nbytes)
    except NoRoom as e:
        log.warning("kvtool store: save dropped: %s", e)
        return False
    except Exception as e:
        log.warning("kvtool store: eviction failed (%s)", e)
        return True
    if files:
        _evicted(files, freed)
        log.info("kvtool store: evicted %d files (%d bytes) to stay within the store's bounds",
                 files, freed)
    return True


def _evicted(files: int, freed: int) -> None:
    activity.record("chunks_evicted", files)
    activity.record("bytes_evicted", freed)


def write_capture(path: str, gather: Any, token_ids: list[int], model: dict,
                  lossy_sources: list[str], tokenizer_fingerprint: str | None) -> None:
    """A request's whole prompt K/V (``gather()``: keys, values), lossless, at ``path``
    (``capture_dir``), with what they went through (an fp8 cache's rounding) and the model's
    sliding windows (every layer holds every token); a failure is logged and counted, never
    raised."""
    import os

    import numpy as np

    from kvtool.cache import KVCache, windows_layer_info
    from kvtool.engines.vllm.windows import model_windows
    from kvtool.formats import save

    try:
        keys, values = gather()
        cache = KVCache(keys, values, token_ids=np.asarray(token_ids), model=model,
                        tokenizer_fingerprint=tokenizer_fingerprint, lossy_sources=lossy_sources,
                        # every position of every layer, its windows named as HF and mlx-lm do
                        layer_info=windows_layer_info(model_windows(model, len(keys))))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save(cache, path, codec="raw")  # lossless; callers re-encode
        count("captures")
    except Exception as e:
        log.warning("kvtool: cannot capture %s (%s: %s)", path, type(e).__name__, str(e)[:200])
        count("save_failures")


#: (chunk path, error type) already warned of: a place that cannot be written (a directory
#: there, a read-only mount) fails at every request of that prefix
_WARNED_WRITES: set[tuple[str, str]] = set()


def save_failed(chunk: Any, e: BaseException) -> None:
    """Count a chunk write that failed; warn once per chunk and kind of error (then debug)."""
    count("save_failures")
    key = (chunk.path, type(e).__name__)
    first = key not in _WARNED_WRITES
    if first:
        if len(_WARNED_WRITES) >= 1 << 16:
            _WARNED_WRITES.clear()
        _WARNED_WRITES.add(key)
    (log.warning if first else log.debug)(
        "kvtool: cannot write %s (%s: %s); the prefix stays unstored%s", chunk.path,
        type(e).__name__, str(e)[:200], " (said once for this chunk)" if first else "")
