"""Which prefix-store chunk files a :class:`~kvtool.engines.vllm.store.PrefixStore` trusts, and
what becomes of the others (the store rules in :mod:`~kvtool.engines.vllm.store`'s docstring).

A file is judged by its header (:func:`~kvtool.engines.vllm.chunk_checks.check_header`) once
per stamp (inode, size and mtime; an ETag on S3); the verdict is shared by the process's
stores, so that a chunk the worker half failed to load is skipped by the scheduler half's next
lookup. A damaged file is quarantined by a store that may write, a newer one left alone, and a
file stored lossy is replaced by a lossless store's exact write (:meth:`ChunkJudge._free_place`).
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvtool.engines.vllm.chunk_checks import check_header, refusal_reason
from kvtool.engines.vllm.common import count, log
from kvtool.engines.vllm.guard import is_down
from kvtool.engines.vllm.safeio import Stamp, UnsafeFileError
from kvtool.engines.vllm.store_backend import QUARANTINE_DIR

if TYPE_CHECKING:
    from kvtool.engines.vllm.store import Chunk

MAX_VERDICTS = 1 << 16
# per chunk path: (stamp of the file judged, usable?, the dtype it is exact in or None; for an
# unusable file, DAMAGED where it is damaged and was kept: its quarantine failed)
_VERDICTS: dict[str, tuple[Stamp, bool, str | None]] = {}
DAMAGED = "damaged"


class ChunkJudge:
    """The judging half of :class:`~kvtool.engines.vllm.store.PrefixStore` (a mixin: it uses
    the store's ``backend``, ``model``, ``model_dir``, ``writable``, ``exact_dtype``,
    ``lossy_sources``, ``pin``, ``exists``, ``_name`` and ``_check_writable``)."""

    def is_valid(self, chunk: Chunk, token_ids: Sequence[int]) -> bool:
        """Whether the chunk's file exists and its header matches this model and chunk
        (verdicts are remembered per file stamp; a bad file goes to :meth:`reject`)."""
        verdict = self._verdict(chunk, token_ids)
        return verdict is not None and self._usable(chunk, *verdict)

    def _free_place(self, chunk: Chunk, token_ids: Sequence[int],
                    lossy_sources: Sequence[str] = ()) -> tuple[bool, Stamp | None]:
        """For a write that found a file in the chunk's place: (may it write?, the stamp of
        the file it writes over, or None: the place is free now).

        A damaged file that was kept (its quarantine failed: a read-only or symlinked
        quarantine folder) is quarantined again, so that it is replaced once that works.
        For an exact write (a lossless store's, with nothing lossy before it): a file stored
        lossy (a lossy server's or pin's), which this store never loads, is written over (in
        one step, once the exact chunk is encoded), and a damaged one is quarantined by the
        judging. Else the first writer would win and a lossless server would compute that
        prefix forever. Exact chunks, in any dtype, and sound chunks for a lossy write, are
        never replaced."""
        self._check_writable()
        judged = _VERDICTS.get(chunk.path)
        if judged is not None and not judged[1] and judged[2] == DAMAGED:
            return bool(self._quarantine(chunk, judged[0])) or not self.exists(chunk), None
        if self.exact_dtype is None or self.lossy_sources or lossy_sources:
            return False, None
        verdict = self._verdict(chunk, token_ids)
        if verdict is None:  # damaged (then quarantined), unreadable (kept) or gone
            return not self.exists(chunk), None
        judged = _VERDICTS.get(chunk.path)
        if not verdict[0] or verdict[1] is not None or judged is None \
                or (chunk.path, judged[0]) in self._unreplaceable:
            return False, None
        return True, judged[0]  # only the file judged lossy: another's exact chunk is kept

    def _replace_lossy(self, chunk: Chunk, judged: Stamp, encode: Callable[[str], int]) -> int:
        """Write the exact chunk over the lossy file stamped ``judged``; its size, or 0 where
        the file changed since or cannot be replaced (said once: its prefix is computed)."""
        try:
            size = self.backend.write_new(self._name(chunk), encode, replace=judged)
        except OSError as e:
            if is_down(e) or e.errno not in (errno.EACCES, errno.EPERM):
                raise  # the store's (the caller's guard), or a failed write, as any write's
            self._warn_once(chunk, f"kvtool store: cannot replace the lossy chunk {chunk.path} "
                            f"({e}); kept, and its prefix computed by this lossless server",
                            counter=None)
            self._unreplaceable.add((chunk.path, judged))  # not encoded again for this file
            return 0
        if size:
            _VERDICTS.pop(chunk.path, None)
        return size

    def _verdict(self, chunk: Chunk, token_ids: Sequence[int]) -> tuple[bool, str | None] | None:
        """(sound?, the dtype its K/V are exact in or None) of the chunk's file; None where it
        is absent or could not be read (warned of, or rejected)."""
        from kvtool.errors import KvtoolError

        stamp = None
        try:
            cached = _VERDICTS.get(chunk.path)
            if cached is not None and self.backend.peek(self._name(chunk)) == cached[0]:
                return cached[1:]  # unchanged since (S3: a HEAD)
            with self.pin(chunk) as (path, stamp):
                if cached is not None and cached[0] == stamp:
                    return cached[1:]
                exact = check_header(path, self.model, chunk, token_ids)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            if is_down(e):
                raise  # the store, not this file: the caller's guard takes it out of service
            return self._unreadable(chunk, e, stamp)
        except (KvtoolError, ValueError) as e:
            return self._unreadable(chunk, e, stamp)
        _remember(chunk.path, stamp, True, exact)
        return True, exact

    def _usable(self, chunk: Chunk, ok: bool, exact: str | None) -> bool:
        """A valid chunk, unless this store is lossless and the chunk is not exact in its
        dtype: skipped then (a miss, said once), never rejected (lossy servers use it)."""
        if not ok or self._serves(exact):
            return ok
        if not self._warned_inexact:  # once: a store of lossy chunks would repeat it a lot
            self._warned_inexact = True
            log.warning("kvtool store: this server's policy is lossless%s, so it loads no "
                        "chunk stored lossy or in another dtype (first: %s, %s); their "
                        "tokens are computed", f" in {self.exact_dtype}" if self.exact_dtype
                        else "", chunk.path, "lossy" if exact is None else f"exact in {exact}")
        return False

    def _serves(self, exact: str | None) -> bool:
        """Whether this store loads a chunk exact in ``exact`` (None: stored lossy)."""
        if self.exact_dtype is None:  # a lossy policy: any chunk
            return True
        return exact is not None and exact == (self.exact_dtype or exact)  # "": dtype unknown

    def _unreadable(self, chunk: Chunk, e: BaseException, stamp: Stamp | None) -> None:
        """None, after a warning (unsafe or unopenable file) or :meth:`reject`."""
        if isinstance(e, UnsafeFileError):
            self._warn_once(chunk, f"kvtool store: ignoring {chunk.path}: {e.strerror}; "
                            "symlinks and special files in the store are never followed")
        elif stamp is None:
            self._warn_once(chunk, f"kvtool store: cannot open {chunk.path} ({e}); skipped")
        else:
            self.reject(chunk, e, stamp)
        return None

    def reject(self, chunk: Chunk, error: BaseException, stamp: Stamp | None = None) -> None:
        """A chunk that failed its header check or its load (``stamp``: the file as read).

        Never deleted: a file of a newer kvtool is skipped and left alone; a damaged file
        (a :class:`FormatError`, or content that contradicts its key) is moved to
        ``<root>/quarantine/`` by a store that may write, so that the chunk is written anew,
        and only remembered as bad (until rewritten) by a read-only one; an unreadable file
        (``OSError``) is skipped. Other errors are not the file's fault: nothing happens."""
        from kvtool.errors import FormatError, MissingCodecError, NewerVersionError

        if isinstance(error, MissingCodecError):
            _remember(chunk.path, stamp, False)
            count("newer_files")  # with them: files this kvtool cannot read but must not touch
            if chunk.path not in self._warned:
                self._warned.add(chunk.path)
                log.warning("kvtool store: skipping %s: %s; it is left alone for the servers "
                            "that have the codec", chunk.path,
                            str(error).replace(f"{chunk.path}: ", ""))
            return
        if isinstance(error, NewerVersionError):
            _remember(chunk.path, stamp, False)
            count("newer_files")
            if not self._warned_newer:
                self._warned_newer = True
                log.warning("kvtool store: skipping %s and any other chunk written by a newer "
                            "kvtool (%s); they are left alone", chunk.path,
                            str(error).replace(f"{chunk.path}: ", ""))
            return
        if isinstance(error, OSError):
            _remember(chunk.path, stamp, False)
            count("invalid_files")
            log.warning("kvtool store: skipping %s: it is unreadable (%s)", chunk.path, error)
            return
        if not isinstance(error, (FormatError, ValueError)):
            return
        count("invalid_files")
        moved = self.writable and self._quarantine(chunk, stamp)
        if not moved:
            _remember(chunk.path, stamp, False, DAMAGED)
        log.warning("kvtool store: ignoring %s: %s; the prefix will be recomputed%s",
                    chunk.path, refusal_reason(error, chunk.path),
                    f" (moved to {moved})" if moved else "" if self.writable
                    else " (read-only store: left in place)")

    def _quarantine(self, chunk: Chunk, stamp: Stamp | None) -> str | None:
        """Move the chunk's file (if still the one judged, by ``stamp``) to the quarantine
        folder; its new path, or None."""
        name = f"{self.model_dir}-{chunk.key}.{time.time_ns()}.kvz"  # says where it came from
        try:
            if not self.backend.quarantine(self._name(chunk), name, stamp):
                return None  # rewritten since it was read: judge the new file afresh
        except OSError as e:  # tried again at the chunk's next write: said once
            self._warn_once(chunk, f"kvtool store: cannot quarantine {chunk.path} ({e})",
                            counter=None)
            return None
        _VERDICTS.pop(chunk.path, None)
        count("quarantined_files")
        return self.backend.path(f"{QUARANTINE_DIR}/{name}")

    def _warn_once(self, chunk: Chunk, message: str, counter: str | None = "invalid_files"
                   ) -> None:
        if chunk.path not in self._warned:
            self._warned.add(chunk.path)
            if counter:
                count(counter)
            log.warning("%s", message)


def _remember(path: str, stamp: Stamp | None, ok: bool, exact: str | None = None) -> None:
    if stamp is None:
        return
    if len(_VERDICTS) >= MAX_VERDICTS:
        _VERDICTS.clear()
    _VERDICTS[path] = (stamp, ok, exact)
