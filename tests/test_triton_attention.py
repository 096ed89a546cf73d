"""Attention from codes on Triton (``tests/triton_attention_cases.py``), run in a fresh process:
under Triton's interpreter (``TRITON_INTERPRET=1``, never set in this process) without CUDA,
the ``gpu`` cases compiled with it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
torch = pytest.importorskip("torch")

CASES = Path(__file__).with_name("triton_attention_cases.py")


def run_cases(*args: str, **env: str) -> str:
    run = subprocess.run([sys.executable, "-m", "pytest", str(CASES), "-q", "-p",
                          "no:cacheprovider", *args], env={**os.environ, **env},
                         capture_output=True, text=True, cwd=CASES.parent.parent, timeout=1200)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    return run.stdout


def test_attention_from_codes_under_the_interpreter():
    out = run_cases("-m", "not gpu", TRITON_INTERPRET="1")
    summary = out.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, summary
    assert int(summary.split()[0]) >= 15, summary  # every case ran


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_attention_from_codes_on_cuda():
    out = run_cases("-m", "gpu or not gpu")
    assert "passed" in out.strip().splitlines()[-1]
