"""``kvtool patch-vllm`` when files cannot be written, and after a run killed mid-way.

Unwritable files are simulated by refusing the write of one specific path (this works as root,
where permission bits do not stop writes), and for real with ``chattr +i`` where the file system
supports it. Killed runs are simulated by leaving what a killed run leaves (a stale temp file,
orphan backups) and for real by a subprocess that SIGKILLs itself inside a write.
"""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_patch_vllm import FAKE_CPU, _snapshot, copy_real_backends, make_fake_vllm

from kvtool import fileio
from kvtool.cli.main import cli
from kvtool.engines.vllm import patch as patcher
from kvtool.engines.vllm import patch_files
from kvtool.errors import PatchError

STATE = patch_files.STATE_DIR


@pytest.fixture(params=["fake", "real"])
def tree(request, tmp_path) -> Path:
    return make_fake_vllm(tmp_path) if request.param == "fake" else copy_real_backends(tmp_path)


def _targets(root: Path) -> list[Path]:
    """The backend files a patch run writes, in the order it writes them."""
    return [root / rel for rel in patcher.TARGETS if (root / rel).exists()]


def _source(snap: dict[str, str]) -> dict[str, str]:
    """A snapshot without ``__pycache__`` (patching rightly removes stale compiled files)."""
    return {k: v for k, v in snap.items() if "__pycache__" not in k}


def _deny(monkeypatch, target: Path, refuse: Callable[[bytes], bool] = lambda data: True,
          exc: type[OSError] = PermissionError) -> list[bytes]:
    """Make every atomic write of ``target`` (whose data ``refuse`` accepts) fail like an
    immutable file does. Returns the refused writes."""
    real = patch_files.atomic_write
    refused: list[bytes] = []

    def guarded(path, write, **kwargs):
        buf = io.BytesIO()
        write(buf)
        data = buf.getvalue()
        if os.path.realpath(path) == os.path.realpath(target) and refuse(data):
            refused.append(data)
            raise exc(errno.EPERM, "Operation not permitted", str(path))
        return real(path, lambda f: f.write(data), **kwargs)

    monkeypatch.setattr(patch_files, "atomic_write", guarded)
    return refused


def _run(*args: str):
    return CliRunner().invoke(cli, ["patch-vllm", *args])


def _assert_clean_and_unpatched(root: Path, before: dict[str, str]) -> None:
    """Every source file as before (sha256), no manifest or backup, no temp file anywhere."""
    assert _source(_snapshot(root)) == _source(before)
    assert not (root / STATE).exists()
    assert patcher.status(root)["state"] == "not patched"
    res = _run("--status", "--json", "--vllm-path", str(root))
    assert res.exit_code == 0 and json.loads(res.output)["state"] == "not patched"
    assert not list(root.rglob("*.kvtmp")) and not list(root.rglob("*.kvtool-tmp"))


# -- a file that cannot be written ----------------------------------------------------------
@pytest.mark.parametrize("which", ["last target", "first target", "backup", "manifest"])
def test_unwritable_file_exits_7_and_rolls_everything_back(tree, monkeypatch, which):
    targets = _targets(tree)
    rel0 = str(targets[0].relative_to(tree))
    victim = {"last target": targets[-1], "first target": targets[0],
              "backup": tree / STATE / "backup" / f"{rel0}.orig",
              "manifest": tree / STATE / "manifest.json"}[which]
    before = _snapshot(tree)
    refused = _deny(monkeypatch, victim)
    res = _run("--vllm-path", str(tree))
    assert res.exit_code == 7, res.output
    assert res.output.count("\n") == 1
    assert f"cannot write {victim.resolve()}: Operation not permitted" in res.output
    assert "every file was rolled back, vLLM is unchanged" in res.output
    assert len(refused) == 1
    _assert_clean_and_unpatched(tree, before)


def test_a_file_that_cannot_be_restored_is_reported_and_kept_in_the_manifest(tmp_path,
                                                                              monkeypatch):
    root = make_fake_vllm(tmp_path)
    before = _snapshot(root)
    first, *_, last = _targets(root)
    original = first.read_bytes()
    _deny(monkeypatch, first, refuse=lambda data: data == original)  # patch it, not restore it
    real_compile = patcher._compile_file

    def failing_compile(path: Path) -> None:
        if path == last:
            raise SyntaxError("simulated compile failure")
        real_compile(path)

    monkeypatch.setattr(patcher, "_compile_file", failing_compile)
    with pytest.raises(PatchError) as err:
        patcher.patch(root)
    msg = str(err.value)
    assert "\n" not in msg and "simulated compile failure" in msg
    assert f"could not restore {first.resolve()} (Operation not permitted)" in msg
    assert "every other file was rolled back" in msg and "--revert" in msg
    for path in _targets(root)[1:]:  # every other file is back
        assert patcher.sha256(path.read_bytes()) == before[str(path.relative_to(root))]
    manifest = json.loads((root / STATE / "manifest.json").read_text())
    rel = str(first.relative_to(root))
    assert list(manifest["files"]) == [rel]  # exactly what is still patched
    backups = [p for p in (root / STATE).rglob("*") if p.is_file() and p.name != "manifest.json"]
    assert backups == [root / STATE / manifest["files"][rel]["backup"]]
    st = patcher.status(root)
    assert {f["file"]: f["state"] for f in st["files"]}[rel] == "patched"
    assert st["state"] == "modified"

    monkeypatch.undo()  # the file is writable again: a plain revert finishes the job
    assert patcher.revert(root)["action"] == "reverted"
    _assert_clean_and_unpatched(root, before)


def test_revert_with_an_unwritable_file_restores_the_others(tree, monkeypatch):
    before = _snapshot(tree)
    patcher.patch(tree)
    patched = _snapshot(tree)
    victim = _targets(tree)[1]
    rel = str(victim.relative_to(tree))
    _deny(monkeypatch, victim)
    res = _run("--revert", "--vllm-path", str(tree))
    assert res.exit_code == 7 and res.output.count("\n") == 1, res.output
    assert f"could not restore {victim.resolve()} (Operation not permitted)" in res.output
    assert "every other file was restored" in res.output
    for path in _targets(tree):
        key = str(path.relative_to(tree))
        assert patcher.sha256(path.read_bytes()) == (patched if path == victim else before)[key]
    manifest = json.loads((tree / STATE / "manifest.json").read_text())
    assert list(manifest["files"]) == [rel]
    assert {f["file"]: f["state"] for f in patcher.status(tree)["files"]}[rel] == "patched"
    assert not list(tree.rglob("*.kvtmp"))
    res = _run("--status", "--vllm-path", str(tree))
    assert ": modified" in res.output and "only partly patched" in res.output

    monkeypatch.undo()
    res = _run("--revert", "--vllm-path", str(tree))
    assert res.exit_code == 0, res.output
    _assert_clean_and_unpatched(tree, before)


def test_other_os_errors_are_patch_errors_too(tmp_path, monkeypatch):
    root = make_fake_vllm(tmp_path)
    before = _snapshot(root)
    _deny(monkeypatch, _targets(root)[-1], exc=OSError)  # EPERM as a plain OSError
    with pytest.raises(PatchError, match="cannot write .*: Operation not permitted; every file"):
        patcher.patch(root)
    _assert_clean_and_unpatched(root, before)


def test_an_interrupt_mid_patch_rolls_back_then_propagates(tmp_path, monkeypatch):
    root = make_fake_vllm(tmp_path)
    before = _snapshot(root)
    compiled: list[Path] = []

    def interrupted(path: Path) -> None:
        compiled.append(path)
        if len(compiled) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(patcher, "_compile_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        patcher.patch(root)
    _assert_clean_and_unpatched(root, before)


def _chattr(flag: str, path: Path) -> bool:
    if shutil.which("chattr") is None:
        return False
    return subprocess.run(["chattr", flag, str(path)], capture_output=True).returncode == 0


@pytest.mark.parametrize("what", ["target", "package dir"])
def test_immutable_file_with_chattr(tmp_path, what):
    root = make_fake_vllm(tmp_path)
    victim = _targets(root)[-1] if what == "target" else root
    if not _chattr("+i", victim):
        pytest.skip("chattr +i is not available or not supported here")
    try:
        if _still_writable(victim):
            pytest.skip("chattr +i does not stop writes here")
        before = _snapshot(root)
        res = _run("--vllm-path", str(root))
        assert res.exit_code == 7 and res.output.count("\n") == 1, res.output
        named = victim if what == "target" else root / STATE / "backup"
        assert f"cannot write {named.resolve()}" in res.output
        assert "every file was rolled back, vLLM is unchanged" in res.output
        _assert_clean_and_unpatched(root, before)
    finally:
        _chattr("-i", victim)
    assert _run("--vllm-path", str(root)).exit_code == 0  # writable again: it just works
    assert patcher.status(root)["state"] == "patched"


def test_revert_of_an_immutable_file_with_chattr(tmp_path):
    root = make_fake_vllm(tmp_path)
    before = _snapshot(root)
    patcher.patch(root)
    victim = _targets(root)[0]
    if not _chattr("+i", victim):
        pytest.skip("chattr +i is not available or not supported here")
    try:
        res = _run("--revert", "--vllm-path", str(root))
        assert res.exit_code == 7 and res.output.count("\n") == 1, res.output
        assert f"could not restore {victim.resolve()}" in res.output
        assert patcher.status(root)["state"] == "modified"
        assert not list(root.rglob("*.kvtmp"))
    finally:
        _chattr("-i", victim)
    assert _run("--revert", "--vllm-path", str(root)).exit_code == 0
    _assert_clean_and_unpatched(root, before)


def _still_writable(path: Path) -> bool:
    """Whether a new file can still be created next to (or in) ``path`` despite chattr."""
    probe = (path if path.is_dir() else path.parent) / ".kvtool-chattr-probe"
    if path.is_dir():
        try:
            probe.write_bytes(b"")
        except OSError:
            return False
        probe.unlink()
        return True
    try:
        with open(path, "ab"):
            return True
    except OSError:
        return False


def test_a_tree_of_symlinks_is_patched_without_touching_what_they_point_to(tmp_path):
    real = make_fake_vllm(tmp_path / "real")
    originals = _snapshot(real)
    root = tmp_path / "links" / "vllm"
    shutil.copytree(real, root, copy_function=os.symlink)
    assert patcher.patch(root)["action"] == "patched"
    assert _snapshot(real) == originals
    assert all(not p.is_symlink() for p in _targets(root))  # the links were replaced
    assert patcher.status(root)["state"] == "patched"
    assert patcher.revert(root)["action"] == "reverted"
    assert _snapshot(real) == originals
    assert _source(_snapshot(root)) == _source(originals)
    assert not list(root.rglob("*.kvtmp")) and not (root / STATE).exists()


# -- a killed run ---------------------------------------------------------------------------
def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(proc.stdout)


def _leave_stale_temp(target: Path, pid: int) -> Path:
    """A temp file named as kvtool.fileio names them, by a writer that is gone."""
    prefix = fileio.temp_prefix(str(target)).replace(f".{os.getpid()}.", f".{pid}.")
    tmp = target.parent / f"{prefix}x1y2z3{fileio.TEMP_SUFFIX}"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_bytes(b"half a file")
    return tmp


def test_leftovers_of_a_killed_run_are_removed_by_the_next(tmp_path):
    root = make_fake_vllm(tmp_path)
    before = _snapshot(root)
    target = _targets(root)[0]
    rel = str(target.relative_to(root))
    pid = _dead_pid()
    orphan = root / STATE / "backup" / f"{rel}.orig"  # killed before the manifest was written
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(target.read_bytes())
    temps = [_leave_stale_temp(target, pid), _leave_stale_temp(root / STATE / "manifest.json", pid)]

    res = _run("--status", "--vllm-path", str(root))
    assert res.exit_code == 0 and ": not patched" in res.output.splitlines()[0]
    assert "removed 3 leftover files of an interrupted run" in res.output
    assert not any(p.exists() for p in [*temps, orphan])
    _assert_clean_and_unpatched(root, before)

    _leave_stale_temp(target, pid)
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"truncated")
    report = patcher.patch(root)
    assert report["action"] == "patched" and len(report["cleaned"]) == 2
    assert not list(root.rglob("*.kvtmp"))
    manifest = json.loads((root / STATE / "manifest.json").read_text())
    assert orphan.read_bytes() == FAKE_CPU.encode() and rel in manifest["files"]
    patcher.revert(root)
    _assert_clean_and_unpatched(root, before)


def test_live_temps_and_recorded_backups_are_kept(tmp_path):
    root = make_fake_vllm(tmp_path)
    patcher.patch(root)
    live = _leave_stale_temp(_targets(root)[0], os.getpid())  # a writer that is still running
    files = _snapshot(root)
    assert patcher.status(root)["cleaned"] == [] and _snapshot(root) == files
    assert patcher.status(root)["state"] == "patched" and live.exists()
    live.unlink()


KILLER = textwrap.dedent('''
    import os, signal, sys

    from kvtool.engines.vllm import patch as patcher
    from kvtool.engines.vllm import patch_files

    root, victim, action = sys.argv[1:4]
    real = patch_files.atomic_write

    def killing(path, write, **kwargs):
        if os.path.basename(path) != victim:
            return real(path, write, **kwargs)

        def half(f):
            f.write(b"half a file")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)

        return real(path, half, **kwargs)

    patch_files.atomic_write = killing
    getattr(patcher, action)(root)
''')


@pytest.mark.parametrize("action,victim", [
    ("patch", "flash_attn.py.orig"),  # mid backups: no manifest yet
    ("patch", "manifest.json"),  # every backup written, the manifest half
    ("patch", "flash_attn.py"),  # the manifest written, cpu_attn.py patched, flash_attn.py half
    ("revert", "flash_attn.py"),  # cpu_attn.py restored, flash_attn.py half
])
def test_run_killed_with_sigkill_then_next_run_succeeds(tmp_path, action, victim):
    root = make_fake_vllm(tmp_path)
    before = _snapshot(root)
    if action == "revert":
        patcher.patch(root)
    script = tmp_path / "killer.py"
    script.write_text(KILLER)
    repo = str(Path(patcher.__file__).resolve().parents[3])
    env = {**os.environ, "PYTHONPATH": repo}
    proc = subprocess.run([sys.executable, str(script), str(root), victim, action], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert list(root.rglob("*.kvtmp"))  # it really died inside a write

    st = patcher.status(root)  # removes the temp (and orphans); never claims a false "patched"
    assert st["cleaned"] and st["state"] in ("not patched", "modified")
    assert not list(root.rglob("*.kvtmp"))
    if action == "patch":
        assert patcher.patch(root)["action"] == "patched"  # no --force needed
        assert patcher.status(root)["state"] == "patched"
        manifest = json.loads((root / STATE / "manifest.json").read_text())
        backups = {str(p.relative_to(root / STATE)) for p in (root / STATE).rglob("*.orig")}
        assert backups == {e["backup"] for e in manifest["files"].values()}
    assert patcher.revert(root)["action"] == "reverted"
    _assert_clean_and_unpatched(root, before)
