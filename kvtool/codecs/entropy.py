"""rANS entropy coding of stored tensors: the ``"rans"`` compression of .kvz files.

Quantised codes are far from uniform: turbo3's 8 Lloyd–Max levels carry ~2.83 bits of entropy,
and on real keys and values each (head, coordinate) has its own skew (~2.5 bits). This module
codes a tensor's bytes as ``bits``-bit symbols with static frequency tables, one per context,
stored with the data. It is lossless on any bytes and used for storage only (``.kvz`` files
and the prefix store): codecs, the runtime cache and the kernels keep fixed-width codes.

The blob layout and the coding rules are normative: ``docs/format.md`` section 6.2. In short:
row ``i`` of ``row_bytes`` bytes is cut LSB-first into ``S = ceil(8 * row_bytes / bits)``
symbols; symbol ``j = i * S + k`` uses table ``(i // (rows / groups)) * columns + k % columns``
and rANS lane ``j % lanes`` (32-bit states, 16-bit words, frequencies summing to
``2**precision``). Decoding runs the lanes in lockstep, so the numpy reference below is
vectorised over lanes; :mod:`kvtool.kernels.numba_rans` is the compiled path (same bytes).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from math import ceil

import numpy as np

from kvtool.errors import FormatError

VERSION = 1
PRECISION = 12  # frequency tables sum to 2**12
MIN_PRECISION, MAX_PRECISION = 8, 15
STATE_LOW = 1 << 16  # states live in [2**16, 2**32); words are 16 bits
MAX_LANES = 4096
_HEAD = struct.Struct("<4B5I")  # version, bits, precision, reserved, row_bytes, groups,
#                                 columns, lanes, words
HEADER_BYTES = _HEAD.size


@dataclass(frozen=True)
class RansLayout:
    """How a tensor's bytes become symbols and contexts (the blob's header fields)."""

    bits: int
    row_bytes: int
    groups: int
    columns: int
    lanes: int
    precision: int = PRECISION

    def symbols_per_row(self) -> int:
        return ceil(8 * self.row_bytes / self.bits)

    def tables(self) -> int:
        return self.groups * self.columns


# -- symbols <-> bytes -----------------------------------------------------------------------------
def to_symbols(data: np.ndarray, bits: int, row_bytes: int) -> np.ndarray:
    """``data`` (uint8, length a multiple of ``row_bytes``) as symbols ``[rows, S]``."""
    from kvtool.kernels import ops_for

    rows = data.size // row_bytes
    mat = data.reshape(rows, row_bytes)
    if bits == 8:
        return mat
    per_row = ceil(8 * row_bytes / bits)
    need = (per_row * bits + 7) // 8
    if need > row_bytes:  # the last symbol reads zero bits past the row
        mat = np.concatenate([mat, np.zeros((rows, need - row_bytes), np.uint8)], axis=1)
    return ops_for(mat).unpack_bits(np.ascontiguousarray(mat), bits, per_row)


def from_symbols(sym: np.ndarray, bits: int, row_bytes: int) -> np.ndarray:
    """Inverse of :func:`to_symbols`: the flat uint8 bytes; refuses bits set past a row."""
    from kvtool.kernels import ops_for

    if bits == 8:
        return sym.reshape(-1)
    packed = ops_for(sym).pack_bits(sym, bits)
    if packed.shape[1] > row_bytes:
        if packed[:, row_bytes:].any():
            raise FormatError("rans: a symbol sets bits past the end of its row")
        packed = packed[:, :row_bytes]
    return np.ascontiguousarray(packed).reshape(-1)


def context_index(n_rows: int, layout: RansLayout) -> np.ndarray:
    """The table of every symbol, flat in symbol order (int32)."""
    per_row = layout.symbols_per_row()
    group = np.arange(n_rows, dtype=np.int32) // (n_rows // layout.groups) * layout.columns
    column = np.arange(per_row, dtype=np.int32) % layout.columns
    return (group[:, None] + column[None, :]).reshape(-1)


# -- frequency tables ------------------------------------------------------------------------------
def normalize(counts: np.ndarray, precision: int = PRECISION) -> np.ndarray:
    """Frequencies summing to ``2**precision``, ≥ 1 wherever ``counts`` > 0 (rows of tables)."""
    total = 1 << precision
    out = np.zeros(counts.shape, np.int64)
    for t, row in enumerate(counts):
        n = int(row.sum())
        if n == 0:
            out[t, 0] = total  # an unused table: any valid one
            continue
        f = np.where(row > 0, np.maximum(1, np.floor(row * total / n + 0.5)), 0).astype(np.int64)
        diff = total - int(f.sum())
        order = np.argsort(-f, kind="stable")
        while diff:
            for s in order:  # take from (or give to) the most frequent symbols first
                if diff > 0:
                    f[s] += diff
                    diff = 0
                elif f[s] > 1:
                    step = min(-diff, int(f[s]) - 1)
                    f[s] -= step
                    diff += step
                if not diff:
                    break
        out[t] = f
    return out


def _cost_bits(counts: np.ndarray, freqs: np.ndarray, precision: int) -> float:
    used = counts > 0
    return float(-(counts[used] * (np.log2(freqs[used]) - precision)).sum())


# -- blob ------------------------------------------------------------------------------------------
def _lanes(n_symbols: int) -> int:
    return int(min(256, max(1, n_symbols // 2048)))


def encode(data: np.ndarray, *, code_bits: int | None = None, row_bytes: int = 1,
           lead: int = 1) -> bytes:
    """The smallest rANS blob for the bytes ``data`` over a few layouts.

    ``code_bits``/``row_bytes``: packed codes of that width, rows of that many bytes (try both
    those symbols and plain bytes); ``lead``: the tensor's first axis (heads), tried as groups.
    """
    data = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
    candidates = [(8, 1 if code_bits else row_bytes)]
    if code_bits and 1 <= code_bits < 8:
        candidates.insert(0, (code_bits, row_bytes))
    best: tuple[float, RansLayout, np.ndarray, np.ndarray] | None = None
    for bits, rbytes in candidates:
        if rbytes < 1 or data.size % rbytes:
            continue
        rows = data.size // rbytes
        sym = to_symbols(data, bits, rbytes)
        per_row = sym.shape[1] if sym.ndim == 2 else 1
        for groups in sorted({1, lead if lead > 0 and rows % lead == 0 else 1}):
            for columns in sorted({1, per_row}):
                layout = RansLayout(bits, rbytes, groups, columns, _lanes(sym.size))
                ctx = context_index(rows, layout)
                counts = np.zeros((layout.tables(), 1 << bits), np.int64)
                counts.reshape(-1)[:] = np.bincount(
                    ctx.astype(np.int64) * (1 << bits) + sym.reshape(-1), minlength=counts.size)
                freqs = normalize(counts, layout.precision)
                cost = (_cost_bits(counts, freqs, layout.precision) / 8 + HEADER_BYTES
                        + freqs.size * 2 + layout.lanes * 4)
                if best is None or cost < best[0]:
                    best = (cost, layout, sym, freqs)
    if best is None:
        raise ValueError("rans: no layout fits the data")
    _, layout, sym, freqs = best
    return pack_blob(layout, freqs, *_encode_symbols(sym.reshape(-1), context_index(
        sym.shape[0] if sym.ndim == 2 else sym.size, layout), freqs, layout))


def pack_blob(layout: RansLayout, freqs: np.ndarray, states: np.ndarray,
              words: np.ndarray) -> bytes:
    head = _HEAD.pack(VERSION, layout.bits, layout.precision, 0, layout.row_bytes,
                      layout.groups, layout.columns, layout.lanes, int(words.size))
    return b"".join([head, freqs.astype("<u2").tobytes(), states.astype("<u4").tobytes(),
                     words.astype("<u2").tobytes()])


def _encode_symbols(sym: np.ndarray, ctx: np.ndarray, freqs: np.ndarray,
                    layout: RansLayout) -> tuple[np.ndarray, np.ndarray]:
    """(final lane states, words in reading order)."""
    cum = np.concatenate([np.zeros((len(freqs), 1), np.int64), np.cumsum(freqs, 1)], 1)
    from kvtool.kernels import cpu_kernels

    if cpu_kernels() is not None:
        from kvtool.kernels.numba_rans import encode_kernel

        words = np.empty(sym.size, np.uint16)
        states = np.empty(layout.lanes, np.uint32)
        n = encode_kernel(sym.astype(np.uint8), ctx, freqs.astype(np.uint32),
                          cum.astype(np.uint32), layout.precision, layout.lanes, states, words)
        return states, words[:n][::-1].copy()
    return encode_reference(sym, ctx, freqs, cum, layout)


def encode_reference(sym: np.ndarray, ctx: np.ndarray, freqs: np.ndarray, cum: np.ndarray,
                     layout: RansLayout) -> tuple[np.ndarray, np.ndarray]:
    """Numpy encoder, lanes in lockstep, last symbol first (the reference for the kernel)."""
    lanes, p = layout.lanes, layout.precision
    x = np.full(lanes, STATE_LOW, np.uint64)
    chunks = []
    for start in range((sym.size - 1) // lanes * lanes, -1, -lanes):
        n = min(lanes, sym.size - start)
        s, t = sym[start:start + n].astype(np.int64), ctx[start:start + n]
        f = freqs[t, s].astype(np.uint64)
        c = cum[t, s].astype(np.uint64)
        xs = x[:n]
        emit = xs >= (f << np.uint64(32 - p))
        chunks.append((xs[emit] & np.uint64(0xFFFF))[::-1])
        xs = np.where(emit, xs >> np.uint64(16), xs)
        x[:n] = ((xs // f) << np.uint64(p)) + xs % f + c
    words = np.concatenate(chunks) if chunks else np.zeros(0, np.uint64)
    return x.astype(np.uint32), words[::-1].astype(np.uint16)


def _parse(blob: np.ndarray, nbytes: int) -> tuple[RansLayout, np.ndarray, np.ndarray,
                                                    np.ndarray, int]:
    """Header, tables, states and words of a blob; every field checked before any allocation."""
    if blob.size < HEADER_BYTES:
        raise FormatError(f"rans blob of {blob.size} bytes is shorter than its header")
    version, bits, precision, reserved, row_bytes, groups, columns, lanes, n_words = \
        _HEAD.unpack(blob[:HEADER_BYTES].tobytes())
    if version != VERSION:
        raise FormatError(f"rans blob version {version} is not supported (this kvtool reads "
                          f"version {VERSION})")
    if not 1 <= bits <= 8 or not MIN_PRECISION <= precision <= MAX_PRECISION or reserved:
        raise FormatError(f"rans header is invalid (bits {bits}, precision {precision})")
    if row_bytes < 1 or nbytes % row_bytes:
        raise FormatError(f"rans rows of {row_bytes} bytes do not divide {nbytes} bytes")
    rows = nbytes // row_bytes
    layout = RansLayout(bits, row_bytes, groups, columns, lanes, precision)
    per_row = layout.symbols_per_row()
    if not (1 <= groups and (groups == 1 if rows == 0 else rows % groups == 0)
            and 1 <= columns <= per_row and 1 <= lanes <= MAX_LANES):
        raise FormatError(f"rans layout is invalid (groups {groups}, columns {columns}, "
                          f"lanes {lanes} for {rows} rows of {per_row} symbols)")
    n_tables, n_sym = layout.tables(), 1 << bits
    size = HEADER_BYTES + 2 * n_tables * n_sym + 4 * lanes + 2 * n_words
    if size != blob.size:
        raise FormatError(f"rans blob is {blob.size} bytes, its header describes {size} "
                          "(truncated or corrupt)")
    at = HEADER_BYTES
    freqs = blob[at:at + 2 * n_tables * n_sym].view("<u2").reshape(n_tables, n_sym)
    at += freqs.nbytes
    states = blob[at:at + 4 * lanes].view("<u4")
    words = blob[at + 4 * lanes:].view("<u2")
    if (freqs.sum(axis=1, dtype=np.int64) != 1 << precision).any():
        raise FormatError(f"rans frequency table does not sum to 2**{precision}")
    if (states < STATE_LOW).any():
        raise FormatError("rans lane state out of range (corrupt stream)")
    return layout, freqs.astype(np.int64), states, words, rows


def decode(blob: np.ndarray, nbytes: int) -> np.ndarray:
    """The ``nbytes`` bytes a rANS blob holds; :class:`FormatError` on anything malformed."""
    blob = np.ascontiguousarray(blob, dtype=np.uint8).reshape(-1)
    layout, freqs, states, words, rows = _parse(blob, nbytes)
    n = rows * layout.symbols_per_row()
    if n == 0:
        if words.size or (states != STATE_LOW).any():
            raise FormatError("rans stream is corrupt: an empty tensor with coded data")
        return np.zeros(0, np.uint8)
    cum = np.concatenate([np.zeros((len(freqs), 1), np.int64), np.cumsum(freqs, 1)], 1)
    from kvtool.kernels import cpu_kernels

    if cpu_kernels() is not None:
        from kvtool.kernels.numba_rans import decode_kernel

        out = np.empty(nbytes, np.uint8)
        err = decode_kernel(states, words, freqs.astype(np.uint32), cum.astype(np.uint32),
                            slot_table(freqs, layout.precision), layout.precision, layout.bits,
                            layout.symbols_per_row(), rows // layout.groups, layout.columns, out)
        if err:
            raise FormatError("rans stream is corrupt: " + _KERNEL_ERRORS.get(err, str(err)))
        return out
    sym = decode_reference(states, words, context_index(rows, layout), freqs, cum, layout, n)
    return from_symbols(sym.reshape(rows, -1), layout.bits, layout.row_bytes)


_KERNEL_ERRORS = {1: "it ends early", 2: "it does not end where it should",
                  3: "a symbol sets bits past the end of its row"}


def slot_table(freqs: np.ndarray, precision: int) -> np.ndarray:
    """``[tables, 2**precision]``: the symbol owning each slot."""
    symbols = np.tile(np.arange(freqs.shape[1], dtype=np.uint8), len(freqs))
    return np.repeat(symbols, freqs.reshape(-1)).reshape(len(freqs), 1 << precision)


def decode_reference(states: np.ndarray, words: np.ndarray, ctx: np.ndarray, freqs: np.ndarray,
                     cum: np.ndarray, layout: RansLayout, n: int) -> np.ndarray:
    """Numpy decoder, lanes in lockstep (the reference for the kernel)."""
    lanes, p = layout.lanes, layout.precision
    mask = np.uint64((1 << p) - 1)
    lookup = slot_table(freqs, p)
    x = states.astype(np.uint64)
    w = words.astype(np.uint64)
    out = np.empty(n, np.uint8)
    ptr = 0
    for start in range(0, n, lanes):
        m = min(lanes, n - start)
        t = ctx[start:start + m]
        xs = x[:m]
        slot = xs & mask
        s = lookup[t, slot.astype(np.int64)]
        xs = freqs[t, s].astype(np.uint64) * (xs >> np.uint64(p)) + slot - cum[t, s].astype(
            np.uint64)
        need = xs < STATE_LOW
        k = int(need.sum())
        if ptr + k > w.size:
            raise FormatError("rans stream is corrupt: it ends early")
        xs[need] = (xs[need] << np.uint64(16)) | w[ptr:ptr + k]
        ptr += k
        x[:m] = xs
        out[start:start + m] = s
    if ptr != w.size or (x != STATE_LOW).any():
        raise FormatError("rans stream is corrupt: it does not end where it should")
    return out


def entropy_bits(data: np.ndarray, bits: int) -> float:
    """Order-0 entropy of ``data``'s ``bits``-bit symbols in bits per symbol (for reports)."""
    counts = np.bincount(np.asarray(data).reshape(-1), minlength=1 << bits).astype(float)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum()) if p.size else 0.0


__all__ = ["RansLayout", "decode", "encode", "entropy_bits"]
