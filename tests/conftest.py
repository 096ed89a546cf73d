"""Shared fixtures and helpers for the test suite."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def relative_mse(x, x_hat) -> float:
    """‖x − x̂‖² / ‖x‖² over the whole array (float64)."""
    x = np.asarray(x, dtype=np.float64)
    x_hat = np.asarray(x_hat, dtype=np.float64)
    return float(((x - x_hat) ** 2).sum() / (x**2).sum())
