"""``turbomix``'s uint8 norms (``norm_bits=8``): each vector's norm as a code on a log-spaced grid
between its group's least and greatest nonzero norm (stored in fp16), half the side information
of fp16 norms for a relative error under 1%."""

from __future__ import annotations

import numpy as np

from kvtool.errors import CodecError

_NORM_STEPS = 254  # uint8 norm codes: 0 is a zero norm, 1..255 a log-spaced grid


def norm_codes(norms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp16 norms [G, T] as (uint8 codes [G, T], fp16 range [G, 1, 2]): per group, the least and
    the greatest nonzero norm, and each norm's nearest point of the 255-step log-spaced grid
    between them (code 0: a zero norm). The relative error is at most half a step,
    ``ln(max/min) / 508`` (0.9% for a 100x range), far below the codebooks' error."""
    n = norms.astype(np.float64)
    positive = n > 0
    lo = np.where(positive, n, np.inf).min(axis=1, initial=np.inf)  # (groups of no tokens)
    hi = n.max(axis=1, initial=0.0)
    lo = np.where(np.isfinite(lo), lo, 0.0).astype(np.float16)
    hi = hi.astype(np.float16)
    log_lo, span = _log_range(lo, hi)
    with np.errstate(divide="ignore"):
        t = (np.log2(np.where(positive, n, 1.0)) - log_lo[:, None]) / span[:, None]
    codes = 1 + np.rint(np.clip(t, 0.0, 1.0) * _NORM_STEPS)
    codes = np.where(positive, codes, 0).astype(np.uint8)
    return codes, np.stack([lo, hi], axis=-1)[:, None, :]


def norm_values(codes: np.ndarray, ranges: np.ndarray) -> np.ndarray:
    """float32 norms [G, T] of :func:`norm_codes` output (``ranges`` [G, 2])."""
    lo, hi = ranges[:, 0], ranges[:, 1]
    if bool((lo > hi).any()):
        raise CodecError("turbomix: a norm range's least norm is above its greatest, which no "
                         "writer stores")
    log_lo, span = _log_range(lo, hi)
    t = (codes.astype(np.float64) - 1) / _NORM_STEPS
    values = np.exp2(log_lo[:, None] + t * span[:, None])
    return np.where(codes > 0, values, 0.0).astype(np.float32)


def _log_range(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(log2 lo, log2 hi − log2 lo) in float64; a zero bound reads as fp16's least step, so
    every value is finite."""
    tiny = float(np.finfo(np.float16).smallest_subnormal)
    log_lo = np.log2(np.maximum(lo.astype(np.float64), tiny))
    log_hi = np.log2(np.maximum(hi.astype(np.float64), tiny))
    return log_lo, np.maximum(log_hi - log_lo, 1e-12)


__all__ = ["norm_codes", "norm_values"]
