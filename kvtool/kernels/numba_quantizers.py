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
    else:  # four inputs per pass over an output row: a quarter of the stores
        whole = n - n % 4
        for i in range(n):
            for v in range(width):
                u[i, v] = 0.0
            for j in range(0, whole, 4):
                r0, r1, r2, r3 = dense[c, i, j], dense[c, i, j + 1], dense[c, i, j + 2], \
                    dense[c, i, j + 3]
                for v in range(width):
                    u[i, v] += (r0 * t[j, v] + r1 * t[j + 1, v]) \
                        + (r2 * t[j + 2, v] + r3 * t[j + 3, v])
            for j in range(whole, n):
                r = dense[c, i, j]
                for v in range(width):
                    u[i, v] += r * t[j, v]


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
    else:  # four inputs per pass over an output row: a quarter of the stores
        whole = n - n % 4
        for j in range(n):
            for v in range(width):
                u[j, v] = 0.0
            for i in range(0, whole, 4):
                r0, r1, r2, r3 = dense[c, i, j], dense[c, i + 1, j], dense[c, i + 2, j], \
                    dense[c, i + 3, j]
                for v in range(width):
                    u[j, v] += (y[i, v] * r0 + y[i + 1, v] * r1) \
                        + (y[i + 2, v] * r2 + y[i + 3, v] * r3)
            for i in range(whole, n):
                r = dense[c, i, j]
                for v in range(width):
                    u[j, v] += y[i, v] * r


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
def unpack_tile(codes, w, bits, q):
    """The inverse of :func:`pack_tile`: rows ``codes[:w]`` (packed LSB-first) into the first
    ``w`` columns of the code tile, a vectorised loop over the rows per code."""
    n = q.shape[0]
    mask = np.uint32((1 << bits) - 1)
    for j in range(n):  # code j: bits [j·bits, (j+1)·bits) of the row
        at = np.uint32(j * bits)
        first, shift = at >> np.uint32(3), at & np.uint32(7)
        if shift + bits > 8:  # straddles two bytes
            second = first + np.uint32(1)
            for v in range(w):
                word = np.uint32(codes[v, first]) | (np.uint32(codes[v, second]) << np.uint32(8))
                q[j, v] = np.uint8((word >> shift) & mask)
        else:
            for v in range(w):
                q[j, v] = np.uint8((np.uint32(codes[v, first]) >> shift) & mask)


__all__ = ["MEMORY", "STATES", "pack_tile", "pair_codes", "rotate", "rotate_back",
           "scalar_codes", "trellis_codes", "unpack_tile"]
