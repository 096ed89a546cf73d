"""File-system helpers shared by every writer: atomic replacement of a file, and the collection
of temp files that a killed writer left behind.

A temp file is named ``.<target name>.<host>.<pid>.<random>.kvtmp`` next to its target. A later
write into the same directory removes those whose writer is dead (same host, pid gone) or that
are older than :data:`STALE_TEMP_SECONDS` (a writer on another host of a shared directory).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import tempfile
import time
from collections.abc import Callable
from typing import BinaryIO

TEMP_SUFFIX = ".kvtmp"
STALE_TEMP_SECONDS = 6 * 3600  # a temp file of another host this old is a crash leftover
_TEMP_RE = re.compile(r"^\..+\.(?P<host>[A-Za-z0-9_-]{1,64})\.(?P<pid>\d{1,10})\.[a-z0-9_]+"
                      + re.escape(TEMP_SUFFIX) + "$")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:64] or "host"


def temp_prefix(path: str) -> str:
    """The name prefix of this process's temp files for ``path`` (see the module docstring)."""
    return f".{os.path.basename(path)}.{_host()}.{os.getpid()}."


def _pid_alive(pid: int) -> bool:
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
    if m["host"] == _host() and int(m["pid"]) != os.getpid():
        return not _pid_alive(int(m["pid"])) or age > STALE_TEMP_SECONDS
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


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], int]) -> int:
    """Run ``write(f)`` on a temp file next to ``path``, fsync it, and rename it over ``path``.

    On any exception the temp file is removed and an existing ``path`` is left untouched.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    remove_stale_temps(directory)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path), suffix=TEMP_SUFFIX, dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            written = write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _file_mode(path))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable (POSIX)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return written
