"""``benchmarks/cold_start.py``: a policy's first and warm save/load, timed in a fresh process,
and the limit each first call is held to (2 × warm + 1 s)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "cold_start.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=600)


def test_one_policy_in_a_fresh_process(tmp_path):
    out = tmp_path / "rows.json"
    run = _run("--policy", "turbo3", "--layers", "2", "--heads", "2", "--tokens", "128",
               "--dim", "64", "--repeats", "2", "--json", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "| turbo3 | kept |" in run.stdout
    (row,) = json.loads(out.read_text())["rows"]
    assert row["policy"] == "turbo3" and row["device"] == "cpu"
    assert row["fp16_bytes"] == 2 * 2 * 2 * 128 * 64 * 2  # layers × K/V × heads × tokens × dim
    assert 0 < row["file_bytes"] < row["fp16_bytes"] / 3  # turbo3's codes, not raw K/V
    for key in ("import_s", "first_save_s", "warm_save_s", "first_load_s", "warm_load_s"):
        assert math.isfinite(row[key]) and row[key] > 0, key
    for op in ("save", "load"):
        assert row[f"{op}_limit_s"] == pytest.approx(2 * row[f"warm_{op}_s"] + 1)
        assert row[f"{op}_within"] == (row[f"first_{op}_s"] <= row[f"{op}_limit_s"])


def test_bad_options_are_refused():
    run = _run("--device", "tpu")
    assert run.returncode == 2 and "--device must be one of" in run.stderr
    run = _run("--policy", "nosuchcodec", "--layers", "1", "--tokens", "64", "--repeats", "1")
    assert run.returncode != 0 and "nosuchcodec" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal")
def test_cuda_without_cuda_is_one_line():
    run = _run("--device", "cuda", "--policy", "turbo3")
    assert run.returncode != 0 and "CUDA is not available" in run.stderr
    assert "Traceback" not in run.stderr
