"""Shared fixtures and helpers for the test suite."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest

# presets fitted on this machine (kvtool calibrate --preset) would change what --preset means
# for the bundled models: tests (and the processes they start) read an empty folder instead
os.environ["KVTOOL_PRESET_FITS_DIR"] = tempfile.mkdtemp(prefix="kvtool-preset-fits-")


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def relative_mse(x, x_hat) -> float:
    """‖x − x̂‖² / ‖x‖² over the whole array (float64)."""
    x = np.asarray(x, dtype=np.float64)
    x_hat = np.asarray(x_hat, dtype=np.float64)
    return float(((x - x_hat) ** 2).sum() / (x**2).sum())


@pytest.fixture(scope="session")
def loaded():
    """The default model (SmolLM2-135M-Instruct, float32), loaded once for the whole session."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kvtool.models import load_model

    torch.set_num_threads(1)  # small model: 1 thread is fastest on a shared 2-core box
    return load_model("default", dtype="float32")


@pytest.fixture
def runner():
    """A click test runner for ``kvtool`` commands."""
    from click.testing import CliRunner

    return CliRunner()


@pytest.fixture(autouse=True)
def _fresh_cast_notes(monkeypatch):
    """The dtype-cast note is logged once per process; each test sees its own first time."""
    import kvtool.models

    monkeypatch.setattr(kvtool.models, "_NOTED", set())
