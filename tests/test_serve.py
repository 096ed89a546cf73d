"""``kvtool serve``: the engine command line it builds, pins checked before start, the store's
metrics (vLLM's connector stats → Prometheus, per-process files → ``kvtool store stats``), and
real servers with the default policy (the ``quality`` preset, compiled kernels) driven by the
``openai`` client: cold, shared-prefix, concurrent, and after a restart served from the store
(every other policy's restart: tests/test_serve_restart.py).

The real servers start twice for the whole module (each start takes 30-70 s on a 2-core CPU):
``server_a`` serves the cold, shared-prefix and concurrent requests, then ``server_b`` replaces
it on the same store.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import time
from pathlib import Path

import pytest
from serve_util import Server

from kvtool.cli.main import cli


def dry_run(runner, *args: str) -> dict:
    out = runner.invoke(cli, ["serve", "--dry-run", "--json", *args])
    assert out.exit_code == 0, out.output
    return json.loads(out.output)


def test_a_port_in_use_is_refused_before_the_engine_starts(runner, monkeypatch):
    """A server on a taken port loaded its model, then died with a traceback."""
    import socket

    def started(*args):
        raise AssertionError("the engine was started")

    monkeypatch.setattr(os, "execve", started)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for engine in ("mlx", "vllm"):
            out = runner.invoke(cli, ["serve", "--engine", engine, "--port", port])
            assert out.exit_code == 1 and f"--port {port}: cannot listen there" in out.output, \
                out.output
        assert dry_run(runner, "--port", port)["url"].endswith(f":{port}/v1")  # (a dry run)


def test_command_line_has_connector_cpu_defaults_and_passthrough(runner, tmp_path):
    plan = dry_run(runner, "--store", str(tmp_path), "--port", "8123", "--codec", "raw",
                   "--max-store-bytes", "1GB", "--store-timeout", "0.5", "--",
                   "--max-num-seqs", "3")
    argv = plan["argv"]
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    extra = transfer["kv_connector_extra_config"]
    assert transfer["kv_connector"] == "KvtoolConnector"
    assert (extra["store_path"], extra["codec"], extra["max_bytes"]) == (str(tmp_path), "raw",
                                                                        "1GB")
    assert extra["store_timeout"] == 0.5
    assert argv[argv.index("--port") + 1] == "8123"
    at = argv.index("--served-model-name")  # the model's name answers, and "default" too
    assert argv[at + 1:at + 3] == ["SmolLM2-135M-Instruct", "default"]
    assert argv[-2:] == ["--max-num-seqs", "3"]  # passed through, last
    assert "--enforce-eager" in argv and "--kv-cache-memory-bytes" in argv  # no CUDA here
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    assert plan["url"] == "http://127.0.0.1:8123/v1" and plan["policy"] == "raw"
    assert plan["lossy"] is False
    assert dry_run(runner, "--codec", "turbo3")["lossy"] is True
    own = dry_run(runner, "--", "--kv-cache-memory-bytes", "123")["argv"]
    assert own.count("--kv-cache-memory-bytes") == 1  # the user's own value wins
    assert argv[argv.index("--shutdown-timeout") + 1] == "30"  # queued saves finish on stop
    own = dry_run(runner, "--", "--shutdown-timeout=0")["argv"]
    assert "--shutdown-timeout" not in own and own[-1] == "--shutdown-timeout=0"


def test_a_count_of_zero_replaces_the_presets_in_serve_and_store_pin(runner, tmp_path):
    """``--preset balanced --sink-tokens 0`` kept the preset's 4 sinks in the server, while
    ``store pin`` wrote chunks without them."""
    plan = dry_run(runner, "--store", str(tmp_path), "--preset", "balanced", "--sink-tokens",
                   "0")
    argv = plan["argv"]
    extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra["sink_tokens"] == 0 and "sink=" not in plan["policy"]
    assert "sink=4" in dry_run(runner, "--preset", "balanced")["policy"]
    mlx = runner.invoke(cli, ["serve", "--engine", "mlx", "--dry-run", "--json", "--preset",
                              "balanced", "--sink-tokens", "0"])
    if importlib.util.find_spec("mlx_lm") is not None:  # (a dependency CI installs)
        assert mlx.exit_code == 0, mlx.output
        assert "sink=" not in json.loads(mlx.output)["policy"]


def test_a_store_that_is_a_file_or_under_one_is_refused(runner, tmp_path):
    (tmp_path / "file.kvz").write_bytes(b"x")
    for store, message in ((tmp_path / "file.kvz", "not a directory"),
                           (tmp_path / "file.kvz" / "x", "cannot be created or written here")):
        out = runner.invoke(cli, ["serve", "--dry-run", "--store", str(store)])
        assert out.exit_code != 0 and message in out.output, out.output
        assert len(out.output.strip().splitlines()) == 1


def test_a_store_that_cannot_be_created_is_refused_before_the_engine_starts(
        runner, tmp_path, monkeypatch):
    """What ``os.access`` cannot tell (root on /proc, a stale mount) is found by creating the
    store before the engine starts; a dry run creates nothing."""
    import os
    import socket

    store = tmp_path / "new" / "store"
    with socket.socket() as probe:  # a port free now (a privileged one needs root)
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])

    def refuse(path, *args, **kwargs):
        raise OSError(2, "No such file or directory", str(path))

    def never(*args):
        raise AssertionError("the engine started")

    assert runner.invoke(cli, ["serve", "--dry-run", "--store", str(store)]).exit_code == 0
    assert not store.exists()
    monkeypatch.setattr(os, "makedirs", refuse)
    monkeypatch.setattr(os, "execve", never)
    for engine in ("vllm", "mlx"):
        out = runner.invoke(cli, ["serve", "--engine", engine, "--port", port,
                                  "--store", str(store)])
        assert out.exit_code != 0, out.output
        assert f"--store {store}: cannot be created (No such file" in out.output, out.output


def test_pins_of_another_dtype_are_cast_and_of_another_model_refused(runner, loaded,
                                                                      tmp_path):
    import dataclasses

    from kvtool.engines.hf import capture
    from kvtool.formats import save
    from kvtool.identity import canonical_sha256

    cache = capture(loaded.model, loaded.tokenizer, "A pinned system prompt.",
                    model_info=loaded.info)
    pin, other = str(tmp_path / "system.kvz"), str(tmp_path / "other.kvz")
    save(cache, pin)
    plan = dry_run(runner, "--pin", pin)  # a float32 capture, a bfloat16 server
    assert plan["connector"]["kvz_files"] == [os.path.realpath(pin)]
    assert "computed in float32" in plan["notes"][0] and "bfloat16" in plan["notes"][0]
    assert dry_run(runner, "--dtype", "float32", "--pin", pin)["notes"] == []
    os.symlink(pin, tmp_path / "link.kvz")  # one file, given twice: served once
    twice = dry_run(runner, "--dtype", "float32", "--pin", pin, "--pin", str(tmp_path / "link.kvz"))
    assert twice["pins"] == [os.path.realpath(pin)] == twice["connector"]["kvz_files"]
    lossy = str(tmp_path / "lossy.kvz")  # under a lossless policy: the plan says lossy
    save(cache, lossy, codec="turbo3")
    plan = dry_run(runner, "--dtype", "float32", "--codec", "raw", "--pin", lossy)
    assert plan["lossy"] and plan["policy"] == "raw"
    assert plan["notes"] == [f"--pin {lossy}: stored lossy; answers that reuse it may differ "
                             "slightly from a cold run"]
    assert not dry_run(runner, "--dtype", "float32", "--codec", "raw", "--pin", pin)["lossy"]
    layout = {**cache.model["layout"], "rope_theta": 1.0}  # another model's identity
    save(dataclasses.replace(cache, model={**cache.model, "layout": layout,
                                           "fingerprint": canonical_sha256(layout)}), other)
    out = runner.invoke(cli, ["serve", "--dry-run", "--pin", other])
    assert out.exit_code == 5 and "belongs to another model" in out.output, out.output
    assert "Traceback" not in out.output
    bad = runner.invoke(cli, ["serve", "--dry-run", "--store", str(tmp_path / "s"),
                              "--max-store-bytes", "lots"])
    assert bad.exit_code != 0 and "not a size" in bad.output


def test_a_dry_run_refuses_what_the_server_would_refuse_or_ignore(runner, loaded, tmp_path,
                                                                   monkeypatch):
    """Each refused with one line before vLLM starts: a store bound of 0 or without a store, a
    context past the model's positions (unless vLLM's override is set), a store path that
    holds files but no store, a pin the connector would not serve; a pin longer than a prompt
    can be gets a note."""
    import dataclasses

    from kvtool.engines.hf import capture
    from kvtool.formats import save

    def refused(*args: str) -> str:
        out = runner.invoke(cli, ["serve", "--dry-run", *args])
        assert out.exit_code != 0, out.output
        assert len(out.output.strip().splitlines()) == 1 and "Traceback" not in out.output
        return out.output

    store = str(tmp_path / "store")
    assert "1MB or more" in refused("--store", store, "--max-store-bytes", "0")
    assert "1MB or more" in refused("--store", store, "--max-store-bytes", "1B")
    tiny = runner.invoke(cli, ["serve", "--dry-run", "--store", store, "--store-timeout",
                               "1e-300"])  # every lookup would time out: a usage error
    assert tiny.exit_code == 2 and "0.001<=x<=3600" in tiny.output, tiny.output
    assert "give --store" in refused("--max-store-bytes", "2GB")
    assert "--store is empty" in refused("--store", "")
    assert "--host is empty" in refused("--host", "")
    for host in ("bad!host", "999.1.1.1"):  # mlx_lm.server hung on one after a traceback
        assert "not an address to listen on" in refused("--host", host)
        assert "not an address to listen on" in refused("--engine", "mlx", "--host", host)
    assert "sets --kv-transfer-config itself" in refused("--", "--kv-transfer-config", "{}")
    for dotted in ("--kv-transfer-config.kv_role", "--kv_transfer_config.kv_connector_extra_"
                   "config.store_path"):  # vLLM reads either as a whole new config
        assert "sets --kv-transfer-config itself" in refused("--store", store, "--", dotted, "x")
    for url in ("gs://bucket/x", "S3://bucket/x", "https://host/x"):  # never ./gs:/bucket/x
        assert "is not supported" in refused("--store", url)
        assert "is not supported" in refused("--store", url, "--json")
    assert "random" in refused("--store", store, "--", "--load-format", "dummy")
    assert "random" in refused("--store", store, "--", "--load_format=dummy")
    assert "--load-format" in dry_run(runner, "--", "--load-format", "dummy")["argv"]
    assert "give kvtool serve --max-model-len" in refused("--", "--max-model", "9")  # abbrev.
    assert "give kvtool serve --port" in refused("--", "--port=9")
    assert "--max-model-len instead" in refused("--", "--max_model_len", "999999")
    assert "give --store" in refused("--store-timeout", "2")
    for fp8 in (["--kv-cache-dtype", "fp8"], ["--kv_cache_dtype=fp8_e5m2"],
                ["--kv-cache-d", "fp8_e4m3"]):  # rounded K/V: never filed as exact
        assert "lossless store policy" in refused("--store", store, "--codec", "raw", "--", *fp8)
        assert fp8[-1] in dry_run(runner, "--store", store, "--", *fp8)["argv"][-1]
    assert "kvtool reads fp8 (e4m3, e5m2)" in refused("--store", store, "--",
                                                      "--kv-cache-dtype", "fp8_inc")
    assert "--kv-cache-dtype" in dry_run(runner, "--", "--kv-cache-dtype", "fp8")["argv"]
    for parallel in (["-tp", "2"], ["--tensor-parallel-size=4"], ["-pp", "2"],
                     ["--pipeline_parallel_size", "2"], ["-pcp", "2"],
                     ["--decode-context-parallel-size", "2"]):  # each worker: part of a chunk
        assert "one worker per engine" in refused("--store", store, "--", *parallel), parallel
    bare = dry_run(runner, "--", "-tp", "2")["argv"]  # no store: vLLM's business, and no
    assert "-tp" in bare and "--kv-transfer-config" not in bare  # connector to refuse it
    yaml_file = tmp_path / "engine.yaml"  # vLLM's --config: its arguments count too
    yaml_file.write_text("tensor-parallel-size: 2\nmax-num-seqs: 4\n")
    assert "one worker per engine" in refused("--store", store, "--", "--config", str(yaml_file))
    argv = dry_run(runner, "--store", store, "--", "--config", str(yaml_file), "-tp", "1")["argv"]
    assert argv[-4:] == ["--config", str(yaml_file), "-tp", "1"]  # passed on as given
    assert dry_run(runner, "--store", store, "--", "-tp", "1")["store"] == store
    assert dry_run(runner, "--store", store, "--", "--kv-cache-dtype", "auto")["store"] == store
    assert "8192 positions" in refused("--max-model-len", "8193")
    argv = dry_run(runner, "--max-model-len", "8192")["argv"]
    assert argv[argv.index("--max-model-len") + 1] == "8192"  # the model's own length
    yarn = json.dumps({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                        "original_max_position_embeddings": 8192}})
    argv = dry_run(runner, "--max-model-len", "32768", "--", "--hf-overrides", yarn)["argv"]
    assert argv[argv.index("--max-model-len") + 1] == "32768"  # vLLM stretches it: not ours
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    argv = dry_run(runner, "--max-model-len", "10000")["argv"]
    assert argv[argv.index("--max-model-len") + 1] == "10000"
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN")
    junk = tmp_path / "home"
    (junk / "notes").mkdir(parents=True)
    (junk / "todo.txt").write_text("x")
    assert "holds no kvtool store" in refused("--store", str(junk))
    assert dry_run(runner, "--store", str(tmp_path / "new"))["store"] == str(tmp_path / "new")
    text = " ".join(["A pinned system prompt that runs past a short context."] * 3)
    cache = capture(loaded.model, loaded.tokenizer, text, model_info=loaded.info)
    assert cache.num_tokens > 16
    pin, bare = str(tmp_path / "system.kvz"), str(tmp_path / "bare.kvz")
    save(cache, pin)
    save(dataclasses.replace(cache, token_ids=None), bare)
    assert "stores no token ids" in refused("--pin", bare)
    other_tok, big_id, damaged = (str(tmp_path / f"{n}.kvz") for n in ("tok", "id", "bad"))
    save(dataclasses.replace(cache, tokenizer_fingerprint="0" * 64), other_tok)
    ids = cache.token_ids.copy()
    ids[-1] = 10**9
    save(dataclasses.replace(cache, token_ids=ids), big_id)
    data = bytearray(open(pin, "rb").read())
    data[-100] ^= 0xFF  # in the last tensor's bytes: the header still opens
    open(damaged, "wb").write(bytes(data))
    assert "another tokenizer" in refused("--pin", other_tok)
    assert "token id 1000000000" in refused("--pin", big_id)
    assert "damaged" in refused("--pin", damaged)
    # an identity without its layout fields (as older files) names the model's fingerprint:
    # the layers' own shapes must still be the served model's
    bare_model = {k: v for k, v in cache.model.items()
                  if k not in ("layout", "num_layers", "num_kv_heads", "head_dim")}
    halved = [a.reshape(a.shape[0] * 2, a.shape[1], a.shape[2] // 2) for a in cache.keys]
    for name, wrong, message in (
            ("heads", dataclasses.replace(cache, model=bare_model, keys=halved,
                                          values=[a.clone() for a in halved]),
             "layer 0 holds 6 KV heads × head_dim 32, the model 3 × 64"),
            ("layers", dataclasses.replace(cache, model=bare_model, keys=cache.keys[:-1],
                                           values=cache.values[:-1]),
             "29 layers, the model has 30")):
        save(wrong, tmp_path / f"{name}.kvz")
        assert message in refused("--pin", str(tmp_path / f"{name}.kvz")), name
    # weights vLLM quantizes as it loads them are another model's: its K/V differ
    assert cache.model["weights"]
    for quantized in (["--quantization", "fp8"], ["-q", "fp8"], ["-qfp8"], ["--quant=fp8"]):
        assert "other weights" in refused("--pin", pin, "--", *quantized), quantized
    notes = dry_run(runner, "--dtype", "float32", "--max-model-len", "16", "--pin", pin)["notes"]
    assert len(notes) == 1 and "reach --max-model-len 16" in notes[0], notes
    # the config vLLM runs, with --hf-overrides: another RoPE is another model for a pin
    yarn = json.dumps({"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                        "original_max_position_embeddings": 8192}})
    assert "another model" in refused("--pin", pin, "--", "--hf-overrides", yarn)
    assert "another model" in refused("--pin", pin, "--", f"--hf-overrides={yarn}")
    (tmp_path / "yarn.yaml").write_text("hf-overrides: " + yarn + "\n")
    assert "another model" in refused("--pin", pin, "--", "--config", str(tmp_path / "yarn.yaml"))
    same = json.dumps({"max_position_embeddings": 8192})
    assert dry_run(runner, "--pin", pin, "--", "--hf-overrides", same)["pins"]
    argv = dry_run(runner, "--", "--hf-overrides", json.dumps({"num_key_value_heads": 1}))["argv"]
    budget = int(argv[argv.index("--kv-cache-memory-bytes") + 1])
    base = dry_run(runner)["argv"]
    assert int(base[base.index("--kv-cache-memory-bytes") + 1]) - (64 << 20) == \
        3 * (budget - (64 << 20))  # the default model's 3 KV heads, overridden to 1
    for dotted in (["--hf-overrides.num_key_value_heads", "1"],
                   ["--hf_overrides.num_key_value_heads=1"]):  # vLLM's dotted form
        argv = dry_run(runner, "--", *dotted)["argv"]
        assert int(argv[argv.index("--kv-cache-memory-bytes") + 1]) == budget, dotted
    fp8 = dry_run(runner, "--", "--kv-cache-dtype", "fp8")["argv"]  # one byte a cached value
    assert 2 * (int(fp8[fp8.index("--kv-cache-memory-bytes") + 1]) - (64 << 20)) == \
        int(base[base.index("--kv-cache-memory-bytes") + 1]) - (64 << 20)
    assert "another model" in refused("--pin", pin, "--", "--hf-overrides.rope_scaling.rope_type",
                                      "yarn", "--hf-overrides.rope_scaling.factor", "4.0",
                                      "--hf-overrides.rope_scaling.original_max_position_"
                                      "embeddings", "8192")


# -- metrics without a server ---------------------------------------------------------------------
def test_connector_stats_reach_prometheus_once_per_change():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from prometheus_client.parser import text_string_to_metric_families

    from kvtool.engines.vllm import activity
    from kvtool.engines.vllm.metrics import KvtoolPromMetrics, MetricsMixin

    class Config:  # the parts of a VllmConfig the metrics read
        class kv_transfer_config:  # noqa: N801
            kv_connector_extra_config = {"key_codec": "kivi4", "value_codec": "turbo3"}

        class model_config:  # noqa: N801
            dtype = "torch.bfloat16"

    registry = CollectorRegistry()
    types = {cls: _in_registry(cls, registry) for cls in (Counter, Gauge, Histogram)}
    prom = KvtoolPromMetrics(Config, types, ["model_name", "engine"], {0: ["m", "0"]})
    connector = MetricsMixin()
    connector.get_kv_connector_stats()  # drop what earlier tests of this process counted
    activity.lookup("a", 512, 600, 2, 0.004)
    activity.lookup("b", 0, 300, 0, 0.002)
    activity.observe("load", 0.02)
    worker = connector.get_kv_connector_stats()
    assert connector.get_kv_connector_stats() is None  # drained once, however many halves
    activity.record("bytes_loaded", 1000)
    activity.observe("save", 0.5)
    payload = MetricsMixin.build_kv_connector_stats(worker.to_dict())
    payload.aggregate(connector.get_kv_connector_stats())  # vLLM: worker + scheduler halves
    assert payload.reduce()["requests_hit"] == 1 and payload.reduce()["load_ms_avg"] == 20.0
    prom.observe(payload.to_dict(), 0)
    samples = {(s.name, s.labels.get("result") or s.labels.get("lossy")): s.value
               for f in text_string_to_metric_families(_exposition(registry)) for s in f.samples}
    assert samples[("kvtool_store_requests_total", "hit")] == 1
    assert samples[("kvtool_store_requests_total", "miss")] == 1
    assert samples[("kvtool_store_prompt_tokens_total", "hit")] == 512
    assert samples[("kvtool_store_prompt_tokens_total", "miss")] == 300 + 88
    assert samples[("kvtool_store_loaded_bytes_total", None)] == 1000
    assert samples[("kvtool_store_load_seconds_count", None)] == 1
    assert samples[("kvtool_store_lookup_seconds_count", None)] == 2
    assert samples[("kvtool_store_save_seconds_sum", None)] == 0.5
    assert samples[("kvtool_store_policy_info", "true")] == 1


def _in_registry(cls, registry):
    """``cls`` registering into ``registry`` (a test's own, not the process's)."""
    return lambda *a, **kw: cls(*a, registry=registry,
                                **{k: v for k, v in kw.items() if k != "multiprocess_mode"})


def _exposition(registry) -> str:
    from prometheus_client import generate_latest

    return generate_latest(registry).decode()


def test_policy_lossiness():
    from kvtool.policy import CodecPolicy

    assert not CodecPolicy.from_options(codec="raw").is_lossy("bfloat16")
    assert CodecPolicy.from_options(codec="raw:dtype=float16").is_lossy("bfloat16")
    assert CodecPolicy.from_options(key_codec="raw", value_codec="turbo3").is_lossy("bfloat16")


def test_store_stats_sum_every_process_file(runner, tmp_path):
    from kvtool.engines.vllm import activity
    from kvtool.engines.vllm.stats_files import StatsWriter
    from kvtool.policy import CodecPolicy

    class Store:  # what the writer needs of a PrefixStore
        root = tmp_path
        policy = CodecPolicy.from_options(codec="turbo3")

    writers = [StatsWriter(Store, "turbo3", True, interval=0) for _ in range(2)]
    activity.record("requests_hit", 3)
    activity.record("bytes_loaded", 4096)
    activity.observe("load", 0.25)
    for w in writers:  # two processes' files (here: the same counters twice)
        assert w.write()
    (tmp_path / "stats" / "junk.json").write_text("{not json")
    os.symlink(tmp_path / "stats" / writers[0].name, tmp_path / "stats" / "link.json")
    out = runner.invoke(cli, ["store", "stats", "--json", str(tmp_path)])
    assert out.exit_code == 0, out.output
    got = json.loads(out.output)["activity"]
    assert got["processes"] == 2 and got["unreadable"] == 2  # the junk and the symlink
    assert got["counters"]["requests_hit"] == 6 and got["counters"]["bytes_loaded"] == 8192
    assert got["counters"]["load_count"] == 2 and got["policies"] == {"turbo3": True}
    text = runner.invoke(cli, ["store", "stats", str(tmp_path)]).output
    assert "6 hit" in text and "avg 250 ms" in text and "turbo3 (lossy)" in text


# -- real servers ----------------------------------------------------------------------------------
PREFIX = " ".join(f"shared{i}" for i in range(160))  # ~600 tokens: two stored chunks
COLD = PREFIX + " The end of the first document."


def default_policy() -> str:
    from kvtool.engines.vllm.common import policy_from_extra

    return policy_from_extra({}).describe()


def _chunks(store: Path) -> list[Path]:
    return sorted(p for p in store.rglob("*.kvz") if "quarantine" not in p.parts)


@pytest.fixture(scope="module")
def server_a(tmp_path_factory):
    pytest.importorskip("vllm")
    pytest.importorskip("openai")
    tmp = tmp_path_factory.mktemp("serve")
    server = Server(tmp / "store", tmp / "a.log").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cold(server_a):
    """The cold request's text, once its chunks are stored."""
    text = server_a.complete(COLD)
    for _ in range(60):  # the connector writes in the background
        if len(_chunks(server_a.store)) >= 2:
            break
        time.sleep(1)
    return text


def test_cold_request_misses_then_fills_the_store(server_a, cold):
    assert cold.strip()
    assert len(_chunks(server_a.store)) >= 2, server_a.log.read_text()[-3000:]
    assert server_a.wait_metric("kvtool_store_requests_total", 1, result="miss") >= 1
    server_a.complete("Hi.", max_tokens=1)  # async saves show with the engine's next step
    assert server_a.wait_metric("kvtool_store_saved_chunks_total", 2) >= 2
    policy = default_policy()
    assert server_a.metric("kvtool_store_policy_info", policy=policy, lossy="true") == 1
    text = server_a.log.read_text()  # visible at INFO without any logging setup
    assert "kvtool store: miss" in text and "kvtool store: saved" in text
    assert f"policy {policy} is lossy" in text


def test_shared_prefix_request_hits_the_store(server_a, cold):
    before = server_a.metric("kvtool_store_prompt_tokens_total", result="hit")
    assert server_a.complete(PREFIX + " A different ending, the second document.").strip()
    after = server_a.wait_metric("kvtool_store_prompt_tokens_total", before + 512, result="hit")
    assert after - before >= 512  # the shared prefix's two chunks


def test_requests_may_name_the_model_default(server_a):
    """As the README's examples and the mlx engine: "default" is the served model."""
    out = server_a.client().completions.create(model="default", prompt="Hello", max_tokens=2)
    assert out.model == server_a.model != "default" and out.choices[0].text


def test_eight_concurrent_requests_succeed(server_a, cold):
    client = server_a.client(__import__("openai").AsyncOpenAI)

    async def one(i: int) -> str:
        out = await client.completions.create(
            model=server_a.model, prompt=f"{PREFIX} Question {i}: what is {i} plus {i}?",
            max_tokens=8, temperature=0)
        return out.choices[0].text

    async def run() -> list:
        return await asyncio.gather(*(one(i) for i in range(8)), return_exceptions=True)

    before = server_a.metric("kvtool_store_requests_total", result="hit")
    answers = asyncio.run(run())
    assert not [a for a in answers if isinstance(a, BaseException)], answers
    assert all(a.strip() for a in answers)
    assert server_a.wait_metric("kvtool_store_requests_total", before + 8, result="hit") \
        >= before + 8


@pytest.fixture(scope="module")
def server_b(server_a, cold):
    """A new server on server A's store, after A stopped."""
    server_a.stop()
    server = Server(server_a.store, server_a.log.with_name("b.log")).start()
    yield server
    server.stop()


def test_restart_serves_from_the_store_and_keeps_serving(server_b, cold):
    """The default policy runs the compiled kernels inside vLLM's worker: a load used to
    change the worker's OpenMP thread count, and vLLM's CPU attention aborted the engine."""
    assert server_b.complete(COLD).strip()  # lossy policy: text may differ from cold
    assert server_b.wait_metric("kvtool_store_requests_total", 1, result="hit") >= 1
    assert server_b.wait_metric("kvtool_store_loaded_tokens_total", 512) >= 512
    assert server_b.metric("kvtool_store_loaded_bytes_total") > 0
    assert server_b.metric("kvtool_store_load_seconds_count") >= 1
    assert server_b.metric("kvtool_store_failures_total") == 0
    assert "kvtool store: loaded" in server_b.log.read_text()
    for prompt in (COLD, PREFIX + " Another ending after the restart."):  # later requests
        assert server_b.complete(prompt).strip()
    assert server_b.alive(), server_b.log.read_text()[-3000:]


def test_store_stats_count_both_servers(runner, server_b):
    from kvtool.engines.vllm.stats_files import store_activity

    for _ in range(30):  # each process rewrites its file every 5 s while its counters change
        if store_activity(server_b.store)["counters"]["requests_hit"] >= 10:
            break
        time.sleep(1)
    server_b.stop()
    out = runner.invoke(cli, ["store", "stats", "--json", str(server_b.store)])
    assert out.exit_code == 0, out.output
    activity = json.loads(out.output)["activity"]
    counters = activity["counters"]
    assert activity["processes"] >= 2 and activity["policies"] == {default_policy(): True}
    assert counters["requests_hit"] >= 10 and counters["requests_missed"] >= 1
    assert counters["tokens_loaded"] >= 512 and counters["chunks_saved"] >= 2
    assert counters["load_failures"] == counters["save_failures"] == 0
    # both servers exited through SIGTERM: their files say "ended", and prune folds them
    pruned = runner.invoke(cli, ["store", "prune", "--json", str(server_b.store)])
    assert json.loads(pruned.output)["folded_stats_files"] == activity["processes"]
    again = json.loads(runner.invoke(cli, ["store", "stats", "--json", str(server_b.store)])
                       .output)["activity"]
    assert again["counters"] == counters and again["folded"] == activity["processes"]


def test_connector_options_are_checked_and_presets_honoured():
    from kvtool.engines.vllm.common import DEFAULT_PRESET, policy_from_extra
    from kvtool.engines.vllm.options import check_extra
    from kvtool.errors import CodecError, KvtoolError
    from kvtool.presets import preset_policy

    assert policy_from_extra({}) == preset_policy(DEFAULT_PRESET)
    assert policy_from_extra({"preset": "balanced"}) == preset_policy("balanced")
    assert policy_from_extra({"codec": "raw"}).describe() == "raw"
    assert policy_from_extra({"sink_tokens": 0}).sink_tokens == 0  # explicit 0 is kept
    with pytest.raises(CodecError, match="unknown preset"):
        policy_from_extra({"preset": "tiny"})
    check_extra({"store_path": "/x", "preset": "small", "max_bytes": "1G"})
    with pytest.raises(KvtoolError, match="'codek'; did you mean 'codec'"):
        check_extra({"codek": "turbo3"})


def test_the_plan_keys_online_quantization_as_the_connector_does():
    """``--quantization-config`` (JSON or dotted) makes vLLM quantize other layers or another
    way: other K/V, so another ``model.weights``. The plan computes it from the engine's
    arguments exactly as the connector does from vLLM's parsed and resolved config; the plain
    ``--quantization`` method keeps its earlier identity."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from kvtool.engines.vllm.serve import _quantization_method
    from kvtool.engines.vllm.served_model import quantization_method

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    ignore = json.dumps({"ignore": ["lm_head"]})
    methods = {}
    for args in (["-q", "fp8"], ["--quantization", "fp8", "--quantization-config", ignore],
                 ["-q", "fp8", "--quantization-config.ignore", '["lm_head"]'],
                 ["-q", "fp8", f"--quantization_config={ignore}"],
                 ["-q", "fp8", "--quantization-config", json.dumps({"linear": "fp8_per_block"})]):
        engine = EngineArgs.from_cli_args(parser.parse_args(["--model", "m", *args]))
        want = quantization_method(engine.quantization, engine.quantization_config)
        assert _quantization_method(tuple(args)) == want, args
        methods[" ".join(args)] = want
    assert methods["-q fp8"] == "fp8"
    assert len(set(methods.values())) == 3  # plain; ignoring lm_head (three spellings); per-block
