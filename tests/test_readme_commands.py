"""Every ``kvtool ...`` command in README.md's shell blocks runs as written, on the default model.

README.md is read at test time. Each command line (``\\``-continued lines joined) is expanded by
bash exactly as a user's shell would (quotes, ``$(cat doc.txt)``, ``~``), in one temp directory
shared by all commands, in README order, so later commands use the files earlier ones wrote.
The expanded words then run in-process through ``kvtool``'s click entry point (one Python
process: no torch import per command). Then every ``python`` block runs there too.

The reader's own files, provided before the commands run (:data:`READER_FILES`): ``doc.txt``
(a short document), ``STORE_DIR/`` (an empty store directory, the placeholder's literal name),
``system_prompt.kvz`` (a captured 300-token system prompt) and ``HOME`` (the temp dir) with an
empty ``~/kvstore/`` (the store a server, not run here, would have made) and the default model
converted already, as ``scripts/setup.sh``'s demo or any earlier run leaves it in kvtool's cache
(a link to the session's converted model).

Not run (:func:`NOT_RUN`): ``kvtool serve`` without ``--dry-run`` (a server that does not
exit), ``kvtool patch-vllm`` without ``--status``/``--dry-run`` (it edits the installed vLLM)
and commands naming a remote store URL (``s3://...``: credentials and a network).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
DOC_TXT = ("The lighthouse on Skerry Point was kept by Ada Mair for thirty years. Every night she "
           "wrote down the ships that passed.\n")
SYSTEM_PROMPT = "You are a careful assistant. Answer briefly and cite the document. " * 24
READER_FILES = ("doc.txt", "STORE_DIR/", "~/kvstore/", "system_prompt.kvz", "~ (HOME)")


def NOT_RUN(words: list[str]) -> str | None:  # noqa: N802  (a documented list, as a rule)
    """Why a README command is not run, or None to run it."""
    if any(re.match(r"^[a-z0-9]+://", w) for w in words):
        return "it names a remote store (s3://...), which needs credentials and a network"
    if words[:1] == ["serve"] and "--dry-run" not in words:
        return "kvtool serve without --dry-run starts a server that does not exit"
    if words[:1] == ["patch-vllm"] and not {"--status", "--dry-run"} & set(words):
        return "kvtool patch-vllm would patch the installed vLLM"
    return None


def blocks(lang: str) -> list[str]:
    """The bodies of README.md's fenced ``lang`` blocks (indented ones too), in order."""
    text = README.read_text(encoding="utf-8")
    pattern = re.compile(rf"^([ \t]*)```{lang}\n(.*?)^\1```", re.M | re.S)
    out = []
    for m in pattern.finditer(text):
        indent = m.group(1)
        out.append("\n".join(line[len(indent):] if line.startswith(indent) else line
                             for line in m.group(2).splitlines()))
    return out


def readme_commands() -> list[str]:
    """Each ``kvtool`` command line of the bash blocks, continuation lines joined."""
    commands = []
    for body in blocks("bash"):
        joined = re.sub(r"\\\n\s*", " ", body)
        commands += [line.strip() for line in joined.splitlines()
                     if line.strip().startswith("kvtool ")]
    return commands


def expand(command: str, cwd: Path, env: dict[str, str]) -> list[str]:
    """The words bash makes of ``command`` (after ``kvtool``), comments dropped."""
    rest = command.removeprefix("kvtool ")
    out = subprocess.run(["bash", "-c", f"printf '%s\\0' {rest}"], cwd=cwd, env=env,
                         capture_output=True, check=True)
    return [w for w in out.stdout.decode().split("\0")[:-1]]


def test_readme_lists_commands():
    commands = readme_commands()
    assert len(commands) >= 15, commands
    for name in ("capture", "inspect", "compress", "decompress", "generate", "eval", "codecs"):
        assert any(c.startswith(f"kvtool {name} ") for c in commands), name


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    pytest.importorskip("transformers")
    work = tmp_path_factory.mktemp("readme")
    (work / "doc.txt").write_text(DOC_TXT, encoding="utf-8")
    (work / "STORE_DIR").mkdir()
    (work / "kvstore").mkdir()  # ~/kvstore: the store `kvtool serve --store ~/kvstore` makes
    # the default model as converted for the rest of the session (its GGUF conversion, ~25 s:
    # the first load of the session; tests/test_hf_engine.py), where kvtool looks under HOME
    from kvtool import models

    converted = models.ensure_default_converted()
    with pytest.MonkeyPatch.context() as m:
        m.setenv("HOME", str(work))
        m.delenv("KVTOOL_CACHE_DIR", raising=False)
        m.delenv("XDG_CACHE_HOME", raising=False)
        shared = models.converted_dir(models.default_gguf_path())
    shared.parent.mkdir(parents=True)
    shared.symlink_to(converted, target_is_directory=True)
    return work


def test_every_readme_command_runs(workdir, monkeypatch):
    from click.testing import CliRunner

    from kvtool import progress
    from kvtool.cli.main import cli

    env = dict(os.environ, HOME=str(workdir))
    monkeypatch.setenv("HOME", str(workdir))
    monkeypatch.chdir(workdir)
    runner = CliRunner()
    ran, skipped, seconds = [], [], {}
    for command in readme_commands():
        words = expand(command, workdir, env)
        why = NOT_RUN(words)
        if why:
            skipped.append((command, why))
            continue
        if "system_prompt.kvz" in words and not (workdir / "system_prompt.kvz").exists():
            pin = runner.invoke(cli, ["capture", "--prompt", SYSTEM_PROMPT, "-o",
                                      "system_prompt.kvz"])  # a store chunk: >= 256 tokens
            assert pin.exit_code == 0, pin.output
        start = time.perf_counter()
        result = runner.invoke(cli, words, catch_exceptions=True)
        seconds[command] = time.perf_counter() - start
        assert result.exit_code == 0, (f"README command failed (exit {result.exit_code}):\n"
                                       f"  {command}\n{result.output}{result.exception!r}")
        ran.append(command)
    progress.set_verbosity(progress.NORMAL)
    for command, took in sorted(seconds.items(), key=lambda x: -x[1]):
        print(f"{took:7.2f} s  {command}")  # shown with pytest -s: what the test spends
    assert ran and all("serve" not in c or "--dry-run" in c for c in ran)
    assert {c.split()[1] for c in ran} >= {"capture", "generate", "store", "codecs"}
    assert all(NOT_RUN(expand(c, workdir, env)) for c, _ in skipped)


def test_readme_python_snippets_run(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    snippets = blocks("python")
    assert snippets
    for code in snippets:
        scope: dict = {"__name__": "__readme__"}
        exec(compile(code, str(README), "exec"), scope)  # noqa: S102  (our own README)
    assert (workdir / "doc.kvz").is_file()


def test_readme_shell_lines_parse():
    """Every command line is valid shell (no [optional] placeholders left in them)."""
    for command in readme_commands():
        words = shlex.split(command, comments=True)
        assert not any(w.startswith("[") for w in words), command
