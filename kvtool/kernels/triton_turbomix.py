"""Triton kernels for ``turbomix`` (CUDA; CPU tensors under ``TRITON_INTERPRET=1``).

The fused numba design (:mod:`kvtool.kernels.numba_turbomix`) on the GPU, every array staying
on ``x``'s device (the small tables — rotations, codebooks, trellis subsets — are built once on
the host and cached per device):

- :func:`_stats_kernel`: per group the channel means (float64 sums, rounded to fp16 as stored)
  and the channel energies after centering (float64); the top-n outlier channels by energy
  (ties: the lowest channel) and each part's channels, in one launch
  (:mod:`kvtool.kernels.triton_turbomix_select`);
- :func:`_encode_kernel`, once per part: gather the part's channels minus the mean, the norm,
  then per candidate rotation ``u = t·R_cᵀ`` as tensor-core dots with exact fp32 products
  (``t`` split in three bf16 pieces; ``R_c`` is exact in bf16 at power-of-two widths, whose
  two Hadamard rounds are one dense matrix of k/n entries here, as in
  :mod:`kvtool.kernels.triton_cuda`, and split too at other widths), the quantiser
  (scalar by binary search, ``vq=2`` pairs by an argmax over the 2-D codebook, or the 32-state
  trellis: a Viterbi pass over ``[BLOCK_M, 32]`` path costs with one uint32 of decisions per
  row and coordinate, then a traceback per row), LSB-first packing and each row's squared
  error; a program per group then keeps its least-error candidate (ties: the lowest), with
  its codes and norms (:mod:`kvtool.kernels.triton_turbomix_select`). ``select=scalar``: the
  candidates are scored with the scalar codebook first, and the trellis or pair quantiser then
  runs once, each group with its chosen rotation (``HAS_CHOICE``): no host round trip;
- :func:`_decode_kernel`: unpack, look up, rotate back with the group's candidate, scale by the
  norm, add the mean and store the part's channels in the output dtype.

The tile steps (rotations, packing, lookups, quantisers, the trellis search) are in
:mod:`kvtool.kernels.triton_turbomix_steps`. Ties follow the reference: the lowest bucket, the
lowest pair index, the lower predecessor state, the lowest final state, the lowest candidate.
Sums run in another order than the reference's, so a coordinate within float rounding of a
decision may decide the other way.
"""

from __future__ import annotations

from functools import lru_cache, partial
from typing import Any, NoReturn

import numpy as np
import torch

from kvtool.errors import CodecError
from kvtool.kernels.device_checks import check_values, require
from kvtool.kernels.triton_cuda import _output
from kvtool.kernels.triton_support import (
    INTERPRET,
    _jit,
    _persisted,
    _sm_count,
    available,
    cdiv,
    launch,
    next_power_of_2,
)
from kvtool.kernels.triton_turbomix_norms import norm_codes, norm_values
from kvtool.kernels.triton_turbomix_select import choose, choose_rotation, outlier_channels
from kvtool.kernels.triton_turbomix_steps import (
    _pack,
    _pairs,
    _part,
    _rot,
    _scalar,
    _trellis,
    _values,
)
from kvtool.kernels.triton_turbomix_tables import (
    _rotation_rows,
    _rotations,
    _seeds,
    _tables,
    _width,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None

name = "triton"
SCALAR, PAIR, TRELLIS = 0, 1, 2
QUANTIZERS = {"scalar": SCALAR, "pair": PAIR, "trellis": TRELLIS}
_INPUT = (torch.float32, torch.float16, torch.bfloat16)


#: (rows per program, warps) of the autotune search; the encode adds tiles of a row per thread.
#: 32 or 64 rows with 8 warps lost every key of the H100's autotune table (ninth session,
#: ``docs/gpu.md``) by 1.07-2.23×: not searched (each config is a compile on first use)
_CONFIGS = ((16, 4), (16, 8), (32, 4), (64, 4))
_ROW_CONFIGS = ((16, 1), (32, 1), (64, 2))
_MOST_ROWS = max(m for m, _ in _CONFIGS + _ROW_CONFIGS)  # a program's rows, at most


_KEY = ("N", "NP", "BITS", "QUANT", "RP", "tok_class")


def _tuned(fn: Any, configs: tuple[tuple[int, int], ...] = _CONFIGS,
           key: tuple[str, ...] = _KEY) -> Any:
    """Autotune rows per program (``BM``) and warps on GPUs (fixed under the interpreter; the
    results persist across processes where Triton can); the ``tok_class`` argument (tokens per
    group, capped at 64) keeps short groups apart (tuned apart, compiled once: it is not
    specialised on)."""
    if triton is None or INTERPRET:
        return _jit(fn)
    return triton.autotune([triton.Config({"BM": m}, num_warps=w, num_stages=1)
                            for m, w in configs],
                           key=list(key),
                           prune_configs_by={"early_config_prune": _prune},
                           **_persisted())(triton.jit(fn, do_not_specialize=["tok_class"]))


def _prune(configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
    """No more rows per program than a group has (16 at least), and [BM, NP] tiles that fit
    in registers. Tiles of a row per thread (BM ≥ 32 × warps, or one warp) are for the
    trellis search alone: its [32 states, BM] path costs then stay in each thread's registers
    (compiled for sm_90, its step is ~20 warp-instructions per row where it was ~170 with the
    states across a warp's lanes); everything else keeps 4 and 8 warps."""
    most = max(16, named_args.get("tok_class", kwargs.get("tok_class", 64)))
    width = kwargs.get("NP", named_args.get("NP", 128))
    fits = [c for c in configs if c.kwargs["BM"] <= most and c.kwargs["BM"] * width <= 8192]
    if kwargs.get("QUANT", named_args.get("QUANT", 0)) == TRELLIS:
        rows = [c for c in fits if c.kwargs["BM"] >= 32 * c.num_warps]
        if rows or any(c.num_warps < 4 for c in fits):
            return rows or [c for c in fits if c.num_warps == 1]
    return [c for c in fits if c.num_warps >= 4] or configs[:2]


# -- kernels -------------------------------------------------------------------------------------
@_jit
def _stats_kernel(x_ptr, mean_ptr, energy_ptr, tokens, D: tl.constexpr, BD: tl.constexpr,
                  BT: tl.constexpr, CENTER: tl.constexpr, ENERGY: tl.constexpr):
    """mean[g] (fp16, as stored) and energy[g] = Σ (x − mean)² (float64) per channel."""
    g = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    cmask = cols < D
    m = tl.zeros([BD], tl.float32)
    if CENTER:
        acc = tl.zeros([BD], tl.float64)
        for t0 in range(0, tokens, BT):
            tt = t0 + tl.arange(0, BT)
            v = tl.load(x_ptr + (g * tokens + tt)[:, None] * D + cols[None, :],
                        mask=(tt < tokens)[:, None] & cmask[None, :], other=0.0)
            acc += tl.sum(v.to(tl.float32).to(tl.float64), axis=0)
        m = (acc / tokens).to(tl.float32).to(tl.float16).to(tl.float32)
        tl.store(mean_ptr + g * D + cols, m.to(tl.float16), mask=cmask)
    if ENERGY:
        acc2 = tl.zeros([BD], tl.float64)
        for t0 in range(0, tokens, BT):
            tt = t0 + tl.arange(0, BT)
            ok = (tt < tokens)[:, None] & cmask[None, :]
            v = tl.load(x_ptr + (g * tokens + tt)[:, None] * D + cols[None, :], mask=ok,
                        other=0.0)
            a = tl.where(ok, v.to(tl.float32) - m[None, :], 0.0).to(tl.float64)
            acc2 += tl.sum(a * a, axis=0)
        tl.store(energy_ptr + g * D + cols, acc2, mask=cmask)


#: the encode's work per row differs C-fold between one chosen candidate and all of them, and
#: by the packing a probe skips: each tunes its own tile
@partial(_tuned, configs=_CONFIGS + _ROW_CONFIGS, key=_KEY + ("HAS_CHOICE", "CODES"))
def _encode_kernel(x_ptr, mean_ptr, ch_ptr, ch_stride, rt_ptr, bnd_ptr, cent_ptr, pts_ptr,
                   hsq_ptr, lvl_ptr, edge_ptr, choice_ptr, codes_ptr, norms_ptr, err_ptr, u_scr,
                   dec_scr, q_scr, rows, tokens, groups, C, tok_class,
                   D: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, NB: tl.constexpr,
                   BITS: tl.constexpr, CPG: tl.constexpr, BPG: tl.constexpr,
                   QUANT: tl.constexpr, PER: tl.constexpr, RP: tl.constexpr,
                   HAS_MEAN: tl.constexpr, ALL_CH: tl.constexpr, HAS_CHOICE: tl.constexpr,
                   CODES: tl.constexpr, KR: tl.constexpr, BM: tl.constexpr,
                   BK: tl.constexpr):
    """codes[c, r], err[c, r] per candidate c and norms[r] of one part (``HAS_CHOICE``: only
    group g's candidate ``choice[g]``, as c = 0: ``select=scalar``; not ``CODES``: the
    errors and norms alone, ``select=scalar``'s probe), for items (token
    blocks of one group) pid, pid + programs, ...; the scalar and pair quantisers rotate the
    part gathered once for its norm, in one dot per piece (sm_90: half the loads of gathering
    it again per candidate), or (``KR`` < ``NP``: :func:`_rotation_rows`) ``KR`` rows of the
    rotation per dot, the part's columns reloaded; the trellis sums the rotation over BK-wide
    chunks of the part (reloaded: few registers beside its path costs), and its state goes
    through this program's scratch (stored [NP, BM]: a coordinate's rows are contiguous)."""
    pid = tl.program_id(0)
    lanes = tl.arange(0, BM)
    jp = tl.arange(0, NP)
    scr = pid.to(tl.int64) * (NP * BM)
    per_group = tl.cdiv(tokens, BM)
    for item in range(pid, groups * per_group, tl.num_programs(0)):
        g = item // per_group
        tok = (item % per_group) * BM + lanes
        rmask = tok < tokens
        r = g.to(tl.int64) * tokens + tok
        chg = ch_ptr + g * ch_stride
        t = _part(x_ptr, mean_ptr, chg, g, r, rmask, jp, N, D, HAS_MEAN, ALL_CH)
        nrm = tl.sqrt_rn(tl.sum(t * t, axis=1))
        tl.store(norms_ptr + r, nrm, mask=rmask)
        n16 = nrm.to(tl.float16).to(tl.float32)
        inv = tl.math.div_rn(tl.full([BM], 1.0, tl.float32), tl.where(nrm > 0, nrm, nrm + 1))
        for c in range(C):
            if HAS_CHOICE:
                rot = rt_ptr + tl.load(choice_ptr + g).to(tl.int64) * (RP * NP * NP)
            else:
                rot = rt_ptr + c * (RP * NP * NP)
            out = codes_ptr + (c * rows + r) * NB
            if QUANT == 2:  # u to the scratch a column chunk at a time: few live registers
                # (loops, not unrolled: (NP/BK)² chunk products took sm_90's compile 190-245 s
                # per config at NP=256, 11-16 s at 128)
                for n0 in range(0, NP, BK):
                    u = tl.zeros([BM, BK], tl.float32)
                    for k0 in range(0, NP, BK):
                        tk = _part(x_ptr, mean_ptr, chg, g, r, rmask, k0 + tl.arange(0, BK), N,
                                   D, HAS_MEAN, ALL_CH)
                        u = _rot(u, tk, rot, k0, N, NP, BK, RP, True, n0)
                    tl.store(u_scr + scr + (n0 + tl.arange(0, BK))[None, :] * BM
                             + lanes[:, None], u)
                err = _trellis(u_scr + scr, dec_scr + scr, q_scr + scr, inv, n16, lvl_ptr,
                               edge_ptr, N, BM, BITS, PER)
                q = tl.load(q_scr + scr + jp[None, :] * BM + lanes[:, None],
                            mask=(jp < N)[None, :], other=0).to(tl.int32)
                tl.debug_barrier()
            else:
                if KR == NP:
                    u = _rot(tl.zeros([BM, NP], tl.float32), t, rot, 0, N, NP, NP, RP)
                else:  # KR rows of the rotation per dot, the part's columns reloaded
                    u = tl.zeros([BM, NP], tl.float32)
                    for k0 in range(0, NP, KR):
                        tk = _part(x_ptr, mean_ptr, chg, g, r, rmask, k0 + tl.arange(0, KR), N,
                                   D, HAS_MEAN, ALL_CH)
                        u = _rot(u, tk, rot, k0, N, NP, KR, RP)
                y = u * inv[:, None]
                if QUANT == 0:
                    q, v = _scalar(y, bnd_ptr, cent_ptr, BITS)
                else:
                    q, v = _pairs(y, pts_ptr, hsq_ptr, BM, NP, BITS)
                d = tl.where((jp < N)[None, :], u - n16[:, None] * v, 0.0)
                err = tl.sum(d * d, axis=1)
                q = tl.where((jp < N)[None, :], q, 0)
            if CODES:
                _pack(q, out, rmask, NB, BM, NP, BITS, CPG, BPG)
            tl.store(err_ptr + c * rows + r, err, mask=rmask)


@_tuned
def _decode_kernel(codes_ptr, norms_ptr, choice_ptr, ch_ptr, ch_stride, mean_ptr, r_ptr,
                   cent_ptr, pts_ptr, slv_ptr, out_ptr, tokens, tok_class,
                   D: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, NB: tl.constexpr,
                   BITS: tl.constexpr, QUANT: tl.constexpr, RP: tl.constexpr,
                   HAS_MEAN: tl.constexpr, HAS_CHOICE: tl.constexpr, ALL_CH: tl.constexpr,
                   BM: tl.constexpr, BK: tl.constexpr):
    """out[r, ch[g]] = norm[r] · values(codes[r]) @ R_c + mean[g, ch[g]], c = choice[g], in
    fp32 accuracy, then rounded once (every output dtype: each value within a step of the
    reference's). ``ALL_CH``: the part is every channel (a part's channels ascend, so in
    order): rows are stored whole, in vector stores."""
    pid = tl.program_id(0)
    per_group = tl.cdiv(tokens, BM)
    g = pid // per_group
    tok = (pid % per_group) * BM + tl.arange(0, BM)
    rmask = tok < tokens
    r = g.to(tl.int64) * tokens + tok
    row_ptr = codes_ptr + r * NB
    c = 0
    if HAS_CHOICE:
        c = tl.load(choice_ptr + g).to(tl.int32)
    acc = tl.zeros([BM, NP], tl.float32)
    for k0 in tl.static_range(0, NP, BK):
        y = _values(row_ptr, rmask, k0 + tl.arange(0, BK), cent_ptr, pts_ptr, slv_ptr,
                    N, NB, BITS, QUANT, BM, BK)
        acc = _rot(acc, y, r_ptr + c * (RP * NP * NP), k0, N, NP, BK, RP)
    v = acc * tl.load(norms_ptr + r, mask=rmask, other=0.0).to(tl.float32)[:, None]
    cols = tl.arange(0, NP)
    if ALL_CH:
        ch = cols
    else:
        ch = tl.load(ch_ptr + g * ch_stride + cols, mask=cols < N, other=0)
    if HAS_MEAN:
        v += tl.load(mean_ptr + g * D + ch, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + r[:, None] * D + ch[None, :], _output(v, out_ptr.dtype.element_ty),
             mask=rmask[:, None] & (cols < N)[None, :])


# -- host side -----------------------------------------------------------------------------------
#: rows of persistent trellis programs per SM: its kernel takes all 255 registers a thread, so an
#: SM holds 8 warps (two per scheduler, to hide each other's loads), a warp per 32 rows
_TRELLIS_ROWS_PER_SM = 8 * 32


def _trellis_programs(sms: int, block: int) -> int:
    """Persistent trellis programs of ``block`` rows: as many as the SMs hold at once, since
    each works through its share of the items with its own scratch (at most
    ``_TRELLIS_ROWS_PER_SM`` rows of it per SM)."""
    return sms * _TRELLIS_ROWS_PER_SM // max(block, 32)


def _launch(tokens: int, items: Any) -> tuple[Any, dict[str, Any], int]:
    """(grid, fixed meta-parameters, tok_class) of a kernel over ``items(BM)`` programs: BM
    autotuned on GPUs; under the interpreter (whose cost is per op, not per element) a whole
    group per program where it has up to 64 tokens."""
    tok_class = min(64, next_power_of_2(tokens))
    if INTERPRET:
        block = max(16, tok_class)
        return (items(block),), {"BM": block, "num_warps": 4}, tok_class
    return lambda meta: (items(meta["BM"]),), {}, tok_class


def word_aligned(codes: torch.Tensor) -> torch.Tensor:
    """``codes`` (contiguous) at a 4-byte-aligned address, copied if a view starts elsewhere:
    the kernels read trellis rows of whole words as 32-bit words."""
    codes = codes.contiguous()
    return codes if codes.data_ptr() % 4 == 0 else codes.clone()


@lru_cache(maxsize=16)
def _all_channels(dim: int, device: torch.device) -> torch.Tensor:
    """int32 [1, D]: the one part of a codec without outliers (read-only, kept per device)."""
    return torch.arange(dim, dtype=torch.int32, device=device)[None, :]


@lru_cache(maxsize=16)
def _unused(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Placeholders for the trellis scratch that other quantisers never touch."""
    return tuple(torch.empty(1, dtype=t, device=device)
                 for t in (torch.float32, torch.int32, torch.int8))


def _encode_part(codec: Any, rows: torch.Tensor, tokens: int, channels: torch.Tensor,
                 mean: torch.Tensor | None, bits: int, quantizer: str,
                 choice: torch.Tensor | None = None, probe: bool = False
                 ) -> tuple[Any, Any, Any]:
    """(codes [C, R, nbytes] uint8, norms [R] fp32, errors [C, R] fp32) of one part: every
    candidate, or (``choice`` [G]) each group's own, as C = 1; a ``probe`` writes no codes
    (an empty [C, R, 0])."""
    from kvtool.kernels.bitpack import group_shape

    n, device = channels.shape[1], rows.device
    (nrows, dim), width, nb = rows.shape, _width(n), (n * bits + 7) // 8
    seeds = _seeds(codec)
    rt, _, pieces = _rotations(n, seeds, device)
    tab = _tables(n, bits, quantizer, device)
    groups, sms = nrows // tokens, _sm_count(device)
    trellis = quantizer == "trellis"
    # other quantisers need no scratch: a program per item, which the GPU schedules as their
    # registers allow (a fixed 4 per SM outnumbered the 2-3 of quality's configs that fit on
    # sm_90, so the rest ran in a second wave)
    grid, meta, tok_class = _launch(tokens, lambda bm: min(
        groups * cdiv(tokens, bm), _trellis_programs(sms, bm)) if trellis
        else groups * cdiv(tokens, bm))
    if trellis:  # this launch's own: the kernel writes it (rows its programs hold at once:
        # a block flush's few groups need far less than every SM's share)
        size = min(sms * _TRELLIS_ROWS_PER_SM, groups * (tokens + _MOST_ROWS - 1)) * width
        scratch = tuple(torch.empty(size, dtype=t, device=device)
                        for t in (torch.float32, torch.int32, torch.int8))
    else:
        scratch = _unused(device)
    kept = len(seeds) if choice is None else 1
    codes = torch.empty((kept, nrows, 0 if probe else nb), dtype=torch.uint8, device=device)
    norms = torch.empty(nrows, dtype=torch.float32, device=device)
    err = torch.empty((kept, nrows), dtype=torch.float32, device=device)
    cpg, bpg = group_shape(bits)
    launch(_encode_kernel, grid, (
        rows, mean if mean is not None else norms, channels,
        channels.shape[1] if channels.shape[0] > 1 else 0, rt, tab["bnd"], tab["cent"],
        tab["pts"], tab["hsq"], tab["lvl"], tab["edge"], codes if choice is None else choice,
        codes, norms, err, *scratch, nrows, tokens, groups, kept, tok_class),
        {"D": dim, "N": n, "NP": width, "NB": nb, "BITS": bits, "CPG": cpg, "BPG": bpg,
         "QUANT": QUANTIZERS[quantizer], "PER": 1 << (bits - 1), "RP": pieces,
         "HAS_MEAN": mean is not None, "ALL_CH": channels.shape[1] == dim,
         "HAS_CHOICE": choice is not None, "CODES": not probe,
         "KR": _rotation_rows(width, pieces), "BK": min(width, 32),
         "enable_fp_fusion": False, **meta}, (tok_class,))
    return codes, norms, err


def encode(codec: Any, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """``turbomix`` arrays of ``x[..., tokens, dim]`` (a CUDA tensor; CPU under the
    interpreter) on its device, in the shapes of ``codec.expected_arrays``."""
    shape, dim = tuple(x.shape), x.shape[-1]
    if dim < 2:
        raise CodecError(f"{codec.codec_id}: head_dim must be at least 2")
    n_hi = codec._split(dim)[0]
    tokens = shape[-2] if len(shape) > 1 else 1
    rows = (x if x.dtype in _INPUT else x.float()).reshape(-1, dim).contiguous()
    groups, device = rows.shape[0] // tokens, rows.device
    out: dict[str, torch.Tensor] = {}
    mean = energy = None
    if codec.center or n_hi:
        mean = torch.empty((groups, dim), dtype=torch.float16, device=device)
        energy = torch.empty((groups, dim), dtype=torch.float64, device=device)
        bd = min(64, next_power_of_2(dim))
        launch(_stats_kernel, (groups, cdiv(dim, bd)), (rows, mean, energy, tokens),
               {"D": dim, "BD": bd, "BT": 16, "CENTER": codec.center, "ENERGY": n_hi > 0})
    if codec.center:
        out["mean"] = mean
    parts = [(_all_channels(dim, device), codec.bits)]
    if n_hi:
        out["outlier_mask"], lo, top = outlier_channels(energy, n_hi)
        parts = [(lo, codec.bits), (top, codec.outlier_bits)]
    centered = mean if codec.center else None
    choice = None
    if codec._selects_by_scalar():  # each group's rotation by the scalar codebook: only it runs
        probe = [_encode_part(codec, rows, tokens, ch, centered, bits, "scalar", probe=True)
                 for ch, bits in parts]
        choice = choose_rotation(probe, groups, tokens)
    encoded = [_encode_part(codec, rows, tokens, ch, centered, bits, codec.quantizer, choice)
               for ch, bits in parts]
    chosen, ok = choose(encoded, groups, tokens, codec.norm_bits)
    out.update(chosen)
    if choice is not None:
        out["rotation"] = choice

    def fail() -> NoReturn:  # NaN/Inf input, or a norm past fp16's range
        from kvtool.kernels import check_finite, torch_ops

        check_finite(torch_ops, x, codec.codec_id)
        raise CodecError(f"{codec.codec_id}: vector norm exceeds the fp16 range")

    require(ok.all(), fail)
    return {k: out[k].reshape(spec.shape)
            for k, spec in codec.expected_arrays(shape, "float32").items()}


def channel_sets_of(codec: Any, arrays: dict[str, torch.Tensor], groups: int, dim: int,
                    check: bool = True) -> list[torch.Tensor]:
    """Each part's channels, int32 [G, n] ascending (the other channels, then the outliers;
    [1, D] for all of them without outliers). ``check`` refuses a mask that does not name
    ``outliers`` channels (a host sync; skip it for arrays this process encoded)."""
    n_hi = codec._split(dim)[0] if hasattr(codec, "_split") else 0
    device = arrays["codes"].device
    if not n_hi:
        return [torch.arange(dim, dtype=torch.int32, device=device)[None, :]]
    packed = arrays["outlier_mask"].reshape(groups, -1)
    bits = (packed[..., None].int() >> torch.arange(8, device=device, dtype=torch.int32)) & 1
    mask = bits.reshape(groups, -1)[:, :dim].to(torch.uint8)
    if check and bool((mask.sum(1) != n_hi).any()):
        raise CodecError(f"{codec.codec_id}: an outlier mask does not name {n_hi} of "
                         f"{dim} channels, which no writer stores")
    order = torch.sort(mask, dim=1, stable=True).indices.int()
    return [order[:, :dim - n_hi].contiguous(), order[:, dim - n_hi:].contiguous()]


def _check(codec: Any, a: dict[str, torch.Tensor], shape: tuple[int, ...]) -> None:
    """Refuse arrays no encode of ``shape`` writes (see ``TurboMixCodec._check_decodable``)."""
    for key, spec in codec.expected_arrays(shape, "float32").items():
        got = a.get(key)
        if got is None or got.numel() != int(np.prod(spec.shape, dtype=np.int64)) \
                or str(got.dtype).removeprefix("torch.") != spec.dtype:
            raise CodecError(f"{codec.codec_id}: array {key!r} does not match an encode "
                             f"of shape {shape}, which no writer stores")
    if "rotation" in a and a["rotation"].numel() and check_values() \
            and int(a["rotation"].max()) >= codec.candidates:
        raise CodecError(f"{codec.codec_id}: a rotation index is past candidates="
                         f"{codec.candidates}, which no writer stores")


def decode(codec: Any, arrays: dict[str, torch.Tensor], shape: tuple[int, ...],
           dtype: str) -> torch.Tensor:
    """x̂ [shape] in ``dtype`` (float32/float16/bfloat16) from the codec's arrays (tensors on
    one device: CUDA, or CPU under the interpreter), without leaving the device."""
    dim = shape[-1]
    _check(codec, arrays, shape)
    tokens = shape[-2] if len(shape) > 1 else 1
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    groups = rows // max(tokens, 1)
    device = next(iter(arrays.values())).device
    out = torch.empty((rows, dim), dtype=getattr(torch, dtype), device=device)
    if not rows:
        return out.reshape(shape)
    channel_sets = channel_sets_of(codec, arrays, groups, dim, check_values())
    mean = arrays["mean"].reshape(groups, dim).contiguous() if codec.center else None
    choice = arrays["rotation"].reshape(groups).int().contiguous() \
        if "rotation" in arrays else None
    seeds = _seeds(codec)
    grid, meta, tok_class = _launch(tokens, lambda bm: groups * cdiv(tokens, bm))
    for suffix, channels, bits in zip(("", "_hi"), channel_sets,
                                      (codec.bits, codec.outlier_bits), strict=False):
        n = channels.shape[1]
        norms = arrays["norms" + suffix].reshape(groups, tokens)
        if codec.norm_bits == 8:
            norms = norm_values(norms, arrays["norm_range" + suffix].reshape(groups, 2),
                                check_values())
        _, r, pieces = _rotations(n, seeds, device)
        tab = _tables(n, bits, codec.quantizer, device)
        launch(_decode_kernel, grid, (
            word_aligned(arrays["codes" + suffix].reshape(rows, -1)),
            norms.reshape(-1).contiguous(),
            choice if choice is not None else channels, channels,
            n if channels.shape[0] > 1 else 0, mean if mean is not None else out, r, tab["cent"],
            tab["pts"], tab["slv"], out, tokens, tok_class),
            {"D": dim, "N": n, "NP": _width(n), "NB": (n * bits + 7) // 8, "BITS": bits,
             "QUANT": QUANTIZERS[codec.quantizer], "RP": pieces, "HAS_MEAN": mean is not None,
             "HAS_CHOICE": choice is not None, "ALL_CH": n == dim, "BK": min(_width(n), 32),
             "enable_fp_fusion": False, **meta}, (tok_class,))
    return out.reshape(shape)


__all__ = ["INTERPRET", "QUANTIZERS", "available", "channel_sets_of", "decode", "encode", "name",
           "norm_codes", "norm_values", "word_aligned"]
