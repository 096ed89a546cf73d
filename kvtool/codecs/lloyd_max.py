"""Lloyd–Max scalar codebooks computed from a density (never hand-typed constants).

After a random rotation, each coordinate of a unit vector in R^D follows the exact marginal
``f(t) ∝ (1 − t²)^((D−3)/2)`` on [−1, 1]; :func:`sphere_marginal_codebook` returns the MSE-optimal
codebook for it. Results are cached per (D, levels).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np

_GRID = 1 << 18


@dataclass(frozen=True)
class Codebook:
    centroids: np.ndarray  # float32, sorted, len = levels
    boundaries: np.ndarray  # float32, len = levels - 1 (midpoints)
    mse: float  # expected squared error per coordinate under the density

    @property
    def levels(self) -> int:
        return len(self.centroids)


def lloyd_max(t: np.ndarray, weights: np.ndarray, levels: int, iters: int = 5000) -> Codebook:
    """MSE-optimal ``levels``-point quantiser for a density sampled on the sorted grid ``t``.

    Uses prefix sums, so each iteration costs O(levels · log grid).
    """
    w = weights / weights.sum()
    cw = np.concatenate([[0.0], np.cumsum(w)])
    cwt = np.concatenate([[0.0], np.cumsum(w * t)])
    cwtt = np.concatenate([[0.0], np.cumsum(w * t * t)])
    # start from the density's quantiles
    centroids = np.interp((np.arange(levels) + 0.5) / levels, cw[1:], t)
    for _ in range(iters):
        bounds = (centroids[1:] + centroids[:-1]) / 2
        cuts = np.concatenate([[0], np.searchsorted(t, bounds), [len(t)]])
        mass = cw[cuts[1:]] - cw[cuts[:-1]]
        first = cwt[cuts[1:]] - cwt[cuts[:-1]]
        new = np.where(mass > 0, first / np.maximum(mass, 1e-300), centroids)
        if np.max(np.abs(new - centroids)) < 1e-13:
            centroids = new
            break
        centroids = new
    bounds = (centroids[1:] + centroids[:-1]) / 2
    cuts = np.concatenate([[0], np.searchsorted(t, bounds), [len(t)]])
    mass = cw[cuts[1:]] - cw[cuts[:-1]]
    first = cwt[cuts[1:]] - cwt[cuts[:-1]]
    second = cwtt[cuts[1:]] - cwtt[cuts[:-1]]
    mse = float(np.sum(second - 2 * centroids * first + centroids**2 * mass))
    return Codebook(centroids.astype(np.float32), bounds.astype(np.float32), mse)


def _grid(lo: float, hi: float) -> np.ndarray:
    edges = np.linspace(lo, hi, _GRID + 1)
    return (edges[1:] + edges[:-1]) / 2  # midpoint rule


@cache
def sphere_marginal_codebook(dim: int, levels: int) -> Codebook:
    """Codebook for one coordinate of a uniformly random unit vector in R^dim."""
    if dim < 2:
        raise ValueError("head_dim must be at least 2 for a rotation codebook")
    # beyond ±14 standard deviations the mass is < 1e-40: skip it for grid resolution
    half = min(1.0, 14.0 / np.sqrt(dim))
    t = _grid(-half, half)
    logf = (dim - 3) / 2 * np.log1p(-np.minimum(t * t, 1 - 1e-16))
    return lloyd_max(t, np.exp(logf - logf.max()), levels)


@cache
def planar_radius_codebook(dim: int, levels: int) -> Codebook:
    """Codebook for the radius of a coordinate pair of a random unit vector in R^dim.

    r² ~ Beta(1, (dim − 2)/2), so f(r) ∝ r (1 − r²)^((dim − 4)/2) on [0, 1].
    """
    if dim < 3:
        raise ValueError("dimension must be at least 3 for a planar radius codebook")
    hi = min(1.0, 16.0 / np.sqrt(dim))
    r = _grid(0.0, hi)
    logf = np.log(r) + (dim - 4) / 2 * np.log1p(-np.minimum(r * r, 1 - 1e-16))
    return lloyd_max(r, np.exp(logf - logf.max()), levels)
