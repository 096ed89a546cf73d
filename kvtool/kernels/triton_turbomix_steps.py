"""The tile steps of the Triton ``turbomix`` kernels (:mod:`kvtool.kernels.triton_turbomix`):
exact-product rotations, packing and unpacking, the part's gather, the code → value lookups and
the three quantisers, the trellis's Viterbi search and traceback; each on a [rows, width] tile.

Ties follow the reference (:mod:`kvtool.codecs.turbomix`, :mod:`kvtool.codecs.trellis`): the
lowest bucket, the lowest pair index, the lower predecessor state, the lowest final state.
"""

from __future__ import annotations

from kvtool.codecs.trellis_tables import SUBSET_TAPS, UNION_TAPS
from kvtool.kernels.triton_cuda import _bf16, _quantize
from kvtool.kernels.triton_support import _INTERP, _jit, tl
from kvtool.kernels.triton_turbomix_tables import TRELLIS_HASH

_UNION_TAPS = tl.constexpr(UNION_TAPS) if tl is not None else None
_SUBSET_TAPS = tl.constexpr(SUBSET_TAPS) if tl is not None else None
_MASK2, _MULT2, _MASK3, _MULT3, _MASK4, _MULT4 = (
    tl.constexpr(v) if tl is not None else None for b in (2, 3, 4) for v in TRELLIS_HASH[b])


@_jit
def _split(x):
    """fp32 ``x`` as three bf16 pieces whose sum is ``x``."""
    hi = _bf16(x)
    r = x - hi.to(tl.float32)
    mid = _bf16(r)
    return hi, mid, _bf16(r - mid.to(tl.float32))


@_jit
def _dot(a, m, acc):
    if _INTERP:  # the interpreter multiplies bf16 operands as their raw bits: widen (exact)
        a, m = a.to(tl.float32), m.to(tl.float32)
    return tl.dot(a, m, acc)


@_jit
def _rot(acc, t, m_ptr, k0, N: tl.constexpr, NP: tl.constexpr, BK: tl.constexpr,
         RP: tl.constexpr, FP32: tl.constexpr = True, n0=0):
    """``acc + t @ M[k0:k0+BK, n0:n0+W]`` (W: ``acc``'s width) for an fp32 chunk ``t``
    [BM, BK] and ``M`` [NP, NP] (an N×N matrix, zero-padded) stored as RP bf16 pieces (one
    where exact): in fp32 accuracy, or (not ``FP32``) to ~16 bits, the leading terms only (for
    a result rounded to fp16 next, or summed with fp16 dots' error)."""
    hi, mid, lo = _split(t)
    return _by_pieces(acc, hi, mid, lo, m_ptr, k0 + tl.arange(0, BK),
                      n0 + tl.arange(0, acc.shape[1]), N, NP, RP, FP32)


@_jit
def _rot_cols(hi, mid, lo, m_ptr, n0, MP: tl.constexpr, N: tl.constexpr, NP: tl.constexpr,
              BN: tl.constexpr, RP: tl.constexpr, FP32: tl.constexpr = True):
    """``(hi + mid + lo) @ M[:, n0:n0+BN]`` [MP, BN] for an fp32 tile in bf16 pieces
    (:func:`_split`) and ``M`` as :func:`_rot`'s (accuracy likewise): the columns of a
    product a program cannot slice out of registers, one chunk at a time."""
    return _by_pieces(tl.zeros([MP, BN], tl.float32), hi, mid, lo, m_ptr, tl.arange(0, NP),
                      n0 + tl.arange(0, BN), N, NP, RP, FP32)


@_jit
def _by_pieces(acc, hi, mid, lo, m_ptr, rows, cols, N: tl.constexpr, NP: tl.constexpr,
               RP: tl.constexpr, FP32: tl.constexpr):
    """``acc + (hi + mid + lo) @ (M₁ + M₂ + M₃)[rows, cols]``, small terms first: in fp32
    accuracy (every term down to 2⁻²⁴ of the leading one), or to ~16 bits (hi·M₁, mid·M₁,
    hi·M₂). Entries past the N×N matrix (its zero padding) are not read."""
    offs = rows[:, None] * NP + cols[None, :]
    keep = (rows < N)[:, None] & (cols < N)[None, :]  # unused where N = NP
    m1 = _piece(m_ptr + offs, keep, N < NP)
    if RP == 3:
        m2 = _piece(m_ptr + NP * NP + offs, keep, N < NP)
        if FP32:
            acc = _dot(hi, _piece(m_ptr + 2 * NP * NP + offs, keep, N < NP), acc)
            acc = _dot(mid, m2, acc)
            acc = _dot(lo, m1, acc)
        acc = _dot(hi, m2, acc)
    elif FP32:
        acc = _dot(lo, m1, acc)
    acc = _dot(mid, m1, acc)
    return _dot(hi, m1, acc)


@_jit
def _piece(ptrs, keep, PADDED: tl.constexpr):
    """A matrix piece's entries at ``ptrs`` (``PADDED``: 0 outside ``keep``, not read)."""
    if PADDED:
        return tl.load(ptrs, mask=keep, other=0.0)
    return tl.load(ptrs)


@_jit
def _pack(q, row_ptr, rmask, NB: tl.constexpr, BM: tl.constexpr, NP: tl.constexpr,
          BITS: tl.constexpr, CPG: tl.constexpr, BPG: tl.constexpr):
    """Store int32 codes ``q`` [BM, NP] LSB-first into the rows at ``row_ptr`` [BM]."""
    shift = tl.arange(0, CPG) * BITS
    if CPG * BITS > 32:  # 5 and 7 bits: groups of 8 codes in 5 and 7 bytes
        q, shift = q.to(tl.int64), shift.to(tl.int64)
    g = tl.sum(tl.reshape(q, [BM, NP // CPG, CPG]) << shift[None, None, :], axis=2)
    byte = tl.arange(0, NP // CPG) * BPG
    for k in tl.static_range(BPG):
        tl.store(row_ptr[:, None] + (byte + k)[None, :], ((g >> (8 * k)) & 0xFF).to(tl.uint8),
                 mask=rmask[:, None] & (byte + k < NB)[None, :])


@_jit
def _unpack(row_ptr, rmask, idx, N: tl.constexpr, NB: tl.constexpr, BITS: tl.constexpr):
    """Codes [BM, len(idx)] at code indices ``idx`` (0 outside 0..N-1) of packed rows."""
    ok = (idx >= 0) & (idx < N)
    bit = idx * BITS
    byte = bit >> 3
    lo = tl.load(row_ptr[:, None] + byte[None, :], mask=rmask[:, None] & ok[None, :], other=0)
    hi = tl.load(row_ptr[:, None] + byte[None, :] + 1,
                 mask=rmask[:, None] & (ok & (byte + 1 < NB))[None, :], other=0)
    word = lo.to(tl.int32) | (hi.to(tl.int32) << 8)
    return (word >> (bit & 7)[None, :]) & ((1 << BITS) - 1)


@_jit
def _part(x_ptr, mean_ptr, ch_ptr, g, r, rmask, j, N: tl.constexpr, D: tl.constexpr,
          HAS_MEAN: tl.constexpr, ALL_CH: tl.constexpr):
    """fp32 ``x[r, ch[g, j]] − mean[g, ch[g, j]]`` [BM, len(j)] (0 where j ≥ N); ``ch_ptr``
    points at the group's channels (``ALL_CH``: every channel in order, not read: the loads
    are contiguous)."""
    if ALL_CH:
        ch = j
    else:
        ch = tl.load(ch_ptr + j, mask=j < N, other=0)
    t = tl.load(x_ptr + r[:, None] * D + ch[None, :], mask=rmask[:, None] & (j < N)[None, :],
                other=0.0).to(tl.float32)
    if HAS_MEAN:
        m = tl.load(mean_ptr + g * D + ch, mask=j < N, other=0.0).to(tl.float32)
        t = tl.where((j < N)[None, :], t - m[None, :], 0.0)
    return t


@_jit
def _values(row_ptr, rmask, idx, cent_ptr, pts_ptr, slv_ptr, N: tl.constexpr,
            NB: tl.constexpr, BITS: tl.constexpr, QUANT: tl.constexpr, BM: tl.constexpr,
            BK: tl.constexpr):
    """Unit-vector coordinates [BM, BK] at code indices ``idx`` (0 where idx ≥ N)."""
    if QUANT == 0:
        y = tl.load(cent_ptr + _unpack(row_ptr, rmask, idx, N, NB, BITS))
    elif QUANT == 1:  # the pair's index from both its codes; this coordinate of its point
        first = _unpack(row_ptr, rmask, idx & ~1, N, NB, BITS)
        second = _unpack(row_ptr, rmask, idx | 1, N, NB, BITS)
        y = tl.load(pts_ptr + 2 * ((first << BITS) | second) + (idx & 1)[None, :])
    else:  # the code and the 5 before it in one window of bytes (zeros before the first)
        y = tl.load(slv_ptr + _trellis_index(row_ptr, rmask, idx, N, NB, BITS))
    return tl.where((idx < N)[None, :], y, 0.0)


@_jit
def _trellis_index(row_ptr, rmask, idx, N: tl.constexpr, NB: tl.constexpr,
                   BITS: tl.constexpr):
    """The value-table index [BM, len(idx)] of trellis codes: the code at ``idx`` and its
    path state, the top bits of the 5 codes before it (zeros before the first), hashed
    one-to-one from the 6·BITS bits that end with the code (``triton_turbomix_tables.
    trellis_hash``). Rows of whole 32-bit words (4-byte aligned: the callers' rows) read the
    window from two aligned words, others from 3-4 bytes."""
    lo = (idx - 5) * BITS  # the window's first bit (negative: before the row)
    if NB % 4 == 0:
        at = lo >> 5  # the word holding it (-1: before the row)
        words = row_ptr.to(tl.pointer_type(tl.uint32))[:, None]
        low = tl.load(words + at[None, :], mask=rmask[:, None] & ((at >= 0) & (idx < N))[None, :],
                      other=0)
        high = tl.load(words + (at + 1)[None, :],
                       mask=rmask[:, None] & ((at + 1 < NB // 4) & (idx < N))[None, :], other=0)
        pair = (high.to(tl.uint64) << 32) | low.to(tl.uint64)
        w = (pair >> (lo & 31).to(tl.uint64)[None, :]).to(tl.uint32)
    else:
        first = lo >> 3
        w = tl.zeros([rmask.shape[0], idx.shape[0]], tl.uint32)
        for k in tl.static_range((6 * BITS + 6) // 8 + 1):
            b = first + k
            ok = (b >= 0) & (b < NB) & (idx < N)
            w |= tl.load(row_ptr[:, None] + b[None, :], mask=rmask[:, None] & ok[None, :],
                         other=0).to(tl.uint32) << (8 * k)
        w = w >> (lo & 7).to(tl.uint32)[None, :]
    if BITS == 2:
        h = (w & _MASK2) * _MULT2
    elif BITS == 3:
        h = (w & _MASK3) * _MULT3
    else:
        h = (w & _MASK4) * _MULT4
    return (h >> (27 - BITS)).to(tl.int32)


@_jit
def _scalar(y, bnd_ptr, cent_ptr, BITS: tl.constexpr):
    """(codes, centroids) of ``y``: the number of boundaries strictly below each value (a
    binary search over the 2**BITS − 1) and that bucket's centroid. At 2..4 bits both stay in
    registers: the boundaries and centroids are loaded once, as scalars, and picked by
    selects (``triton_cuda``'s quantiser, then a select tree on the code's bits), where a
    gather per level and value made a chain of dependent loads per coordinate."""
    if BITS <= 4:
        k = _quantize(y, bnd_ptr, BITS)
        return k, _centroid(k, cent_ptr, BITS)
    k = tl.zeros(y.shape, tl.int32)
    for s in tl.static_range(BITS):
        step = 1 << (BITS - 1 - s)
        k += tl.where(y > tl.load(bnd_ptr + k + (step - 1)), step, 0)
    return k, tl.load(cent_ptr + k)


@_jit
def _centroid(k, t_ptr, BITS: tl.constexpr):
    """``t[k]`` for codes ``k`` < 2**BITS (2..4 bits): a select tree on ``k``'s bits over the
    table's entries, loaded as scalars."""
    b0, b1 = (k & 1) != 0, (k & 2) != 0
    v = _quad(b0, b1, t_ptr)
    if BITS >= 3:
        v = tl.where((k & 4) != 0, _quad(b0, b1, t_ptr + 4), v)
    if BITS == 4:
        hi = tl.where((k & 4) != 0, _quad(b0, b1, t_ptr + 12), _quad(b0, b1, t_ptr + 8))
        v = tl.where((k & 8) != 0, hi, v)
    return v


@_jit
def _quad(b0, b1, t_ptr):
    """``t[2·b1 + b0]``: one of four scalar entries per element."""
    return tl.where(b1, tl.where(b0, tl.load(t_ptr + 3), tl.load(t_ptr + 2)),
                    tl.where(b0, tl.load(t_ptr + 1), tl.load(t_ptr)))


@_jit
def _pairs(y, pts_ptr, hsq_ptr, BM: tl.constexpr, BN: tl.constexpr, BITS: tl.constexpr):
    """(codes, values) [BM, BN] of the nearest 2-D codebook point per coordinate pair
    (score ``x·c − |c|²/2``; ties: the lowest index)."""
    y0, y1 = tl.split(tl.reshape(y, [BM, BN // 2, 2]))
    top = tl.full([BM, BN // 2], float("-inf"), tl.float32)
    at = tl.zeros([BM, BN // 2], tl.int32)
    for p in range(1 << (2 * BITS)):
        s = y0 * tl.load(pts_ptr + 2 * p)
        s = s + y1 * tl.load(pts_ptr + 2 * p + 1)
        s = s - tl.load(hsq_ptr + p)
        better = s > top
        top = tl.where(better, s, top)
        at = tl.where(better, p, at)
    q = tl.reshape(tl.join(at >> BITS, at & ((1 << BITS) - 1)), [BM, BN])
    v = tl.reshape(tl.join(tl.load(pts_ptr + 2 * at), tl.load(pts_ptr + 2 * at + 1)), [BM, BN])
    return q, v


@_jit
def _nearest(y, j, edge_ptr, PER: tl.constexpr):
    """Index within subset ``j`` of the level nearest ``y`` (edges strictly below)."""
    k = tl.zeros(y.shape, tl.int32)
    for e in tl.static_range(PER - 1):
        k += (y > tl.load(edge_ptr + j * (PER - 1) + e)).to(tl.int32)
    return k


@_jit
def _subset_error(y, j: tl.constexpr, lvl_ptr, edge_ptr, PER: tl.constexpr):
    """Squared distance [BM] from ``y`` to the nearest level of subset ``j``."""
    diff = y - tl.load(lvl_ptr + 4 * _nearest(y, j, edge_ptr, PER) + j)
    return diff * diff


@_jit
def _parity(x):
    """Parity of each 5-bit ``x``."""
    x ^= x >> 4
    x ^= x >> 2
    x ^= x >> 1
    return x & 1


@_jit
def _subset(state, u):
    """Subset of the branch with path bit ``u`` out of ``state`` (``trellis.subset_table``,
    computed: on a state axis held in registers the compiler folds it to constants, so each
    state's pick below is a register, where loaded subsets cost selects on every step)."""
    return 2 * (u ^ _parity(state & _SUBSET_TAPS)) + _parity(state & _UNION_TAPS)


@_jit
def _pick(j, d0, d1, d2, d3):
    """``d_j[row]`` [32, BM] for each state's subset ``j`` [32, 1]."""
    return tl.where(j == 0, d0[None, :], tl.where(j == 1, d1[None, :],
                                                  tl.where(j == 2, d2[None, :], d3[None, :])))


@_jit
def _predecessors(cost, BM: tl.constexpr):
    """(cost[s >> 1], cost[(s >> 1) | 16]) [32, BM] for the states s: each state's two
    predecessors' path costs, by reshapes of the state axis (``tl.gather`` here trips an
    assertion in Triton 3.6's thread-locality pass on sm_90 at 16-row tiles)."""
    low, high = tl.split(tl.permute(tl.reshape(cost, [2, 16, BM]), (1, 2, 0)))
    return (tl.reshape(tl.permute(tl.join(low, low), (0, 2, 1)), [32, BM]),
            tl.reshape(tl.permute(tl.join(high, high), (0, 2, 1)), [32, BM]))


@_jit
def _trellis(u_ptr, dec_ptr, q_ptr, inv, n16, lvl_ptr, edge_ptr, N: tl.constexpr,
             BM: tl.constexpr, BITS: tl.constexpr, PER: tl.constexpr):
    """Viterbi over the tile's rows (32 path costs each), decisions as one int32 bit mask per
    row and coordinate, then the traceback: codes to ``q_ptr``, returns each row's error.
    The costs are [32 states, BM rows]: with BM ≥ 32 × warps (the trellis configs) a thread
    holds a row's 32 costs, so the predecessor step moves registers, not lanes, and each
    state's subsets are constants (sm_90, a step for 32 rows: 275 warp-instructions with
    Triton 3.9, 327 with 3.6, where loaded subsets took 677 and 639). The next coordinate's
    load is issued a step ahead."""
    lanes = tl.arange(0, BM)
    s = tl.arange(0, 32)[:, None]
    j0 = _subset(s >> 1, s & 1)
    j1 = _subset((s >> 1) | 16, s & 1)
    cost = tl.where(tl.broadcast_to(s, [32, BM]) == 0, 0.0, float("inf"))
    tl.debug_barrier()
    u_next = tl.load(u_ptr + lanes)
    for t in range(N):
        y = u_next * inv
        u_next = tl.load(u_ptr + tl.minimum(t + 1, N - 1) * BM + lanes)
        d0 = _subset_error(y, 0, lvl_ptr, edge_ptr, PER)
        d1 = _subset_error(y, 1, lvl_ptr, edge_ptr, PER)
        d2 = _subset_error(y, 2, lvl_ptr, edge_ptr, PER)
        d3 = _subset_error(y, 3, lvl_ptr, edge_ptr, PER)
        from0, from1 = _predecessors(cost, BM)
        c0 = from0 + _pick(j0, d0, d1, d2, d3)
        c1 = from1 + _pick(j1, d0, d1, d2, d3)
        take = c1 < c0
        cost = tl.where(take, c1, c0)
        tl.store(dec_ptr + t * BM + lanes, tl.sum(take.to(tl.int32) << s, axis=0))
    tl.debug_barrier()
    state = tl.argmin(tl.where(cost == cost, cost, float("inf")), axis=0,
                      tie_break_left=True).to(tl.int32)
    err = tl.zeros([BM], tl.float32)
    for i in range(N):
        t = N - 1 - i
        bit = (tl.load(dec_ptr + t * BM + lanes) >> state) & 1
        prev = (state >> 1) | (bit << 4)
        path = state & 1
        j = _subset(prev, path)
        u = tl.load(u_ptr + t * BM + lanes)
        k = _nearest(u * inv, j, edge_ptr, PER)
        tl.store(q_ptr + t * BM + lanes, ((path << (BITS - 1)) | k).to(tl.int8))
        diff = u - n16 * tl.load(lvl_ptr + 4 * k + j)
        err += diff * diff
        state = prev
    tl.debug_barrier()
    return err
