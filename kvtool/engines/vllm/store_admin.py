"""A prefix store at rest: list, measure, verify and prune it (``kvtool store``; pinning is
:mod:`~kvtool.engines.vllm.store_pins`), with the tools that the connector's byte budget
(:class:`~kvtool.engines.vllm.store_budget.StoreBudget`, re-exported here) applies.

Works on the layout of :mod:`~kvtool.engines.vllm.store` (``<root>/<fingerprint[:16]>/<key[:2]>/
<key>.kvz``, ``<root>/quarantine/``) for every model in the store, without vLLM, on a directory
(its root may be a symlink) or an ``s3://bucket/prefix`` URL
(:mod:`~kvtool.engines.vllm.store_backend`).

"Last hit" is a chunk file's access time: :meth:`PrefixStore.read` sets it on every load it
serves (explicitly, so ``noatime``/``relatime`` mounts do not matter); a chunk never served
since it was written has its write time. On S3, which has no access time, it is the time of the
chunk's hit marker (:mod:`~kvtool.engines.vllm.store_s3`). Pruning is safe while servers run: a
file is removed by unlinking its name (an object by one DELETE), so a server that has it open
finishes reading it, and a server that looks for it next finds a miss and recomputes (then
stores the chunk again). A chunk that vanishes while it is verified was pruned or quarantined
meanwhile: it is *gone*, not damaged. Symlinks and other non-regular files are never followed,
counted or removed. A file chosen for removal that is there but cannot be removed (read-only
filesystem, permissions) is a :class:`RemoveError`, never a silent "removed 0".

Rules of a byte budget (the connector's ``max_bytes``, and ``kvtool store prune``): the bytes
counted are the whole store's (chunks, quarantine, temp files); stale temp files of dead
writers are collected (``Backend.collect_garbage`` of every model directory); quarantined
files go oldest first (by the time they were quarantined), and the quarantine has bounds of
its own (:class:`~kvtool.engines.vllm.store_budget.StoreBudget`: 10% of ``max_bytes`` and 7
days by default); then least recently hit chunks go, pinned chunks never.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NoReturn

from kvtool.engines.mlx_store import LOCK_FILE as MLX_LOCK_FILE
from kvtool.engines.vllm.store_backend import (
    MODEL_DIR,
    PINS_FILE,
    QUARANTINE_DIR,
    Backend,
    Entry,
    chunk_name,
    is_url,
    open_backend,
)
from kvtool.errors import KvtoolError
from kvtool.fileio import TEMP_SUFFIX, is_stale_temp

_CHUNK = re.compile(r"^[0-9a-f]{64}\.kvz$")
_MLX_ENTRY = re.compile(r"^[0-9a-f]{32}\.safetensors$")  # kvtool.engines.mlx_store's files
_QUARANTINED_AT = re.compile(r"\.(\d{10,20})\.kvz$")  # <model>-<key>.<time_ns>.kvz
#: a unit is required (a bare 30 would be seconds to us and days to a reader) and lowercase
#: (``30M``: minutes or months?); ASCII digits only
_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([smhdw])\s*$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class StoredChunk:
    """One chunk file found in the store."""

    path: str  # a file path, or an s3:// URL
    model: str  # the model directory (fingerprint[:16])
    bytes: int
    written: float  # mtime, seconds since the epoch
    last_hit: float  # atime: the last load served from it (or its write)
    pinned: bool = False  # listed in the store's pins file: never pruned or evicted
    name: str = ""  # relative to the store ("<model>/<xx>/<key>.kvz")

    @property
    def key(self) -> str:
        """The chain key its file name says it is."""
        return self.name.rsplit("/", 1)[-1].removesuffix(".kvz")


@dataclasses.dataclass
class StoreScan:
    """Everything under a store root, by kind."""

    root: str
    chunks: list[StoredChunk]
    temp_files: int = 0
    temp_bytes: int = 0
    quarantined_files: int = 0
    quarantined_bytes: int = 0
    ignored: int = 0  # symlinks, special files, names not of the store's layout
    pins: dict[str, Any] = dataclasses.field(default_factory=dict)  # chunk key → pin record
    #: why the pins file could not be read (:func:`read_pins`' error): then ``pins`` is empty,
    #: and nothing may be pruned (:func:`eviction_order` refuses), but the store can be read
    pins_problem: str | None = None
    backend: Backend | None = None
    quarantine: list[Entry] = dataclasses.field(default_factory=list)
    temps: list[Entry] = dataclasses.field(default_factory=list)
    models: list[str] = dataclasses.field(default_factory=list)  # model directories seen

    @property
    def total_bytes(self) -> int:
        """What a byte budget counts: chunks, quarantine and temp files."""
        return sum(c.bytes for c in self.chunks) + self.quarantined_bytes + self.temp_bytes


@dataclasses.dataclass
class VerifyReport:
    """What :func:`verify` found."""

    damaged: list[tuple[str, str]]  # (path, problem)
    gone: list[str]  # chunks removed (pruned, quarantined) while the scan ran: not damaged


class RemoveError(KvtoolError):
    """Files chosen for removal that are there but could not be removed; ``removed``: the
    (files, bytes) that were."""

    def __init__(self, message: str, removed: tuple[int, int] = (0, 0)):
        super().__init__(message)
        self.removed = removed


def backend_of(root: str | os.PathLike | Backend,
               storage_options: dict | None = None) -> Backend:
    """The backend of a directory or ``s3://`` URL (a backend is passed through)."""
    if hasattr(root, "walk") and hasattr(root, "location"):
        return root  # type: ignore[return-value]
    return open_backend(root, storage_options)  # type: ignore[arg-type]


def scan(root: str | os.PathLike | Backend, storage_options: dict | None = None, *,
         missing_ok: bool = False) -> StoreScan:
    """Walk the store at ``root`` (a :class:`KvtoolError` if it is not a directory, or its
    bucket cannot be reached, or it holds no store but other entries: :func:`refuse_foreign`;
    ``missing_ok``, the server's own scans: a directory not made yet, or of other entries, is
    an empty store)."""
    backend = backend_of(root, storage_options)
    if missing_ok and not is_url(backend.location) and not os.path.lexists(backend.location):
        return StoreScan(backend.location, [], backend=backend)
    backend.check()
    out = StoreScan(backend.location, [], backend=backend)
    try:
        out.pins = read_pins(backend)
    except KvtoolError as e:  # the chunks can still be listed, read and verified
        out.pins_problem = str(e)
    try:
        entries = list(backend.walk())
    except OSError as e:
        raise KvtoolError(f"cannot list {backend.location}: {e.strerror or e}") from None
    models = set()
    for e in entries:
        parts = e.name.split("/")
        if MODEL_DIR.match(parts[0]):
            models.add(parts[0])
        if parts[0] == QUARANTINE_DIR:
            out.quarantine.append(e)
            out.quarantined_files += 1
            out.quarantined_bytes += e.size
        elif not e.regular:
            out.ignored += 1
        elif parts[-1].endswith(TEMP_SUFFIX):
            out.temps.append(e)
            out.temp_files += 1
            out.temp_bytes += e.size
        elif _CHUNK.match(parts[-1]):
            out.chunks.append(StoredChunk(backend.path(e.name), parts[0], e.size, e.mtime,
                                          e.last_hit, parts[-1][:-4] in out.pins, e.name))
        else:
            out.ignored += 1
    out.models = sorted(models)
    if not (missing_ok or out.chunks or out.temps or out.quarantine or out.models or out.pins
            or out.pins_problem):
        refuse_foreign(backend)  # a server's own scans (missing_ok) take the root it was given
    return out


def refuse_foreign(root: str | os.PathLike | Backend) -> None:
    """A :class:`KvtoolError` for a store root that holds entries but none a store writes (a
    mistyped path: the user's home, a model directory), which would read as an empty store
    and fill up with a store's directories. An empty or missing root is a new store, as is
    one of hidden entries and ``lost+found`` alone (a volume's mount point)."""
    from kvtool.engines.vllm.stats_files import STATS_DIR
    from kvtool.engines.vllm.store_s3 import HITS_DIR

    backend = backend_of(root)
    every = backend.root_names()
    names = [n for n in every  # "": an S3 console's folder marker
             if n and not n.startswith(".") and n != "lost+found"]
    own = (QUARANTINE_DIR, PINS_FILE, STATS_DIR, HITS_DIR)
    mlx = [n for n in names if _MLX_ENTRY.match(n)]  # (its quarantine/ is named like ours)
    if (mlx or MLX_LOCK_FILE in every) and not any(MODEL_DIR.match(n) for n in names) \
            and all(n in mlx or n == QUARANTINE_DIR for n in names):
        raise KvtoolError(f"{backend.location} is an mlx-lm prompt-cache store (kvtool serve "
                          "--engine mlx): the kvtool store commands manage the vLLM "
                          "connector's stores")
    if not names or any(MODEL_DIR.match(n) or n.startswith(own) for n in names):
        return
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    raise KvtoolError(f"{backend.location} holds no kvtool store: none of its entries ({shown}) "
                      f"is a store's (model directories of 16 hex digits, {QUARANTINE_DIR}/, "
                      f"{STATS_DIR}/, {PINS_FILE}); check the path")


def stats(found: StoreScan) -> dict[str, Any]:
    """Totals of a scan, overall and per model directory (JSON-ready)."""
    models: dict[str, dict[str, Any]] = {}
    for c in found.chunks:
        m = models.setdefault(c.model, {"model": c.model, "chunks": 0, "bytes": 0,
                                        "oldest_hit": c.last_hit, "newest_hit": c.last_hit})
        m["chunks"] += 1
        m["bytes"] += c.bytes
        m["oldest_hit"] = min(m["oldest_hit"], c.last_hit)
        m["newest_hit"] = max(m["newest_hit"], c.last_hit)
    return {
        "root": found.root,
        "chunks": len(found.chunks),
        "bytes": sum(c.bytes for c in found.chunks),
        "pinned_chunks": sum(c.pinned for c in found.chunks),
        "models": sorted(models.values(), key=lambda m: -m["bytes"]),
        "temp_files": found.temp_files, "temp_bytes": found.temp_bytes,
        "quarantined_files": found.quarantined_files,
        "quarantined_bytes": found.quarantined_bytes,
        "ignored_entries": found.ignored,
    }


def verify(found: StoreScan, progress: Callable[[Iterable], Iterable] = iter) -> VerifyReport:
    """Every chunk file whose checksums or layers fail, or whose content contradicts its place
    (model directory, or the key it records); and the chunks that vanished since the scan
    (gone, not damaged). Reads every byte; changes nothing. ``progress`` wraps the iteration
    over the chunks (a tqdm bar)."""
    from kvtool.formats import open_kvz
    from kvtool.formats.info import verify_file

    report = VerifyReport([], [])
    backend = backend_of(found.backend or found.root)
    for c in progress(found.chunks):
        try:
            with backend.pin(c.name) as (path, _), open_kvz(path) as f:
                problems = verify_file(f)
                fingerprint = str(f.model.get("fingerprint", ""))
                if fingerprint[:16] != c.model:
                    problems.append(f"it belongs to model {fingerprint[:16] or '?'}, "
                                    f"stored under {c.model}")
                misfiled = misplaced(f.store_chunk, c.key)
                if misfiled:
                    problems.append(misfiled)
                if c.name != chunk_name(c.model, c.key):
                    problems.append(f"it is never read here: a server looks for it at "
                                    f"{chunk_name(c.model, c.key)}")
        except (FileNotFoundError, NotADirectoryError):
            report.gone.append(c.path)  # pruned or quarantined since the scan
            continue
        except KvtoolError as e:
            problems = [str(e).replace(f"{c.path}: ", "")]
        except OSError as e:
            problems = [f"unreadable ({e.strerror or e})"]
        report.damaged += [(c.path, p) for p in problems[:1]]
    return report


def misplaced(place: dict[str, Any] | None, key: str, start: int | None = None) -> str | None:
    """Why a chunk file whose header records ``place`` (:attr:`KvzFile.store_chunk`) cannot be
    the chunk ``key`` (starting at token ``start``, when known), or None. A file that records
    no place (written before kvtool recorded it) is not refused."""
    if place is None:
        return None
    if place["key"] != key:
        return (f"it was written as chunk {place['key'][:16]}… (another prefix: its K/V were "
                "computed after other tokens), not this one")
    if start is not None and place["start"] != start:
        return f"it was written for tokens from {place['start']}, not from {start}"
    return None


def parse_duration(text: str) -> float:
    """Seconds in ``30d``, ``12h``, ``90m`` (minutes), ``45s``, ``2w``: a lowercase unit is
    required."""
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a duration (a number and a unit: s, m for minutes, "
                         "h, d or w, like 30d, 12h, 90m)")
    return float(m.group(1)) * _SECONDS[m.group(2)]


def parse_size(text: str) -> int:
    """Bytes in ``500MB``, ``2GiB``, ``10G``, ``1000`` (decimal units; ``i`` for binary)."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a size (like 500MB, 2GiB, 10G)")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** " kmgt".index(m.group(2).lower() or " "))


def prune_plan(found: StoreScan, *, max_bytes: int | None = None,
               older_than: float | None = None, now: float | None = None,
               other_bytes: int = 0) -> list[StoredChunk]:
    """The chunks to remove, least recently hit first: every chunk not hit within
    ``older_than`` seconds, then more until the rest, with ``other_bytes`` (what stays of the
    quarantine and temp files), fits in ``max_bytes``. Pinned chunks stay (and count)."""
    now = time.time() if now is None else now
    by_age = eviction_order(found)
    doomed = [c for c in by_age if older_than is not None and now - c.last_hit > older_than]
    if max_bytes is not None:
        gone = {c.path for c in doomed}
        left = sum(c.bytes for c in found.chunks) - sum(c.bytes for c in doomed) + other_bytes
        for c in by_age:
            if left <= max_bytes:
                break
            if c.path not in gone:
                doomed.append(c)
                left -= c.bytes
    return doomed


def quarantined_at(entry: Entry) -> float:
    """When a file was quarantined (its name says; else its mtime)."""
    m = _QUARANTINED_AT.search(entry.name)
    return int(m.group(1)) / 1e9 if m else entry.mtime


def quarantine_plan(found: StoreScan, *, max_bytes: int | None = None,
                    older_than: float | None = None, now: float | None = None) -> list[Entry]:
    """Quarantined files to remove, oldest first: those quarantined more than ``older_than``
    seconds ago, then more until the quarantine fits in ``max_bytes``."""
    now = time.time() if now is None else now
    left = found.quarantined_bytes
    doomed = []
    for e in sorted(found.quarantine, key=lambda e: (quarantined_at(e), e.name)):
        if not ((older_than is not None and now - quarantined_at(e) > older_than)
                or (max_bytes is not None and left > max_bytes)):
            break
        doomed.append(e)
        left -= e.size
    return doomed


def stale_temps(found: StoreScan) -> list[Entry]:
    """The temp files of the scan whose writers can no longer finish them (dead, or gone
    for :data:`~kvtool.fileio.STALE_TEMP_SECONDS`)."""
    backend = backend_of(found.backend or found.root)
    return [t for t in found.temps if is_stale_temp(backend.path(t.name))]


def collect_temps(found: StoreScan) -> tuple[int, int]:
    """Remove stale temp files: ``Backend.collect_garbage`` of every model directory (on S3,
    once with no model: the writers' local temp directories); (files, bytes). A
    :class:`RemoveError` if a stale temp file of the scan is there but cannot be removed."""
    backend = backend_of(found.backend or found.root)
    stale = stale_temps(found)
    files = freed = 0
    for model in found.models or [""]:
        n, b = backend.collect_garbage(model)
        files, freed = files + n, freed + b
    try:
        n, b = remove(stale, backend)  # what collect_garbage left: removed now, or its error
    except RemoveError as e:
        e.removed = (files + e.removed[0], freed + e.removed[1])
        raise
    return files + n, freed + b


def remove(items: Sequence[StoredChunk | Entry], root: str | os.PathLike | Backend
           ) -> tuple[int, int]:
    """Remove chunk files (or quarantined or temp files), never through a symlinked
    directory; (files, bytes) removed. A file already gone (another prune, a quarantine) is
    skipped; one that is there but cannot be removed is a :class:`RemoveError` (naming it),
    after every other has been tried."""
    backend = backend_of(root)
    files = freed = 0
    failed: list[OSError] = []
    for item in items:
        try:
            size = backend.remove(item.name)
        except OSError as e:
            failed.append(e)
            continue
        if size is not None:
            files, freed = files + 1, freed + size
    if failed:
        e = failed[0]
        what = f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e)
        more = f" (and {len(failed) - 1} more files)" if len(failed) > 1 else ""
        raise RemoveError(f"cannot remove {what}{more}", (files, freed))
    return files, freed


def eviction_order(found: StoreScan) -> list[StoredChunk]:
    """Unpinned chunks, least recently hit first: the order in which chunks are evicted (a
    :class:`KvtoolError` when the pins file could not be read: every chunk may be pinned)."""
    if found.pins_problem:
        raise KvtoolError(found.pins_problem)
    return sorted((c for c in found.chunks if not c.pinned), key=lambda c: (c.last_hit, c.path))


def read_pins(root: str | os.PathLike | Backend) -> dict[str, Any]:
    """The store's pins (chunk key → {"file", "model"}); empty if there is no pins file. A
    pins file that does not parse as one is a :class:`KvtoolError`: read as "no pins", a
    prune would delete every pinned chunk, and a new pin would overwrite the others."""
    backend = backend_of(root)
    try:
        raw = backend.read_small(PINS_FILE)
    except OSError as e:  # a symlink, a directory, no permission: never "no pins"
        _pins_unknown(backend, f"cannot be read ({e.strerror or e})")
    if raw is None:
        return {}
    from kvtool.errors import FormatError
    from kvtool.formats.container import parse_json

    try:  # strict: a chunk key given twice would be read as its last entry
        data = parse_json(raw, PINS_FILE)
    except FormatError as e:
        _pins_unknown(backend, f"is damaged ({e})")
    if isinstance(data, dict) and all(
            isinstance(k, str) and isinstance(v, dict) and isinstance(v.get("file"), str)
            for k, v in data.items()):
        return data
    _pins_unknown(backend, "is damaged (not an object of chunk key → {\"file\": ..., "
                  "\"model\": ...})")


def _pins_unknown(backend: Backend, problem: str) -> NoReturn:
    raise KvtoolError(f"{backend.location}/{PINS_FILE} {problem}: which chunks are pinned is "
                      "unknown, so nothing is pruned, pinned or unpinned until it is restored "
                      "or removed")


def write_pins(root: str | os.PathLike | Backend, pins: dict[str, Any]) -> None:
    """Replace the store's pins file with ``pins`` (atomically: a temp file and a rename in a
    directory, one PUT on S3)."""
    backend_of(root).write_small(PINS_FILE, json.dumps(pins, indent=1, sort_keys=True).encode())
