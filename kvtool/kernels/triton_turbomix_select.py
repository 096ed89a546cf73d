"""The per-group choices of the Triton ``turbomix`` encode (:mod:`kvtool.kernels.triton_turbomix`),
a program per group and one launch each, where they were ~15 (outliers) and ~12 (candidates)
torch ops per encode: on a GPU host each op costs its dispatch, and a ``CompressedCache``
encodes every layer's keys and values at each block flush and in the prefill.

- :func:`_outliers_kernel`: the ``n`` channels of most energy (ties: the lowest channel, as the
  reference's stable sort), as the packed ``outlier_mask`` and both parts' channel lists in
  ascending order;
- :func:`_choose_kernel`: each group's candidate of least summed squared error over its tokens
  and parts (float64; ties: the lowest), its codes copied out, the norms rounded to fp16 (or
  coded to uint8, :mod:`kvtool.kernels.triton_turbomix_norms`), and whether every norm is
  finite and within fp16's range (the encode refuses the input otherwise);
- :func:`_rotation_kernel`: the choice alone, for ``select=scalar``'s probe (it writes no
  codes).
"""

from __future__ import annotations

import torch

from kvtool.codecs.norm_grid import _NORM_STEPS
from kvtool.codecs.turbo import FP16_MAX
from kvtool.kernels.triton_support import _jit, launch, next_power_of_2
from kvtool.kernels.triton_turbomix_norms import _block, _group_norm_codes

try:
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    tl = None

_BJ = 32  # energies compared per step of the outlier ranking
_TILE = 8192  # bytes of codes a step of a group's loop copies (a [tokens, bytes] tile)


# -- kernels -------------------------------------------------------------------------------------
@_jit
def _outliers_kernel(energy_ptr, mask_ptr, lo_ptr, hi_ptr, D: tl.constexpr, N_HI: tl.constexpr,
                     MASK_BYTES: tl.constexpr, BD: tl.constexpr, BJ: tl.constexpr):
    """Channel i is an outlier when fewer than ``N_HI`` channels come before it in (energy
    descending, channel ascending) order; a NaN energy counts as +inf, so the order is total
    and exactly ``N_HI`` channels are picked whatever the input."""
    g = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BD)
    e_i = tl.load(energy_ptr + g * D + i, mask=i < D, other=float("-inf"))
    e_i = tl.where(e_i == e_i, e_i, float("inf"))
    rank = tl.zeros([BD], tl.int32)
    for j0 in tl.static_range(0, BD, BJ):
        j = j0 + tl.arange(0, BJ)
        e_j = tl.load(energy_ptr + g * D + j, mask=j < D, other=float("-inf"))
        e_j = tl.where(e_j == e_j, e_j, float("inf"))[None, :]
        before = (e_j > e_i[:, None]) | ((e_j == e_i[:, None]) & (j[None, :] < i[:, None]))
        rank += tl.sum((before & (j < D)[None, :]).to(tl.int32), axis=1)
    outlier = (rank < N_HI) & (i < D)
    flag = outlier.to(tl.int32)
    hi_at = tl.cumsum(flag, axis=0) - flag  # outliers before channel i
    tl.store(hi_ptr + g * N_HI + hi_at, i, mask=outlier)
    tl.store(lo_ptr + g * (D - N_HI) + (i - hi_at), i, mask=(i < D) & ~outlier)
    bits = tl.reshape(flag, [BD // 8, 8]) << tl.arange(0, 8)[None, :]
    byte = tl.arange(0, BD // 8)
    tl.store(mask_ptr + g * MASK_BYTES + byte, tl.sum(bits, axis=1).to(tl.uint8),
             mask=byte < MASK_BYTES)


@_jit
def _norms_step(n_ptr, out_ptr, at, ok, FP16_LIMIT: tl.constexpr):
    """fp16 copies of the fp32 norms at ``at`` (masked by ``ok``); how many are past fp16's
    range or NaN."""
    n = tl.load(n_ptr + at, mask=ok, other=0.0)
    tl.store(out_ptr + at, n.to(tl.float16), mask=ok)
    return tl.sum((ok & ~(n <= FP16_LIMIT)).to(tl.int32), axis=0)


@_jit
def _copy_codes(codes_ptr, out_ptr, src, dst, ok, NB: tl.constexpr, BB: tl.constexpr):
    """Packed code rows ``src`` → ``dst`` (row indices [BT]) of ``NB`` bytes."""
    b = tl.arange(0, BB)
    m = ok[:, None] & (b < NB)[None, :]
    v = tl.load(codes_ptr + src[:, None] * NB + b[None, :], mask=m)
    tl.store(out_ptr + dst[:, None] * NB + b[None, :], v, mask=m)


@_jit
def _least_error(err_ptr, err2_ptr, base, rows, tokens, C, TWO: tl.constexpr, BT: tl.constexpr):
    """The candidate of least summed squared error over the group's tokens from ``base`` and
    its parts (float64; ties: the lowest)."""
    best = tl.program_id(0) * 0
    least = tl.full([], float("inf"), tl.float64)
    for c in range(C):
        acc = tl.zeros([BT], tl.float64)
        for t0 in range(0, tokens, BT):
            t = t0 + tl.arange(0, BT)
            at = base + t + c * rows
            acc += tl.load(err_ptr + at, mask=t < tokens, other=0.0).to(tl.float64)
            if TWO:
                acc += tl.load(err2_ptr + at, mask=t < tokens, other=0.0).to(tl.float64)
        total = tl.sum(acc, axis=0)
        best = tl.where(total < least, c, best)
        least = tl.minimum(total, least)
    return best


@_jit
def _rotation_kernel(err_ptr, err2_ptr, rot_ptr, rows, tokens, C, TWO: tl.constexpr,
                     BT: tl.constexpr):
    """rot[g]: group g's candidate of least error (``select=scalar``'s probe: no codes)."""
    g = tl.program_id(0).to(tl.int64)
    tl.store(rot_ptr + g, _least_error(err_ptr, err2_ptr, g * tokens, rows, tokens, C, TWO,
                                       BT).to(tl.uint8))


@_jit
def _choose_kernel(err_ptr, err2_ptr, codes_ptr, codes2_ptr, norms_ptr, norms2_ptr, out_ptr,
                   out2_ptr, n16_ptr, n16b_ptr, n8_ptr, n8b_ptr, range_ptr, range2_ptr, rot_ptr,
                   ok_ptr, rows, tokens, C, NB: tl.constexpr, NB2: tl.constexpr,
                   BB: tl.constexpr, TWO: tl.constexpr, CHOOSE: tl.constexpr,
                   NORM8: tl.constexpr, STEPS: tl.constexpr, FP16_LIMIT: tl.constexpr,
                   BT: tl.constexpr):
    """Group g's candidate (``CHOOSE``: rot[g], its codes to ``out``), fp16 norms (``NORM8``:
    uint8 codes and ranges of them) and ok[g]; ``TWO``: a second part (the outliers)."""
    g = tl.program_id(0).to(tl.int64)
    base = g * tokens
    best = tl.program_id(0) * 0
    if CHOOSE:
        best = _least_error(err_ptr, err2_ptr, base, rows, tokens, C, TWO, BT)
        tl.store(rot_ptr + g, best.to(tl.uint8))
    bad = tl.program_id(0) * 0
    for t0 in range(0, tokens, BT):
        t = t0 + tl.arange(0, BT)
        ok = t < tokens
        bad += _norms_step(norms_ptr, n16_ptr, base + t, ok, FP16_LIMIT)
        if TWO:
            bad += _norms_step(norms2_ptr, n16b_ptr, base + t, ok, FP16_LIMIT)
        if CHOOSE:
            src = best.to(tl.int64) * rows + base + t
            _copy_codes(codes_ptr, out_ptr, src, base + t, ok, NB, BB)
            if TWO:
                _copy_codes(codes2_ptr, out2_ptr, src, base + t, ok, NB2, BB)
    tl.store(ok_ptr + g, (bad == 0).to(tl.uint8))
    if NORM8:
        tl.debug_barrier()  # the fp16 norms above, stored by other threads of this program
        _group_norm_codes(n16_ptr + base, n8_ptr + base, range_ptr + 2 * g, tokens, STEPS, BT)
        if TWO:
            _group_norm_codes(n16b_ptr + base, n8b_ptr + base, range2_ptr + 2 * g, tokens,
                              STEPS, BT)


# -- host side -----------------------------------------------------------------------------------
def outlier_channels(energy: torch.Tensor, n_hi: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed ``outlier_mask`` uint8 [G, 1, ⌈D/8⌉], the other channels int32 [G, D − n_hi],
    the outliers int32 [G, n_hi]; both ascending) of channel energies float64 [G, D]."""
    groups, dim = energy.shape
    device, nbytes = energy.device, -(-dim // 8)
    mask = torch.empty((groups, 1, nbytes), dtype=torch.uint8, device=device)
    lo = torch.empty((groups, dim - n_hi), dtype=torch.int32, device=device)
    hi = torch.empty((groups, n_hi), dtype=torch.int32, device=device)
    if groups:
        bd = max(_BJ, next_power_of_2(dim))
        launch(_outliers_kernel, (groups,), (energy.contiguous(), mask, lo, hi),
               {"D": dim, "N_HI": n_hi, "MASK_BYTES": nbytes, "BD": bd, "BJ": _BJ})
    return mask, lo, hi


def choose(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], groups: int,
           tokens: int, norm_bits: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The encode's arrays of its parts' candidates (each (codes [C, R, nbytes], norms [R],
    errors [C, R]), R = groups · tokens): ``codes``/``norms`` (``_hi``: the second part's),
    ``norm_range`` with uint8 norms, ``rotation`` with candidates; and ok [G] (uint8: whether
    each group's norms are finite and within fp16's range)."""
    cands, rows, _ = parts[0][0].shape
    device = parts[0][0].device
    two, suffixes = len(parts) == 2, ("", "_hi")[:len(parts)]
    out: dict[str, torch.Tensor] = {}
    ok = torch.empty(groups, dtype=torch.uint8, device=device)
    n16 = [torch.empty((groups, tokens), dtype=torch.float16, device=device) for _ in parts]
    n8 = [torch.empty((groups, tokens), dtype=torch.uint8, device=device) for _ in parts] \
        if norm_bits == 8 else n16
    ranges = [torch.empty((groups, 1, 2), dtype=torch.float16, device=device) for _ in parts] \
        if norm_bits == 8 else n16
    if cands > 1:
        codes = [torch.empty((groups, tokens, c.shape[2]), dtype=torch.uint8, device=device)
                 for c, _, _ in parts]
        out["rotation"] = torch.empty((groups, 1), dtype=torch.uint8, device=device)
    else:
        codes = [c[0].view(groups, tokens, -1) for c, _, _ in parts]
    for suffix, c, nrm, rng in zip(suffixes, codes, n8, ranges, strict=True):
        out["codes" + suffix], out["norms" + suffix] = c, nrm
        if norm_bits == 8:
            out["norm_range" + suffix] = rng
    if groups:
        second = parts[-1]
        nb = [c.shape[2] for c, _, _ in parts]
        bb = next_power_of_2(max(nb))
        launch(_choose_kernel, (groups,), (
            parts[0][2], second[2], parts[0][0], second[0], parts[0][1], second[1], codes[0],
            codes[-1], n16[0], n16[-1], n8[0], n8[-1], ranges[0], ranges[-1],
            out.get("rotation", ok), ok, rows, tokens, cands),
            {"NB": nb[0], "NB2": nb[-1], "BB": bb, "TWO": two, "CHOOSE": cands > 1,
             "NORM8": norm_bits == 8, "STEPS": _NORM_STEPS, "FP16_LIMIT": FP16_MAX,
             "BT": min(max(16, _TILE // bb), _block(tokens))})
    elif norm_bits == 8:
        for rng in ranges:
            rng.zero_()
    return out, ok


def choose_rotation(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], groups: int,
                    tokens: int) -> torch.Tensor:
    """uint8 [G, 1]: each group's candidate of least summed error over its parts' errors
    [C, R] (float64, ties: the lowest, as :func:`choose`; its sums run in steps of up to 1024
    tokens, :func:`choose`'s in steps its code tiles fit), for a probe that wrote no codes."""
    err, second = parts[0][2], parts[-1][2]
    rotation = torch.empty((groups, 1), dtype=torch.uint8, device=err.device)
    if groups:
        launch(_rotation_kernel, (groups,), (err, second, rotation, err.shape[1], tokens,
                                             err.shape[0]),
               {"TWO": len(parts) == 2, "BT": _block(tokens)})
    return rotation


__all__ = ["choose", "choose_rotation", "outlier_channels"]
