"""The file side of ``kvtool patch-vllm``: writes, backups, the manifest, rollback and clean-up.

A patch run writes, in this order, the backups, then the manifest (naming every file it is about
to change), then the files; so a run killed at any point leaves a state the next run reads
correctly: backups no manifest refers to are orphans (removed by :func:`clean_leftovers`), a
recorded file that still holds its original bytes reads as "not patched", and temp files of a
dead writer are collected by :mod:`kvtool.fileio`. Every write is atomic and an ``OSError`` while
writing becomes a one-line :class:`PatchError` naming the path. :func:`restore_all` goes on past
a file it cannot restore, and :func:`settle_manifest` then records exactly the files still
patched, so the manifest always says what is on disk. :func:`locked` keeps two runs apart.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from kvtool.errors import KvtoolError, PatchError
from kvtool.fileio import atomic_write, stale_temps

STATE_DIR = ".kvtool_patch"
MANIFEST = "manifest.json"
BACKUP_DIR = "backup"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def state_dir(root: Path) -> Path:
    """``<vllm>/.kvtool_patch``: the manifest and the backups."""
    return root / STATE_DIR


def backup_rel(rel: str) -> str:
    """Where the backup of ``rel`` lives, relative to the state dir (as the manifest says)."""
    return f"{BACKUP_DIR}/{rel}.orig"


def reason(e: BaseException) -> str:
    """The short cause of ``e`` (``strerror`` without the temp-file names of ``str(e)``)."""
    return (e.strerror if isinstance(e, OSError) else None) or str(e) or type(e).__name__


def replace_file(path: Path, data: bytes) -> None:
    """Atomically make ``path`` a regular file holding ``data`` (raises ``OSError`` or
    :class:`KvtoolError`). A symlink is replaced, not written through, so that patching a tree
    of links never changes the files they point to."""
    atomic_write(path, lambda f: f.write(data), follow_symlinks=False)


def write_file(path: Path, data: bytes) -> None:
    """:func:`replace_file`, creating the directory; an ``OSError`` (or a path that
    :mod:`kvtool.fileio` refuses) becomes a one-line :class:`PatchError` naming ``path``."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(path, data)
    except OSError as e:
        raise PatchError(f"cannot write {path}: {reason(e)}") from e
    except PatchError:
        raise
    except KvtoolError as e:  # names the path itself
        raise PatchError(f"cannot write {e}") from e


def clear_pycache(path: Path) -> None:
    """Remove the compiled copies of ``path`` so that Python recompiles the new source."""
    for pyc in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
        with contextlib.suppress(OSError):
            pyc.unlink()


@contextlib.contextmanager
def locked(root: Path, blocking: bool = True) -> Iterator[bool]:
    """An exclusive lock on the vllm package directory itself (POSIX; no lock file left).
    Yields whether it is held: without ``blocking``, not while another run holds it."""
    try:
        import fcntl
    except ImportError:  # Windows: no concurrent patching protection
        yield blocking
        return
    fd = os.open(root, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            held = True
        except BlockingIOError:
            held = False
        yield held
    finally:
        os.close(fd)  # releases the lock


# -- manifest and backups -------------------------------------------------------------------
def read_manifest(root: Path) -> dict[str, Any] | None:
    """The manifest, ``None`` when there is none; :class:`PatchError` when it is unreadable."""
    path = state_dir(root) / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, OSError) as e:
        manifest = {"error": e}
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict) or not all(
            _valid_entry(rel, entry) for rel, entry in manifest["files"].items()):
        raise PatchError(f"{path} is unreadable or not a kvtool manifest; 'kvtool "
                         "patch-vllm --revert --force' removes kvtool's blocks and the record "
                         "(or reinstall vLLM)")
    return manifest


_SHA256 = re.compile(r"[0-9a-f]{64}")
_TARGET = re.compile(r"v1/attention/backends/[A-Za-z0-9_]+\.py")


def _valid_entry(rel: Any, entry: Any) -> bool:
    """Whether a manifest's file entry is one a patch wrote: a backend module's path (never
    outside vLLM's tree: a revert writes there) with its sha256s and its backup's place."""
    return (isinstance(rel, str) and _TARGET.fullmatch(rel) is not None
            and isinstance(entry, dict) and entry.get("backup") == backup_rel(rel)
            and all(isinstance(entry.get(k), str) and _SHA256.fullmatch(entry[k])
                    for k in ("sha256_before", "sha256_after")))


def write_manifest(root: Path, manifest: dict[str, Any]) -> None:
    write_file(state_dir(root) / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())


def write_backup(root: Path, rel: str, original: bytes) -> None:
    """Write and read back the backup of ``rel``."""
    path = state_dir(root) / backup_rel(rel)
    write_file(path, original)
    try:
        ok = sha256(path.read_bytes()) == sha256(original)
    except OSError as e:
        raise PatchError(f"cannot read back {path}: {reason(e)}") from e
    if not ok:
        raise PatchError(f"the backup {path} did not verify")


def drop_state(root: Path) -> None:
    """Remove the manifest (the claim that vLLM is patched) first, then the backups."""
    state = state_dir(root)
    try:
        (state / MANIFEST).unlink(missing_ok=True)
    except OSError as e:
        raise PatchError(f"cannot remove {state / MANIFEST}: {reason(e)}") from e
    shutil.rmtree(state, ignore_errors=True)  # what stays is an orphan: collected next run


def settle_manifest(root: Path, manifest: dict[str, Any] | None,
                    still_patched: Iterable[str]) -> str | None:
    """Make the manifest record exactly ``still_patched`` (no manifest when that is empty) and
    drop the other backups. Returns what went wrong, for an error message, or ``None``."""
    keep = set(still_patched)
    try:
        if not keep:
            drop_state(root)
            return None
        if manifest is None:  # stray blocks (revert --force): nothing to record
            return None
        write_manifest(root, {**manifest, "files": {
            rel: entry for rel, entry in manifest["files"].items() if rel in keep}})
    except PatchError as e:
        return str(e)
    clean_leftovers(root, ())
    return None


# -- restore and clean-up -------------------------------------------------------------------
def restore_all(root: Path, changes: Iterable[tuple[str, bytes, bytes]]
                ) -> tuple[list[str], dict[str, str]]:
    """For each ``(rel, expected, new)`` whose file holds ``expected``, write ``new`` (files that
    do not hold it are left alone); a failure does not stop the others.

    Returns the files restored and ``{rel: reason}`` of those that could not be.
    """
    done: list[str] = []
    failed: dict[str, str] = {}
    for rel, expected, new in changes:
        path = root / rel
        try:
            if path.read_bytes() != expected:
                continue
            replace_file(path, new)
            clear_pycache(path)
            if sha256(path.read_bytes()) != sha256(new):
                failed[rel] = "it did not verify after writing"
                continue
        except (OSError, KvtoolError) as e:
            failed[rel] = reason(e)
            continue
        done.append(rel)
    return done, failed


def leftovers(root: Path, dirs: Iterable[Path]) -> list[Path]:
    """What killed runs left: stale temp files in ``dirs`` and in the state dir, and backups that
    no manifest refers to (none when the manifest is unreadable: those are kept)."""
    state = state_dir(root)
    walk = [Path(d) for d in dirs]
    if state.is_dir():
        walk += [Path(d) for d, _, _ in os.walk(state)]
    found = [Path(p) for d in dict.fromkeys(walk) for p, _ in stale_temps(str(d))]
    backups = state / BACKUP_DIR
    if not backups.is_dir():
        return found
    try:
        manifest = read_manifest(root)
    except PatchError:
        return found
    entries = manifest["files"].values() if manifest else ()
    keep = {os.path.normpath(state / str(e.get("backup", ""))) for e in entries
            if isinstance(e, dict)}
    for path in sorted(backups.rglob("*")):
        if not path.is_dir() and os.path.normpath(path) not in keep and path not in found:
            found.append(path)
    return found


def clean_leftovers(root: Path, dirs: Iterable[Path]) -> list[str]:
    """Remove :func:`leftovers` and the empty directories they leave; never raises.
    Returns the paths removed. Call it only while holding the patch lock."""
    removed = []
    for path in leftovers(root, dirs):
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(str(path))
    state = state_dir(root)
    if state.is_dir():
        for d in sorted((p for p in state.rglob("*") if p.is_dir()), reverse=True):
            with contextlib.suppress(OSError):
                d.rmdir()  # only when empty
        with contextlib.suppress(OSError):
            state.rmdir()
    return removed


def unrestored(root: Path, failed: dict[str, str], problem: str | None, done: str) -> str:
    """The end of the one-line error after a rollback or revert: what is left, what to do."""
    if not failed and not problem:
        return f"; every file was {done}, vLLM is unchanged"
    msg = ""
    if failed:
        names = ", ".join(f"{root / rel} ({why})" for rel, why in sorted(failed.items()))
        msg = (f"; could not restore {names}: still patched and kept in the manifest, every "
               f"other file was {done}; make it writable, then run 'kvtool patch-vllm --revert'")
    return msg + (f"; {problem}" if problem else "")
