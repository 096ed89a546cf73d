"""Shared pieces of the vLLM connector that need no vLLM: counters, the background saver,
options, the checks a served file passes, and the load/save specs the scheduler half hands the
worker half (the model's identity: :mod:`~kvtool.engines.vllm.served_model`).

The counters are per process: with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the ``uni`` executor
(what kvtool's own engine uses) the scheduler and worker halves of the connector run in one
process, so :func:`stats` sees both.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import hashlib
import logging
import os
import threading
from collections.abc import Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from kvtool.cache import has_sliding_layers
from kvtool.engines.vllm.safeio import Stamp, UnsafeFileError, confine, pin_file, stamp_of
from kvtool.engines.vllm.windows import partial_windows, window_problem

if TYPE_CHECKING:
    from kvtool.engines.vllm.store import Chunk

log = logging.getLogger("kvtool.vllm")
LOG_LEVEL_ENV = "KVTOOL_LOG_LEVEL"


def ensure_visible_logs() -> None:
    """Give kvtool's loggers a stderr handler where nothing else would show them (a vLLM
    server configures only its own ``vllm`` logger), at ``KVTOOL_LOG_LEVEL`` (default INFO):
    store hits, misses, loads and saves are what an operator watches."""
    root = logging.getLogger("kvtool")
    if root.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [kvtool] %(message)s",
                                           "%m-%d %H:%M:%S"))
    root.addHandler(handler)
    level = os.environ.get(LOG_LEVEL_ENV, "INFO").upper()
    root.setLevel(level if isinstance(logging.getLevelName(level), int) else "INFO")
# the store's default policy is the ``quality`` preset (3.78 bits/element): the best mean KL
# and Δppl at ≤ 4 bits over seeds × texts (benchmarks/quality.py); its one-rotation form kept
# greedy answers after a restore closest to recompute (benchmarks/store_policy.py)
DEFAULT_PRESET = "quality"
DEFAULT_ZSTD = True
MIN_CHUNK_TOKENS = 256
COUNTER_NAMES = ("lookups", "hits", "tokens_matched", "tokens_loaded", "files_loaded",
                 "tokens_saved", "chunks_saved", "bytes_saved", "captures", "invalid_files",
                 "load_failures", "save_failures", "refused_files", "quarantined_files",
                 "newer_files", "lookup_timeouts", "load_timeouts", "store_unavailable",
                 "saves_dropped", "disk_full")
_COUNTERS: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)
_TIMES: dict[str, float] = {"load_seconds": 0.0, "save_seconds": 0.0, "write_seconds": 0.0}
MAX_PENDING_SAVES = 64  # queued save batches (copies of K/V) before new ones are dropped
#: ... or this many bytes of them: the quality preset encodes ~400 MB/s, so this is a fraction
#: of a second of the saver's work; a bigger queue only holds copies behind a slow store (and
#: the server's memory swings with it)
MAX_PENDING_SAVE_BYTES = 64 << 20
_SAVER: ThreadPoolExecutor | None = None
_PENDING: dict[Future, int] = {}  # queued or running saves → bytes they hold
_LOCK = threading.Lock()
TRIM_AFTER_BYTES = 16 << 20  # a queue that held this much hands its freed memory back
_held_since_trim = 0  # the most bytes the queue held since it last handed memory back


def stats() -> dict[str, Any]:
    """This process's connector counters (scheduler and worker halves together) and the
    seconds spent loading and saving."""
    out: dict[str, Any] = dict(_COUNTERS)
    out["failures"] = (out["invalid_files"] + out["load_failures"] + out["save_failures"]
                       + out["refused_files"] + out["lookup_timeouts"] + out["load_timeouts"]
                       + out["store_unavailable"] + out["saves_dropped"])
    out.update(_TIMES)
    return out


def reset_stats() -> None:
    for k in _COUNTERS:
        _COUNTERS[k] = 0
    for k in _TIMES:
        _TIMES[k] = 0.0


def count(name: str, n: int = 1) -> None:
    with _LOCK:
        _COUNTERS[name] += n


def submit(fn: Any, *args: Any, bounded: bool = False, nbytes: int = 0) -> Future | None:
    """Run ``fn(*args)`` on the process's one saver thread (writes happen in order).
    ``bounded``: None, and nothing queued, when the queue is full (:func:`saves_full`, or
    ``nbytes`` more would pass :data:`MAX_PENDING_SAVE_BYTES`): a slow or stalled store must
    not pile up copies of K/V in memory."""
    global _SAVER
    with _LOCK:
        if bounded and _full(nbytes):
            return None
        if _SAVER is None:
            _SAVER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtool-saver")
        future = _SAVER.submit(fn, *args)
        _PENDING[future] = nbytes
        global _held_since_trim
        _held_since_trim = max(_held_since_trim, sum(_PENDING.values()))
    future.add_done_callback(_done)
    return future


def _done(future: Future) -> None:
    global _held_since_trim
    with _LOCK:
        _PENDING.pop(future, None)
        drained = not _PENDING and _held_since_trim >= TRIM_AFTER_BYTES
        if drained:
            _held_since_trim = 0
            with contextlib.suppress(RuntimeError):  # a saver shut down meanwhile
                # queued after this save: runs once the saver has dropped the save's copies
                _SAVER.submit(release_freed_memory)


def release_freed_memory() -> bool:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim``; False elsewhere).

    The saver's queued K/V copies are small tensors (a layer of a chunk: ~100 KB) that the C
    allocator serves from its arenas, which keep freed pages: without this, a store stall that
    filled the queue (:data:`MAX_PENDING_SAVE_BYTES`) would leave the server that much larger
    for good (measured with a 256 MiB queue: +300 MB on a 3 GB server after a 12 s S3 freeze,
    benchmarks/soak.py)."""
    name = ctypes.util.find_library("c")
    try:
        return bool(ctypes.CDLL(name).malloc_trim(0)) if name else False
    except (OSError, AttributeError):
        return False


def saves_full() -> bool:
    """Whether the saver's queue is full (:data:`MAX_PENDING_SAVES` batches, or
    :data:`MAX_PENDING_SAVE_BYTES` of K/V copies)."""
    with _LOCK:
        return _full(1)


def _full(nbytes: int) -> bool:
    """Whether ``nbytes`` more would not fit in the saver's queue (the caller holds _LOCK)."""
    return len(_PENDING) >= MAX_PENDING_SAVES or bool(_PENDING) and \
        sum(_PENDING.values()) + nbytes > MAX_PENDING_SAVE_BYTES


def flush(timeout: float | None = None) -> bool:
    """Wait until every background save of this process is written; False on timeout."""
    pending = list(_PENDING)
    return not wait(pending, timeout).not_done if pending else True


def capture_name(token_ids: Any) -> str:
    """The file stem ``capture_dir`` uses for a prompt."""
    return hashlib.sha256(np.asarray(token_ids, dtype="<i8").tobytes()).hexdigest()[:32]


def add_time(name: str, seconds: float) -> None:
    with _LOCK:
        _TIMES[name] += seconds


COUNT_OPTIONS = ("protect_layers", "sink_tokens", "recent_tokens")


def given_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """The policy options a user gave: without those left out (None, False, a 0 of anything but
    a count; a count of 0 replaces a preset's)."""
    return {k: v for k, v in (options or {}).items()
            if v is not None and v is not False and (v != 0 or k in COUNT_OPTIONS)}


def policy_from_extra(extra: dict[str, Any], model_fingerprint: str | None = None):
    """The store's :class:`~kvtool.policy.CodecPolicy` from connector options: ``preset`` (by
    default :data:`DEFAULT_PRESET` unless ``codec`` is given; fitted to the model with
    ``model_fingerprint`` where ``kvtool calibrate --preset`` fitted it) with any codec and
    token options given on top."""
    from kvtool.policy import CodecPolicy

    codec = extra.get("codec")
    preset = extra.get("preset") or (None if codec else DEFAULT_PRESET)
    counts = {k: int(extra[k]) for k in COUNT_OPTIONS if extra.get(k) is not None}
    policy = CodecPolicy.from_options(codec=codec, key_codec=extra.get("key_codec"),
                                      value_codec=extra.get("value_codec"), preset=preset,
                                      model_fingerprint=model_fingerprint, **counts)
    return policy.resolve()  # sink=auto: chunks are written as they come (every scanned token)


MIN_STORE_TIMEOUT = 0.001  # seconds
MIN_MAX_BYTES = 1_000_000  # a store bound under this holds hardly a chunk of a model


def store_timeout(extra: dict[str, Any]) -> float:
    """``store_timeout``: seconds a lookup, or one chunk's read, may take before it counts as
    a miss (default :data:`~kvtool.engines.vllm.guard.DEFAULT_TIMEOUT`)."""
    from kvtool.engines.vllm.guard import DEFAULT_TIMEOUT
    from kvtool.errors import KvtoolError

    value = extra.get("store_timeout", DEFAULT_TIMEOUT)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not MIN_STORE_TIMEOUT <= seconds <= 3600:  # under a millisecond: every lookup a miss
        raise KvtoolError(f"kv_connector_extra_config: store_timeout must be a number of "
                          f"seconds in [{MIN_STORE_TIMEOUT}, 3600], got {value!r}")
    return seconds


def parse_max_bytes(text: str, label: str) -> int:
    """A store's bound in bytes (``2GB``; see ``store_admin.parse_size``): a
    :class:`KvtoolError` naming ``label`` unless it is a positive size."""
    from kvtool.engines.vllm.store_admin import parse_size
    from kvtool.errors import KvtoolError

    try:
        size = parse_size(text)
    except ValueError as e:
        raise KvtoolError(f"{label}: {e}") from None
    if size < MIN_MAX_BYTES:
        raise KvtoolError(f"{label}: {text!r} would evict every chunk as it is written; give "
                          "1MB or more (like 2GB)")
    return size


def budget_options(extra: dict[str, Any]) -> dict[str, Any]:
    """The :class:`~kvtool.engines.vllm.store_budget.StoreBudget` keyword arguments of the
    connector options ``max_bytes``, ``quarantine_max_bytes`` (sizes) and
    ``quarantine_max_age`` (a duration); each refused, by name, when malformed (and
    ``max_bytes`` unless positive)."""
    from kvtool.engines.vllm.store_admin import parse_duration, parse_size
    from kvtool.errors import KvtoolError

    out: dict[str, Any] = {}
    if extra.get("max_bytes") is not None:
        out["max_bytes"] = parse_max_bytes(str(extra["max_bytes"]),
                                           "kv_connector_extra_config: max_bytes")
    for option, arg, parse in (("quarantine_max_bytes", "quarantine_bytes", parse_size),
                               ("quarantine_max_age", "quarantine_age", parse_duration)):
        if extra.get(option) is None:
            continue
        try:
            out[arg] = parse(str(extra[option]))
        except ValueError as e:
            raise KvtoolError(f"kv_connector_extra_config: {option}: {e}") from None
    out.setdefault("max_bytes", None)
    return out


def common_prefix(a: np.ndarray, b: list[int]) -> int:
    n = min(len(a), len(b))
    diff = np.nonzero(a[:n] != np.asarray(b[:n], dtype=np.int64))[0]
    return int(diff[0]) if diff.size else n


def unservable(f: Any, sliding_ok: bool = False) -> str | None:
    """Why an open .kvz (:class:`~kvtool.formats.reader.KvzFile`) or a loaded
    :class:`~kvtool.cache.KVCache` cannot be served as a prefix (None: it can): a prompt is
    matched against its token ids, and a store chunk holds no sliding-window layer
    (``sliding_ok``: a served file may; :func:`partial_windows` says when it serves only a
    prompt that continues all of it)."""
    if f.token_ids is None:
        return "it stores no token ids"
    if not sliding_ok and has_sliding_layers(f.layer_info):
        return "it has sliding-window layers"
    return None


def shape_problem(f: Any, model: dict[str, Any]) -> str | None:
    """Why the layers of an open .kvz or a loaded :class:`~kvtool.cache.KVCache` cannot fill
    the served ``model``'s paged caches (their count, KV heads, head_dim), or None. A file
    without the layout fields in its identity still names the model's fingerprint; its
    shapes are what count."""
    from kvtool.formats import constants as C

    layers, heads, dim = (model.get(k) for k in ("num_layers", "num_kv_heads", "head_dim"))
    if isinstance(layers, int) and f.num_layers != layers:
        return f"{f.num_layers} layers, the model has {layers}"
    shapes = [tuple(k.shape) for k in f.keys] if hasattr(f, "keys") else \
        [tuple(layer["key"]["shape"]) for layer in f.header[C.H_LAYERS]]
    for i, (h, _, d) in enumerate(shapes):
        if (isinstance(heads, int) and h != heads) or (isinstance(dim, int) and d != dim):
            return f"layer {i} holds {h} KV heads × head_dim {d}, the model {heads} × {dim}"
    return None


def refuse_unservable(f: Any, sliding_ok: bool = False) -> None:
    """ValueError where :func:`unservable` says why ``f`` cannot be served as a prefix."""
    why = unservable(f, sliding_ok)
    if why is not None:
        raise ValueError(f"it cannot be served as a prefix: {why}")


class ServedFile(NamedTuple):
    """A .kvz file served as a prefix (``kvz_files``, a request's ``kvtool_kvz``): its token
    ids (empty when it cannot be served), whether it serves only a prompt that continues
    all of them (:func:`partial_windows`), and the stamp of the file they were read from
    (the worker loads it only while the file still has it)."""

    path: str
    ids: np.ndarray
    whole: bool = False
    stamp: Stamp | None = None


def refreshed(served: ServedFile, model: dict[str, Any], prefix_caching: bool) -> ServedFile:
    """``served`` read again where its file changed since (a ``kvz_files`` entry rewritten
    while the server runs: its old ids would match prompts of another text); as it is
    otherwise. One ``stat`` a call."""
    try:
        now = stamp_of(os.stat(served.path))
    except OSError:
        now = None
    if now == served.stamp:
        return served
    log.info("kvtool: %s changed since it was read; reading it again", served.path)
    return read_kvz_ids(served.path, model, prefix_caching)


def read_kvz_ids(path: str, model: dict[str, Any], prefix_caching: bool = True) -> ServedFile:
    """A served .kvz file's token ids (empty, with a warning, when it cannot be served). The
    file must be a regular file, not a symlink (see :mod:`~kvtool.engines.vllm.safeio`).
    ``model`` is the engine model's identity; a file of another dtype of the same model is
    served, cast (:func:`check_cache` notes it), one of other weights is not. A file with
    :func:`partial_windows` is not served where vLLM's ``prefix_caching`` is on: the blocks
    it fills would be shared with prompts that need the tokens its windows dropped."""
    from kvtool.errors import KvtoolError
    from kvtool.formats import open_kvz
    from kvtool.identity import other_weights, same_model

    try:
        with pin_file(path) as (pinned_path, stamp), open_kvz(pinned_path) as f:
            if not same_model(f.model, model):
                raise ValueError(f"it belongs to another model{other_weights(f.model, model)}")
            refuse_unservable(f, sliding_ok=True)
            whole = partial_windows(f)
            wrong = window_problem(f, model) if whole else None
            if wrong:
                raise ValueError(wrong)
            if whole and prefix_caching:
                raise ValueError("its sliding-window layers keep only their last tokens, and "
                                 "vLLM's prefix caching would share the blocks it fills with "
                                 "prompts that need the tokens they dropped; serve it with "
                                 "prefix caching off (--no-enable-prefix-caching)")
            return ServedFile(path, f.token_ids, whole, stamp)
    except (KvtoolError, OSError, ValueError) as e:
        log.warning("kvtool: not serving %s: %s", path, e)
        count("invalid_files")
        return ServedFile(path, np.zeros(0, dtype=np.int64))


_ALLOWED_KVZ: set[str] = set()


def allow_kvz(path: str | os.PathLike) -> None:
    """Let requests of this process name ``path`` as ``kvtool_kvz`` (for in-process callers,
    such as kvtool's vLLM engine, that pick the file themselves; a server's requests are
    confined to the operator's ``kvz_dirs``/``kvz_files``)."""
    _ALLOWED_KVZ.add(os.path.realpath(path))


def request_switch(params: dict[str, Any], name: str, default: bool) -> bool:
    """A request's ``kv_transfer_params[name]``: a JSON boolean; anything else (``"false"``
    is a non-empty string, true to Python) is ignored with a warning, keeping ``default``."""
    value = params.get(name, default)
    if isinstance(value, bool):
        return value
    log.warning("kvtool: ignoring the request's %s=%r: expected true or false", name, value)
    return default


def request_kvz(path: Any, dirs: Sequence[str], files: Collection[str],
                model: dict[str, Any], prefix_caching: bool = True) -> ServedFile:
    """:func:`read_kvz_ids` of a request's ``kvtool_kvz`` if it resolves to a regular file under
    ``dirs`` or in ``files`` (real paths); otherwise refused, unopened, with a warning."""
    try:
        if not isinstance(path, str) or not path:
            raise UnsafeFileError(errno.EINVAL, f"{path!r} is not a path")
        real = confine(path, dirs, set(files) | _ALLOWED_KVZ)
    except (OSError, ValueError) as e:  # ValueError: a NUL byte or a lone surrogate in it
        log.warning("kvtool: refusing the request's kvtool_kvz %r: %s", path,
                    getattr(e, "strerror", None) or e)
        count("refused_files")
        return ServedFile(str(path), np.zeros(0, dtype=np.int64))
    return read_kvz_ids(real, model, prefix_caching)


def check_cache(cache: Any, model: dict[str, Any], tokens: int, sliding_ok: bool = False
                ) -> None:
    """Raise ValueError unless a loaded cache is this model's (up to dtype: another dtype is
    cast, logged once per process), holds ``tokens`` tokens and can be served as a prefix
    (:func:`unservable`; ``sliding_ok``: a served file's sliding-window layers, placed at
    their positions by :func:`~kvtool.engines.vllm.paged_io.load_source`)."""
    from kvtool.identity import identity_dtype, log_cast, other_weights, same_model

    if not same_model(cache.model, model):
        raise ValueError(f"the file belongs to another model{other_weights(cache.model, model)}")
    refuse_unservable(cache, sliding_ok)
    wrong = window_problem(cache, model) if sliding_ok else None
    if wrong:
        raise ValueError(wrong)
    log_cast(cache.model, identity_dtype(model) or "", log)
    wrong = shape_problem(cache, model)
    if wrong:
        raise ValueError(wrong)
    if cache.num_tokens != tokens:
        raise ValueError(f"{cache.num_tokens} tokens where {tokens} were due")


# -- what the scheduler half tells the worker half ----------------------------------------------
@dataclass
class Source:
    """A file whose token 0 is sequence position ``start``; it covers ``[start, stop)``."""

    path: str
    start: int
    stop: int
    chunk: Chunk | None = None  # set for store chunks (see PrefixStore.reject)
    stamp: Stamp | None = None  # a served file's, as its ids were read (ServedFile.stamp)


@dataclass
class LoadSpec:
    req_id: str
    block_ids: list[int]
    start: int  # first token to write (tokens before it are already in vLLM's cache)
    stop: int
    sources: list[Source]


@dataclass
class SaveSpec:
    req_id: str
    block_ids: list[int]
    token_ids: list[int]
    chunks: list[Chunk] = field(default_factory=list)
    capture_path: str | None = None  # write the whole prompt (len(token_ids) tokens) here


@dataclass
class ReqState:
    """The scheduler half's view of one request."""

    prompt: list[int]
    block_ids: list[int] = field(default_factory=list)
    next_chunk: int = 0
    chunks: list[Chunk] | None = None
    captured: bool = False
    load: bool = True
    save: bool = True
    capture: bool = False
    files: list[ServedFile] = field(default_factory=list)
    logged: bool = False  # its hit or miss has been logged
    match: tuple[int, list[Source]] | None = None  # its lookup's (tokens, sources), once
    stored: int = 0  # leading chunks the lookup found in the store (never saved again)
    from_file: int = 0  # leading tokens a .kvz file serves: its values, not computed ones
    partial_windows: bool = False  # that file's sliding-window layers kept only their last tokens
    planned: int = 0  # tokens computed once the last step planned for it has run
    load_failed: bool = False  # a block it holds failed to load (see load_failures)
    tainted: bool = False  # it reads K/V computed from a failed load: nothing more is saved
