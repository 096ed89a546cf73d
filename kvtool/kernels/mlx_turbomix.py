"""mlx backend for ``turbomix``: the numpy reference's codes, in vectorised ``mx`` ops.

Everything runs on mlx's default device; only small constant tables (rotation signs and
matrices, codebooks, trellis tables) come from numpy, built once per width and cached.

- group statistics: channel means and energies in float64 where mlx's CPU device is active, as
  the reference sums (elsewhere a double-float mean, float32 energies); the outlier channels
  (the most energy; ties: the lowest channel, as the reference's stable argsort);
- per candidate: the rotation (``mx.hadamard_transform`` and sign flips at a power-of-two
  width, else a matmul by the dense seeded matrix), the quantiser (scalar buckets; the 2-D ``vq=2``
  codebook in row chunks; the 32-state trellis: a Viterbi pass vectorised over rows with path
  costs ``[32, rows]``, one compiled step per coordinate, traced back over rows), each row's
  squared error in the rotated frame; per group the candidate of least error;
- decode: unpack, look up, rotate back with each group's candidate (per-group signs, or
  ``mx.gather_mm`` over the dense matrices), scale, merge the parts, add the mean.

Ties follow the reference: the lowest bucket, pair index, predecessor state, final state and
candidate. Sums run in another order than the reference's matmuls, so a coordinate within
float rounding of a decision may decide the other way; every other code is the reference's.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
import numpy as np

from kvtool.codecs.lloyd_max import sphere_marginal_codebook
from kvtool.codecs.norm_grid import _NORM_STEPS
from kvtool.codecs.rotation import hadamard_signs, is_power_of_two, rotation_matrix
from kvtool.codecs.trellis import MEMORY, STATES, state_values, subset_table
from kvtool.codecs.trellis_tables import trellis_levels
from kvtool.codecs.turbo import FP16_MAX
from kvtool.codecs.turbomix import candidate_seed
from kvtool.codecs.vq_tables import pair_codebook
from kvtool.errors import CodecError
from kvtool.kernels import check_finite, mlx_ops, to_mlx

_TINY = float(np.finfo(np.float16).smallest_subnormal)
_VITERBI_ROWS = 1 << 20  # coordinates per Viterbi chunk: decisions are 32 bytes each
_PAIR_SCORES = 1 << 21  # pair × point scores per chunk (8 MB of float32)


def _wide() -> Any:
    """float64 where mlx's CPU device is active (as the reference sums), else float32."""
    return mx.float64 if mx.default_device().type == mx.cpu else mx.float32


# -- constant tables -----------------------------------------------------------------------------
@cache
def _rotations(n: int, seeds: tuple[int, ...]) -> tuple[bool, mx.array, mx.array]:
    """(hadamard?, a, b): the Hadamard signs s1, s2 [C, n] at a power-of-two ``n`` >= 4,
    else the dense matrices R [C, n, n] and Rᵀ [C, n, n]."""
    if is_power_of_two(n) and n >= 4:
        s1, s2 = (np.stack([hadamard_signs(n, s)[i] for s in seeds]).astype(np.float32)
                  for i in (0, 1))
        return True, mx.array(s1), mx.array(s2)
    dense = np.stack([rotation_matrix(n, s) for s in seeds])
    return False, mx.array(dense), mx.array(np.ascontiguousarray(dense.transpose(0, 2, 1)))


@cache
def _scalar_book(n: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    book = sphere_marginal_codebook(n, 1 << bits)
    return np.asarray(book.boundaries, np.float32), np.asarray(book.centroids, np.float32)


@cache
def _pair_book(n: int, bits: int) -> tuple[mx.array, mx.array]:
    """(points [K, 2], |c|²/2 [K]) at the scale of unit vectors in R^n (the reference's)."""
    points = pair_codebook(bits) / np.float32(np.sqrt(n))
    half_sq = (points ** 2).sum(axis=1) * np.float32(0.5)
    return mx.array(points.astype(np.float32)), mx.array(half_sq.astype(np.float32))


@cache
def _trellis_book(n: int, bits: int) -> tuple[mx.array, list[np.ndarray], list[mx.array]]:
    """(levels [2L], per subset j: its decision edges (numpy) and its levels (mx))."""
    levels = trellis_levels(bits) / np.float32(np.sqrt(n))
    per_subset = levels.reshape(-1, 4).T
    edges = [(per_subset[j, 1:] + per_subset[j, :-1]) * np.float32(0.5) for j in range(4)]
    return mx.array(levels), edges, [mx.array(np.ascontiguousarray(p)) for p in per_subset]


@cache
def _subsets() -> mx.array:
    """subset_table flattened: entry 2·state + path bit."""
    return mx.array(subset_table().reshape(-1).astype(np.uint32))


# -- rotations (exact: sign flips, mx.hadamard_transform's sums, a power-of-two scale) ----------
def _rotate(x: mx.array, s1: mx.array, s2: mx.array) -> mx.array:
    """x Rᵀ for R = H diag(s2) H diag(s1) / n."""
    h = mx.hadamard_transform(x * s1, scale=1.0)
    return mx.hadamard_transform(h * s2, scale=1.0 / x.shape[-1])


def _rotate_back(y: mx.array, s1: mx.array, s2: mx.array) -> mx.array:
    """y R."""
    h = mx.hadamard_transform(y, scale=1.0)
    return mx.hadamard_transform(h * s2, scale=1.0 / y.shape[-1]) * s1


# -- quantisers: unit rows [rows, n] → (uint8 codes, their values) ------------------------------
def _scalar(y: mx.array, bits: int) -> tuple[mx.array, mx.array]:
    bounds, centroids = _scalar_book(y.shape[-1], bits)
    codes = mlx_ops.bucketize(y, bounds)
    return codes, mx.take(mlx_ops.const(centroids, y), codes)


def _pair(y: mx.array, bits: int) -> tuple[mx.array, mx.array]:
    """The nearest 2-D point of each coordinate pair: max x·c − |c|²/2 in elementwise float32
    products (uncompiled, so no fused multiply-add rounds otherwise), ties the lowest index."""
    rows, n = y.shape
    points, half_sq = _pair_book(n, bits)
    k = points.shape[0]
    p0, p1, ar = points[:, 0], points[:, 1], mx.arange(k, dtype=mx.int32)
    pairs = y.reshape(-1, 2)
    step = max(1, _PAIR_SCORES // k)
    found = []
    for at in range(0, pairs.shape[0], step):
        x = pairs[at:at + step]
        score = x[:, :1] * p0 + x[:, 1:] * p1 - half_sq
        best = mx.max(score, axis=1, keepdims=True)
        found.append(mx.min(mx.where(score == best, ar, k), axis=1))
        if len(found) % 16 == 0:
            mx.eval(found[-16:])
    index = mx.concatenate(found) if len(found) > 1 else found[0]
    codes = mx.stack([index >> bits, index & ((1 << bits) - 1)], axis=-1).astype(mx.uint8)
    return codes.reshape(rows, n), mx.take(points, index, axis=0).reshape(rows, n)


@cache
def _viterbi_step() -> Any:
    """One trellis step on path costs [32, rows] and subset distances [4, rows]: (new costs,
    whether each state's best predecessor is the upper one [16, 2, rows]). State s = 2k + u
    comes from k (cost a[0, k]) or k + 16 (a[1, k]) with path bit u."""
    table = subset_table()
    states = np.arange(STATES)
    j0 = mx.array(table[states >> 1, states & 1].astype(np.int32))
    j1 = mx.array(table[(states >> 1) | (STATES >> 1), states & 1].astype(np.int32))

    def step(cost: mx.array, d: mx.array) -> tuple[mx.array, mx.array]:
        rows = cost.shape[-1]
        a = cost.reshape(2, STATES // 2, 1, rows)
        c0 = a[0] + mx.take(d, j0, axis=0).reshape(STATES // 2, 2, rows)
        c1 = a[1] + mx.take(d, j1, axis=0).reshape(STATES // 2, 2, rows)
        upper = c1 < c0
        return mx.where(upper, c1, c0).reshape(STATES, rows), upper

    return mx.compile(step)


def _trellis(y: mx.array, bits: int) -> tuple[mx.array, mx.array]:
    rows, n = y.shape
    step = max(1, _VITERBI_ROWS // n)
    parts = [_viterbi(y[at:at + step], bits) for at in range(0, rows, step)]
    return tuple(mx.concatenate(list(p)) if len(p) > 1 else p[0] for p in zip(*parts, strict=True))


def _viterbi(y: mx.array, bits: int) -> tuple[mx.array, mx.array]:
    """The reference's least-squared-error trellis path for rows ``y`` [rows, n]."""
    rows, n = y.shape
    levels, edges, per_subset = _trellis_book(n, bits)
    yt = mx.contiguous(y.T)  # [n, rows]: each step reads a contiguous run of rows
    within = mx.stack([mlx_ops.bucketize(yt, e) for e in edges], axis=1)  # [n, 4, rows]
    dist = mx.stack([mx.square(yt - mx.take(per_subset[j], within[:, j]))
                     for j in range(4)], axis=1)
    mx.eval(within, dist)
    step = _viterbi_step()
    cost = mx.broadcast_to(mx.array([0.0] + [np.inf] * (STATES - 1))[:, None], (STATES, rows))
    upper = []
    for t in range(n):
        cost, up = step(cost, dist[t])
        upper.append(up.reshape(STATES, rows))
        if t % 16 == 15:
            mx.eval(cost, upper[-16:])
    least = mx.min(cost, axis=0, keepdims=True)  # ties: the lowest final state
    state = mx.min(mx.where(cost == least, mx.arange(STATES)[:, None], STATES), axis=0)
    state = state.astype(mx.uint32)
    subsets = _subsets()
    path, subset = [None] * n, [None] * n
    for t in range(n - 1, -1, -1):
        bit = state & 1
        up = mx.take_along_axis(upper[t], state[None], axis=0)[0].astype(mx.uint32)
        state = (state >> 1) | (up << (MEMORY - 1))
        path[t], subset[t] = bit, mx.take(subsets, 2 * state + bit)
        if t % 16 == 0:
            mx.eval(state, path[t:t + 16], subset[t:t + 16])
    path_t, subset_t = mx.stack(path), mx.stack(subset)  # [n, rows]
    index = mx.take_along_axis(within, subset_t[:, None, :], axis=1)[:, 0]
    codes = ((path_t << (bits - 1)) | index).astype(mx.uint8)
    values = mx.take(levels, 4 * index.astype(mx.uint32) + subset_t)
    return mx.contiguous(codes.T), mx.contiguous(values.T)


_QUANTIZERS = {"scalar": _scalar, "pair": _pair, "trellis": _trellis}


# -- encode --------------------------------------------------------------------------------------
def _group_mean(g: mx.array) -> mx.array:
    """fp16 channel means [G, 1, D] of float32 ``g`` [G, T, D], rounded as the reference does
    (float64 mean → float32 → fp16); without float64 (off the CPU) a double-float mean."""
    if _wide() == mx.float64:
        mean = mx.mean(g.astype(mx.float64), axis=1, keepdims=True)
        return mean.astype(mx.float32).astype(mx.float16)  # twice, as the reference rounds
    hi, lo = g, mx.zeros_like(g)  # the sum as hi + lo: a pairwise tree of exact additions
    while hi.shape[1] > 1:
        if hi.shape[1] % 2:
            hi, lo = (mx.pad(a, [(0, 0), (0, 1), (0, 0)]) for a in (hi, lo))
        h = hi.shape[1] // 2
        s, e = _two_sum(hi[:, :h], hi[:, h:])
        hi, lo = _two_sum(s, e + (lo[:, :h] + lo[:, h:]))
    tokens = g.shape[1]
    q = hi / tokens  # then the remainder (hi + lo − q·T) / T, q·T split exactly (Dekker)
    split = q * 4097.0
    q_hi = split - (split - q)
    t = np.float32(tokens)
    t_hi = float(t * np.float32(4097) - (t * np.float32(4097) - t))
    t_lo = float(t - np.float32(t_hi))
    p = q * tokens
    p_err = ((q_hi * t_hi - p) + q_hi * t_lo + (q - q_hi) * t_hi) + (q - q_hi) * t_lo
    return (q + (((hi - p) - p_err) + lo) / tokens).astype(mx.float16)


def _two_sum(a: mx.array, b: mx.array) -> tuple[mx.array, mx.array]:
    """(a + b rounded, its rounding error), exactly (Knuth)."""
    s = a + b
    v = s - a
    return s, (a - (s - v)) + (b - v)


def _outlier_order(g: mx.array, n_hi: int) -> tuple[mx.array, mx.array]:
    """(mask [G, D] of the n_hi channels of most energy, ties the lowest channel; channel order
    [G, D]: the other channels ascending, then the outliers ascending)."""
    dim = g.shape[-1]
    energy = mx.sum(mx.square(g.astype(_wide())), axis=1)  # [G, D]
    kth = mx.sort(energy, axis=-1)[:, dim - n_hi, None]  # the n_hi-th most
    above, tied = energy > kth, energy == kth
    need = n_hi - mx.sum(above.astype(mx.int32), axis=-1, keepdims=True)
    mask = above | (tied & (mx.cumsum(tied.astype(mx.int32), axis=-1) <= need))
    d = mx.arange(dim, dtype=mx.int32)
    order = mx.sort(mx.where(mask, d + dim, d), axis=-1) % dim  # % dim: in range on NaN input
    return mask, order


def _check_norms(norms: mx.array, x: mx.array, who: str) -> None:
    """numba_turbomix.check_norms: NaN/Inf input, then norms past fp16's range."""
    if not bool(mx.all(norms <= FP16_MAX)):
        if not bool(mx.all(mx.isfinite(norms))):
            check_finite(mlx_ops, x, who)
        raise CodecError(f"{who}: vector norm exceeds the fp16 range")


def encode(codec: Any, x: mx.array) -> dict[str, mx.array]:
    """``turbomix`` arrays (mx, numba_turbomix.encode's shapes: [groups, tokens, ...]) of
    ``x[..., tokens, dim]``."""
    if codec._selects_by_scalar():
        return codec._encode_selected(mlx_ops, x, encode)
    shape, dim = tuple(x.shape), x.shape[-1]
    tokens = shape[-2] if len(shape) > 1 else 1
    n_hi, n_lo = codec._split(dim)
    g = x.astype(mx.float32).reshape(-1, tokens, dim)
    groups, rows = g.shape[0], g.shape[0] * tokens
    out: dict[str, mx.array] = {}
    if codec.center:
        out["mean"] = _group_mean(g)
        g = g - out["mean"].astype(mx.float32)
    parts = [(g.reshape(rows, dim), codec.bits)]
    if n_hi:
        mask, order = _outlier_order(g, n_hi)
        out["outlier_mask"] = mlx_ops.pack_bits(mask.astype(mx.uint8), 1)[:, None, :]
        parts = [(mx.take_along_axis(g, mx.broadcast_to(at[:, None, :], (groups, tokens,
                                                                          at.shape[-1])), -1)
                  .reshape(rows, -1), bits)
                 for at, bits in ((order[:, :n_lo], codec.bits),
                                  (order[:, n_lo:], codec.outlier_bits))]
    norms = []
    for p, _ in parts:
        norm = mx.sqrt(mx.sum(p * p, axis=-1, keepdims=True))
        _check_norms(norm, x, codec.codec_id)
        norms.append(norm)
    seeds = tuple(candidate_seed(codec.seed, c) for c in range(codec.candidates))
    quantize = _QUANTIZERS[codec.quantizer]
    best: list[mx.array] = []
    best_err = choice = None
    for c in range(len(seeds)):
        codes, err = [], None
        for (p, bits), norm in zip(parts, norms, strict=True):
            hadamard, a, b = _rotations(p.shape[-1], seeds)
            u = _rotate(p, a[c], b[c]) if hadamard else mx.matmul(p, b[c])
            inv = 1 / mx.where(norm > 0, norm, norm + 1)
            q, values = quantize(u * inv, bits)
            row_err = mx.sum(mx.square(u - norm.astype(mx.float16).astype(mx.float32)
                                       * values), axis=-1)
            part_err = mx.sum(row_err.reshape(groups, tokens).astype(_wide()), axis=1)
            err = part_err if err is None else err + part_err
            codes.append(mlx_ops.pack_bits(q, bits).reshape(groups, tokens, -1))
        if c == 0:
            best, best_err = codes, err
            choice = mx.zeros(groups, dtype=mx.uint8)
        else:  # the least error per group; ties: the lowest candidate
            better = err < best_err
            best = [mx.where(better[:, None, None], new, old)
                    for new, old in zip(codes, best, strict=True)]
            best_err = mx.where(better, err, best_err)
            choice = mx.where(better, mx.array(c, dtype=mx.uint8), choice)
        mx.eval(best, best_err, choice)
    if len(seeds) > 1:
        out["rotation"] = choice[:, None]
    for codes, norm, suffix in zip(best, norms, ("", "_hi"), strict=False):
        out["codes" + suffix] = codes
        n16 = norm.reshape(groups, tokens).astype(mx.float16)
        if codec.norm_bits == 8:
            out["norms" + suffix], out["norm_range" + suffix] = norm_codes(n16)
        else:
            out["norms" + suffix] = n16
    return out


def norm_codes(norms: mx.array) -> tuple[mx.array, mx.array]:
    """turbomix.norm_codes in mx: fp16 norms [G, T] → (uint8 codes [G, T], range [G, 1, 2])."""
    wide = _wide()
    n = norms.astype(wide)
    positive = n > 0
    lo = mx.min(mx.where(positive, n, mx.inf), axis=1)
    lo = mx.where(mx.isfinite(lo), lo, 0.0).astype(mx.float16)
    hi = mx.max(n, axis=1).astype(mx.float16)
    log_lo, span = _log_range(lo, hi)
    t = (mx.log2(mx.where(positive, n, 1.0)) - log_lo[:, None]) / span[:, None]
    codes = 1 + mx.round(mx.clip(t, 0.0, 1.0) * _NORM_STEPS)
    codes = mx.where(positive, codes, 0).astype(mx.uint8)
    return codes, mx.stack([lo, hi], axis=-1)[:, None, :]


def norm_values(codes: mx.array, ranges: mx.array) -> mx.array:
    """turbomix.norm_values in mx: float32 norms [G, T] of uint8 codes and ranges [G, 2]."""
    lo, hi = ranges[:, 0], ranges[:, 1]
    if bool(mx.any(lo > hi)):
        raise CodecError("turbomix: a norm range's least norm is above its greatest, which no "
                         "writer stores")
    wide = _wide()
    log_lo, span = _log_range(lo, hi)
    t = (codes.astype(wide) - 1) / _NORM_STEPS
    values = mx.power(mx.array(2.0, dtype=wide), log_lo[:, None] + t * span[:, None])
    return mx.where(codes > 0, values, 0.0).astype(mx.float32)


def _log_range(lo: mx.array, hi: mx.array) -> tuple[mx.array, mx.array]:
    wide = _wide()
    log_lo = mx.log2(mx.maximum(lo.astype(wide), _TINY))
    log_hi = mx.log2(mx.maximum(hi.astype(wide), _TINY))
    return log_lo, mx.maximum(log_hi - log_lo, 1e-12)


# -- decode --------------------------------------------------------------------------------------
def _check(codec: Any, a: dict[str, mx.array], shape: tuple[int, ...]) -> None:
    """TurboMixCodec._check_decodable on mx arrays (the same messages)."""
    who = codec.codec_id
    for name, spec in codec.expected_arrays(shape, "float32").items():
        got = a.get(name)
        if got is None or got.size != int(np.prod(spec.shape, dtype=np.int64)) \
                or mlx_ops.dtype_name(got) != spec.dtype:
            raise CodecError(f"{who}: array {name!r} does not match an encode of shape "
                             f"{shape}, which no writer stores")
    if "rotation" in a and a["rotation"].size \
            and int(mx.max(a["rotation"]).item()) >= codec.candidates:
        raise CodecError(f"{who}: a rotation index is past candidates={codec.candidates}, "
                         "which no writer stores")


def _values(codes: mx.array, n: int, bits: int, quantizer: str) -> mx.array:
    """Unit-row values [rows, n] (float32) of packed codes [rows, bytes]."""
    if quantizer == "scalar":
        return mlx_ops.unpack_lookup(codes, bits, n, _scalar_book(n, bits)[1])
    q = mlx_ops.unpack_bits(codes, bits, n)
    if quantizer == "pair":
        points, _ = _pair_book(n, bits)
        index = (q[:, 0::2].astype(mx.uint16) << bits) | q[:, 1::2]
        return mx.take(points, index, axis=0).reshape(q.shape)
    return mx.take(_trellis_values(n, bits), _trellis_index(bits)(q))


@cache
def _trellis_values(n: int, bits: int) -> mx.array:
    """The value of code q after path state s, at index ``s << bits | q``."""
    return mx.array(state_values(n, bits))


@cache
def _trellis_index(bits: int) -> Any:
    """Compiled: codes [rows, n] → ``s << bits | q`` (uint16), s the path bits (each code's top
    bit) of the MEMORY coordinates before, the latest in bit 0 (zeros before the first)."""

    def run(q: mx.array) -> mx.array:
        n, index = q.shape[-1], q.astype(mx.uint16)
        path = mx.pad(index >> (bits - 1), [(0, 0), (MEMORY, 0)])
        for k in range(1, MEMORY + 1):
            index = index | (path[:, MEMORY - k:MEMORY - k + n] << (k - 1 + bits))
        return index

    return mx.compile(run)


def decode(codec: Any, arrays: dict[str, Any], shape: tuple[int, ...],
           dtype: str) -> mx.array:
    """x̂ [shape] in ``dtype`` (mx) from the codec's arrays (mx, or anything to_mlx takes),
    validated as TurboMixCodec._decode_as validates them."""
    a = {k: to_mlx(v) for k, v in arrays.items()}
    _check(codec, a, shape)
    dim = shape[-1]
    n_hi, n_lo = codec._split(dim)
    tokens = shape[-2] if len(shape) > 1 else 1
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    groups = rows // tokens
    choice = a["rotation"].reshape(groups).astype(mx.uint32) if "rotation" in a else None
    specs = [("", dim, codec.bits)]
    if n_hi:
        mask = mlx_ops.unpack_bits(a["outlier_mask"].reshape(groups, -1), 1, dim)
        if bool(mx.any(mx.sum(mask.astype(mx.int32), axis=-1) != n_hi)):
            raise CodecError(f"{codec.codec_id}: an outlier mask does not name {n_hi} of "
                             f"{dim} channels, which no writer stores")
        specs = [("", n_lo, codec.bits), ("_hi", n_hi, codec.outlier_bits)]
    seeds = tuple(candidate_seed(codec.seed, c) for c in range(codec.candidates))
    decoded = []
    for suffix, n, bits in specs:
        if codec.norm_bits == 16:
            norms = a["norms" + suffix].astype(mx.float32)
        else:
            norms = norm_values(a["norms" + suffix].reshape(groups, tokens),
                                a["norm_range" + suffix].reshape(groups, 2))
        y = _values(a["codes" + suffix].reshape(rows, -1), n, bits, codec.quantizer) \
            .reshape(groups, tokens, n)
        hadamard, r1, r2 = _rotations(n, seeds)
        if hadamard:  # each group's candidate's signs
            y = _rotate_back(y, *(r[0] if choice is None else r[choice][:, None, :]
                                  for r in (r1, r2)))
        else:
            y = mx.matmul(y, r1[0]) if choice is None else mx.gather_mm(y, r1, rhs_indices=choice)
        decoded.append(y * norms.reshape(groups, tokens, 1))
    x = decoded[0]
    if n_hi:  # channel d of the output is column pos[d] of [other channels, outliers]
        lo_pos = mx.cumsum(1 - mask.astype(mx.int32), axis=-1) - 1
        hi_pos = mx.cumsum(mask.astype(mx.int32), axis=-1) - 1 + n_lo
        pos = mx.where(mask.astype(mx.bool_), hi_pos, lo_pos)
        x = mx.take_along_axis(mx.concatenate(decoded, axis=-1),
                               mx.broadcast_to(pos[:, None, :], (groups, tokens, dim)), -1)
    if codec.center:
        x = x + a["mean"].reshape(groups, 1, dim).astype(mx.float32)
    return mlx_ops.astype(x, dtype, saturate=True).reshape(shape)


__all__ = ["decode", "encode", "norm_codes", "norm_values"]
