"""Issue 12: a CLI people already know how to use.

Quiet broken pipes, errors that name their path, one dtype vocabulary, -q/-v and progress bars,
discoverable codec options, the context-length check, checks before the slow work, stdin
prompts, chat templates, sampling, Hub ids, GGUF conversion once, and --prompt-cache.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvtool.cli.main import cli

KVTOOL = str(Path(sys.executable).parent / "kvtool")


@pytest.fixture(scope="module")
def kvz(tmp_path_factory) -> Path:
    """A small raw .kvz file (no model needed)."""
    import kvtool
    from kvtool.cache import KVCache

    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((2, 24, 64)).astype(np.float32) for _ in range(8)]
    path = tmp_path_factory.mktemp("polish") / "f.kvz"
    kvtool.save(KVCache(arrays[:4], arrays[4:], token_ids=np.arange(24)), path)
    return path


@pytest.fixture
def fast_model(monkeypatch, loaded):
    """Commands load the session's default model instead of loading it again."""
    import kvtool.models

    monkeypatch.setattr(kvtool.models, "load_model", lambda *a, **k: loaded)
    return loaded


@pytest.fixture(autouse=True)
def normal_verbosity():
    from kvtool import progress

    yield
    progress.set_verbosity(progress.NORMAL)


# -- 1. quiet exits, errors that name their path ----------------------------------------------
@pytest.mark.parametrize("command", ["codecs | head -1", "inspect {kvz} | head -3",
                                     "codecs --options --json | head -2"])
def test_broken_pipe_exits_quietly(kvz, command):
    out = subprocess.run(["bash", "-o", "pipefail", "-c",
                          f"{KVTOOL} {command.format(kvz=kvz)}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    assert out.stdout.strip()


def test_errors_name_the_path(runner, kvz, tmp_path):
    truncated = tmp_path / "cut.kvz"
    truncated.write_bytes(kvz.read_bytes()[:500])
    cases = [
        (["inspect", str(tmp_path / "missing.kvz")], "missing.kvz"),
        (["inspect", str(truncated)], str(truncated)),
        (["decompress", str(kvz), "-o", str(tmp_path / "no" / "x.kvz")], str(tmp_path / "no")),
        (["compress", str(truncated), "-o", str(tmp_path / "y.kvz"), "--codec", "turbo3"],
         str(truncated)),
        (["capture", "--prompt-file", str(tmp_path / "none.txt"), "-o", str(tmp_path / "z.kvz")],
         "none.txt"),
    ]
    for args, path in cases:
        result = runner.invoke(cli, args)
        assert result.exit_code != 0, args
        assert path in result.output, (args, result.stdout)


# -- 2. one dtype vocabulary ------------------------------------------------------------------
def test_dtype_param_accepts_both_spellings():
    from kvtool.cli._common import DTYPE

    for short, long in (("fp16", "float16"), ("bf16", "bfloat16"), ("fp32", "float32")):
        assert DTYPE.convert(short, None, None) == long
        assert DTYPE.convert(long, None, None) == long
        assert DTYPE.convert(long.upper(), None, None) == long
    import click

    with pytest.raises(click.BadParameter, match="fp32, bf16 or fp16"):
        DTYPE.convert("fp64", None, None)


def _commands(group, prefix=()):
    import click

    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*prefix, name))
        else:
            yield (*prefix, name), cmd


def test_every_dtype_option_uses_the_one_vocabulary():
    from kvtool.cli._common import DtypeParam

    seen = []
    for path, cmd in _commands(cli):
        for p in cmd.params:
            if p.name == "dtype":
                assert isinstance(p.type, DtypeParam), path
                seen.append(path)
    assert {("capture",), ("generate",), ("eval",), ("decompress",), ("serve",)} <= set(seen)


def test_every_float_option_refuses_nan_and_infinity(runner):
    """A NaN passes every range comparison: ``--store-timeout nan`` reached the connector's
    config (and the dry run's JSON as NaN), ``--temperature inf`` sampled uniformly."""
    import click

    from kvtool.cli._common import FiniteFloatRange

    seen = []
    for path, cmd in _commands(cli):
        for p in cmd.params:
            if isinstance(p.type, click.FloatRange | click.types.FloatParamType):
                assert isinstance(p.type, FiniteFloatRange), (path, p.name)
                seen.append((path, p.name))
    assert {(("generate",), "temperature"), (("serve",), "store_timeout")} <= set(seen)
    for args in (["generate", "--temperature", "inf"], ["generate", "--top-p", "nan"],
                 ["serve", "--dry-run", "--store-timeout", "nan"],
                 ["capture", "--prompt", "hi", "--threads", "100000"],
                 ["generate", "--seed", str(2**64)], ["generate", "--seed", "-1"]):
        out = runner.invoke(cli, args)
        assert out.exit_code == 2 and "Invalid value" in out.output, out.output
    for args, message in ((["generate", "--prompt", "hi", "--seed", "7"], "--temperature > 0"),
                          (["generate", "--prompt", "hi", "--top-p", "0.9"], "--temperature > 0"),
                          (["codecs", "--measure"], "--measure needs --presets")):
        out = runner.invoke(cli, args)  # an option that would do nothing
        assert out.exit_code == 2 and message in out.output, out.output


def test_decompress_takes_long_dtype_names(runner, kvz, tmp_path):
    from kvtool.formats import open_kvz

    for name, want in (("bfloat16", "bfloat16"), ("fp16", "float16")):
        out = tmp_path / f"{name}.kvz"
        result = runner.invoke(cli, ["decompress", str(kvz), "--dtype", name, "-o", str(out)])
        assert result.exit_code == 0, result.output
        with open_kvz(out) as f:
            assert f.info()["dtype"] == want


# -- 3. -q / -v and progress bars --------------------------------------------------------------
class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_quiet_verbose_and_progress(runner, monkeypatch):
    import logging

    from kvtool import progress

    assert runner.invoke(cli, ["-q", "codecs"]).exit_code == 0
    assert progress.verbosity() == progress.QUIET
    monkeypatch.setattr(sys, "stderr", _Tty())
    assert not progress.progress_enabled()  # quiet wins over a terminal
    progress.info("hidden")
    assert sys.stderr.getvalue() == ""
    assert runner.invoke(cli, ["-v", "codecs"]).exit_code == 0
    assert logging.getLogger("kvtool").getEffectiveLevel() == logging.DEBUG
    progress.set_verbosity(progress.NORMAL)
    assert progress.progress_enabled()
    for _ in progress.bar(range(3), desc="work"):
        pass
    assert "work" in sys.stderr.getvalue()  # a bar on a terminal
    # transformers' GGUF loader has a tqdm of its own: quiet (or off a terminal) hides it too
    from transformers import modeling_gguf_pytorch_utils as gguf_loader

    from kvtool.models import transformers_quiet

    real = gguf_loader.tqdm
    for level, shown in ((progress.QUIET, False), (progress.NORMAL, True)):
        progress.set_verbosity(level)
        with transformers_quiet():
            assert gguf_loader.tqdm(range(2)).disable is not shown
        assert gguf_loader.tqdm is real
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert not progress.progress_enabled()  # not a terminal: no bar
    assert progress.bar(range(3)).disable


def test_forward_progress_counts_layers(fast_model, monkeypatch):
    from kvtool import progress
    from kvtool.engines.hf import capture

    monkeypatch.setattr(sys, "stderr", _Tty())
    layers = progress.decoder_layers(fast_model.model)
    assert len(layers) == fast_model.model.config.num_hidden_layers
    with progress.forward_progress(layers, len(layers), "prefill", "layer") as b:
        capture(fast_model.model, fast_model.tokenizer, "one two three")
        assert b.n == len(layers)
    assert all(not layer._forward_hooks for layer in layers)  # hooks removed


def test_help_is_not_cut_off(runner):
    out = runner.invoke(cli, ["--help"]).output
    commands = out.split("Commands:")[1].split("Exit codes")[0]
    assert "..." not in commands
    assert "-q, --quiet" in out and "-v, --verbose" in out
    gen = runner.invoke(cli, ["generate", "--help"]).output
    assert "--max-tokens, --max-new-tokens" in gen and "Most tokens to generate" in gen


# -- 4. codec options you can discover ---------------------------------------------------------
def test_codecs_options_lists_types_and_defaults(runner):
    out = runner.invoke(cli, ["codecs", "--options"]).output
    line = next(x for x in out.splitlines() if x.startswith("turbo3 "))
    assert "center: bool = false" in line and "seed: int = 27510" in line
    data = json.loads(runner.invoke(cli, ["codecs", "--options", "--json"]).stdout)
    assert {"name": "group_size", "type": "int", "default": 64, "required": False} \
        in data["codecs"]["int4"]


def test_unknown_codec_option_says_did_you_mean(runner, kvz, tmp_path):
    result = runner.invoke(cli, ["compress", str(kvz), "-o", str(tmp_path / "o.kvz"),
                                 "--codec", "turbo3:centre=true"])
    assert result.exit_code == 3
    assert "did you mean 'center'?" in result.output
    result = runner.invoke(cli, ["compress", str(kvz), "-o", str(tmp_path / "o.kvz"),
                                 "--codec", "turbo"])
    assert result.exit_code == 3 and "did you mean 'turbo" in result.output
    from kvtool.codecs import get_codec
    from kvtool.errors import CodecError

    with pytest.raises(CodecError, match="did you mean 'channel'"):
        get_codec("kivi2:axis=chanel")


# -- 5. context length -------------------------------------------------------------------------
def test_context_length_refused_with_limit(runner, fast_model, tmp_path):
    limit = fast_model.model.config.max_position_embeddings
    result = runner.invoke(cli, ["generate", "--prompt", "hi", "--max-tokens", str(limit + 1)])
    assert result.exit_code == 1
    assert f"context length of {limit}" in result.output and "--force" in result.output
    long_prompt = "word " * (limit + 10)
    result = runner.invoke(cli, ["capture", "--prompt", long_prompt,
                                 "-o", str(tmp_path / "long.kvz")])
    assert result.exit_code == 1 and f"context length of {limit}" in result.output
    assert not (tmp_path / "long.kvz").exists()


def test_context_length_force_goes_on(capsys):
    from kvtool.errors import KvtoolError
    from kvtool.models import check_context_length

    check_context_length(10, 8, True, "m")  # --force: a warning, no error
    assert "context length of 8" in capsys.readouterr().err
    with pytest.raises(KvtoolError, match="context length of 8"):
        check_context_length(10, 8, False, "m")
    check_context_length(8, 8, False, "m")
    check_context_length(10**6, None, False, "m")  # unknown limit: no check


# -- 6. checks before the slow work ------------------------------------------------------------
def test_output_dirs_checked_before_the_model(runner, tmp_path, monkeypatch):
    import kvtool.models

    def no_model(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(kvtool.models, "load_model", no_model)
    for args in (["capture", "--prompt", "hi", "-o", str(tmp_path / "nodir" / "a.kvz")],
                 ["generate", "--prompt", "hi", "--prompt-cache",
                  str(tmp_path / "nodir" / "p.kvz")]):
        result = runner.invoke(cli, args)
        assert result.exit_code == 1, result.output
        assert f"directory {tmp_path / 'nodir'} does not exist" in result.output
    doc = tmp_path / "doc.txt"  # an output that is the input: refused, the text kept
    doc.write_text("hello")
    for args in (["capture", "--prompt-file", str(doc), "-o", str(doc)],):
        result = runner.invoke(cli, args)
        assert result.exit_code == 1 and "is the input file" in result.output, result.output
    assert doc.read_text() == "hello"
    result = runner.invoke(cli, ["generate", "--prompt", "", "--no-chat-template"])
    assert result.exit_code == 2 and "the prompt is empty" in result.output, result.output


# -- 7. input and generation -------------------------------------------------------------------
def test_prompt_file_dash_reads_stdin(runner, fast_model, tmp_path):
    from kvtool.formats import load

    out = tmp_path / "stdin.kvz"
    result = runner.invoke(cli, ["capture", "--prompt-file", "-", "-o", str(out)],
                           input="The quick brown fox")
    assert result.exit_code == 0, result.output
    ids = fast_model.tokenizer("The quick brown fox")["input_ids"]
    assert load(out).token_ids.tolist() == ids
    result = runner.invoke(cli, ["generate", "--prompt-file", "-", "--max-tokens", "2",
                                 "--no-chat-template", "--json"], input="The quick brown fox")
    assert json.loads(result.stdout)["recompute"]["prompt_tokens"] == len(ids)


def test_chat_template_applied_unless_turned_off(runner, fast_model):
    from kvtool.engines.hf import chat_prompt, encode_text, prompt_ids

    tok = fast_model.tokenizer
    assert tok.chat_template  # the default model has one
    templated = prompt_ids(tok, "What is 2+2?")
    assert templated == encode_text(tok, chat_prompt(tok, "What is 2+2?"), special=False)
    assert "What is 2+2?" in chat_prompt(tok, "What is 2+2?")
    plain = prompt_ids(tok, "What is 2+2?", chat_template=False)
    assert plain == encode_text(tok, "What is 2+2?") and len(templated) > len(plain)
    for flag, want in (([], len(templated)), (["--no-chat-template"], len(plain))):
        result = runner.invoke(cli, ["generate", "--prompt", "What is 2+2?", "--max-tokens",
                                     "1", "--json", *flag])
        assert json.loads(result.stdout)["recompute"]["prompt_tokens"] == want


def test_sampling_options(runner, fast_model):
    def run(*extra):
        result = runner.invoke(cli, ["generate", "--prompt", "Once upon a time", "--json",
                                     "--max-tokens", "6", *extra])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["recompute"]["new_token_ids"]

    greedy = run()
    assert run("--max-new-tokens", "6") == greedy  # the old name still works
    a = run("--temperature", "1.5", "--top-p", "0.95", "--seed", "7")
    assert a == run("--temperature", "1.5", "--top-p", "0.95", "--seed", "7")
    samples = {tuple(run("--temperature", "1.5", "--seed", str(s))) for s in range(3)}
    assert len(samples) > 1  # sampling does sample
    assert run("--temperature", "0", "--seed", "3") == greedy


def test_runtime_codec_without_cache(runner, fast_model):
    result = runner.invoke(cli, ["generate", "--prompt", "Name a colour.", "--max-tokens", "3",
                                 "--runtime-codec", "turbo3", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert len(report["recompute"]["new_token_ids"]) >= 1
    # a prompt shorter than a block: nothing encoded, and the user is told
    assert report["runtime_codec"]["encoded_tokens"] == 0 and "encoded none" in result.stderr
    result = runner.invoke(cli, ["generate", "--prompt", "Name a colour. " * 40,
                                 "--max-tokens", "2", "--runtime-codec", "turbo3", "--json"])
    assert result.exit_code == 0 and "encoded none" not in result.stderr, result.output
    report = json.loads(result.stdout)["runtime_codec"]
    assert report["encoded_tokens"] >= 64 and report["encoded_tokens"] % 64 == 0, report


# -- 8. models: Hub ids and GGUF conversion ----------------------------------------------------
def _fake_hub_model(hf_home: Path, repo: str, rev: str = "0123abcd") -> Path:
    org, name = repo.split("/")
    root = hf_home / "hub" / f"models--{org}--{name}"
    snap = root / "snapshots" / rev
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(rev)
    return snap


def test_hub_id_resolves_from_the_local_cache(tmp_path, monkeypatch):
    from kvtool.errors import ModelNotFoundError
    from kvtool.models import resolve_model

    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snap = _fake_hub_model(tmp_path, "HuggingFaceTB/SmolLM2-135M-Instruct")
    name, location = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert name == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert location.resolve() == snap.resolve()
    with pytest.raises(ModelNotFoundError, match=r"not in the Hugging Face cache .*hf download"):
        resolve_model("someone/absent-model")


def test_every_gguf_converts_once(tmp_path, monkeypatch):
    from kvtool import models

    monkeypatch.setenv("KVTOOL_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "gemma-tiny.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    calls = []

    def fake_convert(src: Path, target: Path, dtype: str = "bfloat16") -> float:
        calls.append(src)
        target.mkdir()
        (target / "config.json").write_text("{}")
        (target / "model.safetensors").write_bytes(b"")
        return 0.0

    monkeypatch.setattr(models, "convert_gguf", fake_convert)
    name, first = models.model_location(str(gguf))
    assert name == "gemma-tiny" and first.parent == tmp_path / "cache" / "models"
    assert first.name.startswith("gemma-tiny-bf16-")
    assert models.model_location(str(gguf))[1] == first and len(calls) == 1
    gguf.write_bytes(b"GGUF" + bytes(63) + b"\x01")  # new content: a new conversion
    assert models.model_location(str(gguf))[1] != first and len(calls) == 2


# -- 9. --prompt-cache -------------------------------------------------------------------------
def test_prompt_cache_saves_then_restores(runner, fast_model, tmp_path):
    path = tmp_path / "pc.kvz"
    args = ["generate", "--prompt", "The capital of France is", "--prompt-cache", str(path),
            "--max-tokens", "4", "--json"]
    first = runner.invoke(cli, args)
    assert first.exit_code == 0, first.output
    one = json.loads(first.stdout)
    assert one["prompt_cache"]["action"] == "saved" and path.is_file()
    mtime = os.stat(path).st_mtime_ns
    second = json.loads(runner.invoke(cli, args).stdout)
    assert second["prompt_cache"]["action"] == "restored"
    assert second["restore"]["new_token_ids"] == one["restore"]["new_token_ids"]
    assert os.stat(path).st_mtime_ns == mtime  # restored, not rewritten
    other = json.loads(runner.invoke(cli, [*args[:2], "Something else entirely", *args[3:]])
                       .stdout)
    assert other["prompt_cache"]["action"] == "saved"  # another prompt: captured again


# -- 10. honest reports, no silent re-quantization --------------------------------------------
def test_raw_float32_reports_its_own_dtype_ratio(runner, kvz, tmp_path):
    out = runner.invoke(cli, ["compress", str(kvz), "--codec", "raw", "-o", str(tmp_path / "r.kvz"),
                              "--json"])
    report = json.loads(out.output)
    assert report["source_dtype"] == "float32" and report["ratio"] < 0.6  # vs fp16: < 1
    assert 0.9 < report["ratio_vs_source"] <= 1.0  # raw float32 is float32-sized
    text = runner.invoke(cli, ["compress", str(kvz), "--codec", "turbo3", "-o",
                               str(tmp_path / "t.kvz")]).output
    assert "smaller than its float32 K/V" in text and "vs fp16" not in text


def test_compressing_a_lossy_file_again_is_refused(runner, kvz, tmp_path):
    lossy, again = tmp_path / "t3.kvz", tmp_path / "again.kvz"
    assert runner.invoke(cli, ["compress", str(kvz), "--codec", "turbo3", "-o",
                               str(lossy)]).exit_code == 0
    out = runner.invoke(cli, ["compress", str(lossy), "--codec", "turbo2", "-o", str(again)])
    assert out.exit_code != 0 and "already lossy (turbo3)" in out.output
    assert str(lossy) in out.output and not again.exists()
    assert runner.invoke(cli, ["compress", str(lossy), "--codec", "raw", "-o",
                               str(again)]).exit_code == 0  # lossless: nothing is added
    assert runner.invoke(cli, ["compress", str(lossy), "--codec", "turbo2", "--force", "-o",
                               str(again)]).exit_code == 0


def test_a_file_larger_than_its_kv_is_not_called_smaller():
    from kvtool.cli.inspect import size_ratio

    assert size_ratio(3.2) == "3.20x smaller" and size_ratio(1.0) == "1.00x smaller"
    assert size_ratio(0.94) == "1.06x larger"
