"""Compiled CPU attention straight from turbo codes (numba): no K̂/V̂ is ever materialised.

A turbo key is ``k̂ = ‖k‖ · Rᵀ c`` with ``c[d] = centroids[code[d]]``, so a score is
``q·k̂ = ‖k‖ · (R q)·c``: each query is rotated once (``q @ R_kᵀ``, with the softmax scale folded
in) and every score is a dot product of the rotated query with the centroids read straight from
the packed bytes. Values are summed in the rotated domain, ``Σ p_j v̂_j = (Σ p_j ‖v_j‖ c_j) @ R_v``,
and rotated back once per query row at the end.

Layout. One "row" is one (query head, query token) pair; the ``G = Hq / Hkv`` query heads of a
KV head (GQA) share its code rows, which are unpacked once per tile and used for all ``G · Q``
rows. Encoded tokens are split over (batch · KV head, token range) tasks spread over numba's
threads; each task runs a tiled online softmax (:data:`TILE` tokens at a time: unpack the keys of
the tile, score them, rescale, unpack each value row and accumulate). A second pass per
(batch, KV head) merges the tasks' partial softmax states, rotates the value sum back and
continues the same softmax over the exact (full-precision) tokens, which are visible by the
causal rule (new tokens last) or an additive bias, then normalises.

Unpacking: LSB-first packed codes are read a byte (2 and 4 bits: 4 or 2 codes) or a 6-bit chunk
(3 bits: two codes; a group of 8 codes is 3 bytes) at a time and looked up in a small table of
the chunk's centroid values (:func:`chunk_table`).
"""

from __future__ import annotations

from functools import lru_cache

import numba
import numpy as np
from numba import prange
from numba.core.errors import NumbaError as BuildError  # a kernel that fails to compile

from kvtool.kernels.numba_support import f16_to_f32, jit, u32_as_f32, warn_fallback

TILE = 64  # tokens unpacked and scored together: 64 rows of up to 128 floats stay in L1/L2
BITS = (2, 3, 4)  # code widths the kernels unpack
MIN_TOKENS_PER_TASK = 256  # below this, one task per (batch, KV head): threads cost more
#: most query rows (query heads per KV head × query tokens) worth reading codes for: beyond it
#: (prefill chunks) decoding once per forward and a BLAS attention cost less than these loops
MAX_ROWS = 48
_FAST = {"nsz", "arcp", "contract", "afn", "reassoc"}  # no nnan/ninf: -inf marks masked tokens


@lru_cache(maxsize=32)
def _chunk_table(bits: int, values: bytes) -> np.ndarray:
    vals = np.frombuffer(values, dtype=np.float32)
    per, width = (4, 8) if bits == 2 else (2, 8) if bits == 4 else (2, 6)
    rows = np.arange(1 << width)[:, None]
    table = np.ascontiguousarray(vals[(rows >> (bits * np.arange(per))) & ((1 << bits) - 1)])
    table = table.view(np.uint64)  # pairs of float32 values: one 8-byte copy per pair
    table.setflags(write=False)
    return table


def chunk_table(bits: int, centroids: np.ndarray) -> np.ndarray:
    """The centroids of the codes packed in each chunk — a byte holding 4 two-bit or 2 four-bit
    codes, 6 bits holding 2 three-bit codes — as ``uint64`` ``[2**width, per / 2]``: each item
    is the bits of two consecutive float32 centroid values."""
    values = np.ascontiguousarray(centroids, dtype=np.float32)
    if values.shape != (1 << bits,):
        raise ValueError(f"need {1 << bits} centroids for {bits}-bit codes, got {values.shape}")
    return _chunk_table(bits, values.tobytes())


@numba.njit(inline="always")
def _unpack(row, bits, table, out):
    """Centroid values of one packed code row into ``out`` (``uint64`` [dim / 2]: float pairs)."""
    half = out.shape[0]
    if bits == 4:
        for k in range(half):
            out[k] = table[row[k], 0]
    elif bits == 2:
        for k in range(half // 2):
            b = row[k]
            out[2 * k] = table[b, 0]
            out[2 * k + 1] = table[b, 1]
    else:  # 3 bits: 8 codes in 3 bytes, read as four 6-bit chunks of two codes
        for g in range(half // 4):
            u = np.int64(row[3 * g]) | (np.int64(row[3 * g + 1]) << 8) \
                | (np.int64(row[3 * g + 2]) << 16)
            out[4 * g] = table[u & 63, 0]
            out[4 * g + 1] = table[(u >> 6) & 63, 0]
            out[4 * g + 2] = table[(u >> 12) & 63, 0]
            out[4 * g + 3] = table[u >> 18, 0]


@numba.njit(inline="always")
def _exp(x):
    """exp(x) for x ≤ 0 in float32 (relative error < 3e-7), inlined so loops vectorise.

    Cody–Waite reduction ``x = n·ln2 + r``, ``|r| ≤ ln2/2``, and a degree-7 Taylor polynomial.
    ``-inf`` (anything below -87) gives 2**-126 instead of 0: a weight of ~1e-38.
    """
    x = max(x, np.float32(-87.3))
    n = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
    r = (x - n * np.float32(0.693145751953125)) - n * np.float32(1.428606765330187e-06)
    p = np.float32(1.0 / 5040.0)
    p = p * r + np.float32(1.0 / 720.0)
    p = p * r + np.float32(1.0 / 120.0)
    p = p * r + np.float32(1.0 / 24.0)
    p = p * r + np.float32(1.0 / 6.0)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    return p * u32_as_f32(np.uint32(np.int32(n) + 127) << np.uint32(23))


@numba.njit(inline="always")
def _dot(a, b):
    s = np.float32(0.0)
    for d in range(a.shape[0]):
        s += a[d] * b[d]
    return s


@numba.njit(inline="always")
def _softmax_step(s, m, ls, r, n):
    """One block of the online softmax for query row ``r``: raise its running max ``m[r]``
    over the scores ``s[r, :n]``, turn them into their weights in place and add those to
    ``ls[r]``; returns the factor by which the row's earlier sums must be scaled."""
    top = m[r]
    for t in range(n):
        top = max(top, s[r, t])
    alpha = _exp(m[r] - top)
    m[r] = top
    total = ls[r] * alpha
    for t in range(n):
        p = _exp(s[r, t] - top)
        s[r, t] = p
        total += p
    ls[r] = total
    return alpha


@numba.njit(fastmath=_FAST, nogil=True)
def merge_exact(bh, q, pm, pl, pacc, v_r, ke, ve, bias, causal, scale, splits, hkv, groups,
                out):
    """Merge the tasks' partial softmax states of (batch, KV head) ``bh``, rotate the value sum
    back (``pacc`` [tasks, rotations, rows, D] times ``v_r`` [rotations, D, D]), continue the
    same softmax over the exact tokens and write the normalised rows into ``out``."""
    batch, hq, nq, dim = q.shape
    rows, nv, n_exact = groups * nq, v_r.shape[0], ke.shape[2]
    neg = np.float32(-np.inf)
    b, h = bh // hkv, bh % hkv
    kx, vx = ke[b, h], ve[b, h]
    top = np.full(rows, neg, np.float32)
    for part in range(splits):
        for r in range(rows):
            top[r] = max(top[r], pm[bh * splits + part, r])
    total = np.zeros(rows, np.float32)
    rot = np.zeros((nv, rows, dim), np.float32)
    for part in range(splits):
        task = bh * splits + part
        for r in range(rows):
            f = _exp(pm[task, r] - top[r]) if pl[task, r] > 0 else np.float32(0.0)
            total[r] += pl[task, r] * f
            for c in range(nv):
                for d in range(dim):
                    rot[c, r, d] += f * pacc[task, c, r, d]
    o = np.zeros((rows, dim), np.float32)
    qx = np.empty((rows, dim), np.float32)
    for r in range(rows):
        for c in range(nv):
            for d in range(dim):  # Σ over rotations of (Σ p ‖v‖ c) @ R_v
                x = rot[c, r, d]
                if x != 0.0:
                    for e in range(dim):
                        o[r, e] += x * v_r[c, d, e]
        qh = q[b, h * groups + r // nq, r % nq]
        for d in range(dim):
            qx[r, d] = qh[d] * scale
    sx = np.empty((rows, n_exact), np.float32)
    for j in range(n_exact):  # exact scores, masked ones -inf
        kj = kx[j]
        for r in range(rows):
            i = r % nq
            if causal and j > n_exact - nq + i:
                sx[r, j] = neg
                continue
            v = _dot(qx[r], kj)
            if bias.shape[0] > 0:
                v += bias[min(b, bias.shape[0] - 1), i, j]
            sx[r, j] = v
    for r in range(rows):
        new_top = top[r]
        for j in range(n_exact):
            new_top = max(new_top, sx[r, j])
        alpha = _exp(top[r] - new_top)
        total[r] *= alpha
        for d in range(dim):
            o[r, d] *= alpha
        for j in range(n_exact):
            p = _exp(sx[r, j] - new_top) if sx[r, j] != neg else np.float32(0.0)
            sx[r, j] = p
            total[r] += p
    for j in range(n_exact):
        vj = vx[j]
        for r in range(rows):
            p = sx[r, j]
            if p != 0.0:
                for d in range(dim):
                    o[r, d] += p * vj[d]
    for r in range(rows):
        inv = np.float32(1.0) / total[r]
        dst = out[b, r % nq, h * groups + r // nq]
        for d in range(dim):
            dst[d] = o[r, d] * inv


def _attend_impl(q, kc, kn, kbits, ktab, k_rt, krot, kmean, vc, vn, vbits, vtab, v_r, vrot,
                 block, ke, ve, bias, causal, scale, splits, out):
    """See :func:`attend`."""
    batch, hq, nq, dim = q.shape
    bh_count, n_enc = kn.shape
    hkv = bh_count // batch
    groups = hq // hkv
    rows = groups * nq  # row r: query head h·groups + r // nq, query token r % nq
    tasks = bh_count * splits
    neg = np.float32(-np.inf)
    nk, nv = k_rt.shape[0], v_r.shape[0]  # rotations in use (turbomix: its candidates)
    centered = kmean.shape[0] > 0
    pm = np.empty((tasks, rows), np.float32)
    pl = np.empty((tasks, rows), np.float32)
    pacc = np.empty((tasks, nv, rows, dim), np.float32)

    for task in prange(tasks):  # encoded tokens: a partial softmax per (batch·KV head, range)
        bh, part = task // splits, task % splits
        b, h = bh // hkv, bh % hkv
        lo, hi = part * n_enc // splits, (part + 1) * n_enc // splits
        kcodes, knorms, vcodes, vnorms = kc[bh], kn[bh], vc[bh], vn[bh]
        qrot = np.zeros((nk, rows, dim), np.float32)  # scale · q @ R_kᵀ, per rotation
        qs = np.empty((rows, dim), np.float32)  # scale · q, for the blocks' key means
        for r in range(rows):
            qh = q[b, h * groups + r // nq, r % nq]
            for d in range(dim):
                qs[r, d] = qh[d] * scale
            for c in range(nk):
                for d in range(dim):
                    x = qs[r, d]
                    for e in range(dim):
                        qrot[c, r, e] += x * k_rt[c, d, e]
        qm = np.zeros(rows, np.float32)  # scale · q · mean of the current block's keys
        current = -1
        m = np.full(rows, neg, np.float32)
        ls = np.zeros(rows, np.float32)
        acc = np.zeros((nv, rows, dim), np.float32)
        kb64 = np.empty((TILE, dim // 2), np.uint64)
        kb = kb64.view(np.float32)
        vb64 = np.empty(dim // 2, np.uint64)
        vb = vb64.view(np.float32)
        s = np.empty((rows, TILE), np.float32)
        for t0 in range(lo, hi, TILE):
            n = min(TILE, hi - t0)
            for t in range(n):
                _unpack(kcodes[t0 + t], kbits, ktab, kb64[t])
            for t in range(n):
                blk = (t0 + t) // block
                if centered and blk != current:
                    current = blk
                    for r in range(rows):
                        qm[r] = _dot(qs[r], kmean[bh, blk])
                rk = qrot[krot[bh, blk]]
                norm = f16_to_f32(knorms[t0 + t])
                kt = kb[t]
                for r in range(rows):
                    s[r, t] = norm * _dot(rk[r], kt) + qm[r]
            for r in range(rows):
                alpha = _softmax_step(s, m, ls, r, n)
                if alpha != 1.0:
                    for c in range(nv):
                        for d in range(dim):
                            acc[c, r, d] *= alpha
            for t in range(n):
                _unpack(vcodes[t0 + t], vbits, vtab, vb64)
                norm = f16_to_f32(vnorms[t0 + t])
                av = acc[vrot[bh, (t0 + t) // block]]
                for r in range(rows):
                    w = s[r, t] * norm
                    for d in range(dim):
                        av[r, d] += w * vb[d]
        pm[task] = m
        pl[task] = ls
        pacc[task] = acc

    for bh in prange(bh_count):  # merge, rotate back, then the exact tokens, normalise
        merge_exact(bh, q, pm, pl, pacc, v_r, ke, ve, bias, causal, scale, splits, hkv, groups,
                    out)


_serial = jit(fastmath=_FAST, nogil=True)(_attend_impl)
_parallel = jit(fastmath=_FAST, nogil=True, parallel=True)(_attend_impl)


def attend(q: np.ndarray, kc: np.ndarray, kn: np.ndarray, kbits: int, ktab: np.ndarray,
           k_rt: np.ndarray, vc: np.ndarray, vn: np.ndarray, vbits: int, vtab: np.ndarray,
           v_r: np.ndarray, ke: np.ndarray, ve: np.ndarray, bias: np.ndarray | None,
           causal: bool, scale: float, out: np.ndarray, threads: int = 1,
           krot: np.ndarray | None = None, vrot: np.ndarray | None = None,
           kmean: np.ndarray | None = None, block: int = 0) -> np.ndarray:
    """Softmax attention of ``q`` over encoded tokens and exact ones, into ``out``.

    ``q`` float32 [B, Hq, Q, D]; ``kc``/``vc`` uint8 packed codes [B·Hkv, E, D·bits/8] and
    ``kn``/``vn`` fp16 norms as uint16 [B·Hkv, E] of the E encoded tokens, which every query
    sees; ``ktab``/``vtab`` from :func:`chunk_table`; ``k_rt`` = R_kᵀ and ``v_r`` = R_v (float32
    [D, D], or [C, D, D]: one per rotation in use, ``turbomix``'s candidates); then the encoded
    tokens come in blocks of ``block`` tokens, ``krot``/``vrot`` (uint8 [B·Hkv, E / block])
    naming each block's rotation and ``kmean`` (float32 [B·Hkv, E / block, D], optional) its
    keys' mean; ``ke``/``ve`` float32 [B, Hkv, X, D]: the exact tokens (sinks, window, and the Q
    new tokens last; their order matters only for the causal rule). Exact token j is visible to
    query i when ``causal`` is false or ``j ≤ X − Q + i``; ``bias`` (float32 [1 or B, Q, X],
    additive, ``-inf`` hides) is added to exact scores. ``out`` float32 [B, Q, Hq, D] (the
    layout attention functions return). ``threads`` > 1 splits the encoded tokens over numba's
    threads.
    """
    n_enc = kn.shape[1]
    splits = 1
    if threads > 1 and n_enc >= 2 * MIN_TOKENS_PER_TASK:
        splits = int(min(threads, n_enc // MIN_TOKENS_PER_TASK))
    fn = _parallel if threads > 1 else _serial
    if bias is None:
        bias = np.zeros((0, 0, 0), np.float32)
    single = np.zeros((kn.shape[0], 1), np.uint8)  # one rotation, one block of every token
    block = block if block > 0 else max(1, n_enc)
    fn(q, kc, kn, kbits, ktab, k_rt.reshape(-1, *k_rt.shape[-2:]),
       single if krot is None else krot,
       np.zeros((0, 1, 1), np.float32) if kmean is None else kmean, vc, vn, vbits, vtab,
       v_r.reshape(-1, *v_r.shape[-2:]), single if vrot is None else vrot, block, ke, ve, bias,
       causal, np.float32(scale), splits, out)
    return out


__all__ = ["MAX_ROWS", "TILE", "BuildError", "attend", "chunk_table", "warn_fallback"]
