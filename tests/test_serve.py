"""``kvtool serve``: the engine command line it builds, pins checked before start, and a real
vLLM server that answers and fills the store."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from kvtool.cli.main import cli


def dry_run(runner, *args: str) -> dict:
    out = runner.invoke(cli, ["serve", "--dry-run", "--json", *args])
    assert out.exit_code == 0, out.output
    return json.loads(out.output)


def test_command_line_has_connector_cpu_defaults_and_passthrough(runner, tmp_path):
    plan = dry_run(runner, "--store", str(tmp_path), "--port", "8123", "--codec", "raw",
                   "--max-store-bytes", "1GB", "--", "--max-num-seqs", "3")
    argv = plan["argv"]
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    extra = transfer["kv_connector_extra_config"]
    assert transfer["kv_connector"] == "KvtoolConnector"
    assert (extra["store_path"], extra["codec"], extra["max_bytes"]) == (str(tmp_path), "raw",
                                                                        "1GB")
    assert argv[argv.index("--port") + 1] == "8123"
    assert argv[-2:] == ["--max-num-seqs", "3"]  # passed through, last
    assert "--enforce-eager" in argv and "--kv-cache-memory-bytes" in argv  # no CUDA here
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    assert plan["url"] == "http://127.0.0.1:8123/v1" and plan["policy"] == "raw"
    own = dry_run(runner, "--", "--kv-cache-memory-bytes", "123")["argv"]
    assert own.count("--kv-cache-memory-bytes") == 1  # the user's own value wins


def test_pins_of_another_dtype_are_refused_with_the_fix(runner, loaded, tmp_path):
    from kvtool.engines.hf import capture
    from kvtool.formats import save

    cache = capture(loaded.model, loaded.tokenizer, "A pinned system prompt.",
                    model_info=loaded.info)
    pin = str(tmp_path / "system.kvz")
    save(cache, pin)
    out = runner.invoke(cli, ["serve", "--dry-run", "--pin", pin])
    assert out.exit_code == 5
    assert "captured as float32" in out.output and "--dtype bfloat16" in out.output
    assert "Traceback" not in out.output
    plan = dry_run(runner, "--dtype", "float32", "--pin", pin)
    assert plan["connector"]["kvz_files"] == [os.path.realpath(pin)]
    bad = runner.invoke(cli, ["serve", "--dry-run", "--max-store-bytes", "lots"])
    assert bad.exit_code != 0 and "not a size" in bad.output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise AssertionError(f"HTTP {e.code}: {e.read()[:500]!r}") from None


def test_a_real_server_answers_and_fills_the_store(tmp_path):
    pytest.importorskip("vllm")
    store, port = tmp_path / "store", _free_port()
    kvtool = shutil.which("kvtool", path=os.path.dirname(sys.executable))
    log = open(tmp_path / "server.log", "w")
    env = {k: v for k, v in os.environ.items()  # what kvtool's in-process engine quietens
           if k not in ("VLLM_LOGGING_LEVEL", "KVTOOL_LOG_LEVEL",
                        "VLLM_ENABLE_V1_MULTIPROCESSING")}
    proc = subprocess.Popen([kvtool, "serve", "--store", str(store), "--port", str(port),
                             "--codec", "raw", "--max-model-len", "1024"], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}/v1"
        deadline = time.time() + 240
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{base}/models", timeout=5) as r:
                    name = json.loads(r.read())["data"][0]["id"]
                break
            except OSError:
                assert time.time() < deadline, "server did not start"
                time.sleep(2)
        prompt = " ".join(f"word{i}" for i in range(120))  # ~400 tokens: one chunk
        out = _post(f"{base}/completions", {"model": name, "prompt": prompt, "max_tokens": 4,
                                             "temperature": 0})
        assert out["choices"][0]["text"]
        for _ in range(60):  # the connector writes in the background
            if list(store.rglob("*.kvz")):
                break
            time.sleep(1)
        assert list(store.rglob("*.kvz")), "the server stored no chunk"
        text = (tmp_path / "server.log").read_text()
        for _ in range(20):  # logs visible at INFO without any logging setup
            if "kvtool store: saved" in text:
                break
            time.sleep(0.5)
            text = (tmp_path / "server.log").read_text()
        assert "kvtool store: miss" in text and "kvtool store: saved" in text
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
