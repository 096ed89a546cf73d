"""Compiled CPU backend (numba) for ``turbomix``: every option fused, one pass per part.

A ``turbomix`` vector is split into parts (the other channels, then the outlier channels), each
with its own rotation, codebook and norm (:mod:`kvtool.codecs.turbomix`). The kernels here take
one part of the whole input at a time and work on tiles of up to :data:`TILE` rows of one group
(one head of one block: the rows that share a mean, an outlier set and a rotation), stored
transposed (``[n, TILE]``) so that each step is a loop over a contiguous run of rows that LLVM
vectorises:

- :func:`group_stats_kernel`: each group's channel means (accumulated in float64, rounded to
  fp16 as stored) and channel energies after centering (float64), for the outlier choice;
- :func:`part_encode_kernel`: gather the part's channels minus the mean, the norm, then per
  candidate rotation: the rotation (Walsh–Hadamard butterflies at a power-of-two width, else the
  dense seeded matrix), the quantiser (scalar Lloyd–Max, the 2-D ``vq=2`` codebook, or the
  32-state trellis by the Viterbi algorithm, its 32 path decisions per coordinate one uint32),
  the packing, and each row's squared reconstruction error (``select=scalar``: every candidate
  with the scalar codebook first, then the trellis or pair quantiser once, each group with its
  chosen rotation);
- :func:`part_decode_kernel`: unpack, look up (scalar, pair or trellis tables), rotate back
  with the group's candidate, scale by the norm, add the mean and write the part's channels of
  the output in its dtype.

Ties follow the reference: the lowest bucket, the lowest pair index, the lower predecessor
state, the lowest final state, the lowest candidate. Sums run in another order than the
reference's matmuls, so a coordinate within float rounding of a decision boundary may decide
the other way; every other code is the reference's.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numba
import numpy as np
from numba import prange

from kvtool.codecs.rotation import hadamard_signs, is_power_of_two, rotation_matrix
from kvtool.errors import CodecError
from kvtool.kernels.numba_cpu import from_f32, to_f32
from kvtool.kernels.numba_quantizers import (
    PAIR,
    QUANTIZERS,
    SCALAR,
    STATES,
    pack_tile,
    pair_codes,
    rotate,
    rotate_back,
    scalar_codes,
    tile_values,
    trellis_codes,
)
from kvtool.kernels.numba_support import (
    empty_like_backend,
    f16_to_f32,
    f32_to_f16,
    jit,
    kernel_view,
    num_threads,
)

TILE = 64
SPAN = 4  # tiles side by side in one pass of the encode (a [128, 256] float32 pass: 128 KiB)


# -- kernels ---------------------------------------------------------------------------------
@jit(parallel=True, nogil=True)
def group_stats_kernel(x, tokens, center, energy_wanted, mean, energy, threads):
    """Per group of ``tokens`` rows: mean[g] (fp16-rounded, as float32; where ``center``) and
    energy[g] = Σ (x − mean)² per channel (float64; where ``energy_wanted``)."""
    rows, dim = x.shape
    groups = rows // tokens
    for g in prange(groups):
        acc = np.zeros(dim, np.float64)
        if center:
            for t in range(tokens):
                for d in range(dim):
                    acc[d] += to_f32(x[g * tokens + t, d])
            for d in range(dim):
                mean[g, d] = f16_to_f32(f32_to_f16(np.float32(acc[d] / tokens)))
        if energy_wanted:
            for d in range(dim):
                acc[d] = 0.0
            for t in range(tokens):
                for d in range(dim):
                    a = to_f32(x[g * tokens + t, d])
                    if center:
                        a = a - mean[g, d]
                    acc[d] += np.float64(a) * np.float64(a)
            for d in range(dim):
                energy[g, d] = acc[d]


@jit(parallel=True, nogil=True)
def part_encode_kernel(x, tokens, channels, mean, signs, dense, fwht, quantizer, bits, bounds,
                       centroids, points, half_sq, levels, edges, subset_bits, choice, codes,
                       norms, err, threads):
    """codes[c, r], err[c, r] per candidate rotation c, and norms[r] (float32), of the part of
    ``x[r]`` at ``channels[g]`` (row 0 for every group where it has one row) minus ``mean[g]``
    (none where ``mean`` has no rows); where ``choice`` has rows, only group g's candidate
    ``choice[g]``, as c = 0 (``select=scalar``); ``codes`` of no bytes: errors and norms only
    (``select=scalar``'s probe).

    A thread takes its tiles :data:`SPAN` at a time, and the trellis runs over them side by
    side (``[n, span · TILE]``): rows are independent, and its 32-state steps cost less per row
    over longer runs (2026-11-29, 2 threads: ``balanced`` and ``small`` 1.1–1.25× faster, from
    8 × 64 rows to 8 × 4,096). A lone tile keeps the loop of constant width, faster for one."""
    rows = x.shape[0]
    n = channels.shape[1]
    ncand = codes.shape[0]
    groups = rows // tokens
    per_group = (tokens + TILE - 1) // TILE
    items = groups * per_group
    # chunks of SPAN tiles where that leaves two a thread: fewer, wider passes are faster
    nchunks = max(1, min(items, threads * 8, max(threads * 2, (items + SPAN - 1) // SPAN)))
    scale = np.float32(1.0 / n) if fwht else np.float32(1.0)
    spans = min(SPAN, (items + nchunks - 1) // nchunks)  # no more than a chunk takes
    trellis = quantizer != SCALAR and quantizer != PAIR
    wide = spans * TILE if trellis else 0
    for chunk in prange(nchunks):
        t = np.empty((spans, n, TILE), np.float32)
        u = np.empty((spans, n, TILE), np.float32)
        y = np.empty((spans, n, TILE), np.float32)
        yhat = np.empty((spans, n, TILE), np.float32)
        q = np.empty((spans, n, TILE), np.uint8)
        inv = np.empty((spans, TILE), np.float32)
        nrm = np.empty(TILE, np.float32)
        n16 = np.empty((spans, TILE), np.float32)
        best = np.empty(TILE, np.int64)
        k = np.empty(max(wide, TILE), np.uint32)
        e = np.empty(TILE, np.float64)
        packed = np.empty((codes.shape[2], TILE), np.uint32)
        # the trellis's: the span's tiles side by side
        side = n * wide if spans > 1 else 0  # unused (a tile alone): not even allocated
        y_all = np.empty(side, np.float32)
        yhat_all = np.empty(side, np.float32)
        q_all = np.empty(side, np.uint8)
        cost = np.empty(STATES * wide, np.float32)
        fresh = np.empty(STATES * wide, np.float32)
        decisions = np.empty(n * wide, np.uint32)
        found = np.empty(n * wide, np.uint16)
        dist = np.empty(4 * wide, np.float32)
        state = np.empty(wide, np.uint32)
        decided = np.empty(wide, np.uint32)
        first, stop = chunk * items // nchunks, (chunk + 1) * items // nchunks
        for i0 in range(first, stop, spans):
            span = min(spans, stop - i0)
            for b in range(span):
                g, r0, w = _tile_rows(i0 + b, per_group, tokens)
                ch = channels[g if channels.shape[0] > 1 else 0]
                rows_in = x[r0:r0 + w]  # a slice and an unsigned channel: no index wrapping
                tb = t[b]
                for j in range(n):
                    d = np.uint32(ch[j])
                    m = mean[g, d] if mean.shape[0] else np.float32(0.0)
                    for v in range(w):
                        tb[j, v] = to_f32(rows_in[v, d]) - m
                    for v in range(w, TILE):
                        tb[j, v] = 0.0
                for v in range(TILE):
                    nrm[v] = 0.0
                for j in range(n):
                    for v in range(TILE):
                        nrm[v] += tb[j, v] * tb[j, v]
                for v in range(TILE):
                    norm = np.float32(np.sqrt(nrm[v]))
                    nrm[v] = norm
                    n16[b, v] = f16_to_f32(f32_to_f16(norm))
                    inv[b, v] = np.float32(1.0) / (norm if norm > 0 else norm + np.float32(1.0))
                norms[r0:r0 + w] = nrm[:w]
            for c in range(ncand):
                for b in range(span):
                    chosen = c if choice.shape[0] == 0 else \
                        choice[_tile_rows(i0 + b, per_group, tokens)[0]]
                    rotate(t[b], u[b], signs, dense, chosen, fwht)
                    ub, yb = u[b], y[b]
                    for j in range(n):
                        for v in range(TILE):
                            ub[j, v] *= scale
                            yb[j, v] = ub[j, v] * inv[b, v]
                    if quantizer == SCALAR:
                        scalar_codes(yb, bounds, centroids, q[b], yhat[b], k)
                    elif quantizer == PAIR:
                        pair_codes(yb, points, half_sq, bits, q[b], yhat[b], best)
                if trellis and span == 1:  # a constant width: faster for a lone tile
                    trellis_codes(y[0], levels, edges, subset_bits, bits, q[0], yhat[0],
                                  cost[:STATES * TILE].reshape((STATES, TILE)),
                                  fresh[:STATES * TILE].reshape((STATES, TILE)),
                                  decisions[:n * TILE].reshape((n, TILE)),
                                  found[:n * TILE].reshape((n, TILE)),
                                  dist[:4 * TILE].reshape((4, TILE)), state, k, decided)
                elif trellis:
                    width = span * TILE
                    ya = y_all[:n * width].reshape((n, width))
                    qa = q_all[:n * width].reshape((n, width))
                    yhata = yhat_all[:n * width].reshape((n, width))
                    _side_by_side(y, span, ya)
                    trellis_codes(ya, levels, edges, subset_bits, bits, qa, yhata,
                                  cost[:STATES * width].reshape((STATES, width)),
                                  fresh[:STATES * width].reshape((STATES, width)),
                                  decisions[:n * width].reshape((n, width)),
                                  found[:n * width].reshape((n, width)),
                                  dist[:4 * width].reshape((4, width)), state, k, decided)
                    _tile_by_tile(qa, span, q)
                    _tile_by_tile(yhata, span, yhat)
                for b in range(span):
                    _, r0, w = _tile_rows(i0 + b, per_group, tokens)
                    ub, yhatb = u[b], yhat[b]
                    for v in range(TILE):
                        e[v] = 0.0
                    for j in range(n):
                        for v in range(TILE):
                            diff = ub[j, v] - n16[b, v] * yhatb[j, v]
                            e[v] += np.float64(diff * diff)  # squared in fp32, as every backend
                    err[c, r0:r0 + w] = e[:w]
                    if codes.shape[2]:  # none kept by select=scalar's probe
                        pack_tile(q[b], w, bits, packed, codes[c], r0)


@numba.njit(inline="always")
def _side_by_side(tiles, span, out):
    """out[j, b·TILE + v] = tiles[b, j, v] for the first ``span`` tiles."""
    for b in range(span):
        tile = tiles[b]
        for j in range(tile.shape[0]):
            for v in range(TILE):
                out[j, b * TILE + v] = tile[j, v]


@numba.njit(inline="always")
def _tile_by_tile(wide, span, tiles):
    """The inverse of :func:`_side_by_side`."""
    for b in range(span):
        tile = tiles[b]
        for j in range(tile.shape[0]):
            for v in range(TILE):
                tile[j, v] = wide[j, b * TILE + v]


@numba.njit(inline="always")
def _tile_rows(item, per_group, tokens):
    """(group, first row, rows) of tile ``item``: tiles of :data:`TILE` rows within a group."""
    g = item // per_group
    r0 = g * tokens + (item % per_group) * TILE
    return g, r0, min(TILE, (g + 1) * tokens - r0)


@jit(parallel=True, nogil=True)
def part_decode_kernel(codes, norms, choice, tokens, channels, mean, signs, dense, fwht,
                       quantizer, bits, table, subsets, out, threads):
    """out[r, channels[g]] = norms[r] · R_cᵀ values(codes[r]) + mean[g], c = choice[g]
    (choice of one entry: every group's), in out's dtype; ``table``: :func:`decode_table`."""
    rows = codes.shape[0]
    n = channels.shape[1]
    groups = rows // tokens
    per_group = (tokens + TILE - 1) // TILE
    items = groups * per_group
    nchunks = max(1, min(items, threads * 8))
    scale = np.float32(1.0 / n) if fwht else np.float32(1.0)
    for chunk in prange(nchunks):
        y = np.zeros((n, TILE), np.float32)  # a tile's unused columns: rotated, never written
        u = np.empty((n, TILE), np.float32)
        q = np.empty((n, TILE), np.uint8)
        packed = np.empty((n, TILE), np.uint8)
        state = np.empty(TILE, np.uint32)
        for item in range(chunk * items // nchunks, (chunk + 1) * items // nchunks):
            g = item // per_group
            r0 = g * tokens + (item % per_group) * TILE
            w = min(TILE, (g + 1) * tokens - r0)
            c = choice[g if choice.shape[0] > 1 else 0]
            ch = channels[g if channels.shape[0] > 1 else 0]
            tile_values(codes[r0:r0 + w], w, n, bits, quantizer, table, subsets, packed, q,
                        state, y)
            rotate_back(y, u, signs, dense, c, fwht)
            rows_out, row_norms = out[r0:r0 + w], norms[r0:r0 + w]  # slices: no index wrapping
            for j in range(n):
                d = np.uint32(ch[j])
                m = mean[g, d] if mean.shape[0] else np.float32(0.0)
                for v in range(w):
                    value = u[j, v] * scale * to_f32(row_norms[v]) + m
                    rows_out[v, d] = from_f32(value, out[0, 0])


# -- Python entry points -------------------------------------------------------------------------
@cache
def rotation_tables(n: int, seeds: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, bool]:
    """(signs [C, 3, n], dense [C, n, n], butterflies?) for the candidates' seeds: the two
    Hadamard sign vectors and ones where ``n`` is a power of two, else the dense matrices."""
    fwht = is_power_of_two(n) and n >= 4
    if fwht:
        signs = np.stack([np.stack([*(s.astype(np.float32) for s in hadamard_signs(n, seed)),
                                    np.ones(n, np.float32)]) for seed in seeds])
        dense = np.zeros((len(seeds), 1, 1), np.float32)
    else:
        signs = np.zeros((len(seeds), 3, 1), np.float32)
        dense = np.stack([rotation_matrix(n, seed) for seed in seeds]).astype(np.float32)
    for a in (signs, dense):
        a.setflags(write=False)
    return signs, dense, fwht


@cache
def quantizer_tables(n: int, bits: int, quantizer: str) -> tuple[np.ndarray, ...]:
    """(bounds, centroids, points, half_sq, levels, edges, subset_bits) of one part's quantiser
    at width ``n``: the reference's float32 values (unused ones: placeholders), and the trellis
    subsets as two uint32 masks (see :func:`~kvtool.kernels.numba_quantizers.trellis_codes`)."""
    from kvtool.codecs.lloyd_max import sphere_marginal_codebook
    from kvtool.codecs.trellis import subset_table
    from kvtool.codecs.trellis_tables import trellis_levels
    from kvtool.codecs.vq_tables import pair_codebook

    bounds = centroids = levels = np.zeros(1, np.float32)
    points, edges = np.zeros((1, 2), np.float32), np.zeros((4, 1), np.float32)
    half_sq = np.zeros(1, np.float32)
    if quantizer == "scalar":
        book = sphere_marginal_codebook(n, 1 << bits)
        bounds, centroids = (np.asarray(a, np.float32) for a in (book.boundaries,
                                                                 book.centroids))
    elif quantizer == "pair":
        points = pair_codebook(bits) / np.float32(np.sqrt(n))
        half_sq = (points ** 2).sum(axis=1) * np.float32(0.5)
    else:
        levels = trellis_levels(bits) / np.float32(np.sqrt(n))
        per_subset = levels.reshape(-1, 4).T
        edges = np.ascontiguousarray((per_subset[:, 1:] + per_subset[:, :-1]) * np.float32(0.5))
    subsets = subset_table()[:, 0]  # path bit 0; bit 1 flips the subset's high bit
    subset_bits = np.array([sum(int(b & 1) << p for p, b in enumerate(subsets)),
                            sum(int(b >> 1) << p for p, b in enumerate(subsets))], np.uint32)
    assert (subset_table()[:, 1] == subsets ^ 2).all()
    tables = (bounds, centroids, np.ascontiguousarray(points), half_sq, levels, edges,
              subset_bits)
    for a in tables:
        a.setflags(write=False)
    return tables


def _input_rows(x: Any, dim: int) -> np.ndarray:
    view = np.ascontiguousarray(kernel_view(x)).reshape(-1, dim)
    return view if view.dtype in (np.float32, np.uint16, np.int16) else view.astype(np.float32)


def encode(codec: Any, x: Any) -> dict[str, np.ndarray]:
    """``turbomix`` arrays (numpy, the reference's shapes flattened to [groups, tokens, ...])
    of ``x[..., tokens, dim]`` (numpy or CPU torch)."""
    from kvtool.codecs.turbomix import candidate_seed, norm_codes

    shape, dim = tuple(x.shape), x.shape[-1]
    tokens = shape[-2] if len(shape) > 1 else 1
    view = _input_rows(x, dim)
    rows = view.shape[0]
    groups, threads = rows // tokens, num_threads()
    n_hi, n_lo = codec._split(dim)
    mean = np.zeros((groups if codec.center else 0, dim), np.float32)
    energy = np.zeros((groups if n_hi else 0, dim), np.float64)
    if codec.center or n_hi:
        group_stats_kernel(view, tokens, codec.center, n_hi > 0, mean, energy, threads)
    out: dict[str, np.ndarray] = {}
    if codec.center:
        out["mean"] = mean.astype(np.float16)[:, None, :]
    parts = [(np.arange(dim, dtype=np.int32)[None, :], codec.bits)]
    if n_hi:
        hi = np.sort(np.argsort(-energy, axis=-1, kind="stable")[:, :n_hi], axis=-1)
        mask = np.zeros(energy.shape, dtype=bool)
        np.put_along_axis(mask, hi, True, axis=-1)
        out["outlier_mask"] = np.packbits(mask, axis=-1, bitorder="little")[:, None, :]
        lo = np.nonzero(~mask)[1].reshape(groups, n_lo)
        parts = [(lo.astype(np.int32), codec.bits), (hi.astype(np.int32), codec.outlier_bits)]
    seeds = tuple(candidate_seed(codec.seed, c) for c in range(codec.candidates))
    no_choice = np.zeros(0, np.int64)
    if codec._selects_by_scalar():  # each group's rotation by the scalar codebook: only it runs
        errors = _encode_parts(view, tokens, mean, parts, seeds, "scalar", no_choice, threads,
                               probe=True)[1]
        choice = _least(errors, groups, tokens)
        encoded = _encode_parts(view, tokens, mean, parts, seeds, codec.quantizer, choice,
                                threads)[0]
    else:
        encoded, errors = _encode_parts(view, tokens, mean, parts, seeds, codec.quantizer,
                                        no_choice, threads)
        choice = _least(errors, groups, tokens)
    if len(seeds) > 1:
        out["rotation"] = choice.astype(np.uint8)[:, None]
    for (codes, norms), suffix in zip(encoded, ("", "_hi"), strict=False):
        codes = codes.reshape(len(codes), groups, tokens, -1)
        out["codes" + suffix] = codes[choice, np.arange(groups)] if len(codes) > 1 else codes[0]
        norms = norms.reshape(groups, tokens)
        check_norms(norms, x, codec.codec_id)
        if codec.norm_bits == 8:
            out["norms" + suffix], out["norm_range" + suffix] = norm_codes(
                norms.astype(np.float16))
        else:
            out["norms" + suffix] = norms.astype(np.float16)
    return out


def _encode_parts(view: np.ndarray, tokens: int, mean: np.ndarray,
                  parts: list[tuple[np.ndarray, int]], seeds: tuple[int, ...], quantizer: str,
                  choice: np.ndarray, threads: int, probe: bool = False
                  ) -> tuple[list[tuple[Any, Any]], np.ndarray]:
    """([(codes [C, R, nbytes], norms [R])] of each part, summed errors [C, R]): every
    candidate, or (``choice`` with rows) each group's own, as C = 1; a ``probe`` packs no
    codes (nbytes 0)."""
    kept = 1 if choice.size else len(seeds)
    rows = view.shape[0]
    err = np.zeros((kept, rows), np.float64)
    encoded = []
    for channels, bits in parts:
        n = channels.shape[1]
        signs, dense, fwht = rotation_tables(n, seeds)
        codes = np.empty((kept, rows, 0 if probe else (n * bits + 7) // 8), np.uint8)
        norms = np.empty(rows, np.float32)
        part_err = np.empty((kept, rows), np.float64)
        part_encode_kernel(view, tokens, channels, mean, signs, dense, fwht,
                           QUANTIZERS[quantizer], bits, *quantizer_tables(n, bits, quantizer),
                           choice, codes, norms, part_err, threads)
        err += part_err
        encoded.append((codes, norms))
    return encoded, err


def _least(errors: np.ndarray, groups: int, tokens: int) -> np.ndarray:
    """Each group's candidate of least summed error (ties: the lowest)."""
    if len(errors) == 1:
        return np.zeros(groups, np.int64)
    return errors.reshape(len(errors), groups, tokens).sum(axis=2).argmin(axis=0)


def check_norms(norms: np.ndarray, x: Any, who: str) -> None:
    """Refuse NaN/Inf input (its norms are not finite) and norms past fp16's range."""
    from kvtool.codecs.turbo import FP16_MAX

    if not bool((norms <= FP16_MAX).all()):
        from kvtool.kernels import check_finite, ops_for

        if not bool(np.isfinite(norms).all()):
            check_finite(ops_for(x), x, who)
        raise CodecError(f"{who}: vector norm exceeds the fp16 range")


@cache
def decode_table(quantizer: str, bits: int, n: int) -> np.ndarray:
    """The unit-domain values :func:`~kvtool.kernels.numba_quantizers.tile_values` decodes a
    part of width ``n`` to: the scalar centroids, the pair points (flat ``[x0, y0, x1, ...]``)
    or the trellis codebook's sorted levels (picked by subset and code)."""
    tables = quantizer_tables(n, bits, quantizer)
    values = {"scalar": tables[1], "pair": tables[2].reshape(-1), "trellis": tables[4]}
    table = np.array(values[quantizer], np.float32)
    table.setflags(write=False)
    return table


@cache
def subset_masks() -> np.ndarray:
    """The trellis subsets as two uint32 masks (the same at every width and bit count)."""
    masks = np.array(quantizer_tables(2, 2, "trellis")[6])
    masks.setflags(write=False)
    return masks


def decode(codec: Any, arrays: dict[str, np.ndarray], shape: tuple[int, ...], like: Any,
           dtype: str, channel_sets: list[np.ndarray], norms: list[np.ndarray]) -> Any:
    """x̂ [shape] in ``dtype`` as an array of ``like``'s backend, from the codec's arrays
    (numpy), each part's channels [groups or 1, n] and float32 norms [rows]."""
    from kvtool.codecs.turbomix import candidate_seed

    dim = shape[-1]
    tokens = shape[-2] if len(shape) > 1 else 1
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    groups, threads = rows // tokens, num_threads()
    result, out = empty_like_backend(like, (rows, dim), dtype)
    mean = (arrays["mean"].reshape(groups, dim).astype(np.float32) if "mean" in arrays
            else np.zeros((0, dim), np.float32))
    choice = (np.ascontiguousarray(arrays["rotation"].reshape(groups)) if "rotation" in arrays
              else np.zeros(1, np.uint8))
    seeds = tuple(candidate_seed(codec.seed, c) for c in range(codec.candidates))
    bit_widths = (codec.bits, codec.outlier_bits)
    for suffix, channels, part_norms, bits in zip(("", "_hi"), channel_sets, norms, bit_widths,
                                                  strict=False):
        n = channels.shape[1]
        signs, dense, fwht = rotation_tables(n, seeds)
        codes = np.ascontiguousarray(arrays["codes" + suffix]).reshape(rows, -1)
        part_decode_kernel(codes, part_norms, choice, tokens, channels, mean, signs, dense,
                           fwht, QUANTIZERS[codec.quantizer], bits,
                           decode_table(codec.quantizer, bits, n), subset_masks(), out, threads)
    return result.reshape(shape)


__all__ = ["QUANTIZERS", "TILE", "decode", "decode_table", "encode", "group_stats_kernel",
           "part_decode_kernel", "part_encode_kernel", "quantizer_tables", "rotation_tables",
           "subset_masks"]
