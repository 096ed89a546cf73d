"""``benchmarks/mlx_batch.py``: concurrent requests alone and batched, on mlx-lm's KVCache and
on KvtoolMLXCache, in one small run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "mlx_batch.py"


def test_a_small_run_prints_every_row():
    run = subprocess.run([sys.executable, str(SCRIPT), "--requests", "2", "--prompt-tokens",
                          "64", "--new-tokens", "4", "--recent-tokens", "8", "--block-size",
                          "16"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {tuple(cell.strip() for cell in line.split("|")[1:3]): line.split("|")[3:-1]
            for line in run.stdout.splitlines() if line.startswith("| K")}
    assert set(rows) == {("KVCache", "alone"), ("KVCache", "batched"),
                         ("KvtoolMLXCache", "alone"), ("KvtoolMLXCache", "batched")}
    assert rows["KvtoolMLXCache", "batched"][-1].strip() == "2/2"  # the batch's tokens: alone's
    held = {key: float(cells[3]) for key, cells in rows.items()}
    assert held["KvtoolMLXCache", "batched"] < held["KVCache", "batched"] / 2  # codes
