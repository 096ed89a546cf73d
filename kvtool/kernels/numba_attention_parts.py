"""Compiled CPU attention straight from ``turbomix`` codes of every option (numba).

:mod:`kvtool.kernels.numba_attention` reads the scalar codebook's codes of one rotated part
(the ``quality`` preset). This kernel reads what the other presets write: up to two parts per
vector (the outlier channels and the rest, each with its own channel set per block, rotation,
bit width and norm), the scalar, ``vq=2`` pair or trellis quantiser, uint8 or fp16 norms
(dequantised by the caller: one float per token and part), centered keys and values.

Per block (one group: a head's tokens encoded together) and part ``p`` with channels ``ch_p``
and rotation ``R_p`` (the block's candidate), a key is ``k̂[ch_p] = ‖k_p‖ · (y_p @ R_p) +
mean[ch_p]`` with ``y_p`` the part's unit-domain values, so a score is ``Σ_p ‖k_p‖ · (R_p
q[ch_p])·y_p + q·mean``: each query part is rotated once per block, and every score reads the
values straight from the codes, a tile of tokens at a time, decoded transposed so that every
loop runs over the tile's tokens (:func:`~kvtool.kernels.numba_quantizers.tile_values`, which
the presets' decode shares). Values are summed per block in each part's rotated domain and
rotated back into their channels when the block ends (``n_p²`` multiply-adds per query row and
block). The tasks' partial softmax states are merged, and the
exact tokens attended, by :func:`numba_attention.merge_exact`.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, NamedTuple

import numba
import numpy as np
from numba import prange

from kvtool.kernels.numba_attention import (
    _FAST,
    MIN_TOKENS_PER_TASK,
    TILE,
    _dot,
    _softmax_step,
    merge_exact,
)
from kvtool.kernels.numba_quantizers import (
    PAIR,
    QUANTIZERS,
    SCALAR,
    TRELLIS,
    _dense,
    tile_values,
)
from kvtool.kernels.numba_support import jit
from kvtool.kernels.numba_turbomix import decode_table, subset_masks


class RoleCodes(NamedTuple):
    """One role's (keys' or values') encoded tokens for :func:`attend`: ``E`` tokens in blocks
    of ``block``, ``BH`` = batch · KV heads; part 1 is empty (width 0) without outliers."""

    codes0: np.ndarray  # uint8 [BH, E, bytes0]: the packed codes of part 0 (the other channels)
    codes1: np.ndarray  # uint8 [BH, E, bytes1]: part 1 (the outlier channels)
    norms: np.ndarray  # float32 [2, BH, E]: each part's norm
    channels0: np.ndarray  # int32 [BH, blocks, n0]: part 0's channels per block
    channels1: np.ndarray  # int32 [BH, blocks, n1]
    rot0: np.ndarray  # float32 [C, n0, n0]: R of each candidate rotation
    rot1: np.ndarray  # float32 [C, n1, n1]
    rot0_t: np.ndarray  # float32 [C, n0, n0]: Rᵀ (the query's rotation reads its rows)
    rot1_t: np.ndarray  # float32 [C, n1, n1]
    choice: np.ndarray  # uint8 [BH, blocks]: each block's candidate
    mean: np.ndarray  # float32 [BH, blocks, D], or [0, 0, 0]: uncentered
    #: float32: scalar centroids, pair points (flat [x0, y0, ...]), or the trellis codebook's
    #: sorted levels
    table0: np.ndarray
    table1: np.ndarray
    #: uint32 [2]: the trellis subsets (:func:`~kvtool.kernels.numba_quantizers.trellis_codes`;
    #: unused by the other quantisers)
    subsets: np.ndarray
    kind: int  # SCALAR, PAIR or TRELLIS
    bits0: int
    bits1: int


@numba.njit(inline="always")
def _scores(q, values, a, b, acc):
    """``acc[a:b] = values[:, a:b]ᵀ q``: one part's dot products with a query row, a
    vectorised loop over the tile's tokens per channel.

    Here and below, loops over ``[a, b)`` run from 0 over slices: numba wraps every index it
    cannot prove non-negative, and the wrap stops the compiler vectorising (16x slower)."""
    out = acc[a:b]
    for t in range(out.shape[0]):
        out[t] = 0.0
    for j in range(q.shape[0]):
        c = q[j]
        row = values[j, a:b]
        for t in range(out.shape[0]):
            out[t] += c * row[t]


@numba.njit(inline="always")
def _weigh(weights, values, a, b, acc):
    """``acc += values[:, a:b] @ weights[a:b]``: one part's weighted value sum."""
    w = weights[a:b]
    for d in range(acc.shape[0]):
        s = np.float32(0.0)
        row = values[d, a:b]
        for t in range(w.shape[0]):
            s += w[t] * row[t]
        acc[d] += s


@numba.njit(inline="always")
def _rotate_query(qs, channels, rot_t, part, out):
    """out[r] = R q_s[r, channels] for every query row (``rot_t``: Rᵀ; ``part``: a scratch
    shaped as ``out`` of the gathered query parts, so that the products run over rows of Rᵀ)."""
    for r in range(qs.shape[0]):
        for j in range(channels.shape[0]):
            part[r, j] = qs[r, channels[j]]
    _dense(rot_t, out, part, False)


@numba.njit(inline="always")
def _flush(acc, channels, rot, o, tmp):
    """o[r, channels] += acc[r] @ R, then acc = 0: a block's value sum back in its channels
    (``tmp``: a scratch shaped as ``acc``)."""
    _dense(rot, tmp, acc, False)
    for r in range(acc.shape[0]):
        for e in range(channels.shape[0]):
            o[r, channels[e]] += tmp[r, e]
            acc[r, e] = 0.0


def _attend_impl(q, kr, vr, eye, ke, ve, bias, causal, scale, splits, block, out):
    """See :func:`attend`."""
    batch, hq, nq, dim = q.shape
    bh_count, n_enc = kr.norms.shape[1], kr.norms.shape[2]
    hkv = bh_count // batch
    groups = hq // hkv
    rows = groups * nq
    tasks = bh_count * splits
    neg = np.float32(-np.inf)
    kn0, kn1 = kr.channels0.shape[2], kr.channels1.shape[2]
    vn0, vn1 = vr.channels0.shape[2], vr.channels1.shape[2]
    k_centered, v_centered = kr.mean.shape[0] > 0, vr.mean.shape[0] > 0
    pm = np.empty((tasks, rows), np.float32)
    pl = np.empty((tasks, rows), np.float32)
    pacc = np.empty((tasks, 1, rows, dim), np.float32)  # already in the channels

    for task in prange(tasks):
        bh, part = task // splits, task % splits
        b, h = bh // hkv, bh % hkv
        lo, hi = part * n_enc // splits, (part + 1) * n_enc // splits
        qs = np.empty((rows, dim), np.float32)
        for r in range(rows):
            qh = q[b, h * groups + r // nq, r % nq]
            for d in range(dim):
                qs[r, d] = qh[d] * scale
        q0 = np.empty((rows, kn0), np.float32)
        q1 = np.empty((rows, kn1), np.float32)
        qm = np.zeros(rows, np.float32)
        m = np.full(rows, neg, np.float32)
        ls = np.zeros(rows, np.float32)
        o = np.zeros((rows, dim), np.float32)
        acc0 = np.zeros((rows, vn0), np.float32)
        acc1 = np.zeros((rows, vn1), np.float32)
        wsum = np.zeros(rows, np.float32)
        pq0, pq1 = np.empty_like(q0), np.empty_like(q1)  # scratch of the rotations
        pv0, pv1 = np.empty_like(acc0), np.empty_like(acc1)
        packed = np.empty((dim, TILE), np.uint8)  # scratch of tile_values
        qt = np.empty((dim, TILE), np.uint8)
        state = np.empty(TILE, np.uint32)
        kt0 = np.empty((kn0, TILE), np.float32)  # the tile's values, transposed
        kt1 = np.empty((kn1, TILE), np.float32)
        vt0 = np.empty((vn0, TILE), np.float32)
        vt1 = np.empty((vn1, TILE), np.float32)
        s = np.empty((rows, TILE), np.float32)
        s0 = np.empty(TILE, np.float32)
        s1 = np.empty(TILE, np.float32)
        sc0 = np.empty((rows, TILE), np.float32)  # each part's scores
        sc1 = np.empty((rows, TILE), np.float32)
        k_block = v_block = -1
        for t0 in range(lo, hi, TILE):
            n = min(TILE, hi - t0)
            tile_values(kr.codes0[bh, t0:t0 + n], n, kn0, kr.bits0, kr.kind, kr.table0,
                         kr.subsets, packed, qt, state, kt0)
            if kn1:
                tile_values(kr.codes1[bh, t0:t0 + n], n, kn1, kr.bits1, kr.kind, kr.table1,
                             kr.subsets, packed, qt, state, kt1)
            norm0 = kr.norms[0, bh, t0:t0 + n]
            norm1 = kr.norms[1, bh, t0:t0 + n]
            a = 0
            while a < n:  # the tile's tokens of one block at a time
                blk = (t0 + a) // block
                z = min(n, (blk + 1) * block - t0)
                if blk != k_block:
                    k_block = blk
                    c = kr.choice[bh, blk]
                    _rotate_query(qs, kr.channels0[bh, blk], kr.rot0_t[c], pq0, q0)
                    if kn1:
                        _rotate_query(qs, kr.channels1[bh, blk], kr.rot1_t[c], pq1, q1)
                    if k_centered:
                        for r in range(rows):
                            qm[r] = _dot(qs[r], kr.mean[bh, blk])
                n0, n1 = norm0[a:z], norm1[a:z]
                if z - a == TILE:  # the whole tile: contiguous, every row at once
                    _dense(kt0, sc0, q0, False)
                    if kn1:
                        _dense(kt1, sc1, q1, False)
                else:
                    for r in range(rows):
                        _scores(q0[r], kt0, a, z, sc0[r])
                        if kn1:
                            _scores(q1[r], kt1, a, z, sc1[r])
                for r in range(rows):
                    sr, bias_r, x0, x1 = s[r, a:z], qm[r], sc0[r, a:z], sc1[r, a:z]
                    if kn1:
                        for t in range(z - a):
                            sr[t] = n0[t] * x0[t] + n1[t] * x1[t] + bias_r
                    else:
                        for t in range(z - a):
                            sr[t] = n0[t] * x0[t] + bias_r
                a = z
            for r in range(rows):
                alpha = _softmax_step(s, m, ls, r, n)
                if alpha != 1.0:
                    for d in range(dim):
                        o[r, d] *= alpha
                    for d in range(vn0):
                        acc0[r, d] *= alpha
                    for d in range(vn1):
                        acc1[r, d] *= alpha
                    wsum[r] *= alpha
            tile_values(vr.codes0[bh, t0:t0 + n], n, vn0, vr.bits0, vr.kind, vr.table0,
                         vr.subsets, packed, qt, state, vt0)
            if vn1:
                tile_values(vr.codes1[bh, t0:t0 + n], n, vn1, vr.bits1, vr.kind, vr.table1,
                             vr.subsets, packed, qt, state, vt1)
            norm0 = vr.norms[0, bh, t0:t0 + n]
            norm1 = vr.norms[1, bh, t0:t0 + n]
            a = 0
            while a < n:
                blk = (t0 + a) // block
                z = min(n, (blk + 1) * block - t0)
                if blk != v_block:
                    if v_block >= 0:
                        _flush_block(vr, bh, v_block, acc0, acc1, wsum, o, pv0, pv1, v_centered)
                    v_block = blk
                n0, n1, x0, x1 = norm0[a:z], norm1[a:z], s0[a:z], s1[a:z]
                for r in range(rows):
                    sr = s[r, a:z]
                    total = np.float32(0.0)
                    for t in range(z - a):
                        w = sr[t]
                        total += w
                        x0[t] = w * n0[t]
                        x1[t] = w * n1[t]
                    wsum[r] += total
                    _weigh(s0, vt0, a, z, acc0[r])
                    if vn1:
                        _weigh(s1, vt1, a, z, acc1[r])
                a = z
        if v_block >= 0:
            _flush_block(vr, bh, v_block, acc0, acc1, wsum, o, pv0, pv1, v_centered)
        pm[task] = m
        pl[task] = ls
        pacc[task, 0] = o

    for bh in prange(bh_count):
        merge_exact(bh, q, pm, pl, pacc, eye, ke, ve, bias, causal, scale, splits, hkv, groups,
                    out)


@numba.njit(inline="always")
def _flush_block(vr, bh, blk, acc0, acc1, wsum, o, pv0, pv1, centered):
    """A block's value sums (each part's, and the weights' for its mean) into ``o``."""
    c = vr.choice[bh, blk]
    _flush(acc0, vr.channels0[bh, blk], vr.rot0[c], o, pv0)
    if acc1.shape[1]:
        _flush(acc1, vr.channels1[bh, blk], vr.rot1[c], o, pv1)
    if centered:
        mean = vr.mean[bh, blk]
        for r in range(o.shape[0]):
            w = wsum[r]
            for d in range(o.shape[1]):
                o[r, d] += w * mean[d]
    for r in range(o.shape[0]):
        wsum[r] = 0.0


_serial = jit(fastmath=_FAST, nogil=True)(_attend_impl)
_parallel = jit(fastmath=_FAST, nogil=True, parallel=True)(_attend_impl)


def attend(q: np.ndarray, keys: RoleCodes, values: RoleCodes, ke: np.ndarray, ve: np.ndarray,
           bias: np.ndarray | None, causal: bool, scale: float, out: np.ndarray, block: int,
           threads: int = 1) -> np.ndarray:
    """Softmax attention of ``q`` over encoded tokens (``keys``/``values``, :class:`RoleCodes`)
    and exact ones, into ``out``: the arguments and semantics of
    :func:`kvtool.kernels.numba_attention.attend` otherwise."""
    n_enc = keys.norms.shape[2]
    splits = 1
    if threads > 1 and n_enc >= 2 * MIN_TOKENS_PER_TASK:
        splits = int(min(threads, n_enc // MIN_TOKENS_PER_TASK))
    fn = _parallel if threads > 1 else _serial
    if bias is None:
        bias = np.zeros((0, 0, 0), np.float32)
    dim = q.shape[-1]
    eye = _eye(dim)
    fn(q, keys, values, eye, ke, ve, bias, causal, np.float32(scale), splits,
       block if block > 0 else max(1, n_enc), out)
    return out


@lru_cache(maxsize=8)
def _eye(dim: int) -> np.ndarray:
    return np.eye(dim, dtype=np.float32)[None]


def role_codes(codec: Any, arrays: dict[str, np.ndarray], heads: int, tokens: int,
               block: int, dim: int) -> RoleCodes:
    """:class:`RoleCodes` of a ``turbomix`` (or ``turbo``) codec's arrays for ``heads`` =
    batch · KV heads rows of ``tokens`` encoded tokens of ``dim`` channels in blocks of
    ``block`` (numpy arrays of the codec's encode, the blocks joined: ``codes`` [heads, tokens,
    bytes] and so on)."""
    from kvtool.codecs.turbomix import norm_values

    n_hi = codec._split(dim)[0] if hasattr(codec, "_split") else 0
    blocks = tokens // block
    quantizer = getattr(codec, "quantizer", "scalar")
    kind = QUANTIZERS[quantizer]
    groups = heads * blocks
    if n_hi:
        mask = np.unpackbits(arrays["outlier_mask"].reshape(groups, -1), axis=-1, count=dim,
                             bitorder="little").astype(bool)
        channels = [np.nonzero(~mask)[1].reshape(heads, blocks, dim - n_hi),
                    np.nonzero(mask)[1].reshape(heads, blocks, n_hi)]
    else:
        channels = [np.broadcast_to(np.arange(dim), (heads, blocks, dim)),
                    np.zeros((heads, blocks, 0), np.int64)]
    norms = np.zeros((2, heads, tokens), np.float32)
    for p, suffix in enumerate(("", "_hi")[:1 + bool(n_hi)]):
        raw = arrays["norms" + suffix]
        if getattr(codec, "norm_bits", 16) == 8:
            raw = norm_values(raw.reshape(groups, block), arrays["norm_range" + suffix]
                              .reshape(groups, 2))
        norms[p] = raw.reshape(heads, tokens)
    bits = (codec.bits, getattr(codec, "outlier_bits", 0) if n_hi else 0)
    seeds = _seeds(codec)
    # writable copies: one array type for numba (RoleCodes' arrays are all writable)
    tables = [np.array(decode_table(quantizer, b, ch.shape[-1])) if ch.shape[-1]
              else np.zeros(1, np.float32)
              for b, ch in zip(bits, channels, strict=True)]
    rots = [_rotations(ch.shape[-1], seeds) for ch in channels]
    choice = arrays["rotation"].reshape(heads, blocks) if "rotation" in arrays \
        else np.zeros((heads, blocks), np.uint8)
    mean = arrays["mean"].reshape(heads, blocks, dim).astype(np.float32) if "mean" in arrays \
        else np.zeros((0, 0, 0), np.float32)
    return RoleCodes(
        np.ascontiguousarray(arrays["codes"].reshape(heads, tokens, -1)),
        np.ascontiguousarray(arrays["codes_hi"].reshape(heads, tokens, -1)) if n_hi
        else np.zeros((heads, tokens, 1), np.uint8),
        norms, np.ascontiguousarray(channels[0], np.int32),
        np.ascontiguousarray(channels[1], np.int32), rots[0][0], rots[1][0], rots[0][1],
        rots[1][1],
        np.ascontiguousarray(choice, np.uint8), np.ascontiguousarray(mean), tables[0], tables[1],
        np.array(subset_masks()), kind, bits[0], max(bits[1], 1))


def _seeds(codec: Any) -> tuple[int, ...]:
    from kvtool.codecs.turbomix import candidate_seed

    return tuple(candidate_seed(codec.seed, c) for c in range(getattr(codec, "candidates", 1)))


@lru_cache(maxsize=64)
def _rotations(n: int, seeds: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """R and Rᵀ [C, n, n] of each candidate's seed (float32; [C, 0, 0] for an empty part)."""
    from kvtool.codecs.rotation import rotation_matrix

    rot = np.ascontiguousarray(np.stack([rotation_matrix(n, s) for s in seeds]) if n
                               else np.zeros((len(seeds), 0, 0)), np.float32)
    return rot, np.ascontiguousarray(rot.transpose(0, 2, 1))


__all__ = ["PAIR", "SCALAR", "TRELLIS", "RoleCodes", "attend", "role_codes"]
