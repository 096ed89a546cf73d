"""Seeded random rotations shared by the rotation codecs (turbo, prism).

The rotation is generated from a splitmix64 stream implemented here, not from numpy's RNG,
so a file written today decodes identically with any future numpy.

- power-of-two D: ``R = (H · diag(s₂) / √D) · (H · diag(s₁) / √D)`` — two rounds of randomized
  Hadamard transform (Sylvester ``H`` built with the fast Walsh–Hadamard transform, seeded random
  signs); a single round leaves inputs dominated by one channel badly quantised;
- otherwise: a dense orthogonal matrix from modified Gram–Schmidt on seeded Gaussians.

The reference array ops apply ``R`` as one matmul; the compiled CPU kernels apply the same
linear map as sign flips and Walsh–Hadamard butterflies, the Triton kernels as an exact split
``tl.dot`` (see :mod:`kvtool.kernels`).
"""

from __future__ import annotations

from functools import cache

import numpy as np

_MASK = (1 << 64) - 1


def splitmix64(seed: int, count: int) -> np.ndarray:
    """``count`` uint64 values of the splitmix64 sequence started at ``seed``."""
    state = (seed + 0x9E3779B97F4A7C15 * np.arange(1, count + 1, dtype=np.uint64)).astype(
        np.uint64
    )
    with np.errstate(over="ignore"):
        z = state
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return z


def _uniform(seed: int, count: int) -> np.ndarray:
    """Uniform floats in (0, 1) from the top 53 bits."""
    return ((splitmix64(seed, count) >> np.uint64(11)).astype(np.float64) + 0.5) / 2.0**53


def random_signs(dim: int, seed: int) -> np.ndarray:
    return np.where(splitmix64(seed, dim) >> np.uint64(63), -1.0, 1.0)


def hadamard_signs(dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The sign vectors (s₁, s₂) of the two randomized Hadamard rounds of ``R``."""
    return random_signs(dim, seed), random_signs(dim, seed ^ 0xA5A5A5A5)


def fwht(x: np.ndarray) -> np.ndarray:
    """Unnormalised fast Walsh–Hadamard transform over the last axis (length a power of two)."""
    x = np.array(x, dtype=np.float64)
    n = x.shape[-1]
    h = 1
    while h < n:
        y = x.reshape(*x.shape[:-1], n // (2 * h), 2, h)
        a, b = y[..., 0, :].copy(), y[..., 1, :].copy()
        y[..., 0, :], y[..., 1, :] = a + b, a - b
        x = y.reshape(*x.shape[:-1], n)
        h *= 2
    return x


def _gram_schmidt(dim: int, seed: int) -> np.ndarray:
    u1, u2 = _uniform(seed, dim * dim), _uniform(seed ^ 0x5DEECE66D, dim * dim)
    g = (np.sqrt(-2 * np.log(u1)) * np.cos(2 * np.pi * u2)).reshape(dim, dim)
    q = np.zeros((dim, dim))
    for i in range(dim):
        v = g[i].copy()
        for _ in range(2):  # re-orthogonalise once for float64 accuracy
            for j in range(i):
                v -= np.sum(v * q[j]) * q[j]
        q[i] = v / np.sqrt(np.sum(v * v))
    return q


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@cache
def rotation_matrix(dim: int, seed: int) -> np.ndarray:
    """Orthogonal float32 ``R`` [dim, dim]; rotate row vectors with ``x @ R.T``."""
    if is_power_of_two(dim):
        # two rounds of randomized Hadamard: one round maps a basis vector (a single dominant
        # channel) to ±1/√D in every coordinate, far from the sphere-marginal the codebook assumes
        s1, s2 = hadamard_signs(dim, seed)
        first = fwht(np.diag(s1)).T / np.sqrt(dim)
        second = fwht(np.diag(s2)).T / np.sqrt(dim)
        rot = second @ first
    else:
        rot = _gram_schmidt(dim, seed)
    rot = np.ascontiguousarray(rot.astype(np.float32))
    rot.setflags(write=False)
    return rot


@cache
def rotation_matrix_t(dim: int, seed: int) -> np.ndarray:
    """``R.T`` contiguous, for ``x @ R.T``."""
    rt = np.ascontiguousarray(rotation_matrix(dim, seed).T)
    rt.setflags(write=False)
    return rt
