"""kvtool's vLLM cache-write hook, called by the blocks that ``kvtool patch-vllm`` inserts.

Every patched attention backend calls :func:`on_cache_write` right after it writes a step's
keys and values into the paged KV cache — but only while ``KVTOOL_VLLM_HOOK`` is set, so an
unset variable costs the patched code one environment look-up. Modes:

``KVTOOL_VLLM_HOOK=stats``
    shadow-compresses the keys and values being written with ``KVTOOL_VLLM_HOOK_CODEC``
    (default ``turbo3``; any codec spec :func:`kvtool.codecs.get_codec` accepts) and keeps
    per-layer statistics (tokens, original and compressed bytes, ratio, encode seconds). vLLM's
    cache is never changed. Writes are buffered per layer and encoded in batches of
    ``KVTOOL_VLLM_HOOK_BATCH`` tokens (default 256), which keeps the cost per decode step small.

Each process that writes KV (vLLM's EngineCore / worker processes included: the hook lives in
vLLM's own files) writes ``kvtool-vllm-hook-<pid>.json`` into ``KVTOOL_VLLM_HOOK_DIR`` (default
``<tmp>/kvtool-vllm-hook``), atomically, every ``KVTOOL_VLLM_HOOK_FLUSH_S`` seconds (default 10)
and at exit: per layer tokens, writes, original/compressed bytes, ratio and encode seconds,
plus totals (with ``hook_seconds``, the wall time spent inside the hook). This module imports
nothing heavy until the hook is first enabled.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from typing import Any

ENV_MODE = "KVTOOL_VLLM_HOOK"
ENV_CODEC = "KVTOOL_VLLM_HOOK_CODEC"
ENV_DIR = "KVTOOL_VLLM_HOOK_DIR"
ENV_FLUSH = "KVTOOL_VLLM_HOOK_FLUSH_S"
ENV_BATCH = "KVTOOL_VLLM_HOOK_BATCH"
MODES = ("stats",)
OFF_VALUES = ("", "0", "off", "false", "no")
DEFAULT_CODEC = "turbo3"
STATS_FORMAT = "kvtool.vllm-hook-stats"
STATS_FORMAT_VERSION = 1


def stats_dir() -> str:
    """Where stats files go: ``KVTOOL_VLLM_HOOK_DIR`` or ``<tmp>/kvtool-vllm-hook``."""
    return os.environ.get(ENV_DIR) or os.path.join(tempfile.gettempdir(), "kvtool-vllm-hook")


def stats_path(pid: int | None = None, directory: str | None = None) -> str:
    """The stats file of process ``pid`` (default: this one)."""
    return os.path.join(directory or stats_dir(), f"kvtool-vllm-hook-{pid or os.getpid()}.json")


def _warn(msg: str) -> None:
    try:
        sys.stderr.write(f"kvtool: {msg}\n")
    except Exception:
        pass


class _Layer:
    """Running totals and the not-yet-encoded writes of one attention layer."""

    __slots__ = ("stats", "pending", "pending_tokens")

    def __init__(self) -> None:
        self.stats: dict[str, Any] = {"tokens": 0, "writes": 0, "original_bytes": 0,
                                      "compressed_bytes": 0, "key_compressed_bytes": 0,
                                      "value_compressed_bytes": 0, "encode_seconds": 0.0}
        self.pending: list[tuple[Any, Any, Any]] = []  # (keys, values, slot_mapping)
        self.pending_tokens = 0


class StatsRecorder:
    """Shadow compression and statistics for one process (see the module docstring)."""

    def __init__(self, codec_spec: str, directory: str, flush_every: float, batch: int) -> None:
        from kvtool.codecs import get_codec

        self.pid = os.getpid()
        self.codec = get_codec(codec_spec)
        self.key_codec = self.codec.for_role("key")
        self.value_codec = self.codec.for_role("value")
        self.directory = directory
        self.flush_every = flush_every
        self.batch = max(1, batch)
        self.layers: dict[str, _Layer] = {}
        self.info: dict[str, Any] = {}
        self.started = time.time()
        self.hook_seconds = 0.0  # wall time spent inside record(): copies, encoding, flushes
        self.next_flush = time.monotonic() + flush_every
        self.lock = threading.RLock()
        self._register_exit()

    def _register_exit(self) -> None:
        """Flush at interpreter exit and when a multiprocessing child (fork) finishes."""
        import atexit
        import multiprocessing.util as mp_util

        atexit.register(self.flush)
        # a forked multiprocessing child ends with os._exit(): atexit never runs there, but
        # multiprocessing's own exit function runs these finalizers first.
        self._finalizer = mp_util.Finalize(self, StatsRecorder.flush, args=(self,),
                                           exitpriority=100)

    def close(self) -> str | None:
        """Flush now and drop the exit handlers (tests, benchmarks); the file's path."""
        import atexit

        path = self.flush()
        atexit.unregister(self.flush)
        self._finalizer.cancel()
        return path

    # -- recording ---------------------------------------------------------------------------
    def record(self, layer_name: str, key: Any, value: Any, slot_mapping: Any,
               backend: str) -> None:
        """Copy the written rows aside (cheap); encode once a layer has a full batch."""
        start = time.perf_counter()
        n = slot_mapping.shape[0]
        if n == 0:
            return
        # copies: vLLM reuses these buffers. Padding slots (< 0) are dropped at encode time.
        rows = (_copy(key[:n]), _copy(value[:n]), _copy(slot_mapping))
        with self.lock:
            layer = self.layers.get(layer_name)
            if layer is None:
                layer = self._add_layer(layer_name, key, backend)
            layer.stats["writes"] += 1
            layer.pending.append(rows)
            layer.pending_tokens += n
            if layer.pending_tokens >= self.batch:
                self._encode(layer)
            if time.monotonic() >= self.next_flush:
                self.hook_seconds += time.perf_counter() - start  # counted in this flush too
                start = time.perf_counter()
                self.flush()
            self.hook_seconds += time.perf_counter() - start

    def _add_layer(self, layer_name: str, key: Any, backend: str) -> _Layer:
        if not self.info:
            self.info = {"backend": backend, "dtype": str(key.dtype).removeprefix("torch."),
                         "device": str(getattr(key, "device", "cpu"))}
        layer = self.layers[layer_name] = _Layer()
        layer.stats.update(kv_heads=int(key.shape[1]) if key.ndim == 3 else None,
                           head_dim=int(key.shape[-1]))
        return layer

    def _encode(self, layer: _Layer) -> None:
        """Encode the layer's buffered rows (numpy on CPU — the fastest backend there)."""
        if not layer.pending:
            return
        pending, layer.pending, layer.pending_tokens = layer.pending, [], 0
        k, v, slots = (_concat([p[i] for p in pending]) for i in range(3))
        valid = slots >= 0
        if not bool(valid.all()):
            k, v = k[valid], v[valid]
        if k.shape[0] == 0:
            return
        if str(getattr(k, "device", "cpu")) == "cpu" and not isinstance(k, _np_ndarray()):
            from kvtool.kernels import to_numpy

            k, v = to_numpy(k), to_numpy(v)
        start = time.perf_counter()
        enc_k = self.key_codec.encode(k)
        enc_v = self.value_codec.encode(v)
        seconds = time.perf_counter() - start
        s = layer.stats
        s["tokens"] += int(k.shape[0])
        s["original_bytes"] += int(k.nbytes) + int(v.nbytes)
        s["key_compressed_bytes"] += enc_k.nbytes
        s["value_compressed_bytes"] += enc_v.nbytes
        s["compressed_bytes"] += enc_k.nbytes + enc_v.nbytes
        s["encode_seconds"] += seconds

    # -- output ------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The JSON document (after encoding everything still buffered)."""
        with self.lock:
            for layer in self.layers.values():
                self._encode(layer)
            layers = {}
            totals = {"tokens": 0, "original_bytes": 0, "compressed_bytes": 0,
                      "encode_seconds": 0.0}
            for name, layer in self.layers.items():
                s = dict(layer.stats)
                s["ratio"] = _ratio(s["original_bytes"], s["compressed_bytes"])
                s["encode_seconds"] = round(s["encode_seconds"], 6)
                layers[name] = s
                for key in totals:
                    totals[key] += s[key]
            totals["ratio"] = _ratio(totals["original_bytes"], totals["compressed_bytes"])
            totals["encode_seconds"] = round(totals["encode_seconds"], 6)
            totals["layers"] = len(layers)
            totals["hook_seconds"] = round(self.hook_seconds, 6)
        from kvtool import __version__

        vllm = sys.modules.get("vllm")
        return {"format": STATS_FORMAT, "format_version": STATS_FORMAT_VERSION,
                "kvtool_version": __version__, "vllm_version": getattr(vllm, "__version__", None),
                "pid": self.pid, "mode": "stats", "codec": self.codec.get_config(),
                **self.info, "started_at": self.started, "updated_at": time.time(),
                "layers": layers, "totals": totals}

    def flush(self) -> str | None:
        """Write the stats file atomically (temp file + rename); its path, or None on error."""
        if os.getpid() != self.pid:  # a forked child's inherited copy: not ours to write
            return None
        try:
            with self.lock:
                doc = self.snapshot()
                self.next_flush = time.monotonic() + self.flush_every
                return _write_json_atomic(stats_path(self.pid, self.directory), doc)
        except Exception as e:  # never raise into vLLM (or into interpreter shutdown)
            _warn(f"could not write vLLM hook statistics: {type(e).__name__}: {e}")
            return None


def _copy(x: Any) -> Any:
    return x.detach().clone() if hasattr(x, "clone") else x.copy()


def _np_ndarray() -> type:
    import numpy as np

    return np.ndarray


def _concat(parts: list[Any]) -> Any:
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if type(first).__module__.startswith("torch"):
        import torch

        return torch.cat(parts, dim=0)
    import numpy as np

    return np.concatenate(parts, axis=0)


def _ratio(original: int, compressed: int) -> float | None:
    return round(original / compressed, 4) if compressed else None


def _write_json_atomic(path: str, doc: dict[str, Any]) -> str:
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".kvtool-hook-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


# -- the per-process recorder -------------------------------------------------------------------
_recorder: StatsRecorder | None = None
_disabled_pid: int | None = None
_init_lock = threading.Lock()


def get_recorder() -> StatsRecorder | None:
    """This process's recorder (a fresh one after a fork), created on first use."""
    global _recorder, _disabled_pid
    pid = os.getpid()
    rec = _recorder
    if rec is not None and rec.pid == pid:
        return rec
    if _disabled_pid == pid:
        return None
    with _init_lock:
        if _recorder is not None and _recorder.pid == pid:
            return _recorder
        try:
            flush_every = float(os.environ.get(ENV_FLUSH) or 10.0)
            batch = int(os.environ.get(ENV_BATCH) or 256)
            _recorder = StatsRecorder(os.environ.get(ENV_CODEC) or DEFAULT_CODEC, stats_dir(),
                                      flush_every, batch)
        except Exception as e:
            _disabled_pid = pid
            _warn(f"vLLM hook disabled in process {pid}: {type(e).__name__}: {e}")
            return None
    return _recorder


def on_cache_write(layer_name: str | None, key: Any, value: Any, kv_cache: Any,
                   slot_mapping: Any, *, backend: str = "") -> None:
    """Called by patched vLLM right after a step's K/V rows were written into ``kv_cache``.

    ``key``/``value`` are ``[tokens, kv_heads, head_dim]`` (possibly padded past
    ``len(slot_mapping)``), ``kv_cache`` is the ``(key_cache, value_cache)`` pair the backend
    wrote into, ``slot_mapping`` the destination slot per token (-1 = padding).
    """
    mode = os.environ.get(ENV_MODE, "").strip().lower()
    if mode in OFF_VALUES:
        return
    if mode not in MODES:
        global _disabled_pid
        if _disabled_pid != os.getpid():
            _disabled_pid = os.getpid()
            _warn(f"unknown {ENV_MODE}={mode!r} (known: {', '.join(MODES)}); hook disabled")
        return
    rec = get_recorder()
    if rec is None:
        return
    if not layer_name:  # a backend without the layer at hand: name the cache by its storage
        first = kv_cache[0] if isinstance(kv_cache, (tuple, list)) else kv_cache
        layer_name = f"cache@{first.data_ptr():x}" if hasattr(first, "data_ptr") else "unnamed"
    rec.record(layer_name, key, value, slot_mapping, backend)


def flush() -> str | None:
    """Write this process's statistics now (tests, benchmarks); the file's path or None."""
    rec = _recorder
    return rec.flush() if rec is not None and rec.pid == os.getpid() else None


def read_stats(directory: str | None = None) -> list[dict[str, Any]]:
    """Every stats document in ``directory`` (default: :func:`stats_dir`), by pid."""
    directory = directory or stats_dir()
    docs = []
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        if name.startswith("kvtool-vllm-hook-") and name.endswith(".json"):
            with open(os.path.join(directory, name)) as f:
                docs.append(json.load(f))
    return sorted(docs, key=lambda d: d.get("pid", 0))
