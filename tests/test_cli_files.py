"""CLI commands on .kvz files: inspect, compress, decompress; errors and start-up cost."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from kvz_util import one_line_error, rewrite_header, synthetic_cache

from kvtool.cli.main import cli
from kvtool.errors import FormatError
from kvtool.formats import load, open_kvz, save


@pytest.fixture
def raw_file(tmp_path):
    path = tmp_path / "raw.kvz"
    save(synthetic_cache(layers=3, tokens=16), path)
    return path


def test_inspect_text(runner, raw_file):
    result = runner.invoke(cli, ["inspect", str(raw_file)])
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    for needle in ("kvz v1", "synthetic", "tttttttttttttttt", "16 (16 token ids stored)",
                   "3 x [2 kv heads, head_dim 32] float16", "not checked", "raw"):
        assert needle in out, needle


def test_inspect_json_and_verify(runner, tmp_path, raw_file):
    path = tmp_path / "p.kvz"
    save(synthetic_cache(layers=3, tokens=16), path, key_codec="turbo4", value_codec="turbo3",
         protect_layers=1, sink_tokens=2)
    result = runner.invoke(cli, ["inspect", str(path), "--json", "--verify"])
    assert result.exit_code == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["format"] == "kvz" and info["format_version"] == "1"
    assert info["num_layers"] == 3 and info["num_tokens"] == 16 and info["num_token_ids"] == 16
    assert info["model"]["name"] == "synthetic"
    assert info["tokenizer_fingerprint"] == "t" * 16
    assert info["verify"] == {"ok": True, "problems": []}
    assert info["codecs"] == {"raw": 6, "turbo3": 1, "turbo4": 1}
    assert info["layers"][1]["key"]["codecs"] == ["raw", "turbo4"]
    assert info["layers"][1]["value"]["codecs"] == ["raw", "turbo3"]
    assert info["file_bytes"] == path.stat().st_size
    assert info["ratio"] == pytest.approx(info["fp16_bytes"] / info["file_bytes"], abs=1e-3)
    with open_kvz(path) as f:
        assert json.loads(json.dumps(f.info(), default=str)) == \
            {k: v for k, v in info.items() if k != "verify"}


def test_inspect_bad_files_exit_4(runner, tmp_path, raw_file):
    data = bytearray(raw_file.read_bytes())
    data[-3] ^= 0xFF
    (tmp_path / "flip.kvz").write_bytes(bytes(data))
    result = runner.invoke(cli, ["inspect", str(tmp_path / "flip.kvz"), "--verify"])
    assert "checksum mismatch" in one_line_error(result, 4)
    assert "FAILED" in result.stdout  # the report is still printed
    result = runner.invoke(cli, ["inspect", str(tmp_path / "flip.kvz"), "--verify", "--json"])
    one_line_error(result, 4)
    assert json.loads(result.stdout)["verify"]["ok"] is False
    assert runner.invoke(cli, ["inspect", str(tmp_path / "flip.kvz")]).exit_code == 0

    (tmp_path / "trunc.kvz").write_bytes(raw_file.read_bytes()[:500])
    result = runner.invoke(cli, ["inspect", str(tmp_path / "trunc.kvz")])
    assert "trunc.kvz" in one_line_error(result, 4)
    (tmp_path / "text.kvz").write_text("hello world, not a kvz file")
    one_line_error(runner.invoke(cli, ["inspect", str(tmp_path / "text.kvz")]), 4)
    one_line_error(runner.invoke(cli, ["inspect", str(tmp_path / "missing.kvz")]), 1)


def test_unknown_codec_in_file(runner, tmp_path, raw_file):
    def rename(h):
        h["layers"][0]["value"]["segments"][0]["codec"]["id"] = "fancy9"

    rewrite_header(raw_file, tmp_path / "u.kvz", rename)
    result = runner.invoke(cli, ["inspect", str(tmp_path / "u.kvz"), "--verify"])
    line = one_line_error(result, 4)
    assert "fancy9" in line and "plugin" in line
    result = runner.invoke(cli, ["decompress", str(tmp_path / "u.kvz"), "-o",
                                 str(tmp_path / "d.kvz")])
    line = one_line_error(result, 4)
    assert "fancy9" in line and "plugin" in line
    assert not (tmp_path / "d.kvz").exists()


def test_debug_env_shows_the_exception(runner, tmp_path):
    (tmp_path / "bad.kvz").write_bytes(b"\x00" * 64)
    result = runner.invoke(cli, ["inspect", str(tmp_path / "bad.kvz")],
                           env={"KVTOOL_DEBUG": "1"})
    assert isinstance(result.exception, FormatError)


def test_compress_and_decompress(runner, tmp_path, raw_file):
    out = tmp_path / "small.kvz"
    result = runner.invoke(cli, ["compress", str(raw_file), "--codec", "turbo3",
                                 "--key-codec", "turbo4", "--protect-layers", "1",
                                 "--sink-tokens", "2", "--recent-tokens", "2", "--zstd",
                                 "-o", str(out)])
    assert result.exit_code == 0, result.stderr
    assert "wrote" in result.stdout and "k=turbo4 v=turbo3 protect=1 sink=2 recent=2" \
        in result.stdout
    assert out.stat().st_size < raw_file.stat().st_size
    with open_kvz(out) as f:
        assert f.header["layers"][1]["key"]["segments"][1]["codec"]["id"] == "turbo4"

    back = tmp_path / "back.kvz"
    result = runner.invoke(cli, ["decompress", str(out), "--dtype", "fp32", "-o", str(back),
                                 "--json"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["num_layers"] == 3
    cache = load(back)
    assert cache.dtype == "float32" and cache.num_tokens == 16
    assert load(raw_file).model == cache.model


def test_compress_errors(runner, tmp_path, raw_file):
    result = runner.invoke(cli, ["compress", str(raw_file), "-o", str(tmp_path / "x.kvz")])
    assert result.exit_code == 2
    result = runner.invoke(cli, ["compress", str(raw_file), "--codec", "nope",
                                 "-o", str(tmp_path / "x.kvz")])
    assert "nope" in one_line_error(result, 3)
    assert not (tmp_path / "x.kvz").exists()
    for extra, message in ((["--zstd-level", "9"], "--zstd-level needs --zstd"),
                           (["--sink-tokens", str(10**24)], "0<=x<=2147483647")):
        result = runner.invoke(cli, ["compress", str(raw_file), "--codec", "turbo3", *extra,
                                     "-o", str(tmp_path / "x.kvz")])
        assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "x.kvz").exists()
    result = runner.invoke(cli, ["compress", str(raw_file), "--codec", "turbo3", "--zstd",
                                 "--zstd-level", "9", "-o", str(tmp_path / "x.kvz")])
    assert result.exit_code == 0, result.output


def test_help_lists_commands_and_exit_codes(runner):
    result = runner.invoke(cli, ["--help"])
    assert result.exit_code == 0
    for needle in ("inspect", "compress", "decompress", "Exit codes", "file format error"):
        assert needle in result.stdout


def test_cli_startup_imports_no_heavy_modules():
    code = ("import sys\n"
            "from kvtool.cli.main import cli\n"
            "try:\n    cli(['--help'], prog_name='kvtool')\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'numpy', 'transformers', 'kvtool.formats') "
            "if m in sys.modules]\n"
            "print('HEAVY', heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "HEAVY []" in out, out


def test_the_cli_bounds_head_dim_as_files_do():
    """``kvtool codecs`` keeps its own copy of the bound (the formats package imports numpy)."""
    from kvtool.cli import codecs as codecs_cli
    from kvtool.formats import constants

    assert codecs_cli.MAX_HEAD_DIM == constants.MAX_HEAD_DIM
