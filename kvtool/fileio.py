"""File-system helpers shared by every reader and writer: checks of input and output paths,
atomic replacement of a file, and the collection of temp files that a killed writer left behind.

Inputs must be regular files (or symlinks to one): a FIFO, device, directory or socket is refused
after a ``stat`` and before any ``open`` (opening a FIFO blocks). Outputs are written through a
symlink (the file it points to is replaced atomically, in its own directory; the link stays) and
never replace anything but a regular file.

A temp file is named ``.<target name>.<host>.<pid>.<random>.kvtmp`` next to its target
(:func:`temp_name`: unique per call, so threads of one process never share one). A later write
into the same directory removes those whose writer is dead (same host, pid gone) or that are
older than :data:`STALE_TEMP_SECONDS` (a writer on another host of a shared directory).

:func:`atomic_write` to a path that is itself one of this process's temp names (a caller that
publishes the file itself, like the prefix store's ``write_new``) writes that file in place:
no second temp file, no rename.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
import stat
import tempfile
import time
from collections.abc import Callable
from typing import BinaryIO

from kvtool.errors import KvtoolError

TEMP_SUFFIX = ".kvtmp"
STALE_TEMP_SECONDS = 6 * 3600  # a temp file of another host this old is a crash leftover
_TEMP_RE = re.compile(r"^\..+\.(?P<host>[A-Za-z0-9_-]{1,64})\.(?P<pid>\d{1,10})\.[a-z0-9_]+"
                      + re.escape(TEMP_SUFFIX) + "$")


_KINDS = ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
          (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"))


def _kind(mode: int) -> str:
    """What a non-regular file is, in words (``"FIFO"``, ``"character device"``, ...)."""
    return next((name for test, name in _KINDS if test(mode)), "special file")


def check_input_file(path: str) -> None:
    """Raise :class:`KvtoolError` unless ``path`` is a regular file (symlinks followed).

    Uses ``stat`` only, so a FIFO is refused without blocking; a missing or unreadable path
    raises the ``OSError`` of ``stat`` (with the path as its filename).
    """
    path = os.fspath(path)
    if not path:
        raise KvtoolError("input path is empty")
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise KvtoolError(f"{path}: is a {_kind(st.st_mode)}, not a regular file")


def check_output_path(path: str, inputs: tuple[str | None, ...] = ()) -> str:
    """The file that writing ``path`` replaces; raise :class:`KvtoolError` if it cannot be written
    or is one of the command's ``inputs`` (files it reads first; None and ``-`` are skipped).
    ``-`` (standard output, to other tools) is refused: writes are atomic renames.

    A symlink is followed: its (final) target is the file replaced, in the target's directory,
    and the link itself stays. Refused: an empty path, a path ending in a separator, an existing
    non-regular target (directory, FIFO, device, socket), and a parent directory that is missing,
    not a directory or not writable. Cheap (a few ``stat`` calls): commands call it before any
    slow work, and :func:`atomic_write` calls it again.
    """
    path = os.fspath(path)
    if not path:
        raise KvtoolError("output path is empty")
    if path == "-":  # outputs are written to a temp file and renamed: never to a pipe
        raise KvtoolError("-: cannot write to standard output (files are written whole, then "
                          "renamed); give a file name (./- for a file named '-')")
    if path.endswith((os.sep, os.altsep or os.sep)):
        raise KvtoolError(f"{path}: is a directory path, expected a file name")
    real = os.path.realpath(path)
    shown = path if real == os.path.abspath(path) else f"{path} (-> {real})"
    parent = os.path.dirname(real)
    try:
        parent_st = os.stat(parent)
    except FileNotFoundError:
        raise KvtoolError(f"{shown}: directory {parent} does not exist") from None
    except NotADirectoryError:
        raise KvtoolError(f"{shown}: a component of {parent} is not a directory") from None
    if not stat.S_ISDIR(parent_st.st_mode):
        raise KvtoolError(f"{shown}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise KvtoolError(f"{shown}: directory {parent} is not writable")
    try:
        st = os.stat(real)
    except FileNotFoundError:
        return real
    if not stat.S_ISREG(st.st_mode):
        raise KvtoolError(f"{shown}: is a {_kind(st.st_mode)}, not a regular file; "
                          "not replacing it")
    for given in inputs:
        if given not in (None, "-") and os.path.exists(given) and os.path.samefile(real, given):
            raise KvtoolError(f"{shown}: is the input file {given}; not replacing it")
    return real


def check_store_dir(store: str, *, create: bool = False) -> None:
    """Raise :class:`KvtoolError` unless ``store`` is a directory a server could create and
    write (a server saves every prompt it computes). ``create``: make it now, so that what
    ``os.access`` cannot tell (root on ``/proc``, a full or stale mount) is found before the
    engine starts, not at its first save."""
    if os.path.lexists(store) and not os.path.isdir(store):
        raise KvtoolError(f"--store {store}: not a directory (a store is a directory, or an "
                          "s3:// URL where the engine takes one)")
    existing = os.path.abspath(store)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise KvtoolError(f"--store {store}: cannot be created or written here ({existing} is "
                          f"{'not a directory' if not os.path.isdir(existing) else 'read-only'})")
    if create:
        try:
            os.makedirs(store, exist_ok=True)
        except OSError as e:
            raise KvtoolError(f"--store {store}: cannot be created ({e.strerror or e})") from None


def read_text_file(path: str) -> str:
    """The UTF-8 text of the regular file ``path``; one-line :class:`KvtoolError` otherwise."""
    check_input_file(path)
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise KvtoolError(f"{path}: not UTF-8 text (invalid byte 0x{data[e.start]:02x} at "
                          f"offset {e.start})") from None


def host_name() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:64] or "host"


#: bytes of ``path``'s name a temp name keeps: with the host (64), the pid, a random part and
#: the suffix, the temp name stays within the 255 bytes a file name may have
TEMP_NAME_BYTES = 150


def temp_prefix(path: str) -> str:
    """The name prefix of this process's temp files for ``path`` (see the module docstring):
    its name cut to :data:`TEMP_NAME_BYTES`, or a legal long name could not be written."""
    name = os.path.basename(path)
    while len(os.fsencode(name)) > TEMP_NAME_BYTES:
        name = name[:-1]
    return f".{name}.{host_name()}.{os.getpid()}."


def temp_name(path: str) -> str:
    """A fresh temp file name (no directory) for ``path``: unique per call, of the shape that
    :func:`is_stale_temp` knows."""
    return f"{temp_prefix(path)}{secrets.token_hex(8)}{TEMP_SUFFIX}"


def is_own_temp(path: str) -> bool:
    """Whether ``path``'s name is a temp name of this process (see :func:`temp_name`)."""
    m = _TEMP_RE.match(os.path.basename(path))
    return m is not None and m["host"] == host_name() and int(m["pid"]) == os.getpid()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # exists, another user's (or not a pid we can ask about: keep it)
    return True


def is_stale_temp(path: str, now: float | None = None) -> bool:
    """Whether ``path`` is a kvtool temp file whose writer can no longer finish it."""
    m = _TEMP_RE.match(os.path.basename(path))
    if m is None:
        return False
    try:
        st = os.lstat(path)
    except OSError:
        return False
    age = (time.time() if now is None else now) - st.st_mtime
    if m["host"] == host_name() and int(m["pid"]) != os.getpid():
        return not pid_alive(int(m["pid"])) or age > STALE_TEMP_SECONDS
    return age > STALE_TEMP_SECONDS


def stale_temps(directory: str) -> list[tuple[str, int]]:
    """``(path, size)`` of every stale kvtool temp file directly in ``directory``."""
    out = []
    with contextlib.suppress(OSError), os.scandir(directory) as it:
        for entry in it:
            if entry.name.endswith(TEMP_SUFFIX) and is_stale_temp(entry.path):
                with contextlib.suppress(OSError):
                    out.append((entry.path, entry.stat(follow_symlinks=False).st_size))
    return out


def remove_stale_temps(directory: str) -> tuple[int, int]:
    """Remove the stale temp files in ``directory``; returns (files removed, bytes freed)."""
    files = freed = 0
    for path, size in stale_temps(directory):
        with contextlib.suppress(OSError):
            os.unlink(path)
            files += 1
            freed += size
    return files, freed


def _file_mode(path: str) -> int:
    with contextlib.suppress(OSError):
        return os.stat(path).st_mode & 0o7777
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _is_ours(filename: object, target: str) -> bool:
    """Whether an OSError's filename is unset or one of our temp files for ``target``."""
    return filename is None or (isinstance(filename, str) and os.path.basename(filename)
                                .startswith(temp_prefix(target)))


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], int], *,
                 follow_symlinks: bool = True) -> int:
    """Run ``write(f)`` on a temp file next to ``path``, fsync it, and rename it over ``path``.

    ``path`` is first checked with :func:`check_output_path`: a symlink is written through (its
    target is replaced, the link stays) unless ``follow_symlinks`` is false, which replaces the
    link itself with a regular file (the file it pointed to stays untouched); a directory,
    FIFO, device or socket is never replaced.
    On any exception the temp file is removed and an existing ``path`` is left untouched; an
    ``OSError`` of the write itself (e.g. ENOSPC) carries ``path`` as its filename.
    A ``path`` named like this process's temp files (:func:`is_own_temp`) is written in place
    (its caller publishes it) and removed on failure.
    """
    path = os.fspath(path)
    if is_own_temp(path):
        return _write_in_place(path, write)
    replace_link = not follow_symlinks and os.path.islink(path)
    target = os.path.abspath(path) if replace_link else check_output_path(path)
    directory = os.path.dirname(target)
    remove_stale_temps(directory)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix(target), suffix=TEMP_SUFFIX, dir=directory)
        with os.fdopen(fd, "wb") as f:
            written = write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _file_mode(target))
        os.replace(tmp, target)
    except BaseException as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(e, OSError) and e.errno is not None and _is_ours(e.filename, target):
            e.filename = path  # name the user's file, not the temp
            del e.filename2  # (None would print as "-> None")
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable (POSIX)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return written


def _write_in_place(path: str, write: Callable[[BinaryIO], int]) -> int:
    """``write(f)`` into the temp file ``path`` (created if missing, never through a symlink),
    fsync'ed; removed on any exception."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0) \
        | getattr(os, "O_CLOEXEC", 0)
    try:
        with os.fdopen(os.open(path, flags, 0o666), "wb") as f:
            written = write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(path)
        if isinstance(e, OSError) and e.errno is not None and e.filename is None:
            e.filename = path
        raise
    return written
