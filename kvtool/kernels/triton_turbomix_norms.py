"""``turbomix``'s uint8 norms on the device (``norm_bits=8``), one launch each way.

:func:`kvtool.codecs.norm_grid.norm_codes` keeps per group the least and the greatest nonzero
fp16 norm and each norm's nearest point of a 255-step log-spaced grid between them;
:func:`~kvtool.codecs.norm_grid.norm_values` reads the grid back. As torch ops these were ~40
launches per part and encode (about half of a ``balanced`` encode's host work, paid by every
layer at every flush of a ``CompressedCache``) and ~10 per part at each rebuild of the store's
attention views. Here a program per group does either in float64, the reference's arithmetic
in its order (``log2``/``exp2`` as CUDA's libdevice computes them, as torch's float64 ops did),
rounding half to even.
"""

from __future__ import annotations

import torch

from kvtool.codecs.norm_grid import _NORM_STEPS
from kvtool.errors import CodecError
from kvtool.kernels.triton_support import _jit, launch, next_power_of_2

try:
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    tl = None

# -- kernels -------------------------------------------------------------------------------------
@_jit
def _log_range(lo, hi):
    """(log2 lo, log2 hi − log2 lo) in float64 of a group's fp16 bounds (fp32 values); a zero
    bound reads as fp16's least step, so every log is finite."""
    log_lo = tl.log2(tl.maximum(lo.to(tl.float64), 2.0**-24))
    return log_lo, tl.maximum(tl.log2(tl.maximum(hi.to(tl.float64), 2.0**-24)) - log_lo, 1e-12)


@_jit
def _group_norm_codes(row, codes_row, range_row, tokens, STEPS: tl.constexpr, BT: tl.constexpr):
    """codes and (lo, hi) of one group's fp16 norms at ``row`` (see the module doc)."""
    lo = tl.full([BT], float("inf"), tl.float32)
    hi = tl.full([BT], float("-inf"), tl.float32)
    for t0 in range(0, tokens, BT):
        t = t0 + tl.arange(0, BT)
        n = tl.load(row + t, mask=t < tokens, other=0.0).to(tl.float32)
        lo = tl.minimum(lo, tl.where((n > 0) & (t < tokens), n, float("inf")))
        hi = tl.maximum(hi, tl.where(t < tokens, n, float("-inf")))
    least = tl.min(lo, axis=0)
    least = tl.where(least < float("inf"), least, 0.0)  # no positive norm: 0
    most = tl.max(hi, axis=0)
    log_lo, span = _log_range(least, most)
    for t0 in range(0, tokens, BT):
        t = t0 + tl.arange(0, BT)
        n = tl.load(row + t, mask=t < tokens, other=0.0).to(tl.float64)
        positive = n > 0
        x = tl.minimum(tl.maximum((tl.log2(tl.where(positive, n, 1.0)) - log_lo) / span, 0.0),
                       1.0) * STEPS
        r = tl.floor(x)
        d = x - r
        r += tl.where((d > 0.5) | ((d == 0.5) & (r.to(tl.int32) % 2 == 1)), 1.0, 0.0)
        tl.store(codes_row + t, tl.where(positive, 1 + r, 0.0).to(tl.uint8), mask=t < tokens)
    tl.store(range_row, least.to(tl.float16))
    tl.store(range_row + 1, most.to(tl.float16))


@_jit
def _norm_codes_kernel(n_ptr, codes_ptr, range_ptr, tokens, STEPS: tl.constexpr,
                       BT: tl.constexpr):
    """codes[g, :] and range[g] = (lo, hi) of fp16 norms n[g, :]."""
    g = tl.program_id(0).to(tl.int64)
    _group_norm_codes(n_ptr + g * tokens, codes_ptr + g * tokens, range_ptr + 2 * g, tokens,
                      STEPS, BT)


@_jit
def _norm_values_kernel(codes_ptr, range_ptr, out_ptr, tokens, STEPS: tl.constexpr,
                        BT: tl.constexpr):
    """out[g, t] = 2^(log2 lo + (codes[g, t] − 1) / STEPS · span) (0 for code 0), float32."""
    g = tl.program_id(0).to(tl.int64)
    log_lo, span = _log_range(tl.load(range_ptr + 2 * g).to(tl.float32),
                              tl.load(range_ptr + 2 * g + 1).to(tl.float32))
    for t0 in range(0, tokens, BT):
        t = t0 + tl.arange(0, BT)
        c = tl.load(codes_ptr + g * tokens + t, mask=t < tokens, other=0).to(tl.float64)
        v = tl.exp2(log_lo + (c - 1) / STEPS * span)
        tl.store(out_ptr + g * tokens + t, tl.where(c > 0, v, 0.0).to(tl.float32),
                 mask=t < tokens)


# -- host side -----------------------------------------------------------------------------------
def _block(tokens: int) -> int:
    """Tokens per step of a group's loop."""
    return min(1024, max(16, next_power_of_2(tokens)))


def norm_codes(norms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kvtool.codecs.norm_grid.norm_codes` on the device: fp16 norms [G, T] → (uint8
    codes [G, T], fp16 ranges [G, 1, 2])."""
    groups, tokens = norms.shape
    norms = norms.to(torch.float16).contiguous()
    codes = torch.empty((groups, tokens), dtype=torch.uint8, device=norms.device)
    ranges = torch.empty((groups, 1, 2), dtype=torch.float16, device=norms.device)
    if groups and tokens:
        launch(_norm_codes_kernel, (groups,), (norms, codes, ranges, tokens),
               {"STEPS": _NORM_STEPS, "BT": _block(tokens)})
    elif groups:
        ranges.zero_()
    return codes, ranges


def norm_values(codes: torch.Tensor, ranges: torch.Tensor, check: bool = True) -> torch.Tensor:
    """:func:`kvtool.codecs.norm_grid.norm_values` on the device: float32 [G, T] of uint8 codes
    [G, T] and fp16 ranges [G, 2]; ``check=False`` skips the range check (a host sync) for
    arrays this process encoded."""
    groups, tokens = codes.shape
    ranges = ranges.reshape(groups, 2).to(torch.float16).contiguous()
    if check and bool((ranges[:, 0] > ranges[:, 1]).any()):
        raise CodecError("turbomix: a norm range's least norm is above its greatest, which no "
                         "writer stores")
    out = torch.empty((groups, tokens), dtype=torch.float32, device=codes.device)
    if groups and tokens:
        launch(_norm_values_kernel, (groups,), (codes.contiguous(), ranges, out, tokens),
               {"STEPS": _NORM_STEPS, "BT": _block(tokens)})
    return out


__all__ = ["norm_codes", "norm_values"]
