"""Compiled rANS (numba): the same bytes as the numpy reference in :mod:`kvtool.codecs.entropy`.

Symbols go through the lanes round-robin (symbol ``j`` in lane ``j % lanes``), so consecutive
symbols belong to independent states and the CPU overlaps their multiply chains. The decoder
tracks each symbol's table with counters instead of reading a context array, finds symbols
through a slot → symbol table (faster here than comparisons against the cumulative
frequencies) and renormalises without a branch.
"""

from __future__ import annotations

import numpy as np

from kvtool.kernels.numba_support import jit


@jit(nogil=True)
def encode_kernel(sym, ctx, freqs, cum, precision, lanes, states, words):
    """Encode ``sym`` last symbol first; fills ``states`` and ``words`` (in emission order,
    the reverse of reading order) and returns the number of words."""
    n = sym.shape[0]
    x = np.full(lanes, np.uint64(1 << 16), np.uint64)
    shift = np.uint64(32 - precision)
    p = np.uint64(precision)
    count = 0
    for j in range(n - 1, -1, -1):
        lane = j % lanes
        t = ctx[j]
        s = sym[j]
        f = np.uint64(freqs[t, s])
        xs = x[lane]
        if xs >= (f << shift):
            words[count] = np.uint16(xs & np.uint64(0xFFFF))
            count += 1
            xs >>= np.uint64(16)
        x[lane] = ((xs // f) << p) + xs % f + np.uint64(cum[t, s])
    for i in range(lanes):
        states[i] = np.uint32(x[i])
    return count


@jit(nogil=True)
def decode_kernel(states, words, freqs, cum, lookup, precision, bits, per_row, rows_per_group,
                  columns, out):
    """Decode rows of ``per_row`` symbols straight into their packed bytes ``out`` (rows of
    ``out.size / rows`` bytes); 0 on success, 1 if the words run out, 2 if the stream does not
    end exactly (words left over or a lane not back at its initial state), 3 if a symbol sets
    bits past the end of its row.

    The table of symbol ``j`` (row ``i``, column ``k``) is ``(i // rows_per_group) * columns +
    k % columns``; ``lookup[t, slot]`` is the symbol owning ``slot`` in table ``t``.
    """
    n_rows = rows_per_group * (freqs.shape[0] // columns)
    n = n_rows * per_row
    lanes = states.shape[0]
    n_words = words.shape[0]
    x = np.empty(lanes, np.uint64)
    for i in range(lanes):
        x[i] = np.uint64(states[i])
    mask = np.uint64((1 << precision) - 1)
    p = np.uint64(precision)
    low = np.uint64(1 << 16)
    last = max(n_words - 1, 0)
    guard = np.uint64(words[0]) if n_words else np.uint64(0)
    ptr = 0
    lane = 0
    col = 0  # k % columns
    k = 0  # column in the row
    row_in_group = 0
    base = 0  # group * columns
    acc = np.uint64(0)  # bits of the current row not yet written
    n_acc = np.uint64(0)
    width = np.uint64(bits)
    pos = 0
    for _ in range(n):
        t = base + col
        xs = x[lane]
        slot = xs & mask
        s = lookup[t, slot]
        xs = np.uint64(freqs[t, s]) * (xs >> p) + slot - np.uint64(cum[t, s])
        w = np.uint64(words[min(ptr, last)]) if n_words else guard
        if xs < low:
            xs = (xs << np.uint64(16)) | w
            ptr += 1
        x[lane] = xs
        acc |= np.uint64(s) << n_acc
        n_acc += width
        if n_acc >= 8:
            out[pos] = np.uint8(acc & np.uint64(0xFF))
            pos += 1
            acc >>= np.uint64(8)
            n_acc -= np.uint64(8)
        lane += 1
        if lane == lanes:
            lane = 0
        col += 1
        if col == columns:
            col = 0
        k += 1
        if k == per_row:
            if acc != 0:
                return 3
            n_acc = np.uint64(0)
            k = 0
            col = 0
            row_in_group += 1
            if row_in_group == rows_per_group:
                row_in_group = 0
                base += columns
    if ptr > n_words:
        return 1
    if ptr != n_words:
        return 2
    for i in range(lanes):
        if x[i] != low:
            return 2
    return 0
