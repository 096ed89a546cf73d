"""Triton kernels for the turbo2/turbo3/turbo4 codecs (CUDA; CPU under ``TRITON_INTERPRET=1``).

Same math and byte layout as :mod:`kvtool.codecs.turbo` (codes are LSB-first bit-packed like
:mod:`kvtool.kernels.bitpack`), for power-of-two head dims 16..256.

The rotation runs as a dense ``tl.dot`` on tensor cores without losing fp32 accuracy: the
entries of ``R`` are ``k/D`` with ``|k| ≤ D``, exact in fp16 and bf16, so an fp16/bf16 input
times ``R`` is a sum of exact products accumulated in fp32 (same numbers as the fp32 matmul of
the reference, up to summation order). fp32 operands (fp32 inputs, queries, centroids) are
split into bf16 pieces ``hi + mid + lo`` (exact with three pieces) and multiplied piece by
piece; 16-bit outputs use two pieces (about 2⁻¹⁷ relative, far below their rounding).

Encode and decode take a block of rows per program, autotuned; the decode's search adds blocks
in sub-tiles of ``SUB`` rows that load ``R`` once (where it fits in shared memory: D ≤ 128),
the next sub-tile's codes loaded while this one is computed (``benchmarks/triton_sass.py``
shows what each config compiles to). Decode attention from codes lives in
:mod:`kvtool.kernels.triton_attention` (:func:`turbo_decode_attention` here forwards to it).

The plumbing every Triton module shares (interpreter mode, decoration, launches) is in
:mod:`kvtool.kernels.triton_support`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any

import torch

from kvtool.codecs.lloyd_max import sphere_marginal_codebook
from kvtool.codecs.rotation import rotation_matrix
from kvtool.kernels.bitpack import group_shape
from kvtool.kernels.triton_support import (
    _INTERP,
    INTERPRET,
    _jit,
    _persisted,
    available,
    cdiv,
    launch,
    next_power_of_2,
    tl,
    triton,
)

name = "triton"
DIMS = (16, 32, 64, 128, 256)
BITS = (2, 3, 4)
_F16 = (torch.float16, torch.bfloat16)
_OUT = (torch.float32, torch.float16, torch.bfloat16)


def supported(dim: int, bits: int) -> bool:
    """Whether these kernels handle ``dim``/``bits`` (else the caller falls back)."""
    return dim in DIMS and bits in BITS


#: the encode's search, (BLOCK_M, warps, SUB, stages), each block one tile: it holds the winner
#: of every encode key in the H100's autotune table (ninth session, ``docs/gpu.md``: D 64/128,
#: 2-4 bits, both classes) and the runners-up of large blocks; 64-row blocks with 8 warps, 256
#: with 4, and a persistent prefetching grid lost every key (by 1.02-2.8×). ``Rᵀ`` goes 64
#: columns at a time: the quantiser over whole 128-wide rows took up to 1.5× the registers, and
#: 64-row sub-tiles gained or lost a few instructions a row by Triton version (sm_90)
_ENCODE_CONFIGS = ((64, 4, 0, 1), (128, 4, 0, 1), (128, 8, 0, 1), (256, 8, 0, 1))
#: the decode's search, (BLOCK_M, warps, SUB, stages): the H100's winners in one tile (128
#: rows with 4 warps won 6 of 7 keys, taking 255 registers a thread and spilling: 2 programs
#: an SM; 64 rows, 1), and blocks of 64-row sub-tiles that keep ``R``, the next one's codes
#: loaded ahead (2 stages): ~164 registers for about the same instructions a row, 3 programs
#: an SM, ``R`` read once per 256 or 512 rows (sm_90, Triton 3.6 and 3.9:
#: ``benchmarks/triton_sass.py``)
_DECODE_CONFIGS = ((64, 4, 64, 1), (128, 4, 128, 1), (256, 4, 64, 2), (512, 4, 64, 2))


def _tuned(fn: Any, configs: tuple[tuple[int, int, int, int], ...]) -> Any:
    """Autotune the row-block kernels on GPUs over ``configs`` (BLOCK_M, warps, SUB or 0 for a
    kernel without sub-tiles, pipeline stages; fixed block under the interpreter); the
    ``size_class`` argument (0: < 65536 rows) keeps small calls apart from bulk ones without
    compiling them apart (it is not specialised on: both classes share each config's binary).
    Each config is a compile on a process's first call; choices persist across processes
    (``cache_results``) where Triton offers it."""
    if triton is None or INTERPRET:
        return _jit(fn)
    configs = [triton.Config({"BLOCK_M": m} | ({"SUB": sub} if sub else {}), num_warps=w,
                             num_stages=stages) for m, w, sub, stages in configs]
    return triton.autotune(configs, key=["D", "BITS", "PIECES", "size_class"],
                           prune_configs_by={"early_config_prune": _prune},
                           **_persisted())(triton.jit(fn, do_not_specialize=["size_class"]))


def _prune(configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
    """Drop row blocks whose [BLOCK_M, D] tile ([SUB, D] where the rows go in sub-tiles) would
    not fit in registers (more than 128 elements per thread spills:
    ``benchmarks/triton_sass.py``), and at D=256 pipelined sub-tiles (their loop would hold
    several of R's chunks in shared memory: 336 KB on sm_90). Small calls (``size_class`` 0:
    a cache's block flushes, a load's layers) get the first config alone: on the H100 it ran
    within 13% of the best of them (~2 µs a call), where a search costs a process that meets a
    new key mid-generation the compile of every config (Triton 3.9+ launches a lone config
    untimed; older ones time it once, ~0.1 s)."""
    if named_args.get("size_class", kwargs.get("size_class", 1)) == 0:
        return configs[:1]
    dim = kwargs.get("D", named_args.get("D", 128))
    return [c for c in configs
            if c.kwargs.get("SUB", c.kwargs["BLOCK_M"]) * dim <= 128 * 32 * c.num_warps
            and not (dim > 128 and c.num_stages > 1)] or configs[:1]


# -- device helpers ------------------------------------------------------------------------------
@_jit
def _bf16(x):
    """fp32 → bf16, rounding to nearest even (by hand in the interpreter, which truncates)."""
    if _INTERP:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        return b.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(tl.bfloat16)


@_jit
def _output(x, ty: tl.constexpr):
    """fp32 ``x`` as a decoded output element of type ``ty``: bf16 rounded to nearest even,
    fp16 saturated at ±65504 (every backend's decode does both)."""
    if ty == tl.bfloat16:
        return _bf16(x)
    if ty == tl.float16:
        return tl.minimum(tl.maximum(x, -65504.0), 65504.0).to(tl.float16)
    return x.to(ty)


@_jit
def _split(x, PIECES: tl.constexpr):
    """fp32 ``x`` as bf16 pieces whose sum is ``x`` (exact for 3); unused pieces are ``hi``."""
    hi = _bf16(x)
    mid = hi
    lo = hi
    if PIECES >= 2:
        r = x - hi.to(tl.float32)
        mid = _bf16(r)
        if PIECES == 3:
            lo = _bf16(r - mid.to(tl.float32))
    return hi, mid, lo


@_jit
def _mm(acc, hi, mid, lo, m_ptr, k0, n0, D: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
        PIECES: tl.constexpr):
    """``acc + (hi + mid + lo) @ M[k0:k0+BK, n0:n0+BN]`` for a row-major ``M[D, D]``."""
    m = tl.load(m_ptr + (k0 + tl.arange(0, BK))[:, None] * D + (n0 + tl.arange(0, BN))[None, :])
    return _dots(acc, hi, mid, lo, m, PIECES)


@_jit
def _dots(acc, hi, mid, lo, m, PIECES: tl.constexpr):
    """``acc + (hi + mid + lo) @ m``, the small pieces first (the unused ones are ``hi``)."""
    if _INTERP:
        hi, mid, lo, m = hi.to(tl.float32), mid.to(tl.float32), lo.to(tl.float32), m.to(tl.float32)
    if PIECES == 3:
        acc = tl.dot(lo, m, acc)
    if PIECES >= 2:
        acc = tl.dot(mid, m, acc)
    return tl.dot(hi, m, acc)


@_jit
def _centroids(codes_ptr, row_off, rmask, cent_ptr, R: tl.constexpr, D: tl.constexpr,
               BITS: tl.constexpr, CPG: tl.constexpr, BPG: tl.constexpr):
    """fp32 centroids ``[R, D]`` of the packed rows starting at byte offsets ``row_off``."""
    gi = tl.arange(0, D // CPG)
    ptr = codes_ptr + row_off[:, None] + gi[None, :] * BPG
    g = tl.load(ptr, mask=rmask[:, None], other=0).to(tl.int32)
    for k in tl.static_range(1, BPG):
        g |= tl.load(ptr + k, mask=rmask[:, None], other=0).to(tl.int32) << (8 * k)
    shift = tl.arange(0, CPG) * BITS
    codes = (g[:, :, None] >> shift[None, None, :]) & ((1 << BITS) - 1)
    return tl.load(cent_ptr + tl.reshape(codes, [R, D]))


@_jit
def _quantize(u, bnd_ptr, BITS: tl.constexpr):
    """Index of ``u``'s bin among the ``2**BITS - 1`` sorted boundaries, as a branch-free binary
    search: BITS compares and ``2**(BITS-1) - 1`` selects of the next boundary, where counting
    the boundaries below ``u`` takes ``2**BITS - 1`` compares and adds (same result)."""
    if BITS == 2:
        p1 = u > tl.load(bnd_ptr + 1)
        p0 = u > tl.where(p1, tl.load(bnd_ptr + 2), tl.load(bnd_ptr + 0))
        return p1.to(tl.int32) * 2 + p0.to(tl.int32)
    elif BITS == 3:
        p2 = u > tl.load(bnd_ptr + 3)
        p1 = u > tl.where(p2, tl.load(bnd_ptr + 5), tl.load(bnd_ptr + 1))
        t0 = tl.where(p2, tl.where(p1, tl.load(bnd_ptr + 6), tl.load(bnd_ptr + 4)),
                      tl.where(p1, tl.load(bnd_ptr + 2), tl.load(bnd_ptr + 0)))
        p0 = u > t0
        return p2.to(tl.int32) * 4 + p1.to(tl.int32) * 2 + p0.to(tl.int32)
    else:
        p3 = u > tl.load(bnd_ptr + 7)
        p2 = u > tl.where(p3, tl.load(bnd_ptr + 11), tl.load(bnd_ptr + 3))
        t1 = tl.where(p3, tl.where(p2, tl.load(bnd_ptr + 13), tl.load(bnd_ptr + 9)),
                      tl.where(p2, tl.load(bnd_ptr + 5), tl.load(bnd_ptr + 1)))
        p1 = u > t1
        t0 = tl.where(p3,
                      tl.where(p2, tl.where(p1, tl.load(bnd_ptr + 14), tl.load(bnd_ptr + 12)),
                               tl.where(p1, tl.load(bnd_ptr + 10), tl.load(bnd_ptr + 8))),
                      tl.where(p2, tl.where(p1, tl.load(bnd_ptr + 6), tl.load(bnd_ptr + 4)),
                               tl.where(p1, tl.load(bnd_ptr + 2), tl.load(bnd_ptr + 0))))
        p0 = u > t0
        return (p3.to(tl.int32) * 8 + p2.to(tl.int32) * 4 + p1.to(tl.int32) * 2
                + p0.to(tl.int32))


# -- kernels -------------------------------------------------------------------------------------
@_jit
def _code_store(y, inv, bnd_ptr, codes_ptr, rows, rmask, n0, D: tl.constexpr, W: tl.constexpr,
                BITS: tl.constexpr, CPG: tl.constexpr, BPG: tl.constexpr):
    """Quantise the rotated columns ``n0 .. n0 + W`` of the rows (``y · inv``) and store them
    packed. 3-bit codes go out as 32-bit words (four 24-bit groups in three words) where ``W``
    fills whole words: stored a byte at a time, each row took ``3·W/8`` byte stores at a
    3-byte stride (``codes_ptr`` is a fresh, aligned allocation)."""
    code = _quantize(y * inv[:, None], bnd_ptr, BITS)
    shift = tl.arange(0, CPG) * BITS
    g = tl.sum(tl.reshape(code, [y.shape[0], W // CPG, CPG]) << shift[None, None, :], axis=2)
    if BPG == 3 and W % 32 == 0:
        even, odd = tl.split(tl.reshape(g, [y.shape[0], W // 32, 2, 2]))
        g0, g2 = tl.split(even)
        g1, g3 = tl.split(odd)
        words = (codes_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * (D * 3 // 32)
                 + n0 * 3 // 32 + tl.arange(0, W // 32)[None, :] * 3)
        tl.store(words, g0 | (g1 << 24), mask=rmask[:, None])
        tl.store(words + 1, (g1 >> 8) | (g2 << 16), mask=rmask[:, None])
        tl.store(words + 2, (g2 >> 16) | (g3 << 8), mask=rmask[:, None])
    else:
        ptr = (codes_ptr + rows[:, None] * (D * BITS // 8) + n0 * BITS // 8
               + tl.arange(0, W // CPG)[None, :] * BPG)
        for k in tl.static_range(BPG):
            tl.store(ptr + k, ((g >> (8 * k)) & 0xFF).to(tl.uint8), mask=rmask[:, None])


@partial(_tuned, configs=_ENCODE_CONFIGS)
def _encode_kernel(x_ptr, rt_ptr, bnd_ptr, codes_ptr, norms_ptr, n_rows, size_class,
                   D: tl.constexpr, BITS: tl.constexpr, CPG: tl.constexpr, BPG: tl.constexpr,
                   BN: tl.constexpr, PIECES: tl.constexpr, BLOCK_M: tl.constexpr):
    """One block of ``BLOCK_M`` rows per program, rotated ``BN`` columns of ``Rᵀ`` at a time."""
    cols = tl.arange(0, D)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < n_rows
    x = tl.load(x_ptr + rows[:, None] * D + cols[None, :], mask=rmask[:, None], other=0.0)
    xf = x.to(tl.float32)
    norm = tl.sqrt_rn(tl.sum(xf * xf, axis=1))
    tl.store(norms_ptr + rows, norm, mask=rmask)
    inv = tl.math.div_rn(tl.full([BLOCK_M], 1.0, tl.float32),
                         tl.where(norm > 0, norm, norm + 1))
    if PIECES == 1:  # fp16/bf16 input: one exact-product dot against R in the same dtype
        hi, mid, lo = x, x, x
    else:
        hi, mid, lo = _split(xf, PIECES)
    for n0 in tl.static_range(0, D, BN):  # y = x @ Rᵀ, BN columns at a time
        y = _mm(tl.zeros([BLOCK_M, BN], tl.float32), hi, mid, lo, rt_ptr, 0, n0, D, D, BN,
                PIECES)
        _code_store(y, inv, bnd_ptr, codes_ptr, rows, rmask, n0, D, BN, BITS, CPG, BPG)


@partial(_tuned, configs=_DECODE_CONFIGS)
def _decode_kernel(codes_ptr, norms_ptr, cent_ptr, r_ptr, out_ptr, n_rows, size_class,
                   D: tl.constexpr, BITS: tl.constexpr, CPG: tl.constexpr, BPG: tl.constexpr,
                   BK: tl.constexpr, PIECES: tl.constexpr, BLOCK_M: tl.constexpr,
                   SUB: tl.constexpr):
    """x̂ = y @ R for a block of ``BLOCK_M`` rows per program, ``SUB`` rows at a time. A block
    in sub-tiles loads ``R`` once, before them (it stays in shared memory for their dots),
    where it fits (D ≤ 128); a block in one tile, or at D=256, takes ``BK`` rows of ``R`` per
    dot (fewer registers for one tile)."""
    cols = tl.arange(0, D)
    keep_r: tl.constexpr = SUB < BLOCK_M and D <= 128
    if keep_r:
        m = tl.load(r_ptr + cols[:, None] * D + cols[None, :])
    for s in range(0, BLOCK_M, SUB):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + s + tl.arange(0, SUB)
        rmask = rows < n_rows
        if keep_r:
            y = _centroids(codes_ptr, rows * (D * BITS // 8), rmask, cent_ptr, SUB, D, BITS,
                           CPG, BPG)
            hi, mid, lo = _split(y, PIECES)
            acc = _dots(tl.zeros([SUB, D], tl.float32), hi, mid, lo, m, PIECES)
        else:
            acc = tl.zeros([SUB, D], tl.float32)
            for k0 in tl.static_range(0, D, BK):
                y = _centroids(codes_ptr, rows * (D * BITS // 8) + k0 * BITS // 8, rmask,
                               cent_ptr, SUB, BK, BITS, CPG, BPG)
                hi, mid, lo = _split(y, PIECES)
                acc = _mm(acc, hi, mid, lo, r_ptr, k0, 0, D, BK, D, PIECES)
        x = acc * tl.load(norms_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + rows[:, None] * D + cols[None, :],
                 _output(x, out_ptr.dtype.element_ty), mask=rmask[:, None])


@_jit
def _rotate_kernel(x_ptr, m_ptr, out_ptr, n_rows, scale, D: tl.constexpr, BK: tl.constexpr,
                   BLOCK_M: tl.constexpr):
    """``out = (x @ M) * scale`` in fp32 accuracy (queries: ``M = Rᵀ``)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < n_rows
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for k0 in tl.static_range(0, D, BK):
        x = tl.load(x_ptr + rows[:, None] * D + (k0 + tl.arange(0, BK))[None, :],
                    mask=rmask[:, None], other=0.0).to(tl.float32)
        hi, mid, lo = _split(x, 3)
        acc = _mm(acc, hi, mid, lo, m_ptr, k0, 0, D, BK, D, 3)
    tl.store(out_ptr + rows[:, None] * D + tl.arange(0, D)[None, :], acc * scale,
             mask=rmask[:, None])


@_jit
def _scores_kernel(q_ptr, codes_ptr, norms_ptr, cent_ptr, out_ptr, M, N, m_blocks, n_blocks,
                   D: tl.constexpr, BITS: tl.constexpr, CPG: tl.constexpr, BPG: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    nb, rest = pid % n_blocks, pid // n_blocks
    mb, batch = rest % m_blocks, (rest // m_blocks).to(tl.int64)
    ms = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, nmask = ms < M, ns < N
    q = tl.load(q_ptr + (batch * M + ms)[:, None] * D + tl.arange(0, D)[None, :],
                mask=mmask[:, None], other=0.0)
    keys = batch * N + ns
    y = _centroids(codes_ptr, keys * (D * BITS // 8), nmask, cent_ptr, BLOCK_N, D, BITS, CPG,
                   BPG)
    s = tl.dot(q, tl.trans(y), input_precision="tf32x3")
    s = s * tl.load(norms_ptr + keys, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + (batch * M + ms)[:, None] * N + ns[None, :], s,
             mask=mmask[:, None] & nmask[None, :])


# -- host side -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Rotation:
    rt16: torch.Tensor  # Rᵀ fp16 (encode fp16 input)
    rtb: torch.Tensor  # Rᵀ bf16 (encode bf16/fp32 input, query rotation)
    rb: torch.Tensor  # R bf16 (decode)
    r32: torch.Tensor  # R fp32 (attention: rotate the output back)


@lru_cache(maxsize=64)
def _rotation(dim: int, seed: int, device: torch.device) -> _Rotation:
    # R's entries are k/dim up to float64 residue (≤ 1e-14/dim, left where k = 0 for odd powers
    # of two): drop it, so the 16-bit copies are exact (it is far below fp32 resolution anyway)
    k = torch.from_numpy(rotation_matrix(dim, seed).astype("float64") * dim)
    if (k - k.round()).abs().max() > 1e-6:  # pragma: no cover - a rotation.py change
        raise ValueError("rotation entries must be multiples of 1/dim to run in 16-bit dots")
    r = (k.round() / dim).float()
    rt = r.T.contiguous()
    return _Rotation(rt.to(device, torch.float16), rt.to(device, torch.bfloat16),
                     r.to(device, torch.bfloat16), r.to(device))


@lru_cache(maxsize=64)
def _codebook(dim: int, bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(boundaries, centroids) as fp32 device tensors."""
    book = sphere_marginal_codebook(dim, 1 << bits)
    return (torch.from_numpy(book.boundaries.copy()).to(device),
            torch.from_numpy(book.centroids.copy()).to(device))


def _check(dim: int, bits: int) -> None:
    if not supported(dim, bits):
        raise ValueError(f"triton turbo kernels support dims {DIMS} and bits {BITS}, "
                         f"got dim={dim} bits={bits}")


def _rows_launch(rows: int, sub: bool = False) -> dict[str, Any]:
    """Grid and fixed meta-parameters of the row-block kernels (``sub``: the decode's; under
    the interpreter its blocks go in two sub-tiles, so the loop over them runs)."""
    if INTERPRET:
        return {"grid": (cdiv(rows, 32),), "meta": {"BLOCK_M": 32} | ({"SUB": 16} if sub else {})}
    return {"grid": lambda meta: (cdiv(rows, meta["BLOCK_M"]),), "meta": {}}


def turbo_encode(x: torch.Tensor, bits: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes ``[..., D*bits/8]``, fp32 norms ``[...]``) of ``x[..., D]``."""
    dim = x.shape[-1]
    _check(dim, bits)
    lead = tuple(x.shape[:-1])
    if x.dtype not in _OUT:
        x = x.float()
    x2 = x.reshape(-1, dim).contiguous()
    rows, nb = x2.shape[0], dim * bits // 8
    codes = torch.empty((rows, nb), dtype=torch.uint8, device=x.device)
    norms = torch.empty((rows,), dtype=torch.float32, device=x.device)
    if rows:
        rot = _rotation(dim, seed, x.device)
        cpg, bpg = group_shape(bits)
        plan, size_class = _rows_launch(rows), int(rows >= 1 << 16)
        launch(_encode_kernel, plan["grid"], (
            x2, rot.rt16 if x2.dtype == torch.float16 else rot.rtb,
            _codebook(dim, bits, x.device)[0], codes, norms, rows, size_class),
            {"D": dim, "BITS": bits, "CPG": cpg, "BPG": bpg, "BN": min(dim, 64),
             "PIECES": 1 if x2.dtype in _F16 else 3, **plan["meta"]}, (size_class,))
    return codes.reshape(*lead, nb), norms.reshape(lead)


def turbo_decode(codes: torch.Tensor, norms: torch.Tensor, dim: int, bits: int, seed: int,
                 out_dtype: torch.dtype | str) -> torch.Tensor:
    """x̂ ``[..., dim]`` in ``out_dtype`` (fp32/fp16/bf16) from packed codes and norms."""
    if isinstance(out_dtype, str):  # the codecs' dtype names
        out_dtype = getattr(torch, out_dtype)
    _check(dim, bits)
    nb = dim * bits // 8
    if codes.shape[-1] != nb or tuple(norms.shape) != tuple(codes.shape[:-1]):
        raise ValueError(f"codes {tuple(codes.shape)} / norms {tuple(norms.shape)} do not match "
                         f"dim={dim} bits={bits}")
    if out_dtype not in _OUT:
        raise ValueError(f"unsupported output dtype {out_dtype}")
    lead = tuple(codes.shape[:-1])
    c2, n2 = codes.reshape(-1, nb).contiguous(), norms.reshape(-1).contiguous()
    out = torch.empty((c2.shape[0], dim), dtype=out_dtype, device=codes.device)
    if c2.shape[0]:
        rows = c2.shape[0]
        cpg, bpg = group_shape(bits)
        plan, size_class = _rows_launch(rows, sub=True), int(rows >= 1 << 16)
        launch(_decode_kernel, plan["grid"], (
            c2, n2, _codebook(dim, bits, codes.device)[1], _rotation(dim, seed, codes.device).rb,
            out, rows, size_class),
            {"D": dim, "BITS": bits, "CPG": cpg, "BPG": bpg, "BK": min(dim, 64),
             "PIECES": 3 if out_dtype == torch.float32 else 2, **plan["meta"]}, (size_class,))
    return out.reshape(*lead, dim)


def _rotate(x: torch.Tensor, m: torch.Tensor, scale: float) -> torch.Tensor:
    """``(x[rows, D] @ m) * scale`` in fp32."""
    rows, dim = x.shape
    out = torch.empty((rows, dim), dtype=torch.float32, device=x.device)
    if rows:
        launch(_rotate_kernel, (cdiv(rows, 16),), (x.contiguous(), m, out, rows, float(scale)),
               {"D": dim, "BK": min(dim, 64), "BLOCK_M": 16})
    return out


def turbo_scores(q: torch.Tensor, codes: torch.Tensor, norms: torch.Tensor, bits: int,
                 seed: int) -> torch.Tensor:
    """fp32 ``q·k̂`` ``[..., M, N]`` for q ``[..., M, D]`` and packed keys ``[..., N, nbytes]``."""
    dim = q.shape[-1]
    _check(dim, bits)
    nb = dim * bits // 8
    if codes.shape[-1] != nb:
        raise ValueError(f"codes have {codes.shape[-1]} bytes per row, expected {nb}")
    lead = torch.broadcast_shapes(q.shape[:-2], codes.shape[:-2], norms.shape[:-1])
    m, n = q.shape[-2], codes.shape[-2]
    batch = int(torch.Size(lead).numel())
    q_rot = _rotate(q.expand(*lead, m, dim).reshape(-1, dim),
                    _rotation(dim, seed, q.device).rtb, 1.0)
    c3 = codes.expand(*lead, n, nb).reshape(batch, n, nb).contiguous()
    n3 = norms.expand(*lead, n).reshape(batch, n).contiguous()
    out = torch.empty((*lead, m, n), dtype=torch.float32, device=q.device)
    block_m = min(64, max(16, next_power_of_2(m)))
    block_n = 64 if dim <= 128 else 32
    m_blocks, n_blocks = cdiv(m, block_m), cdiv(n, block_n)
    if out.numel():
        cpg, bpg = group_shape(bits)
        launch(_scores_kernel, (batch * m_blocks * n_blocks,), (
            q_rot, c3, n3, _codebook(dim, bits, q.device)[1], out, m, n, m_blocks, n_blocks),
            {"D": dim, "BITS": bits, "CPG": cpg, "BPG": bpg, "BLOCK_M": block_m,
             "BLOCK_N": block_n})
    return out


def turbo_decode_attention(q: torch.Tensor, k_codes: torch.Tensor, k_norms: torch.Tensor,
                           v_codes: torch.Tensor, v_norms: torch.Tensor, **kwargs: Any
                           ) -> torch.Tensor:
    """Split-K decode attention from turbo codes: served by
    :func:`kvtool.kernels.triton_attention.turbo_decode_attention` (same arguments)."""
    from kvtool.kernels.triton_attention import turbo_decode_attention as attend

    return attend(q, k_codes, k_norms, v_codes, v_norms, **kwargs)


__all__ = ["name", "available", "supported", "turbo_encode", "turbo_decode", "turbo_scores",
           "turbo_decode_attention", "INTERPRET"]
