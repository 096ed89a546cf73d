"""``benchmarks/codecs.py`` times the codecs it is given: specs with options (separated by
``;``, since an option list has commas) and a preset's key or value codec, one row each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "codecs.py"


def rows(codecs: str) -> dict[str, list[str]]:
    run = subprocess.run([sys.executable, str(BENCH), "--vectors", "2048", "--chunk", "1024",
                          "--repeats", "1", "--backends", "numpy+numba", "--no-peer",
                          "--codecs", codecs], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    lines = [line.split() for line in run.stdout.splitlines() if "numpy+numba" in line]
    return {cells[0]: cells for cells in lines}


def test_specs_with_options_and_preset_codecs_each_get_a_row():
    out = rows("turbomix:bits=2,outliers=16,trellis=true;turbo3;small/v")
    assert set(out) == {"turbomix:bits=2,outliers=16,trellis=true", "turbo3", "small/v"}, out
    assert float(out["turbo3"][2]) == pytest.approx(3.125)  # bits/element at D=128
    assert 2.0 < float(out["small/v"][2]) < 2.5  # 2-bit codes, norms, rotation choices
    # commas separate specs; a piece with an option and no codec name continues the spec
    assert set(rows("turbo2,turbomix:bits=2,trellis=true,small/k")) == {
        "turbo2", "turbomix:bits=2,trellis=true", "small/k"}
