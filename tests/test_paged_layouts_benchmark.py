"""``benchmarks/paged_layouts.py``: one layer's copies in and out of a CPU paged cache, per
layout. Times are not asserted; every layout reads back what it wrote (the script checks), each
row has its four timings and ratios, and the packing vLLM's own writer makes here is a row."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "paged_layouts.py"


def test_rows_for_every_cpu_layout(tmp_path):
    out = tmp_path / "rows.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--tokens", "80", "--block-size", "32",
                          "--head-dim", "32", "--heads", "2", "--reps", "2", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["layout"]: r for r in json.loads(out.read_text())["rows"]}
    want = {"cpu", "cpu_amx", "cpu_probed (amx)"}
    assert want <= set(rows)
    if importlib.util.find_spec("vllm") is not None:
        assert any(name.startswith("cpu_probed (vLLM ") for name in rows), list(rows)
    for name, row in rows.items():
        times = {f"{op}_{at}_us" for op in ("gather", "scatter") for at in ("aligned", "mid")}
        assert all(math.isfinite(row[t]) and row[t] > 0 for t in times), row
        assert row["vs_cpu"] == pytest.approx({t: row[t] / rows["cpu"][t] for t in times})
        assert f"{name:>26} |" in run.stdout
