"""``benchmarks/decode_host.py``: the host work a ``CompressedCache`` adds to a decode step on
the CUDA code path (run on CPU tensors, launches stubbed). Times are not asserted; the torch
ops the cache issues per layer are: each is host work (and on CUDA often a launch) at every
layer of every step; and no device value is read on the host (on CUDA: a wait)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "decode_host.py"


def test_rows_and_ops_per_layer(tmp_path):
    out = tmp_path / "rows.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--policy", "turbo3,quality,balanced",
                          "--layers", "2", "--context", "256", "--steps", "4", "--rounds", "1",
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["cache"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"DynamicCache", "turbo3", "quality", "balanced"}
    for name, row in rows.items():
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in
                   ("update_us", "attention_us", "total_us")), row
        assert f"{name:>13} |" in run.stdout
    # a layer's step: DynamicCache's own model ops, then what each cache adds (the window's
    # cats, the stacked K/V, the output and launch; a plan per call signature, views per store)
    dynamic = rows["DynamicCache"]["aten_ops"]
    assert 30 < dynamic < 90 and rows["DynamicCache"]["flush_aten_ops"] == dynamic
    for name in ("turbo3", "quality", "balanced"):
        assert rows[name]["aten_ops"] - dynamic <= 7, rows[name]
    # the step that encodes a block, per layer: turbo3 24, quality 53 (two codecs, four
    # candidates each), balanced 109 (outlier parts, uint8 norms; 114 with four candidates); with
    # the candidate choice and the outlier channels as torch ops they were ~72 and ~175, with the
    # uint8 norms ~300
    flush = {name: rows[name]["flush_aten_ops"] - dynamic for name in rows}
    assert 10 < flush["turbo3"] <= 30 and 30 < flush["quality"] <= 62, flush
    assert 60 < flush["balanced"] <= 130, flush
    # a prefill encodes every layer's context: turbo3 adds 14 ops a layer, quality 43,
    # balanced 91 (were ~15, ~60, ~155); its host time per layer is a positive number
    dyn_prefill = rows["DynamicCache"]["prefill_aten_ops"]
    prefill = {name: rows[name]["prefill_aten_ops"] - dyn_prefill for name in rows}
    assert prefill["turbo3"] <= 20 and prefill["quality"] <= 50, prefill
    assert prefill["balanced"] <= 105, prefill
    assert all(math.isfinite(r["prefill_update_us"]) and r["prefill_update_us"] > 0
               for r in rows.values())
    # the host never waits for the device: no device value read in a prefill, in 64 steps
    # (one flushes a block) or in a next turn (it decodes the store: the cache's own arrays,
    # whose values are not checked again), so on CUDA the host keeps running ahead
    for row in rows.values():
        assert row["prefill_host_reads"] == row["step_host_reads"] == 0, row
        assert row["turn_host_reads"] == 0, row
    assert "host reads" in run.stdout and "reads at:" not in run.stdout


def test_attend_host_rows():
    """``benchmarks/attend_host.py``: every row (``turbo_decode_attention``, the store path of
    turbo3 and ``quality``, the parts path of ``balanced`` and ``small``) runs on CPU tensors
    with its kernels stubbed."""
    script = SCRIPT.with_name("attend_host.py")
    run = subprocess.run([sys.executable, str(script), "--calls", "20", "--repeats", "1"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    for shape in ("B=1 N=8K turbo_decode_attention", "B=8 N=32K turbo_decode_attention",
                  "B=1 N=8K turbo3", "B=8 N=32K turbo3", "B=1 N=8K quality",
                  "B=1 N=8K balanced", "B=1 N=8K small"):
        assert f"{shape:>36} |" in run.stdout, run.stdout
