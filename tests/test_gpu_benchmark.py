"""``benchmarks/gpu.py`` runs every section: ``--device cpu --smoke`` (tiny sizes, CPU tensors
under the Triton interpreter) in a fresh process prints each table's header and rows and writes
finite results to ``--json``; its parallel warm-up tasks are valid command lines."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("torch")
pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import gpu  # noqa: E402  (benchmarks/gpu.py; imports neither torch nor triton)
from gpu_common import Budget, Clock, Deadline  # noqa: E402

TITLES = {
    "throughput": "turbo encode (fp16 in) / decode (fp16 out): GB/s",
    "dtypes": "turbo3 by dtype, D=128",
    "attention": "decode attention (one query per sequence), Hq=4 Hkv=2 D=64",
    "presets": "presets through the codec API",
    "cache": "DynamicCache vs CompressedCache: random-init Llama, 2 layers, hidden 64",
}
ROW_KEYS = {
    "throughput": {"dim", "vectors", "copy_gbs", "encode_turbo3_gbs", "decode_turbo3_pct_copy",
                   "turbo2_rel_mse", "turbo4_rel_mse"},
    "dtypes": {"dtype", "encode_gbs", "decode_gbs", "encode_pct_copy", "rel_mse"},
    "attention": {"batch", "tokens", "codes_us", "sdpa_fp16_us", "decode_sdpa_us",
                  "speedup_vs_sdpa_fp16", "speedup_vs_decode_sdpa", "max_abs_diff"},
    "presets": {"preset", "role", "bits_per_element", "encode_gbs", "decode_gbs",
                "encode_pct_copy", "decode_pct_copy", "rel_mse", "encode_busy_ms",
                "decode_busy_ms", "encode_top", "decode_top", "encode_waits", "decode_waits"},
    "cache": {"context", "cache", "prefill_s", "decode_tok_s", "peak_bytes", "kv_bytes",
              "prefill_ratio", "decode_ratio", "kv_ratio", "peak_ratio", "codes_calls",
              "prefill_busy", "step_busy", "prefill_top", "decode_top", "prefill_waits",
              "decode_waits"},
}


def run_gpu(*args: str, timeout: int = 600) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(BENCH / "gpu.py"), *args], env=env,
                         capture_output=True, text=True, cwd=BENCH.parent, timeout=timeout)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return run.stdout


def numbers(value) -> list[float]:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return []
    if isinstance(value, dict):
        return [x for v in value.values() for x in numbers(v)]
    if isinstance(value, list):
        return [x for v in value for x in numbers(v)]
    return [float(value)]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[str, dict]:
    out = tmp_path_factory.mktemp("gpu") / "gpu.json"
    stdout = run_gpu("--device", "cpu", "--smoke", "--json", str(out))
    return stdout, json.loads(out.read_text())


def test_smoke_prints_every_table(smoke):
    stdout, _ = smoke
    lines = stdout.splitlines()
    assert "TIMINGS ARE MEANINGLESS" in stdout and "triton 3" in lines[0]
    for section, title in TITLES.items():
        assert any(line.startswith(title) for line in lines), (section, stdout)
        assert any(line.startswith(f"[{section}: ") for line in lines), section
    for dim in (64, 128, 256):  # throughput rows: D, vectors, copy and six codec cells
        row = next(line for line in lines if line.startswith(f"{dim:>4} |     128 |"))
        assert row.count("%)") == 6, row
    for dtype in ("fp16", "bf16", "fp32"):
        assert any(line.startswith(f"{dtype:>6} |") and line.count("%)") == 2 for line in lines)
    for batch in (1, 2):
        assert any(line.startswith(f"{batch:>3} |    256 |") for line in lines)
    assert any(line.startswith("decode attention from the presets' codes") for line in lines)
    for preset in ("quality", "balanced", "small"):
        assert any(line.startswith(f"{preset:>8} |   2 |    256 |") for line in lines)
    for preset in ("quality", "balanced", "small"):
        for role in ("key", "value"):
            assert any(line.startswith(f"{preset:>8} | {role:>5} |") for line in lines)
    for cache in ("DynamicCache", "turbo3 recent=64", "quality"):
        assert any(line.startswith(f"    256 | {cache:>34} |") for line in lines), cache
    assert "skipped" not in stdout
    assert lines[-1].startswith("total ")


def test_smoke_json_has_every_result(smoke):
    _, data = smoke
    assert data["meta"]["interpreter"] is True and data["meta"]["timer"] == "perf_counter"
    for section, keys in ROW_KEYS.items():
        result = data[section]
        assert result["skipped"] == [] and result["errors"] == [] and result["wall_s"] > 0
        assert result["rows"], section
        for row in result["rows"]:
            assert keys <= set(row), (section, keys - set(row))
        values = numbers(result)
        assert values and all(math.isfinite(v) for v in values), section
    assert len(data["throughput"]["rows"]) == 3 and len(data["attention"]["rows"]) == 2
    assert len(data["attention"]["preset_rows"]) == 6
    assert len(data["presets"]["rows"]) == 6 and len(data["cache"]["rows"]) == 3
    assert all(r["peak_bytes"] is None for r in data["cache"]["rows"])  # CUDA only
    for row in data["cache"]["rows"]:  # the profiled run's op time against the timed run's
        # wall: on CUDA the device's share; on the CPU only a sign of life (a loaded machine
        # slows one run and not the other)
        assert row["prefill_busy"] > 0 and row["step_busy"] > 0, row
        assert row["prefill_top"] and row["decode_top"][0][0].startswith("aten::"), row
        assert row["rounds"] == 1 and row["prefill_waits"] == row["decode_waits"] == []
        assert row["decode_ratio_min"] <= row["decode_ratio"] <= row["decode_ratio_max"], row
    dyn = data["cache"]["rows"][0]
    assert dyn["decode_ratio"] == dyn["decode_ratio_min"] == dyn["prefill_ratio"] == 1.0


def test_smoke_results_are_sane(smoke):
    """Numbers that do not depend on speed: codec errors, attention agreement, cache bytes."""
    _, data = smoke
    theory = {2: 0.116, 3: 0.034, 4: 0.0093}  # relative MSE of turbo<b> (design brief)
    for row in data["throughput"]["rows"]:
        for bits, mse in theory.items():
            assert mse * 0.7 < row[f"turbo{bits}_rel_mse"] < mse * 1.4, row
    for row in data["dtypes"]["rows"]:
        assert 0.02 < row["rel_mse"] < 0.05, row
    for row in data["attention"]["rows"]:
        assert row["max_abs_diff"] < 1e-2 and row["kv_bytes_codes"] < row["kv_bytes_fp16"] / 4
    kernels = {r["preset"]: r["kernel"] for r in data["attention"]["preset_rows"]}
    assert kernels == {"quality": "triton_attention", "balanced": "triton_attention_parts",
                       "small": "triton_attention_parts"}
    for row in data["attention"]["preset_rows"]:  # against SDPA on the decoded fp16 K/V
        assert row["max_abs_diff"] < 1e-2 and row["kv_bytes_codes"] < row["kv_bytes_fp16"] / 3
    for row in data["presets"]["rows"]:
        assert 0 < row["rel_mse"] < 0.1 and 2 <= row["bits_per_element"] <= 4.5, row
        for step in ("encode", "decode"):  # a profiled call's ops (the host's waits: CUDA)
            assert row[f"{step}_busy_ms"] > 0 and row[f"{step}_top"], row
            assert row[f"{step}_waits"] == [], row
    dyn, *compressed = data["cache"]["rows"]
    assert dyn["cache"] == "DynamicCache" and dyn["kv_ratio"] == 1.0
    assert all(0 < r["kv_ratio"] < 0.6 for r in compressed), compressed
    assert compressed[0]["codes_calls"] > 0  # turbo3 on CPU attends from codes


def test_warm_tasks_are_valid_commands():
    args = gpu.parse_args(["--all"])
    tasks = gpu.warm_tasks(args)
    sections = [t[t.index("--sections") + 1] for t in tasks]
    assert set(sections) == set(gpu.SECTIONS)
    assert sections.count("throughput") == 9 and sections.count("presets") == 6
    assert sections.count("cache") == len(args.policy)
    for task in tasks:
        sub = gpu.parse_args(task)
        assert sub.warm_workers == 0 and sub.sections == [task[task.index("--sections") + 1]]
        if sub.sections == ["throughput"]:  # small, but the same kernel variants (>= 64K rows)
            assert sub.vectors == [1 << 16]
        if sub.sections == ["cache"]:
            assert sub.layers == 1 and sub.contexts == args.contexts and sub.rounds == 1
            assert sub.hidden == args.hidden and sub.model_head_dim == args.model_head_dim


def test_warm_runs_tasks_in_processes():
    stdout = run_gpu("--device", "cpu", "--sections", "dtypes", "--dtypes", "fp16", "--dims",
                     "64", "--vectors", "32", "--repeats", "1", "--warm-workers", "1")
    assert "warming Triton's cache: 1 tasks in 1 processes" in stdout
    assert "warm task" not in stdout  # none failed or was cut
    assert "[warm: " in stdout and "[dtypes: " in stdout


def test_cache_ratios_pair_each_run_with_a_dynamic_cache_run(monkeypatch):
    """The host's speed drifts 4x over the rounds; each pair shares it, so the ratios hold."""
    import gpu_cache

    calls = []

    def run(b, model, make, ids, steps):
        calls.append(make)
        speed = 2 ** (len(calls) // 2)  # the same within each (DynamicCache, cache) pair
        tok_s = (100 if make == "dynamic" else 70) * speed
        return {"prefill_s": (1.0 if make == "dynamic" else 1.5) / speed,
                "decode_tok_s": tok_s, "kv_bytes": 5, "codes_calls": 0, "peak_bytes": None,
                "peak_over_base_bytes": None}

    monkeypatch.setattr(gpu_cache, "_run", run)
    bench = type("B", (), {"args": gpu.parse_args(["--rounds", "3"])})()
    out = gpu_cache._rounds(bench, None, "cache", "dynamic", None)
    # one untimed run first; the baseline first in even rounds, second in odd ones
    assert calls == ["cache", "dynamic", "cache", "cache", "dynamic", "dynamic", "cache"]
    assert out["rounds"] == 3 and out["decode_tok_s"] == 70 * 4  # the median round's
    assert out["base_decode_tok_s"] == 100 * 4 and out["base_prefill_s"] == 1.0 / 4
    assert out["decode_ratio"] == out["decode_ratio_min"] == out["decode_ratio_max"] == 0.7
    assert out["prefill_ratio"] == 1.5
    calls.clear()
    base = gpu_cache._rounds(bench, None, "dynamic", None, None)
    assert calls == ["dynamic"] * 4 and base["decode_ratio"] == base["prefill_ratio"] == 1.0
    assert base["base_decode_tok_s"] == base["decode_tok_s"]


def test_cuda_timings_start_from_a_flushed_l2():
    """Each timed call: the flush, waited for, then the start event and the call; the host's
    back-to-back cost and the --warm-l2 clock never flush."""
    from types import SimpleNamespace

    log = []

    class Event:
        def __init__(self, enable_timing: bool = False):
            pass

        def record(self) -> None:
            log.append("record")

        def synchronize(self) -> None:
            log.append("wait")

        def elapsed_time(self, other: Event) -> float:
            return 1.0

    buffers = []

    def empty(size, dtype, device):
        buffers.append((size, device))
        return SimpleNamespace(zero_=lambda: log.append("flush"))

    fake = SimpleNamespace(empty=empty, int8="int8", cuda=SimpleNamespace(
        Event=Event, synchronize=lambda: log.append("sync")))
    clock = Clock(fake, "cuda", repeats=2, warmup=0, cold_l2=True)
    assert buffers == [(Clock.FLUSH_BYTES, "cuda")] and Clock.FLUSH_BYTES >= 4 * 50 * 10**6
    assert clock.median_ms(lambda: log.append("call")) == 1.0
    assert log == ["sync", "flush", "sync", "record", "call", "record", "wait"] * 2
    log.clear()
    clock.host_us(lambda: log.append("call"))
    assert "flush" not in log and log.count("call") == 3
    log.clear()
    Clock(fake, "cuda", repeats=1, warmup=0).median_ms(lambda: log.append("call"))
    assert log == ["sync", "record", "call", "record", "wait"] and len(buffers) == 1
    assert gpu.parse_args([]).warm_l2 is False and gpu.parse_args(["--warm-l2"]).warm_l2


def test_a_failing_row_is_recorded_and_the_run_goes_on(capsys):
    deadline = Deadline(None)
    with deadline.attempt("D=64") as row:
        raise RuntimeError("out of memory")
    assert row.failed and deadline.errors == ["D=64: RuntimeError: out of memory"]
    assert "D=64: FAILED, RuntimeError: out of memory" in capsys.readouterr().out
    with deadline.attempt("D=128") as row:
        pass
    assert not row.failed and len(deadline.errors) == 1


def test_budget_deadlines_are_cumulative_and_skip_rows_that_do_not_fit():
    budget = Budget(100.0, {"a": 30, "b": 10, "c": 10}, start=1000.0)
    assert budget.ends == {"a": 1060.0, "b": 1080.0, "c": 1100.0}
    assert Budget(None, {"a": 1}, start=0.0).deadline("a").at is None
    past = Deadline(0.0)  # long over
    assert not past.allows("row") and past.skipped == ["row"]
    assert Deadline(None, last=1e9).allows("row")


def test_ncu_script_launches_each_kernel_twice_at_one_config():
    """``benchmarks/ncu_turbo.py`` (what ``gpu_session.sh`` profiles with Nsight Compute):
    without CUDA it turns the interpreter on itself, runs the compile and the profiled
    encode + decode and decodes what it encoded; on GPUs each autotuner's search becomes the
    one config asked for, so no tuning launch precedes the profiled ones."""
    import ncu_turbo
    import triton

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # it sets it
    run = subprocess.run([sys.executable, str(BENCH / "ncu_turbo.py"), "--vectors", "128",
                          "--bits", "3"], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["compile", "profiled"]
    assert 0.02 < float(lines[-1].split()[-1]) < 0.05  # turbo3's relative MSE is ~0.034
    run = subprocess.run([sys.executable, str(BENCH / "ncu_turbo.py"), "--vectors", "128",
                          "--preset", "quality"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["compile", "profiled"]
    assert "quality value" in lines[0] and "(16, 4)" in lines[0]
    assert 0.005 < float(lines[-1].split()[-1]) < 0.05  # 3 bits, best of 4 rotations

    class Tuner:
        fn = _decode_kernel
        configs = [triton.Config({"BLOCK_M": m, "SUB": 64}, num_warps=w, num_stages=s)
                   for m, w, s in ((64, 4, 1), (256, 4, 2), (256, 8, 2))]

    tuner = Tuner()
    ncu_turbo._pin(tuner, 256, 4)  # the search's own config, whole (sub-tiles, stages)
    (config,) = tuner.configs
    assert config.kwargs == {"BLOCK_M": 256, "SUB": 64} and config.num_warps == 4 \
        and config.num_stages == 2
    with pytest.raises(SystemExit, match="_decode_kernel searches no config of 128 rows and "
                                         "4 warps: 256,4"):
        ncu_turbo._pin(tuner, 128, 4)
    tuner.configs = [triton.Config({"BM": m}, num_warps=4) for m in (16, 32)]
    ncu_turbo._pin(tuner, 16, 4, name="BM")
    assert tuner.configs[0].kwargs == {"BM": 16} and len(tuner.configs) == 1


def _decode_kernel():
    """A stand-in kernel function: its name is what a refused pin names."""


def test_host_waits_rank_cuda_calls_that_are_not_launches():
    """What a host-bound phase waited on: CUDA runtime/driver calls on the host summed by name,
    costliest first, kernel launches and device events and aten ops left out."""
    from types import SimpleNamespace

    import gpu_common

    def event(name, us, device="cpu"):
        return SimpleNamespace(name=name, device_type=device,
                               time_range=SimpleNamespace(elapsed_us=lambda: us))

    events = [event("cudaStreamSynchronize", 3000), event("cudaLaunchKernel", 9000),
              event("cuLaunchKernelEx", 9000), event("aten::mm", 9000),
              event("cudaStreamSynchronize", 1500), event("cudaHostAlloc", 2000),
              event("_attend_kernel", 9000, "cuda"), event("cudaMemcpyAsync", 10)]
    assert gpu_common.host_waits(events, "cpu", most=2) == [
        ["cudaStreamSynchronize", 4.5, 2], ["cudaHostAlloc", 2.0, 1]]
    assert gpu_common.waits_text([["cudaHostAlloc", 2.0, 1]]) == "cudaHostAlloc 2.00 ms x1"
