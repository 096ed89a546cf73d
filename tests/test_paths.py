"""Hostile paths: FIFOs, devices, directories, symlinks, empty and impossible outputs, non-UTF-8
text, non-GGUF models, a full disk, and the temp files a killed writer leaves behind."""

from __future__ import annotations

import errno
import os
import re
import socket
import stat
import subprocess
import sys
import time

import pytest
from kvz_util import one_line_error, synthetic_cache

from kvtool import fileio
from kvtool.cli._common import os_error_message
from kvtool.cli.main import cli
from kvtool.errors import KvtoolError, ModelNotFoundError
from kvtool.fileio import atomic_write, check_input_file, check_output_path
from kvtool.formats import load, save


@pytest.fixture
def kvz(tmp_path):
    path = tmp_path / "in.kvz"
    save(synthetic_cache(layers=2, tokens=8), path)
    return path


@pytest.fixture
def fifo(tmp_path):
    """A FIFO that this test also holds open for writing: a reader that wrongly opens it gets
    EOF instead of blocking the suite forever."""
    path = tmp_path / "pipe.kvz"
    os.mkfifo(path)
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
    yield path
    os.close(fd)


def _temps(directory) -> list[str]:
    return sorted(p for p in os.listdir(directory) if p.endswith(fileio.TEMP_SUFFIX))


# -- inputs ----------------------------------------------------------------------------------------
def test_check_input_file(tmp_path, kvz, fifo):
    check_input_file(str(kvz))
    os.symlink(kvz, tmp_path / "link.kvz")
    check_input_file(str(tmp_path / "link.kvz"))  # a symlink to a regular file is fine
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "s.sock"))
    try:
        for path, kind in [(fifo, "FIFO"), ("/dev/null", "character device"),
                           (tmp_path, "directory"), (tmp_path / "s.sock", "socket")]:
            with pytest.raises(KvtoolError, match=f"^{path}: is a {kind}, not a regular file$"):
                check_input_file(str(path))
    finally:
        sock.close()
    with pytest.raises(KvtoolError, match="input path is empty"):
        check_input_file("")
    with pytest.raises(FileNotFoundError):
        check_input_file(str(tmp_path / "missing.kvz"))


@pytest.mark.parametrize("command", ["compress", "decompress"])
def test_transcode_refuses_special_inputs(runner, tmp_path, fifo, command):
    out = tmp_path / "out.kvz"
    for src, kind in [(fifo, "FIFO"), ("/dev/null", "character device")]:
        args = [command, str(src), "-o", str(out)] + (["--codec", "int8"]
                                                      if command == "compress" else [])
        line = one_line_error(runner.invoke(cli, args), 1)
        assert line == f"Error: {src}: is a {kind}, not a regular file"
    assert not out.exists()


def test_generate_refuses_special_cache_before_loading_the_model(runner, fifo, monkeypatch):
    import kvtool.models

    monkeypatch.setattr(kvtool.models, "load_model", lambda *a, **k: pytest.fail("loaded"))
    for src in (fifo, "/dev/null"):
        result = runner.invoke(cli, ["generate", "--cache", str(src), "--prompt", "hi"])
        assert f"{src}: is a" in one_line_error(result, 1)


def test_prompt_and_text_files(runner, tmp_path, fifo, monkeypatch):
    import kvtool.models

    monkeypatch.setattr(kvtool.models, "load_model", lambda *a, **k: pytest.fail("loaded"))
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café\n".encode("latin-1"))
    out = str(tmp_path / "o.kvz")
    for args in (["capture", "-o", out, "--prompt-file"], ["eval", "--text"]):
        line = one_line_error(runner.invoke(cli, [*args, str(fifo)]), 1)
        assert line == f"Error: {fifo}: is a FIFO, not a regular file"
        line = one_line_error(runner.invoke(cli, [*args, "/dev/null"]), 1)
        assert line == "Error: /dev/null: is a character device, not a regular file"
        line = one_line_error(runner.invoke(cli, [*args, str(latin1)]), 1)
        assert line == f"Error: {latin1}: not UTF-8 text (invalid byte 0xe9 at offset 3)"
    (tmp_path / "ok.txt").write_text("héllo", encoding="utf-8")
    assert fileio.read_text_file(str(tmp_path / "ok.txt")) == "héllo"


def test_png_as_gguf_and_special_model_paths(runner, tmp_path, fifo):
    from kvtool.models import resolve_model

    png = tmp_path / "model.gguf"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    with pytest.raises(ModelNotFoundError, match=r"model\.gguf: not a GGUF file"):
        resolve_model(str(png))
    gguf_fifo = tmp_path / "m.gguf"
    os.rename(fifo, gguf_fifo)
    with pytest.raises(KvtoolError, match="m.gguf: is a FIFO"):
        resolve_model(str(gguf_fifo))
    with pytest.raises(KvtoolError, match="/dev/null: is a character device"):
        resolve_model("/dev/null")
    (tmp_path / "real.gguf").write_bytes(b"GGUF" + bytes(8))  # magic ok: handed on
    assert resolve_model(str(tmp_path / "real.gguf"))[0] == "real"
    result = runner.invoke(cli, ["capture", "--prompt", "hi", "--model", str(png),
                                 "-o", str(tmp_path / "o.kvz")])
    assert "not a GGUF file" in one_line_error(result, 6)


# -- outputs ---------------------------------------------------------------------------------------
def test_outputs_that_are_not_regular_files_survive(runner, kvz, fifo, tmp_path):
    os.symlink("/dev/null", tmp_path / "null.kvz")
    cases = [(str(fifo), f"{fifo}: is a FIFO"),
             ("/dev/null", "/dev/null: is a character device"),
             (str(tmp_path / "null.kvz"), f"{tmp_path / 'null.kvz'} (-> /dev/null): is a "
                                          "character device")]
    for out, message in cases:
        line = one_line_error(runner.invoke(cli, ["decompress", str(kvz), "-o", out]), 1)
        assert line == f"Error: {message}, not a regular file; not replacing it"
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert os.readlink(tmp_path / "null.kvz") == "/dev/null"
    with pytest.raises(KvtoolError, match="is a directory"):
        atomic_write(tmp_path, lambda f: 0)
    assert _temps(tmp_path) == []


def test_impossible_outputs_fail_before_slow_work(runner, kvz, tmp_path, monkeypatch):
    import kvtool.models

    monkeypatch.setattr(kvtool.models, "load_model", lambda *a, **k: pytest.fail("loaded"))
    monkeypatch.chdir(tmp_path)  # a file named "-" would land here
    (tmp_path / "afile").write_text("x")
    cases = [("", "output path is empty"),
             ("-", "-: cannot write to standard output (files are written whole, then "
              "renamed); give a file name (./- for a file named '-')"),
             (str(tmp_path / "missing" / "o.kvz"),
              f"{tmp_path / 'missing' / 'o.kvz'}: directory {tmp_path / 'missing'} does not "
              "exist"),
             (str(tmp_path / "afile" / "o.kvz"),
              f"{tmp_path / 'afile' / 'o.kvz'}: {tmp_path / 'afile'} is not a directory"),
             (str(tmp_path / "newdir") + "/",
              f"{tmp_path / 'newdir'}/: is a directory path, expected a file name")]
    for out, message in cases:
        for args in (["decompress", str(kvz)], ["compress", str(kvz), "--codec", "int8"],
                     ["capture", "--prompt", "hi"]):
            line = one_line_error(runner.invoke(cli, [*args, "-o", out]), 1)
            assert line == f"Error: {message}", args
        with pytest.raises(KvtoolError, match=re.escape(message.split(": ")[-1])):
            check_output_path(out)
    assert sorted(os.listdir(tmp_path)) == ["afile", "in.kvz"]


def test_symlink_output_replaces_the_target_and_keeps_the_link(runner, kvz, tmp_path):
    big_disk = tmp_path / "big-disk"
    big_disk.mkdir()
    save(synthetic_cache(layers=1, tokens=4), big_disk / "doc.kvz")
    os.chmod(big_disk / "doc.kvz", 0o640)
    os.symlink(big_disk / "doc.kvz", tmp_path / "doc.kvz")
    os.symlink("big-disk/new.kvz", tmp_path / "dangling.kvz")
    assert check_output_path(str(tmp_path / "doc.kvz")) == str(big_disk / "doc.kvz")
    for link in ("doc.kvz", "dangling.kvz"):
        result = runner.invoke(cli, ["decompress", str(kvz), "-o", str(tmp_path / link)])
        assert result.exit_code == 0, result.stderr
        assert os.path.islink(tmp_path / link)
    assert load(big_disk / "doc.kvz").num_layers == 2  # the target was replaced ...
    assert stat.S_IMODE(os.stat(big_disk / "doc.kvz").st_mode) == 0o640  # ... keeping its mode
    assert load(big_disk / "new.kvz").num_layers == 2  # a dangling link's target is created
    assert _temps(tmp_path) == [] and _temps(big_disk) == []


def test_enospc_names_the_file_and_keeps_the_old_one(runner, kvz, tmp_path, monkeypatch):
    out = tmp_path / "out.kvz"
    out.write_bytes(b"old")

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fileio.os, "fsync", full)
    result = runner.invoke(cli, ["decompress", str(kvz), "-o", str(out)])
    assert one_line_error(result, 1) == f"Error: No space left on device: {out}"
    with pytest.raises(OSError) as info:
        atomic_write(out, lambda f: f.write(b"new"))
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(out)
    assert str(info.value).endswith(f"No space left on device: '{out}'")  # not "-> None"
    monkeypatch.undo()
    assert out.read_bytes() == b"old" and _temps(tmp_path) == []


def test_os_error_message():
    assert os_error_message(OSError(errno.ENOSPC, "No space left on device", "a.kvz")) \
        == "No space left on device: a.kvz"
    assert os_error_message(OSError(errno.EXDEV, "Invalid cross-device link", "a", None, "b")) \
        == "Invalid cross-device link: a -> b"
    assert os_error_message(OSError("disk full (simulated)")) == "disk full (simulated)"
    assert os_error_message(MemoryError("big")) == "big"


# -- temp files ------------------------------------------------------------------------------------
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temps_are_collected_by_the_next_write(tmp_path):
    host = fileio.host_name()
    dead = tmp_path / f".x.kvz.{host}.{_dead_pid()}.abc123{fileio.TEMP_SUFFIX}"
    live = tmp_path / f".x.kvz.{host}.{os.getppid()}.abc123{fileio.TEMP_SUFFIX}"
    other_new = tmp_path / f".x.kvz.otherhost.1.abc123{fileio.TEMP_SUFFIX}"
    other_old = tmp_path / f".x.kvz.otherhost.2.abc123{fileio.TEMP_SUFFIX}"
    unrelated = tmp_path / f"notours{fileio.TEMP_SUFFIX}"
    for p in (dead, live, other_new, other_old, unrelated):
        p.write_bytes(b"x" * 10)
    old = time.time() - fileio.STALE_TEMP_SECONDS - 60
    os.utime(other_old, (old, old))
    assert fileio.temp_prefix(str(tmp_path / "x.kvz")) == f".x.kvz.{host}.{os.getpid()}."
    assert sorted(p for p, _ in fileio.stale_temps(str(tmp_path))) == \
        sorted([str(dead), str(other_old)])
    save(synthetic_cache(layers=1, tokens=4), tmp_path / "y.kvz")
    left = sorted(os.listdir(tmp_path))
    assert left == sorted([live.name, other_new.name, unrelated.name, "y.kvz"])
    assert fileio.remove_stale_temps(str(tmp_path)) == (0, 0)


@pytest.mark.parametrize("name", ["z" * 251 + ".kvz", "é" * 125 + ".kvz"])
def test_a_legal_long_output_name_is_written(runner, kvz, tmp_path, monkeypatch, name):
    """A 255-byte file name is legal; its temp file (the name, the host, the pid, a random
    part) would not be, so the temp name keeps only the start of it."""
    monkeypatch.setattr(fileio, "host_name", lambda: "h" * 64)
    out = tmp_path / name
    result = runner.invoke(cli, ["compress", str(kvz), "-o", str(out), "--codec", "turbo3"])
    assert result.exit_code == 0, result.output
    assert load(out).num_tokens == load(kvz).num_tokens
    assert sorted(os.listdir(tmp_path)) == sorted([name, kvz.name])  # no temp file left


def test_inspect_refuses_special_files(runner, fifo):
    for src, kind in [(fifo, "FIFO"), ("/dev/null", "character device")]:
        line = one_line_error(runner.invoke(cli, ["inspect", str(src)]), 1)
        assert line == f"Error: {src}: is a {kind}, not a regular file"
