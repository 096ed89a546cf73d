"""Where kvtool's numba kernels cache their compiled code, and when a cached kernel is stale.

Location: numba caches next to the source (``__pycache__``), else in ``NUMBA_CACHE_DIR``; where
the package directory is read-only (a system site-packages) and ``NUMBA_CACHE_DIR`` is unset,
the kernels cache in kvtool's cache directory instead (:func:`user_cache_dir`), so a second
process loads them (~0.5 s) instead of compiling them again (6-15 s).

Staleness: numba keeps a cached kernel while its own source file keeps its modification time
and size. A kernel's compiled code also holds what it called or inlined from other files
(``numba_quantizers``' tile decoders, ``numba_cpu.from_f32``) and the constants it read from
them (codebooks, trellis tables), so an edit of one of those, or a ``git pull`` into an
editable install that changes only them, would keep running the old code. kvtool's kernels
are stamped with a digest of the sources they can reach as well (:func:`sources_digest`): a
change to any of them recompiles every kernel, once.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numba
from numba.core import caching

_PACKAGE = Path(__file__).resolve().parent.parent
#: ``kvtool.codecs.x`` or ``kvtool.kernels.x`` named in a kernel module's source
_IMPORTED = re.compile(rb"kvtool\.(codecs|kernels)\.(\w+)")


def user_cache_dir() -> str:
    """Where kernels of a read-only install cache: ``numba/`` in kvtool's cache directory
    (``KVTOOL_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvtool``, else ``~/.cache/kvtool``)."""
    from kvtool.models import cache_dir

    return os.path.join(cache_dir(), "numba")


@functools.cache
def sources_digest() -> str:
    """A digest of every numba kernel module and of each kvtool module they import from (the
    codebooks', rotations' and trellis tables' too): a few ms, once a process. An edit of any
    other file (the CLI, a codec's host code) keeps the compiled kernels."""
    kernels = sorted((_PACKAGE / "kernels").glob("numba_*.py"))
    sources = {path.resolve() for path in kernels}
    for path in kernels:
        for folder, name in _IMPORTED.findall(path.read_bytes()):
            module = _PACKAGE / folder.decode() / (name.decode() + ".py")
            if module.is_file():
                sources.add(module.resolve())
    digest = hashlib.sha256()
    for path in sorted(sources):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


class _Stamped:
    """A numba cache locator for kvtool's own sources, whose stamp adds :func:`sources_digest`
    to the file's modification time and size (numba drops an index whose stamp differs)."""

    def get_source_stamp(self):
        return (*super().get_source_stamp(), sources_digest())

    @classmethod
    def from_function(cls, py_func, py_file):
        if not Path(py_file).resolve().is_relative_to(_PACKAGE):
            return None
        return super().from_function(py_func, py_file)


def _stamped_locators() -> list[type]:
    """Stamped variants of numba's locators that serve source files (user-provided directory,
    in-tree ``__pycache__``, user-wide), in numba's order; [] where this numba lacks them."""
    names = ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator")
    found = [getattr(caching, n, None) or getattr(caching, "_" + n, None) for n in names]
    if any(base is None for base in found):
        return []
    return [type("Stamped" + base.__name__.lstrip("_"), (_Stamped, base), {}) for base in found]


def install_stamped_locators() -> bool:
    """Put the stamped locators first in numba's list (once); False where this numba's
    caching internals are not the ones known here (kernels then cache as numba does)."""
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)
    classes = getattr(impl, "_locator_classes", None)
    if not isinstance(classes, list):
        return False
    if any(issubclass(c, _Stamped) for c in classes):
        return True
    stamped = _stamped_locators()
    if not stamped:
        return False
    classes[:0] = stamped
    return True


@functools.cache
def _writable(path: str) -> bool:
    """Whether a cache directory can be created at ``path`` and written (numba's own test)."""
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError:
        return False
    return True


@contextlib.contextmanager
def cache_location(source_dir: str) -> Iterator[None]:
    """Around a decoration: point numba at :func:`user_cache_dir` where it would otherwise
    fall back to its own user-wide directory (the source's ``__pycache__`` is not writable and
    ``NUMBA_CACHE_DIR`` is unset). numba picks a function's cache directory when it decorates
    it, so only kvtool's kernels move; every other library's stay where numba puts them."""
    if numba.config.CACHE_DIR or _writable(os.path.join(source_dir, "__pycache__")):
        yield
        return
    target = user_cache_dir()
    if not _writable(target):
        yield
        return
    previous, numba.config.CACHE_DIR = numba.config.CACHE_DIR, target
    try:
        yield
    finally:
        numba.config.CACHE_DIR = previous


__all__ = ["cache_location", "install_stamped_locators", "sources_digest", "user_cache_dir"]
