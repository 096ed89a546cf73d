"""Where a prefix store's objects live: a local directory, or an S3-compatible bucket
(:mod:`~kvtool.engines.vllm.store_s3`). Nothing here imports vLLM.

A store is named by a location: a directory path, or ``s3://bucket/prefix``. Inside it objects
have the same relative names on every backend (``/``-separated)::

    <model>/<key[:2]>/<key>.kvz     chunk files (model: the fingerprint's first 16 hex digits)
    quarantine/<model>-<key>.<time_ns>.kvz   damaged chunks, moved aside by a writer
    pins.json                       pinned chunk keys (``kvtool store pin``)
    hits/<model>/<key>              S3 only: last-hit markers (a bucket has no access time)

A backend offers what :class:`~kvtool.engines.vllm.store.PrefixStore` and
:mod:`~kvtool.engines.vllm.store_admin` need: pin an object for reading (a local path that
reads exactly what was checked, and a :data:`Stamp` that changes when the object is rewritten),
write a new object atomically (never replacing an existing chunk: of writers racing on one
chunk, exactly one publishes it and counts its bytes, the others get 0; or replacing, in one
step, exactly the object judged: a lossy chunk a lossless writer supersedes), move an object to the
quarantine only if it is still the one judged, mark a hit, walk the store, remove (None when
the object is already gone; an ``OSError`` naming it when it is there but cannot be removed),
read or write a small object, and collect the garbage of dead writers.

The local backend: the root may be a symlink (the operator's choice); below it no symlink is
followed and no special file opened (:mod:`~kvtool.engines.vllm.safeio`). A chunk is encoded
into a temp file of its own (``.<name>.<host>.<pid>.<random>.kvtmp``, unique per call) in the
pinned shard directory, then published by a hard link (a rename that never replaces, where the
filesystem has no links). Every ``OSError`` of a write, pin, quarantine or removal names the
object's path in the store, never a ``/proc/self/fd/...`` or temp path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import re
import stat
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from kvtool.engines.vllm.safeio import (
    Stamp,
    UnsafeFileError,
    fd_path,
    open_dir,
    open_regular_at,
    pinned,
    publish_new,
    stamp_of,
    with_path,
)
from kvtool.errors import KvtoolError
from kvtool.fileio import remove_stale_temps, temp_name

QUARANTINE_DIR = "quarantine"
PINS_FILE = "pins.json"
MODEL_DIR = re.compile(r"^[0-9a-f]{16}$")
SHARD_DIR = re.compile(r"^[0-9a-f]{2}$")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One object found by :meth:`Backend.walk`."""

    name: str  # relative, "/"-separated
    size: int
    mtime: float  # written, seconds since the epoch
    last_hit: float  # the last load served from it (its write time if none since)
    regular: bool = True  # False: a symlink or special file (local), never followed


class Backend(Protocol):
    """The storage operations of a prefix store (see the module docstring)."""

    location: str
    writable: bool  # False: this process never changes the store (hit marks included)

    def path(self, name: str) -> str: ...
    def pin(self, name: str) -> contextlib.AbstractContextManager[tuple[str, Stamp]]: ...
    def peek(self, name: str) -> Stamp | None: ...
    def exists(self, name: str) -> bool: ...
    def write_new(self, name: str, encode: Callable[[str], int],
                  replace: Stamp | None = None) -> int: ...
    def quarantine(self, name: str, dest: str, stamp: Stamp | None) -> bool: ...
    def mark_hit(self, name: str, path: str, stamp: Stamp) -> None: ...
    def walk(self, model: str | None = None) -> Iterator[Entry]: ...
    # None: not there (or, with ``stamp``, no longer the file judged); OSError: cannot
    def remove(self, name: str, stamp: Stamp | None = None) -> int | None: ...
    def read_small(self, name: str) -> bytes | None: ...
    def write_small(self, name: str, data: bytes) -> None: ...
    def collect_garbage(self, model: str) -> tuple[int, int]: ...
    def check(self) -> None: ...
    def root_names(self) -> list[str]: ...


def chunk_name(model_dir: str, key: str) -> str:
    """A chunk's name in the store (relative, "/"-separated): ``<model>/<key[:2]>/<key>.kvz``."""
    return f"{model_dir}/{key[:2]}/{key}.kvz"


def is_url(location: str | os.PathLike) -> bool:
    """Whether ``location`` names an object store (``s3://...``), not a directory."""
    return isinstance(location, str) and location.startswith("s3://")


URL_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def check_location(location: str | os.PathLike, label: str) -> None:
    """Refuse a URL of a scheme other than ``s3://`` (``gs://``, ``https://``, ``S3://``): it
    would otherwise name a local directory ``./gs:/...``."""
    match = URL_SCHEME.match(str(location))
    if match and match.group(1) != "s3":
        hint = " (lowercase: s3://)" if match.group(1).lower() == "s3" else ""
        raise KvtoolError(f"{label} {str(location)[:80]}: a store is a directory or an "
                          f"s3://bucket/prefix URL; {match.group(1)}:// is not supported{hint}")


_OPEN: dict[tuple[str, str, bool], Backend] = {}


def open_backend(location: str | os.PathLike, storage_options: dict | None = None, *,
                 writable: bool = True) -> Backend:
    """The backend for a directory or an ``s3://bucket/prefix`` URL. S3 backends are shared per
    (URL, options), so that the connector's halves and its budget reuse one client."""
    check_location(location, "store")
    if not is_url(location):
        return LocalBackend(location, writable=writable)
    import json

    from kvtool.engines.vllm.store_s3 import S3Backend

    key = (str(location), json.dumps(storage_options or {}, sort_keys=True), writable)
    if key not in _OPEN:
        _OPEN[key] = S3Backend(str(location), storage_options, writable=writable)
    return _OPEN[key]


class LocalBackend:
    """A store directory (the root itself may be a symlink). Writes go to a temp file of their
    own in the pinned directory, then a hard link to the chunk's name; a crash leaves a temp
    file that :meth:`collect_garbage` (or the next write into its directory) removes."""

    def __init__(self, root: str | os.PathLike, *, writable: bool = True):
        self.location = str(root)
        self.writable = writable

    def path(self, name: str) -> str:
        return os.path.join(self.location, *name.split("/"))

    def pin(self, name: str) -> contextlib.AbstractContextManager[tuple[str, Stamp]]:
        """``FileNotFoundError`` when absent, :class:`UnsafeFileError` for a symlink (anywhere
        below the root) or a non-regular file; errors name the chunk's path."""
        parts = name.split("/")
        try:
            dir_fd = open_dir(self.location, parts[:-1])
            try:
                fd = open_regular_at(dir_fd, parts[-1])
            finally:
                os.close(dir_fd)
        except OSError as e:
            raise with_path(e, self.path(name)) from None
        return pinned(fd, self.path(name))

    def peek(self, name: str) -> Stamp | None:
        """The stamp without reading, where that saves work: never here (pinning is cheap)."""
        return None

    def exists(self, name: str) -> bool:
        try:
            return stat.S_ISREG(os.lstat(self.path(name)).st_mode)
        except OSError:
            return False

    def write_new(self, name: str, encode: Callable[[str], int],
                  replace: Stamp | None = None) -> int:
        """``encode(path)`` writes the object at a temp path of its own (unique per call) in
        the pinned directory; it is then published under ``name`` by a hard link that never
        replaces a file another writer published first (:func:`~.safeio.publish_new`; a
        symlink there is replaced, never written through). The object's size, or 0 if a
        regular file was there already or another writer won: one writer counts it.

        ``replace``: the stamp of the file in ``name``'s place that this object supersedes.
        Once encoded, it is renamed over that file if it is still the one judged (the chunk
        never goes missing, and a failed encoding leaves it in place); 0 if a different file
        is there now. An ``OSError`` names the chunk's path in the store."""
        parts = name.split("/")
        dir_fd = None
        try:
            dir_fd = open_dir(self.location, parts[:-1], create=True)
            if replace is None and _regular_at(dir_fd, parts[-1]):
                return 0
            remove_stale_temps(fd_path(dir_fd))  # crash leftovers of this directory
            partial = _reserve_temp(dir_fd, parts[-1])
            try:
                # save() goes through atomic_write, which writes a temp name in place
                size = encode(os.path.join(fd_path(dir_fd), partial))
                won = (publish_new(dir_fd, partial, parts[-1]) if replace is None
                       else _replace_judged(dir_fd, partial, parts[-1], replace))
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(partial, dir_fd=dir_fd)
            if won:
                with contextlib.suppress(OSError):
                    os.fsync(dir_fd)
            return size if won else 0
        except Exception as e:
            raise with_path(e, self.path(name), None if dir_fd is None else fd_path(dir_fd)
                            ) from None
        finally:
            if dir_fd is not None:
                os.close(dir_fd)

    def quarantine(self, name: str, dest: str, stamp: Stamp | None) -> bool:
        """Rename ``name`` to ``quarantine/dest`` if it is still the file judged (``stamp``).
        An ``OSError`` names the chunk's path."""
        parts = name.split("/")
        try:
            src = open_dir(self.location, parts[:-1])
            try:
                st = os.stat(parts[-1], dir_fd=src, follow_symlinks=False)
                if stamp is not None and stamp_of(st) != stamp:
                    return False  # rewritten since it was read: judge the new file afresh
                dst = open_dir(self.location, [QUARANTINE_DIR], create=True)
                try:
                    os.rename(parts[-1], dest, src_dir_fd=src, dst_dir_fd=dst)
                finally:
                    os.close(dst)
            finally:
                os.close(src)
        except OSError as e:
            raise with_path(e, self.path(name)) from None
        return True

    def mark_hit(self, name: str, path: str, stamp: Stamp) -> None:
        """The file's access time, set explicitly (``noatime`` mounts do not matter), if it is
        still the file read (``stamp``; never through a symlink); its mtime is kept."""
        parts = name.split("/")
        with contextlib.suppress(OSError):
            dir_fd = open_dir(self.location, parts[:-1])
            try:
                if stamp_of(os.stat(parts[-1], dir_fd=dir_fd, follow_symlinks=False)) == stamp:
                    os.utime(parts[-1], dir_fd=dir_fd, ns=(time.time_ns(), stamp[2]),
                             follow_symlinks=False)
            finally:
                os.close(dir_fd)

    def walk(self, model: str | None = None) -> Iterator[Entry]:
        """Every entry of the chunk shards (of one model directory, or all) and, for the whole
        store, of the quarantine. Symlinked directories are not entered."""
        models = [model] if model else [e.name for e in _dirs(self.location, MODEL_DIR,
                                                              root=True)]
        for m in models:
            for shard in _dirs(os.path.join(self.location, m), SHARD_DIR):
                yield from _files(shard.path, f"{m}/{shard.name}/")
        if model is None:
            yield from (e for e in _files(os.path.join(self.location, QUARANTINE_DIR),
                                          f"{QUARANTINE_DIR}/") if e.regular)

    def remove(self, name: str, stamp: Stamp | None = None) -> int | None:
        """Unlink a regular file (never through a symlinked directory); its size, or None if it
        was not there (nor a regular file: that is never removed), or, given the ``stamp`` of
        the file judged, if it was rewritten since. An ``OSError`` naming the file if it is
        there but cannot be removed (read-only filesystem, permissions)."""
        parts = name.split("/")
        try:
            dir_fd = open_dir(self.location, parts[:-1])
        except (FileNotFoundError, NotADirectoryError, UnsafeFileError):
            return None
        except OSError as e:
            raise with_path(e, self.path(name)) from None
        try:
            st = os.stat(parts[-1], dir_fd=dir_fd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or (stamp is not None and stamp_of(st) != stamp):
                return None
            os.unlink(parts[-1], dir_fd=dir_fd)
            return st.st_size
        except FileNotFoundError:
            return None  # removed meanwhile (another prune, a quarantine)
        except OSError as e:
            raise with_path(e, self.path(name)) from None
        finally:
            os.close(dir_fd)

    def read_small(self, name: str) -> bytes | None:
        """The file's bytes; None if there is none. A symlink or a non-regular file is an
        :class:`UnsafeFileError`, never read as absent (a pins file read as "no pins" would
        let a prune remove pinned chunks); any other failure is raised."""
        path = self.path(name)
        try:
            if not stat.S_ISREG(os.lstat(path).st_mode):
                raise UnsafeFileError(errno.EINVAL, "not a regular file (a symlink, directory "
                                      "or special file)", path)
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def write_small(self, name: str, data: bytes) -> None:
        from kvtool.fileio import atomic_write

        atomic_write(self.path(name), lambda f: f.write(data), follow_symlinks=False)

    def collect_garbage(self, model: str) -> tuple[int, int]:
        """Remove the stale temp files of dead writers in a model directory's shards; (files,
        bytes). Nothing for a name that is not a model directory's (``""`` included)."""
        if not MODEL_DIR.match(model):
            return 0, 0
        files = freed = 0
        for shard in _dirs(os.path.join(self.location, model), SHARD_DIR):
            n, b = remove_stale_temps(shard.path)
            files, freed = files + n, freed + b
        return files, freed

    def root_names(self) -> list[str]:
        """The names of the root's entries, sorted (none if it cannot be read)."""
        with contextlib.suppress(OSError):
            return sorted(os.listdir(self.location))
        return []

    def check(self) -> None:
        """A :class:`KvtoolError` unless the root is a directory (or a symlink to one: the
        operator's choice; symlinks below the root are never followed)."""
        from kvtool.errors import KvtoolError

        try:
            st = os.stat(self.location)
        except (FileNotFoundError, NotADirectoryError):
            raise KvtoolError(f"no store at {self.location}: the directory does not exist"
                              ) from None
        if not stat.S_ISDIR(st.st_mode):
            raise KvtoolError(f"{self.location} is not a store directory")


def _dirs(path: str, pattern: re.Pattern, *, root: bool = False) -> list[os.DirEntry]:
    """Subdirectories of ``path`` whose names match (a symlinked ``path`` is not entered,
    unless it is the store's ``root``)."""
    with contextlib.suppress(OSError):
        if stat.S_ISDIR((os.stat if root else os.lstat)(path).st_mode):
            with os.scandir(path) as it:
                return sorted((e for e in it if pattern.match(e.name)
                               and e.is_dir(follow_symlinks=False)), key=lambda e: e.name)
    return []


def _files(path: str, prefix: str) -> Iterator[Entry]:
    with contextlib.suppress(OSError):
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return
        with os.scandir(path) as it:
            entries = list(it)
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                yield Entry(prefix + e.name, st.st_size, st.st_mtime,
                            max(st.st_atime, st.st_mtime))
            else:
                yield Entry(prefix + e.name, 0, st.st_mtime, st.st_mtime, regular=False)


def _regular_at(dir_fd: int, name: str) -> bool:
    """Whether a regular file (not a symlink) has ``name`` in ``dir_fd``."""
    try:
        return stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


def _replace_judged(dir_fd: int, tmp: str, name: str, judged: Stamp) -> bool:
    """Rename ``tmp`` over ``name`` if ``name`` is still the regular file stamped ``judged``;
    published anew (:func:`~.safeio.publish_new`) if it is gone. False if another file is
    there: another writer's, left alone. (Between the check and the rename another lossless
    writer may publish the same chunk exactly: replacing it then loses nothing.)"""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return publish_new(dir_fd, tmp, name)
    if not stat.S_ISREG(st.st_mode) or stamp_of(st) != judged:
        return False
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    return True


def _reserve_temp(dir_fd: int, name: str) -> str:
    """Create an empty temp file for ``name`` in ``dir_fd``, under a name that no other writer
    (thread or process) has; its name."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) \
        | getattr(os, "O_CLOEXEC", 0)
    while True:
        tmp = temp_name(name)
        try:
            os.close(os.open(tmp, flags, 0o666, dir_fd=dir_fd))
            return tmp
        except FileExistsError:
            continue
