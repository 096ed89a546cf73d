"""``benchmarks/attend_cpu.py``: one layer's decode-step attention from codes on the CPU
against SDPA. Times are not asserted; every policy's step must have made exactly one call of
the numba kernel (the script refuses a step that fell back to decode-then-attend)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "attend_cpu.py"


def test_rows_of_every_preset():
    run = subprocess.run([sys.executable, str(SCRIPT), "--tokens", "384", "--groups", "2",
                          "--kv-heads", "2", "--calls", "2", "--repeats", "1"],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in run.stdout.splitlines()
            if line.startswith("| 384 |")]
    assert [r[2].strip() for r in rows] == ["quality", "balanced", "small"], run.stdout
    for row in rows:
        assert float(row[3]) > 0 and float(row[4]) > 0 and float(row[5]) > 0, row
