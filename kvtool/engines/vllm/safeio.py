"""Opening files of a shared store, or named by a request, without following symlinks and
without opening anything that is not a regular file (a FIFO would stall the engine, a device
may have side effects on open).

A file is *pinned*: opened once (``O_NOFOLLOW | O_NONBLOCK``, directories walked one
``dir_fd`` at a time), checked with ``fstat``, and handed to the .kvz reader as
``/proc/self/fd/<fd>``, so that what is read is exactly the inode that was checked. Bytes
already in memory are handed over the same way, from an anonymous in-memory file
(:func:`in_memory`).

A new file is written under a temp name in a pinned directory and *published* by
:func:`publish_new`: a hard link to its final name (``renameat2(RENAME_NOREPLACE)`` or a
checked rename where links are missing), which never replaces a file another writer published
first. Errors raised through an fd path name the store's path instead (:func:`with_path`).
Nothing here imports vLLM.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import stat
from collections.abc import Collection, Iterator, Sequence
from typing import Any

Stamp = tuple[int, int, int]  # (inode, size, mtime_ns): a rewritten file gets a new stamp

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_FILE_FLAGS = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_RENAME_NOREPLACE = 1  # renameat2 flag (linux/fs.h)
_FD_DIR = next((d for d in ("/proc/self/fd", "/dev/fd") if os.path.isdir(d)), None)


class UnsafeFileError(OSError):
    """A symlink, or something other than a regular file (or directory), where one was due;
    or a path outside the directories the operator allowed."""


def stamp_of(st: os.stat_result) -> Stamp:
    return st.st_ino, st.st_size, st.st_mtime_ns


def _kind(mode: int) -> str:
    return "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"


def open_dir(root: str | os.PathLike, parts: Sequence[str] = (), *, create: bool = False) -> int:
    """A directory fd for ``root/parts...``: ``root`` itself may be a symlink (the operator's
    choice), no directory under it may be. ``create``: make missing directories."""
    if create:
        os.makedirs(root, exist_ok=True)
    fd = os.open(root, _DIR_FLAGS)
    try:
        for part in parts:
            if part in ("", ".", "..") or os.sep in part:
                raise UnsafeFileError(errno.EINVAL, f"bad path component {part!r}")
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, dir_fd=fd)
            try:
                sub = os.open(part, _DIR_FLAGS | _NOFOLLOW, dir_fd=fd)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                link = stat.S_ISLNK(os.lstat(part, dir_fd=fd).st_mode)
                raise UnsafeFileError(e.errno, f"{part} is "
                                      + ("a symbolic link" if link else "not a directory")
                                      ) from None
            os.close(fd)
            fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular_at(dir_fd: int | None, name: str) -> int:
    """Open ``name`` (in ``dir_fd``) for reading only if it is a regular file, not a symlink.

    Checked with ``lstat`` before opening, so a FIFO or device is never opened; the fd is
    checked again with ``fstat`` (the entry may have been swapped in between)."""
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFileError(errno.EINVAL, f"{name} is {_kind(st.st_mode)}")
    try:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeFileError(e.errno, f"{name} is a symbolic link") from None
        raise
    got = os.fstat(fd)
    if not stat.S_ISREG(got.st_mode) or (got.st_dev, got.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise UnsafeFileError(errno.EINVAL, f"{name} changed while being opened")
    return fd


def fd_path(fd: int) -> str:
    """A path that opens exactly the file behind ``fd``."""
    if _FD_DIR is None:  # pragma: no cover - every supported platform has one
        raise OSError(errno.ENOSYS, "no /proc/self/fd or /dev/fd to read pinned files through")
    return f"{_FD_DIR}/{fd}"


@contextlib.contextmanager
def pinned(fd: int, shown: str) -> Iterator[tuple[str, Stamp]]:
    """``(path to read fd through, stamp)``; closes ``fd``. kvtool errors raised inside name
    ``shown`` instead of the fd path."""
    path = fd_path(fd)
    try:
        yield path, stamp_of(os.fstat(fd))
    except Exception as e:
        from kvtool.errors import KvtoolError

        if isinstance(e, KvtoolError) and path in str(e):
            raise type(e)(str(e).replace(path, shown)) from None
        raise
    finally:
        os.close(fd)


@contextlib.contextmanager
def in_memory(data: bytes, shown: str) -> Iterator[str]:
    """A path reading ``data`` from an anonymous in-memory file (errors name ``shown``)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("kvtool-chunk", getattr(os, "MFD_CLOEXEC", 0))
    else:  # pragma: no cover - every Linux has memfd_create
        import tempfile

        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    with pinned(fd, shown) as (path, _):
        yield path


def pin_file(path: str) -> contextlib.AbstractContextManager[tuple[str, Stamp]]:
    """:func:`pinned` for a regular file at ``path`` (its last component not a symlink)."""
    directory, name = os.path.split(os.path.abspath(path))
    dir_fd = os.open(directory, _DIR_FLAGS)
    try:
        fd = open_regular_at(dir_fd, name)
    finally:
        os.close(dir_fd)
    return pinned(fd, path)


def confine(path: str, dirs: Collection[str], files: Collection[str]) -> str:
    """The real path of ``path`` if it is a regular file listed in ``files`` or under one of
    ``dirs`` (all real paths); else :class:`UnsafeFileError`. Only ``lstat``/``readlink`` are
    used (what :func:`os.path.realpath` does): nothing is opened, no symlink target is stat'ed
    before it is known to be allowed."""
    real = os.path.realpath(path)
    if real not in files and not any(_under(real, d) for d in dirs):
        raise UnsafeFileError(errno.EACCES, f"{path} is not under kvz_dirs nor in kvz_files")
    st = os.lstat(real)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFileError(errno.EINVAL, f"{path} is {_kind(st.st_mode)}")
    return real


def _under(path: str, directory: str) -> bool:
    return os.path.commonpath([path, directory]) == directory and path != directory


def with_path(error: BaseException, path: str, hidden: str | None = None) -> BaseException:
    """``error`` naming ``path`` (a file of the store as the user knows it) instead of the
    ``/proc/self/fd/...`` or temp path it was raised with (``hidden``: that path's directory,
    replaced in a :class:`KvtoolError`'s text). Raise the result."""
    from kvtool.errors import KvtoolError

    if isinstance(error, OSError):
        if error.errno is None:
            return error if path in str(error) else OSError(f"{path}: {error}")
        if error.filename2 is None:
            error.filename = path
        else:  # a rename's: its text would say "'path' -> None" with filename2 cleared
            return type(error)(error.errno, error.strerror, path)
    elif isinstance(error, KvtoolError) and hidden and hidden in str(error):
        return type(error)(re.sub(re.escape(hidden) + r"/[^\s:'\"]*", path, str(error)))
    return error


def publish_new(dir_fd: int, tmp: str, name: str) -> bool:
    """Give the finished file ``tmp`` (in ``dir_fd``) the name ``name`` unless a regular file
    has it already: True if this call published it, False if another writer did first (``tmp``
    is left for the caller to remove either way). Never replaces a regular file; a symlink or
    special file in the way is removed (never written through).

    A hard link where the filesystem has them (atomic: one of two writers wins), else
    ``renameat2(RENAME_NOREPLACE)`` (atomic), else a rename after a check (not atomic)."""
    for _ in range(8):
        try:
            _link_new(dir_fd, tmp, name)
            return True
        except FileExistsError:
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed meanwhile: try again
            if stat.S_ISREG(st.st_mode):
                return False
            if stat.S_ISDIR(st.st_mode):
                raise IsADirectoryError(errno.EISDIR, f"{name} is a directory") from None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dir_fd)  # a symlink (the link, not its target) or FIFO
    raise FileExistsError(errno.EEXIST, f"{name} keeps being replaced by non-regular files")


_NO_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}  # no hard links here


def _link_new(dir_fd: int, tmp: str, name: str) -> None:
    """Create ``name`` for ``tmp``'s file; ``FileExistsError`` if ``name`` exists."""
    try:
        os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        return
    except OSError as e:
        if e.errno not in _NO_LINKS:
            raise
    if _rename_noreplace(dir_fd, tmp, name):
        return
    try:  # no atomic way on this filesystem: a writer racing us here may be replaced
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return
    raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), name)


@functools.lru_cache(maxsize=1)
def _renameat2() -> Any:
    """libc's ``renameat2`` (Linux, glibc >= 2.28), or None."""
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError, ImportError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _rename_noreplace(dir_fd: int, tmp: str, name: str) -> bool:
    """Rename without replacing (``FileExistsError`` if ``name`` exists); False where the
    kernel, libc or filesystem cannot."""
    import ctypes

    fn = _renameat2()
    if fn is None:
        return False
    if fn(dir_fd, os.fsencode(tmp), dir_fd, os.fsencode(name), _RENAME_NOREPLACE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), name)
