"""Shared helpers for the scale-based quantisers (fp8, int8, int4, KIVI).

Scales and minimums are stored as fp16, and codes are computed from the *stored* (fp16-rounded)
values, so decode sees exactly the parameters encode used, on every backend. A scale that
underflows fp16 (a vector or group with range below ~1e-5) decodes to its minimum (or zero):
the absolute error stays below that tiny range.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtool.errors import CodecError
from kvtool.kernels.numpy_ops import FP16_MAX


def to_fp16(xp: Any, a: Any, who: str) -> Any:
    """``a`` as fp16, refusing values that would overflow to Inf."""
    if not bool((abs(a) <= FP16_MAX).all()):
        raise CodecError(f"{who}: values exceed the fp16 range of the stored scales")
    return xp.astype(a, "float16")


def check_scales(scale: np.ndarray, mn: np.ndarray, bits: int, who: str) -> None:
    """:class:`CodecError` for a stored scale below what :func:`asym_quantize` writes: none is
    negative but by the hair of a constant group, whose fp16-rounded minimum can lie half an
    fp16 ulp of it above its maximum (bounded here by a whole ulp, over the levels)."""
    levels = (1 << bits) - 1
    floor = -(np.abs(mn.astype(np.float32)) * np.float32(2.0 ** -10) + np.float32(2.0 ** -24))
    if bool((scale.astype(np.float32) * levels < floor).any()):
        raise CodecError(f"{who}: a negative scale, which no writer stores")


def nonzero(xp: Any, s: Any) -> Any:
    """``s`` with zeros replaced by ones, so all-zero or constant groups divide safely."""
    return xp.where(s > 0, s, s + 1)


def asym_quantize(xp: Any, x: Any, bits: int, axis: int, who: str) -> tuple[Any, Any, Any]:
    """Min/max quantisation of float32 ``x`` with one fp16 (scale, min) per slice along ``axis``.

    Returns uint8 codes shaped like ``x`` and keepdims scale and min.
    """
    levels = (1 << bits) - 1
    mn = to_fp16(xp, xp.amin(x, axis), who)
    mn32 = xp.astype(mn, "float32")
    scale = to_fp16(xp, (xp.amax(x, axis) - mn32) / levels, who)
    codes = xp.round_clip((x - mn32) / nonzero(xp, xp.astype(scale, "float32")), 0, levels,
                          "uint8")
    return codes, scale, mn


def quantize_groups(xp: Any, x: Any, bits: int, group: int, axis: int, who: str):
    """Quantise float32 ``x`` in groups of ``group`` consecutive entries along ``axis``.

    ``axis`` is -1 (groups of channels within a token) or -2 (groups of tokens within a channel).
    A partial last group is padded by edge replication (which leaves its min/max unchanged) and
    stripped again. Returns codes shaped like ``x`` and fp16 scale/min shaped like ``x`` with
    ``axis`` replaced by the number of groups.
    """
    n = x.shape[axis]
    group = n if 0 < n < group else group  # one group either way: not padded to a huge size
    pad = (-n) % group
    xg = xp.pad_axis(x, axis, pad)
    ngroups = (n + pad) // group
    if axis == -1:
        xg = xp.reshape(xg, (*x.shape[:-1], ngroups, group))
        codes, scale, mn = asym_quantize(xp, xg, bits, -1, who)
        codes = xp.reshape(codes, (*x.shape[:-1], ngroups * group))[..., :n]
        return codes, scale[..., 0], mn[..., 0]
    xg = xp.reshape(xg, (*x.shape[:-2], ngroups, group, x.shape[-1]))
    codes, scale, mn = asym_quantize(xp, xg, bits, -2, who)
    codes = xp.reshape(codes, (*x.shape[:-2], ngroups * group, x.shape[-1]))[..., :n, :]
    return codes, scale[..., 0, :], mn[..., 0, :]


def dequantize_groups(xp: Any, codes: Any, scale: Any, mn: Any, group: int, axis: int) -> Any:
    """Inverse of :func:`quantize_groups`: float32 shaped like ``codes``."""
    n = codes.shape[axis]
    ngroups = scale.shape[axis]
    group = n if ngroups == 1 and 0 < n < group else group
    c = xp.astype(xp.pad_axis(codes, axis, ngroups * group - n), "float32")
    s, m = xp.astype(scale, "float32"), xp.astype(mn, "float32")
    if axis == -1:
        c = xp.reshape(c, (*codes.shape[:-1], ngroups, group))
        x = c * s[..., None] + m[..., None]
        return xp.reshape(x, (*codes.shape[:-1], ngroups * group))[..., :n]
    c = xp.reshape(c, (*codes.shape[:-2], ngroups, group, codes.shape[-1]))
    x = c * s[..., None, :] + m[..., None, :]
    return xp.reshape(x, (*codes.shape[:-2], ngroups * group, codes.shape[-1]))[..., :n, :]
