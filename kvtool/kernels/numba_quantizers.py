"""The tile steps of the fused ``turbomix`` kernels (:mod:`kvtool.kernels.numba_turbomix`):
rotations, the three quantisers and packing, each on a tile of rows stored transposed
(``[n, TILE]``), a loop over a contiguous run of rows innermost so that LLVM vectorises it.

Ties follow the reference (:mod:`kvtool.codecs.turbomix`, :mod:`kvtool.codecs.trellis`): the
lowest bucket, the lowest pair index, the lower predecessor state, the lowest final state.
"""

from __future__ import annotations

import numba
import numpy as np

from kvtool.kernels.numba_cpu import _fwht

MEMORY = 5  # path bits in a trellis state (kvtool.codecs.trellis.MEMORY)
STATES = 1 << MEMORY

SCALAR, PAIR, TRELLIS = 0, 1, 2  # the quantiser kinds the kernels take
QUANTIZERS = {"scalar": SCALAR, "pair": PAIR, "trellis": TRELLIS}


@numba.njit(inline="always")
def rotate(t, u, signs, dense, c, fwht):
    """u = R_c t for the columns of the tile (unnormalised for butterflies: times n)."""
    n, width = t.shape
    if fwht:
        for j in range(n):
            for v in range(width):
                u[j, v] = t[j, v]
        _fwht(u, signs[c, 0])
        _fwht(u, signs[c, 1])
    else:
        _dense(t, u, dense[c], False)


@numba.njit(inline="always")
def rotate_back(y, u, signs, dense, c, fwht):
    """u = R_cᵀ y for the columns of the tile (times n for butterflies)."""
    n, width = y.shape
    if fwht:
        for j in range(n):
            for v in range(width):
                u[j, v] = y[j, v]
        _fwht(u, signs[c, 2])  # ones
        s2 = signs[c, 1]
        for j in range(n):
            s = s2[j]
            for v in range(width):
                u[j, v] *= s
        _fwht(u, signs[c, 2])
        s1 = signs[c, 0]
        for j in range(n):
            s = s1[j]
            for v in range(width):
                u[j, v] *= s
    else:
        _dense(y, u, dense[c], True)


@numba.njit(inline="always")
def _dense(t, u, m, back):
    """u[i] = Σ_j M[i, j] t[j] for the columns of ``t``, M = ``m`` (``back``: ``mᵀ``): M has
    a row per row of ``u`` and a column per row of ``t``.

    Four outputs take four inputs per pass over the columns: each loaded input row serves four
    output rows, and each output row is loaded and stored once per four inputs (one output row
    at a time loaded five rows per four products; 1.35-2.25× faster for n = 48-192). Every
    output sums its products in the order of one row at a time, so the result is the same."""
    n, width = t.shape
    outputs = u.shape[0]
    whole = n - n % 4
    for i in range(0, outputs - outputs % 4, 4):
        for k in range(4):
            for v in range(width):
                u[i + k, v] = 0.0
        for j in range(0, whole, 4):
            a0, a1, a2, a3 = _coeffs(m, back, i, j)
            b0, b1, b2, b3 = _coeffs(m, back, i + 1, j)
            c0, c1, c2, c3 = _coeffs(m, back, i + 2, j)
            d0, d1, d2, d3 = _coeffs(m, back, i + 3, j)
            for v in range(width):
                t0, t1, t2, t3 = t[j, v], t[j + 1, v], t[j + 2, v], t[j + 3, v]
                u[i, v] += (a0 * t0 + a1 * t1) + (a2 * t2 + a3 * t3)
                u[i + 1, v] += (b0 * t0 + b1 * t1) + (b2 * t2 + b3 * t3)
                u[i + 2, v] += (c0 * t0 + c1 * t1) + (c2 * t2 + c3 * t3)
                u[i + 3, v] += (d0 * t0 + d1 * t1) + (d2 * t2 + d3 * t3)
        for k in range(4):
            _dense_tail(t, u, m, back, i + k, whole)
    for i in range(outputs - outputs % 4, outputs):  # the last outputs, one at a time
        for v in range(width):
            u[i, v] = 0.0
        for j in range(0, whole, 4):
            r0, r1, r2, r3 = _coeffs(m, back, i, j)
            for v in range(width):
                u[i, v] += (r0 * t[j, v] + r1 * t[j + 1, v]) \
                    + (r2 * t[j + 2, v] + r3 * t[j + 3, v])
        _dense_tail(t, u, m, back, i, whole)


@numba.njit(inline="always")
def _coeffs(m, back, i, j):
    """M[i, j:j+4] of :func:`_dense`'s M."""
    if back:
        return m[j, i], m[j + 1, i], m[j + 2, i], m[j + 3, i]
    return m[i, j], m[i, j + 1], m[i, j + 2], m[i, j + 3]


@numba.njit(inline="always")
def _dense_tail(t, u, m, back, i, whole):
    """Output row i of :func:`_dense` plus the products of its inputs past ``whole``, one at a
    time."""
    n, width = t.shape
    for j in range(whole, n):
        r = m[j, i] if back else m[i, j]
        for v in range(width):
            u[i, v] += r * t[j, v]


@numba.njit(inline="always")
def scalar_codes(y, bounds, centroids, q, yhat, k):
    n, width = y.shape
    nb = bounds.shape[0]
    for j in range(n):
        for v in range(width):
            k[v] = 0
        for b in range(nb):
            bound = bounds[b]
            for v in range(width):
                k[v] += np.uint32(y[j, v] > bound)
        for v in range(width):
            q[j, v] = np.uint8(k[v])
            yhat[j, v] = centroids[k[v]]


@numba.njit(inline="always")
def pair_codes(y, points, half_sq, bits, q, yhat, best):
    n, width = y.shape
    npoints = points.shape[0]
    mask = (1 << bits) - 1
    for j in range(0, n, 2):
        for v in range(width):
            best[v] = 0
        for v in range(width):
            x0, x1 = y[j, v], y[j + 1, v]
            top = x0 * points[0, 0]
            top = top + x1 * points[0, 1]
            top = top - half_sq[0]
            at = 0
            for p in range(1, npoints):
                s = x0 * points[p, 0]
                s = s + x1 * points[p, 1]
                s = s - half_sq[p]
                if s > top:
                    top, at = s, p
            q[j, v] = np.uint8(at >> bits)
            q[j + 1, v] = np.uint8(at & mask)
            yhat[j, v] = points[at, 0]
            yhat[j + 1, v] = points[at, 1]


@numba.njit(inline="always")
def trellis_codes(y, levels, edges, subset_bits, bits, q, yhat, cost, fresh, decisions, found,
                   dist, state, k, decided):
    """Viterbi over the tile's rows at once: 32 path costs per row (two buffers, taking turns),
    one uint32 of decisions per coordinate and row, and the nearest level's index within each
    of the four subsets (3 bits each, one uint16); then the traceback, lane by lane.

    ``subset_bits``: (low, high) uint32 masks, bit ``p`` of each being bit 0 and bit 1 of the
    subset that the path bit 0 leaves state ``p`` by; path bit 1 flips the high bit."""
    n, width = y.shape
    per = edges.shape[1] + 1  # levels per subset
    low_bits, high_bits = subset_bits[0], subset_bits[1]
    for s in range(STATES):
        for v in range(width):
            cost[s, v] = np.inf if s else 0.0
    for t in range(n):
        now, nxt = (cost, fresh) if t % 2 == 0 else (fresh, cost)
        for v in range(width):
            found[t, v] = 0
        for j in range(4):
            for v in range(width):
                k[v] = 0
            for e in range(per - 1):
                edge = edges[j, e]
                for v in range(width):
                    k[v] += np.uint32(y[t, v] > edge)
            for v in range(width):
                found[t, v] |= np.uint16(k[v] << np.uint32(3 * j))
                d = y[t, v] - levels[4 * k[v] + j]
                dist[j, v] = d * d
        for v in range(width):
            decided[v] = 0
        for s in range(STATES):
            u = s & 1
            p0 = s >> 1
            p1 = p0 | (STATES >> 1)
            j0 = ((low_bits >> p0) & 1) | ((((high_bits >> p0) & 1) ^ u) << 1)
            j1 = ((low_bits >> p1) & 1) | ((((high_bits >> p1) & 1) ^ u) << 1)
            shift = np.uint32(s)
            for v in range(width):
                c0 = now[p0, v] + dist[j0, v]
                c1 = now[p1, v] + dist[j1, v]
                take = c1 < c0
                nxt[s, v] = c1 if take else c0
                decided[v] |= np.uint32(take) << shift
        for v in range(width):
            decisions[t, v] = decided[v]
    last = cost if n % 2 == 0 else fresh
    for v in range(width):
        at = 0
        for s in range(1, STATES):
            if last[s, v] < last[at, v]:
                at = s
        state[v] = at
    top = np.uint32(bits - 1)
    for t in range(n - 1, -1, -1):
        for v in range(width):
            s = np.uint32(state[v])
            u = s & np.uint32(1)
            prev = (s >> np.uint32(1)) | (((decisions[t, v] >> s) & np.uint32(1))
                                          << np.uint32(MEMORY - 1))
            j = ((low_bits >> prev) & np.uint32(1)) \
                | ((((high_bits >> prev) & np.uint32(1)) ^ u) << np.uint32(1))
            level = (np.uint32(found[t, v]) >> (np.uint32(3) * j)) & np.uint32(7)
            q[t, v] = np.uint8((u << top) | level)
            yhat[t, v] = levels[4 * level + j]
            state[v] = prev


@numba.njit(inline="always")
def pack_tile(q, w, bits, packed, out, r0):
    """Pack the first ``w`` columns of the code tile LSB-first into ``out[r0:r0 + w]``: the
    bytes are built transposed (``packed``: a ``[nbytes, TILE]`` uint32 scratch), a vectorised
    loop over the rows per code, then copied out a row at a time."""
    n = q.shape[0]
    nbytes = out.shape[1]
    for b in range(nbytes):
        for v in range(w):
            packed[b, v] = 0
    for j in range(n):  # code j: bits [j·bits, (j+1)·bits) of the row
        at = np.uint32(j * bits)
        first, shift = at >> np.uint32(3), at & np.uint32(7)
        for v in range(w):
            packed[first, v] |= np.uint32(q[j, v]) << shift
        if shift + bits > 8:  # straddles two bytes
            second, back = first + np.uint32(1), np.uint32(8) - shift
            for v in range(w):
                packed[second, v] |= np.uint32(q[j, v]) >> back
    rows = out[r0:r0 + w]
    for v in range(w):
        for b in range(nbytes):
            rows[v, b] = np.uint8(packed[b, v] & np.uint32(255))


@numba.njit(inline="always")
def unpack_tile(codes, w, bits, packed, q):
    """The inverse of :func:`pack_tile`: rows ``codes[:w]`` (packed LSB-first) into the first
    ``w`` columns of the code tile. The rows' bytes are transposed first (``packed``: a
    ``[>= bytes, TILE]`` uint8 scratch; a byte is read from its row once, not once per code
    in it), then a vectorised loop over the rows takes out each code. The tiles are indexed
    as 2-D arrays: the same loops over a row slice per code ran 4-7x slower."""
    n = q.shape[0]
    nbytes = (n * bits + 7) // 8
    for v in range(w):
        for b in range(nbytes):
            packed[b, v] = codes[v, b]
    mask = np.uint32((1 << bits) - 1)
    for j in range(n):  # code j: bits [j·bits, (j+1)·bits) of the row
        at = j * bits
        first, shift = at >> 3, np.uint32(at & 7)
        if shift + bits > 8:  # straddles two bytes
            for v in range(w):
                word = np.uint32(packed[first, v]) | (np.uint32(packed[first + 1, v])
                                                      << np.uint32(8))
                q[j, v] = np.uint8((word >> shift) & mask)
        else:
            for v in range(w):
                q[j, v] = np.uint8((np.uint32(packed[first, v]) >> shift) & mask)


@numba.njit
def tile_values(rows, count, n, bits, kind, table, subsets, packed, q, state, out):
    """The part's unit-domain values of ``count`` packed code rows, transposed: value ``j`` of
    row ``t`` into ``out[j, t]``.

    ``packed``, ``q`` (uint8 ``[>= n, TILE]``) and ``state`` (uint32 ``[TILE]``) are scratch.
    Every loop runs over the tile's rows, which the compiler vectorises: the codes are
    unpacked a code at a time (:func:`~kvtool.kernels.numba_quantizers.unpack_tile`), then
    looked up, or for the trellis picked from its codebook by their states
    (:func:`trellis_levels_tile`). The presets' decode and their attention from codes both
    read codes through it.

    Called, not inlined (the other tile steps are): numba compiled it, with the trellis's
    select trees, into each of the attention kernel's four call sites, and the parallel kernel
    took 274 s to compile cold on 2 cores (30 s called; the serial one 58 → 14 s). A call per
    tile of 64 rows costs nothing measurable (attention and decode within ±3%).
    """
    unpack_tile(rows, count, bits, packed, q[:n])
    if kind == SCALAR:
        for j in range(n):
            for t in range(count):
                out[j, t] = table[q[j, t]]
    elif kind == PAIR:
        for j in range(0, n, 2):
            for t in range(count):
                pair = ((np.int64(q[j, t]) << bits) | np.int64(q[j + 1, t])) * 2
                out[j, t] = table[pair]
                out[j + 1, t] = table[pair + 1]
    else:
        trellis_levels_tile(q, n, count, bits, table, subsets, state, out)


@numba.njit(inline="always")
def trellis_levels_tile(q, n, w, bits, levels, subsets, state, y):
    """``y[j, v]`` = the value of trellis code ``q[j, v]`` (an unpacked code tile) for
    ``j < n``, ``v < w``: ``levels`` is the sorted codebook, ``subsets`` the two masks of
    :func:`trellis_codes`. Each row's state, the path bits (each code's top bit) of the
    ``MEMORY`` codes before it, the latest in bit 0, is carried in one lane per row, and the
    level is picked by a tree of selects rather than looked up: a loop with a table lookup
    stays scalar (or gathers), one of selects vectorises (~1.5x here)."""
    for v in range(w):
        state[v] = 0
    if bits == 2:
        levels8 = _tuple8(levels, 0)
        for j in range(n):
            for v in range(w):
                at, state[v] = _trellis_step(q[j, v], state[v], bits, subsets)
                y[j, v] = _pick8(at, levels8)
    elif bits == 3:
        levels16 = _tuple8(levels, 0) + _tuple8(levels, 8)
        for j in range(n):
            for v in range(w):
                at, state[v] = _trellis_step(q[j, v], state[v], bits, subsets)
                y[j, v] = _pick16(at, levels16)
    else:
        levels32 = _tuple8(levels, 0) + _tuple8(levels, 8) + _tuple8(levels, 16) \
            + _tuple8(levels, 24)
        for j in range(n):
            for v in range(w):
                at, state[v] = _trellis_step(q[j, v], state[v], bits, subsets)
                y[j, v] = _pick32(at, levels32)


@numba.njit(inline="always")
def _trellis_step(code, state, bits, subsets):
    """(the index of a trellis code's level in the sorted codebook, the next state): its index
    within its subset is the code's low bits, and the subset is the one that the code's path
    bit (its top bit) leaves ``state`` by."""
    code = np.uint32(code)
    u = code >> np.uint32(bits - 1)
    subset = ((subsets[0] >> state) & np.uint32(1)) \
        | ((((subsets[1] >> state) & np.uint32(1)) ^ u) << np.uint32(1))
    at = ((code & np.uint32((1 << (bits - 1)) - 1)) << np.uint32(2)) | subset
    return at, ((state << np.uint32(1)) & np.uint32(STATES - 1)) | u


@numba.njit(inline="always")
def _tuple8(table, at):
    return (table[at], table[at + 1], table[at + 2], table[at + 3], table[at + 4],
            table[at + 5], table[at + 6], table[at + 7])


@numba.njit(inline="always")
def _pick8(at, levels):
    """``levels[at]`` (8 levels) by a tree of selects."""
    odd = (at & np.uint32(1)) != 0
    a0 = levels[1] if odd else levels[0]
    a1 = levels[3] if odd else levels[2]
    a2 = levels[5] if odd else levels[4]
    a3 = levels[7] if odd else levels[6]
    two = (at & np.uint32(2)) != 0
    b0 = a1 if two else a0
    b1 = a3 if two else a2
    return b1 if (at & np.uint32(4)) != 0 else b0


@numba.njit(inline="always")
def _pick16(at, levels):
    high, low = _pick8(at, levels[8:]), _pick8(at, levels[:8])
    return high if (at & np.uint32(8)) != 0 else low


@numba.njit(inline="always")
def _pick32(at, levels):
    high, low = _pick16(at, levels[16:]), _pick16(at, levels[:16])
    return high if (at & np.uint32(16)) != 0 else low


__all__ = ["MEMORY", "STATES", "pack_tile", "pair_codes", "rotate", "rotate_back",
           "scalar_codes", "tile_values", "trellis_codes", "trellis_levels_tile", "unpack_tile"]
