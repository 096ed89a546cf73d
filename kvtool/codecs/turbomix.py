"""``turbomix``: TurboQuant with a data-aware rotation and outlier channels at more bits.

The vector math is turbo's (:mod:`kvtool.codecs.turbo`: fp16 norm, seeded rotation, Lloyd–Max
codebook of the sphere marginal, LSB-first packing), plus three choices made per group, a group
being every vector that shares the leading indices (one head of one block: ``x[..., T, D]``):

- ``candidates=k``: encode with k seeded rotations (candidate 0 is ``seed`` itself) and keep, per
  group, the one with the least squared reconstruction error; its index is stored (``rotation``,
  uint8), so decoding needs nothing else;
- ``select=scalar`` (with ``candidates`` and ``trellis=true`` or ``vq=2``): pick each group's
  rotation by the scalar codebook's squared error instead (every candidate encoded the cheap
  way), then quantise with that rotation only: one trellis search a vector instead of k. On
  ``small``'s codecs (2 bits, k=4) it keeps all of the KL that k rotations gain over one (SmolLM2:
  0.0120 both ways, one rotation 0.0137) at 2-2.6x the encode speed. Decoding is unchanged;
  ``exact`` (the default) picks by the configured quantiser's own error;
- ``outliers=n``: the n channels with the most energy over the group's tokens (after centering)
  are quantised apart at ``outlier_bits``, the rest at ``bits`` — the TurboQuant paper's split
  (e.g. D=128, n=32: 3/2 bits give 2.5, 4/3 bits give 3.5). Each part has its own norm and
  rotation; the channel set is stored as a bit mask (``outlier_mask``);
- ``outliers_per=m``: ``outliers`` counts channels per ``m`` of head_dim, so the share stays the
  same at every head_dim (:func:`outlier_count`: 16 per 64 is 64 of 256; even, at least 2,
  leaving at least 2); 0 (the default): ``outliers`` channels at any head_dim;
- ``center``: subtract the per-channel mean over the tokens first (fp16, as turbo does);
- ``vq=2``: quantise the rotated coordinates in pairs with a 2-D codebook of ``4**bits`` points
  (:mod:`kvtool.codecs.vq_tables`, Lloyd's algorithm on the 2-D Gaussian, scaled by
  1/sqrt(dim)) instead of one scalar Lloyd–Max codebook per coordinate: the same code bits (the
  pair's index is stored as two ``bits``-wide codes, coordinate 2j the high half), ~10% less
  squared error on real keys and values (the cells of a 2-D codebook pack better than squares);
- ``trellis=true``: trellis-coded quantisation of the rotated coordinates
  (:mod:`kvtool.codecs.trellis`: a 32-state trellis over a codebook of twice the levels, the
  path picked by the Viterbi algorithm): the same code bits, a third less squared error than
  the scalar codebook on Gaussian rows at 2..4 bits (``vq=2``: 8..14%), no side information;
- ``norm_bits=8``: each vector's norm as a uint8 code on a log-spaced grid between its group's
  least and greatest norm (stored in fp16, ``norm_range``) instead of fp16: half the norm's
  side information (0.125 bits/element at head_dim 64) for a relative norm error under 1%.

``turbomix:bits=3`` with defaults writes turbo3's codes and norms. Numpy arrays and CPU tensors
run on fused compiled kernels (:mod:`kvtool.kernels.numba_turbomix`) where numba is on, mlx
arrays on vectorised ``mx`` ops (:mod:`kvtool.kernels.mlx_turbomix`), with no numpy round trip,
CUDA tensors on fused Triton kernels (:mod:`kvtool.kernels.triton_turbomix`), never leaving
the device; all write the reference's codes except within float rounding of a decision.
``KVTOOL_KERNELS=reference`` runs the numpy reference here (converted there and back).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtool.codecs.abc import ArraySpec, Codec, Encoded
from kvtool.codecs.lloyd_max import sphere_marginal_codebook
from kvtool.codecs.norm_grid import norm_codes, norm_values
from kvtool.codecs.params import SEED_MAX, check_bool, check_choice, check_int
from kvtool.codecs.rotation import rotation_matrix, rotation_matrix_t
from kvtool.codecs.trellis import trellis_codes, trellis_values
from kvtool.codecs.turbo import DEFAULT_SEED, FP16_MAX
from kvtool.codecs.vq_tables import pair_codes, pair_values
from kvtool.errors import CodecError
from kvtool.kernels import (
    check_finite,
    compiled_for,
    cpu_kernels,
    kernel_mode,
    numpy_ops,
    to_numpy,
)

MAX_CANDIDATES = 16
_GOLDEN = 0x9E3779B97F4A7C15


def candidate_seed(seed: int, index: int) -> int:
    """The rotation seed of candidate ``index`` (0: ``seed`` itself)."""
    return seed if index == 0 else (seed + index * _GOLDEN) & SEED_MAX


def _packed(n: int, bits: int) -> int:
    return (n * bits + 7) // 8


class TurboMixCodec(Codec):
    codec_id = "turbomix"
    checks_finite = True

    def __init__(self, bits: int = 3, outliers: int = 0, outlier_bits: int = 4,
                 center: bool = False, candidates: int = 1, vq: int = 1,
                 norm_bits: int = 16, trellis: bool = False, seed: int = DEFAULT_SEED,
                 outliers_per: int = 0, select: str = "exact"):
        who = self.codec_id
        self.bits = check_choice(who, "bits", bits, (2, 3, 4))
        self.outliers = check_int(who, "outliers", outliers, 0, 1 << 16)
        self.outliers_per = check_int(who, "outliers_per", outliers_per, 0, 1 << 16)
        if self.outliers_per and not 0 < self.outliers < self.outliers_per:
            raise CodecError(f"{who}: outliers_per={outliers_per} needs 0 < outliers < "
                             f"outliers_per, got outliers={outliers}")
        self.outlier_bits = check_choice(who, "outlier_bits", outlier_bits, (2, 3, 4, 5, 6, 8))
        self.center = check_bool(who, "center", center)
        self.candidates = check_int(who, "candidates", candidates, 1, MAX_CANDIDATES)
        self.vq = check_choice(who, "vq", vq, (1, 2))
        self.trellis = check_bool(who, "trellis", trellis)
        if self.trellis and self.vq == 2:
            raise CodecError(f"{who}: trellis=true and vq=2 are two quantisers of the same "
                             "coordinates; choose one")
        if self.quantizer != "scalar" and self.outliers and self.outlier_bits > 4:
            option = "trellis=true" if self.trellis else "vq=2"
            raise CodecError(f"{who}: {option} has codebooks for 2..4 bits, not "
                             f"outlier_bits={self.outlier_bits}")
        self.norm_bits = check_choice(who, "norm_bits", norm_bits, (8, 16))
        self.seed = check_int(who, "seed", seed, 0, SEED_MAX)
        self.select = check_choice(who, "select", select, ("exact", "scalar"))
        if self.candidates == 1 or self.quantizer == "scalar":
            self.select = "exact"  # nothing to choose apart: the same codes, the same config

    def _params(self) -> dict[str, Any]:
        params = {"bits": self.bits, "outliers": self.outliers,
                  "outlier_bits": self.outlier_bits, "center": self.center,
                  "candidates": self.candidates, "seed": self.seed}
        if self.vq != 1:  # named only when set: configs (files, store keys) from before stay
            params["vq"] = self.vq
        if self.norm_bits != 16:
            params["norm_bits"] = self.norm_bits
        if self.trellis:
            params["trellis"] = True
        if self.outliers_per:
            params["outliers_per"] = self.outliers_per
        if self.select != "exact":
            params["select"] = self.select
        return params

    @property
    def quantizer(self) -> str:
        """How rotated coordinates become codes: ``scalar``, ``pair`` (vq=2) or ``trellis``."""
        return "trellis" if self.trellis else "pair" if self.vq == 2 else "scalar"

    # -- sizes -----------------------------------------------------------------------------------
    def _split(self, dim: int) -> tuple[int, int]:
        """(outlier channels, other channels) at ``dim``."""
        n = outlier_count(dim, self.outliers / self.outliers_per) if self.outliers_per \
            else self.outliers
        if n and dim - n < 2:
            raise CodecError(f"{self.codec_id}: outliers={n} leaves fewer than 2 of head_dim "
                             f"{dim} channels; use fewer outliers")
        if n == 1:
            raise CodecError(f"{self.codec_id}: outliers must be 0 or at least 2")
        if self.vq == 2 and (dim - n) % 2 + n % 2:
            raise CodecError(f"{self.codec_id}: vq=2 quantises channel pairs, so head_dim "
                             f"({dim}) and outliers ({n}) must be even")
        return n, dim - n

    def bits_per_element(self, head_dim: int) -> float:
        n_hi, n_lo = self._split(head_dim)
        code_bits = 8 * (_packed(n_lo, self.bits) + (_packed(n_hi, self.outlier_bits)
                                                     if n_hi else 0))
        return (code_bits + self.norm_bits * (2 if n_hi else 1)) / head_dim

    def expected_arrays(self, shape: tuple[int, ...], dtype: str) -> dict[str, ArraySpec]:
        lead, dim = tuple(shape[:-1]), shape[-1]
        group = tuple(shape[:-2])
        n_hi, n_lo = self._split(dim)
        norms = (ArraySpec(lead, "float16", low=0.0) if self.norm_bits == 16
                 else ArraySpec(lead, "uint8"))
        arrays = {"codes": ArraySpec((*lead, _packed(n_lo, self.bits)), "uint8"),
                  "norms": norms}
        if self.norm_bits == 8:
            arrays["norm_range"] = ArraySpec((*group, 1, 2), "float16", low=0.0)
        if n_hi:
            arrays["codes_hi"] = ArraySpec((*lead, _packed(n_hi, self.outlier_bits)), "uint8")
            arrays["norms_hi"] = norms
            if self.norm_bits == 8:
                arrays["norm_range_hi"] = ArraySpec((*group, 1, 2), "float16", low=0.0)
            arrays["outlier_mask"] = ArraySpec((*group, 1, (dim + 7) // 8), "uint8")
        if self.center:
            arrays["mean"] = ArraySpec((*group, 1, dim), "float16")
        if self.candidates > 1:
            arrays["rotation"] = ArraySpec((*group, 1), "uint8", low=0,
                                           high=self.candidates - 1)
        return arrays

    def compiled_ops(self, head_dim: int) -> tuple[str, ...]:
        """Every option is fused on CPU (:mod:`kvtool.kernels.numba_turbomix`)."""
        return ("encode", "decode") if cpu_kernels() is not None else ()

    # -- encode ----------------------------------------------------------------------------------
    def _encode(self, xp: Any, x: Any) -> dict[str, Any]:
        shape, dim = tuple(x.shape), x.shape[-1]
        n_hi, _ = self._split(dim)
        if dim < 2:
            raise CodecError(f"{self.codec_id}: head_dim must be at least 2")
        fused = self._fused(x)
        if fused is not None:
            expected = self.expected_arrays(shape, "float32")
            return {name: _to_backend(xp, a.reshape(expected[name].shape), x)
                    for name, a in fused.encode(self, x).items()}
        on_mlx = self._mlx(xp, shape)
        if on_mlx is not None:
            expected = self.expected_arrays(shape, "float32")
            return {name: a.reshape(expected[name].shape)
                    for name, a in on_mlx.encode(self, x).items()}
        on_cuda = self._cuda(x)
        if on_cuda is not None:  # device arrays, already in the expected shapes
            return on_cuda.encode(self, x)
        if self._selects_by_scalar() and int(np.prod(shape)):
            return self._encode_selected(xp, x, lambda codec, rows: codec._encode(xp, rows))
        if not xp.all_finite(x):
            check_finite(xp, x, self.codec_id)
        groups = int(np.prod(shape[:-2], dtype=np.int64)) if len(shape) > 1 else 1
        tokens = shape[-2] if len(shape) > 1 else 1  # explicit: -1 is ambiguous when empty
        g = np.asarray(to_numpy(x)).astype(np.float32).reshape(groups, tokens, dim)
        out: dict[str, np.ndarray] = {}
        if self.center:
            # summed in float64: within rounding of exact, so every backend stores the same
            # (no tokens: a zero mean, not NaN)
            mean = (g.mean(axis=1, keepdims=True, dtype=np.float64) if tokens else
                    np.zeros((groups, 1, dim))).astype(np.float32).astype(np.float16)
            out["mean"] = mean
            g = g - mean.astype(np.float32)
        hi_idx = lo_idx = None
        if n_hi:
            energy = (g.astype(np.float64) ** 2).sum(axis=1)  # [G, D]
            hi = np.sort(np.argsort(-energy, axis=-1, kind="stable")[:, :n_hi], axis=-1)
            mask = np.zeros(energy.shape, dtype=bool)
            np.put_along_axis(mask, hi, True, axis=-1)
            out["outlier_mask"] = np.packbits(mask, axis=-1, bitorder="little")[:, None, :]
            hi_idx = hi[:, None, :]
            lo_idx = np.sort(np.argsort(mask, axis=-1, kind="stable")[:, :dim - n_hi],
                             axis=-1)[:, None, :]
        parts = self._parts(g, hi_idx, lo_idx)
        best, best_err = None, None
        for c in range(self.candidates):
            seed = candidate_seed(self.seed, c)
            enc = [self._encode_part(p, bits, seed, self.quantizer) for p, bits in parts]
            err = sum(((p - self._decode_part(codes, norms, p.shape[-1], bits, seed,
                                              self.quantizer))
                       ** 2)
                      .astype(np.float64).sum(axis=(1, 2))
                      for (p, bits), (codes, norms) in zip(parts, enc, strict=True))
            if best is None:
                best, best_err, choice = enc, err, np.zeros(len(g), dtype=np.uint8)
                continue
            better = err < best_err
            choice[better] = c
            best_err = np.where(better, err, best_err)
            best = [(np.where(better[:, None, None], e[0], b[0]),
                     np.where(better[:, None], e[1], b[1])) for e, b in zip(enc, best,
                                                                           strict=True)]
        for (codes, norms), suffix in zip(best, ("", "_hi"), strict=False):
            out["codes" + suffix] = codes
            if self.norm_bits == 8:
                out["norms" + suffix], out["norm_range" + suffix] = norm_codes(norms)
            else:
                out["norms" + suffix] = norms
        if self.candidates > 1:
            out["rotation"] = choice[:, None]
        return {name: _to_backend(xp, a.reshape(self.expected_arrays(shape, "float32")[name]
                                               .shape), x) for name, a in out.items()}

    def _selects_by_scalar(self) -> bool:
        return self.select == "scalar"  # only where there is a choice: __init__ sees to it

    def _encode_selected(self, xp: Any, x: Any, encode: Any) -> dict[str, Any]:
        """``select=scalar``: each group's rotation is the candidate whose scalar-codebook encode
        has the least squared error (an encode of every candidate at a fraction of a trellis
        search's cost); then only that rotation is quantised, the groups encoded in runs of one
        candidate. Each step is ``encode(codec, x)``, a backend's encode (the reference's and
        mlx's), so they write what the numba and Triton kernels write in one pass each (they
        take each group's rotation)."""
        shape = tuple(x.shape)
        probe = self._variant(trellis=False, vq=1, norm_bits=16)
        rotation = encode(probe, x)["rotation"]
        choice = np.asarray(to_numpy(rotation)).reshape(-1)  # one per group
        groups = len(choice)
        order = np.argsort(choice, kind="stable")
        shuffled = bool((order != np.arange(groups)).any())
        rows = xp.reshape(x, (groups, -1, shape[-1]))  # not empty: the tokens are known
        if shuffled:
            rows = xp.take_rows(rows, order)
        pieces, start = [], 0
        for c, count in enumerate(np.bincount(choice, minlength=self.candidates).tolist()):
            if count:
                one = self._variant(candidates=1, seed=candidate_seed(self.seed, c))
                pieces.append(encode(one, rows[start:start + count]))
            start += count
        inverse = np.argsort(order)
        expected = self.expected_arrays(shape, "float32")
        out = {"rotation": xp.reshape(rotation, expected["rotation"].shape)}
        for name, spec in expected.items():
            if name != "rotation":
                joined = xp.concat_rows([p[name] for p in pieces]) if len(pieces) > 1 \
                    else pieces[0][name]
                if shuffled:
                    joined = xp.take_rows(joined, inverse)
                out[name] = xp.reshape(joined, spec.shape)
        return out

    def _variant(self, **options: Any) -> TurboMixCodec:
        """This codec with ``options`` changed (and ``select=exact``), on the backends this
        instance picks (its own ``_fused``/``_mlx``/``_cuda``: tests pin the reference that way)."""
        variant = type(self)(**{**self._params(), "select": "exact", **options})
        for hook in ("_fused", "_mlx", "_cuda"):
            if hook in self.__dict__:
                setattr(variant, hook, self.__dict__[hook])
        return variant

    def _parts(self, g: np.ndarray, hi_idx: Any, lo_idx: Any) -> list[tuple[np.ndarray, int]]:
        """[(vectors, bits)]: the other channels first, then the outlier channels."""
        if hi_idx is None:
            return [(g, self.bits)]
        return [(np.take_along_axis(g, lo_idx, axis=-1), self.bits),
                (np.take_along_axis(g, hi_idx, axis=-1), self.outlier_bits)]

    @staticmethod
    def _encode_part(x: np.ndarray, bits: int, seed: int,
                     quantizer: str = "scalar") -> tuple[np.ndarray, np.ndarray]:
        """turbo's reference rows: (packed codes [G, T, bytes], fp16 norms [G, T])."""
        dim = x.shape[-1]
        norms = numpy_ops.norm(x)
        if not bool((norms <= FP16_MAX).all()):
            raise CodecError("turbomix: vector norm exceeds the fp16 range")
        rotated = np.matmul(x, rotation_matrix_t(dim, seed))
        rotated *= 1 / np.where(norms > 0, norms, norms + 1)
        if quantizer == "scalar":
            codes = numpy_ops.bucketize(rotated,
                                        sphere_marginal_codebook(dim, 1 << bits).boundaries)
        else:
            codes = _VECTOR_QUANTIZERS[quantizer][0](rotated, bits)
        return numpy_ops.pack_bits(codes, bits), norms[..., 0].astype(np.float16)

    @staticmethod
    def _decode_part(codes: np.ndarray, norms: np.ndarray, dim: int, bits: int,
                     seed: int, quantizer: str = "scalar") -> np.ndarray:
        if quantizer == "scalar":
            y = numpy_ops.unpack_lookup(codes, bits, dim,
                                        sphere_marginal_codebook(dim, 1 << bits).centroids)
        else:
            y = _VECTOR_QUANTIZERS[quantizer][1](numpy_ops.unpack_bits(codes, bits, dim), bits)
        return np.matmul(y, rotation_matrix(dim, seed)) * norms.astype(np.float32)[..., None]

    # -- decode ----------------------------------------------------------------------------------
    def _fused(self, like: Any) -> Any:
        """The fused CPU kernels (:mod:`kvtool.kernels.numba_turbomix`) where they serve
        ``like`` (numpy or CPU torch, compiled kernels on), else None: the reference ops."""
        kernels = compiled_for(like)
        if getattr(kernels, "name", None) != "numba" or not int(np.prod(like.shape)):
            return None
        from kvtool.kernels import numba_turbomix

        return numba_turbomix

    def _mlx(self, xp: Any, shape: tuple[int, ...]) -> Any:
        """:mod:`kvtool.kernels.mlx_turbomix` for mlx arrays (not empty; not in reference
        mode), else None."""
        if xp.name != "mlx" or kernel_mode() == "reference" or not int(np.prod(shape)):
            return None
        from kvtool.kernels import mlx_turbomix

        return mlx_turbomix

    def _cuda(self, like: Any) -> Any:
        """:mod:`kvtool.kernels.triton_turbomix` for CUDA tensors (not empty; compiled kernels
        on and Triton available), else None."""
        kernels = compiled_for(like)
        if getattr(kernels, "name", None) != "triton" or not int(np.prod(like.shape)):
            return None
        from kvtool.kernels import triton_turbomix

        return triton_turbomix if triton_turbomix.available() else None

    def _decode(self, xp: Any, enc: Encoded) -> Any:
        return self._decode_as(xp, enc, "float32")

    def _decode_as(self, xp: Any, enc: Encoded, dtype: str) -> Any:
        shape, dim = enc.shape, enc.shape[-1]
        n_hi, n_lo = self._split(dim)
        on_mlx = self._mlx(xp, shape)
        if on_mlx is not None:  # validates and decodes the mx arrays where they are
            return on_mlx.decode(self, enc.arrays, shape, dtype)
        first = next(iter(enc.arrays.values()))
        if not int(np.prod(shape)):  # no vectors (the kernels' reshapes need some): validate
            self._check_decodable({k: np.asarray(to_numpy(v)) for k, v in enc.arrays.items()},
                                  shape)
            return xp.empty(shape, dtype, first)
        on_cuda = self._cuda(first)
        if on_cuda is not None:  # validates and decodes the tensors on their device
            from kvtool.kernels import to_torch

            return on_cuda.decode(self, {k: to_torch(v, first.device)
                                         for k, v in enc.arrays.items()}, shape, dtype)
        a = {k: np.asarray(to_numpy(v)) for k, v in enc.arrays.items()}
        self._check_decodable(a, shape)
        groups = int(np.prod(shape[:-2], dtype=np.int64)) if len(shape) > 1 else 1
        tokens = shape[-2] if len(shape) > 1 else 1
        channel_sets = [np.arange(dim, dtype=np.int32)[None, :]]
        if n_hi:
            mask = np.unpackbits(a["outlier_mask"].reshape(groups, -1), axis=-1, count=dim,
                                 bitorder="little").astype(bool)
            if bool((mask.sum(axis=-1) != n_hi).any()):
                raise CodecError(f"{self.codec_id}: an outlier mask does not name {n_hi} of "
                                 f"{dim} channels, which no writer stores")
            channel_sets = [np.nonzero(~mask)[1].reshape(groups, n_lo).astype(np.int32),
                            np.nonzero(mask)[1].reshape(groups, n_hi).astype(np.int32)]
        norms = [(a["norms" + suffix].reshape(groups, tokens) if self.norm_bits == 16 else
                  norm_values(a["norms" + suffix].reshape(groups, tokens),
                              a["norm_range" + suffix].reshape(groups, 2)))
                 .astype(np.float32).reshape(-1) for suffix in ("", "_hi")[:len(channel_sets)]]
        first = next(iter(enc.arrays.values()))
        fused = self._fused(first)
        if fused is not None:
            return fused.decode(self, a, shape, first, dtype, channel_sets, norms)
        return xp.astype(_to_backend(xp, self._decode_reference(a, shape, channel_sets, norms),
                                     first), dtype, saturate=True)

    def _check_decodable(self, a: dict[str, np.ndarray], shape: tuple[int, ...]) -> None:
        """Refuse arrays no encode of ``shape`` writes (the compiled kernels index by them):
        a missing array, a wrong element count or dtype, a rotation past the candidates."""
        for name, spec in self.expected_arrays(shape, "float32").items():
            got = a.get(name)
            if got is None or got.size != int(np.prod(spec.shape, dtype=np.int64)) \
                    or got.dtype != np.dtype(spec.dtype):
                raise CodecError(f"{self.codec_id}: array {name!r} does not match an encode "
                                 f"of shape {shape}, which no writer stores")
        if "rotation" in a and a["rotation"].size and int(a["rotation"].max()) >= self.candidates:
            raise CodecError(f"{self.codec_id}: a rotation index is past candidates="
                             f"{self.candidates}, which no writer stores")

    def _decode_reference(self, a: dict[str, np.ndarray], shape: tuple[int, ...],
                          channel_sets: list[np.ndarray], norms: list[np.ndarray]) -> np.ndarray:
        dim = shape[-1]
        groups = int(np.prod(shape[:-2], dtype=np.int64)) if len(shape) > 1 else 1
        tokens = shape[-2] if len(shape) > 1 else 1
        choice = a["rotation"].reshape(groups) if "rotation" in a else np.zeros(groups, np.uint8)
        specs = list(zip(("", "_hi"), channel_sets, norms, (self.bits, self.outlier_bits),
                         strict=False))
        x = np.empty((groups, tokens, dim), np.float32)
        for suffix, channels, part_norms, bits in specs:
            n = channels.shape[1]
            codes = a["codes" + suffix].reshape(groups, tokens, -1)
            part_norms = part_norms.reshape(groups, tokens)
            decoded = np.empty((groups, tokens, n), np.float32)
            for c in np.unique(choice).tolist():
                rows = choice == c
                decoded[rows] = self._decode_part(codes[rows], part_norms[rows], n, bits,
                                                  candidate_seed(self.seed, c), self.quantizer)
            if len(specs) == 1:
                x = decoded
            else:
                np.put_along_axis(x, channels[:, None, :], decoded, -1)
        if self.center:
            x += a["mean"].reshape(groups, 1, dim).astype(np.float32)
        return x.reshape(shape)


def outlier_count(head_dim: int, fraction: float) -> int:
    """Outlier channels for ``fraction`` of ``head_dim``: even, at least 2, leaving at least
    2 other channels (turbomix's rules)."""
    n = 2 * max(1, round(head_dim * fraction / 2))
    return min(n, max(2, head_dim - 2 - head_dim % 2))


#: quantizer → (codes of rotated unit rows, their values): the ``bits``-wide codes, one per
#: coordinate, of the quantisers that look at more than one coordinate at a time
_VECTOR_QUANTIZERS = {"pair": (pair_codes, pair_values), "trellis": (trellis_codes, trellis_values)}


def _to_backend(xp: Any, a: np.ndarray, like: Any) -> Any:
    """``a`` as an array of ``like``'s backend (and device)."""
    if xp.name == "numpy":
        return a
    if xp.name == "torch":
        from kvtool.kernels import to_torch

        return to_torch(np.ascontiguousarray(a), like.device).reshape(a.shape)  # 0-d stays 0-d
    from kvtool.kernels import to_mlx

    return to_mlx(np.ascontiguousarray(a)).reshape(a.shape)


__all__ = ["TurboMixCodec", "candidate_seed", "norm_codes", "norm_values"]
