"""TurboQuant-MSE codecs ``turbo2``/``turbo3``/``turbo4``.

Per vector x[D]: store ‖x‖ as fp16, rotate the unit vector with a seeded random rotation
(:mod:`kvtool.codecs.rotation`), quantise each coordinate with the Lloyd–Max codebook of the
exact coordinate marginal of a random unit vector in R^D, and bit-pack the indices LSB-first.
After the rotation the coordinates' distribution no longer depends on the input's shape, so the
error matches the codebook's theoretical value for any input.

``center=True`` first subtracts the per-channel mean over the token axis (stored once per
leading index as fp16): real keys carry large per-channel offsets that otherwise eat the norm.
"""

from __future__ import annotations

from math import prod
from typing import Any, ClassVar, NoReturn

from kvtool.codecs.abc import ArraySpec, Codec, Encoded
from kvtool.codecs.lloyd_max import Codebook, sphere_marginal_codebook
from kvtool.codecs.params import SEED_MAX, check_bool, check_int
from kvtool.codecs.rotation import rotation_matrix, rotation_matrix_t
from kvtool.errors import CodecError
from kvtool.kernels import check_finite, compiled_for, cpu_kernels, row_blocks
from kvtool.kernels.device_checks import require
from kvtool.kernels.numpy_ops import FP16_MAX

DEFAULT_SEED = 0x6B76  # "kv"


class TurboCodec(Codec):
    bits: ClassVar[int]
    checks_finite = True  # a NaN or ±inf anywhere in a vector makes its norm NaN or inf

    def __init__(self, seed: int = DEFAULT_SEED, center: bool = False):
        self.seed = check_int(self.codec_id, "seed", seed, 0, SEED_MAX)
        self.center = check_bool(self.codec_id, "center", center)

    def _params(self) -> dict[str, Any]:
        return {"seed": self.seed, "center": self.center}

    def bits_per_element(self, head_dim: int) -> float:
        # packed codes + fp16 norm per vector (the optional channel mean is amortised over tokens)
        return (head_dim * self.bits + 7) // 8 * 8 / head_dim + 16 / head_dim

    def expected_arrays(self, shape: tuple[int, ...], dtype: str) -> dict[str, ArraySpec]:
        lead, dim = tuple(shape[:-1]), shape[-1]
        arrays = {"codes": ArraySpec((*lead, (dim * self.bits + 7) // 8), "uint8"),
                  "norms": ArraySpec(lead, "float16", low=0.0)}
        if self.center:  # the mean over tokens, keepdims
            mean = (*shape[:-2], 1, dim) if len(shape) > 1 else (1,)
            arrays["mean"] = ArraySpec(mean, "float16")
        return arrays

    def codebook(self, head_dim: int) -> Codebook:
        return sphere_marginal_codebook(head_dim, 1 << self.bits)

    def theoretical_mse(self, head_dim: int) -> float:
        """Expected ‖x − x̂‖² / ‖x‖² for any input (ignoring fp16 rounding of the norm)."""
        return self.codebook(head_dim).mse * head_dim

    def _encode(self, xp: Any, x: Any) -> dict[str, Any]:
        dim = x.shape[-1]
        if dim < 2:
            raise CodecError(f"{self.codec_id}: head_dim must be at least 2")
        given = x
        arrays: dict[str, Any] = {}
        if self.center:
            x = xp.astype(x, "float32")
            mean = xp.astype(xp.mean(x, -2 if x.ndim > 1 else -1), "float16")
            arrays["mean"] = mean
            x = x - xp.astype(mean, "float32")
        kernels = self._kernels(x, dim)
        if kernels is not None:
            arrays["codes"], arrays["norms"] = self._encode_fused(xp, kernels, x, given)
        else:
            arrays["codes"], arrays["norms"] = self._encode_blocks(xp, x, given)
        return arrays

    def compiled_ops(self, head_dim: int) -> tuple[str, ...]:
        """On CPU; CUDA tensors get Triton's encode, decode, scores and attention kernels."""
        kernels = cpu_kernels()
        if kernels is None:
            return ()
        return ("encode", "decode") if kernels.supported(head_dim, self.bits) else ("unpack",)

    def _kernels(self, like: Any, dim: int) -> Any:
        """The compiled backend with fused kernels for arrays like ``like`` and this head_dim."""
        kernels = compiled_for(like)
        return kernels if kernels is not None and kernels.supported(dim, self.bits) else None

    def _encode_fused(self, xp: Any, kernels: Any, x: Any, given: Any) -> tuple[Any, Any]:
        """One compiled pass: norm, rotation as butterflies, normalise, bucketize, pack."""
        dim, lead = x.shape[-1], tuple(x.shape[:-1])
        codes, norms = kernels.turbo_encode(xp.reshape(x, (-1, dim)), self.bits, self.seed)
        self._check_norms(xp, norms, given)
        return xp.reshape(codes, (*lead, codes.shape[-1])), xp.reshape(
            xp.astype(norms, "float16"), lead)

    def _check_norms(self, xp: Any, norms: Any, given: Any) -> None:
        """Refuse NaN/Inf input and norms past fp16's range (a queued device check inside
        :func:`kvtool.kernels.device_checks.deferred`)."""
        def fail() -> NoReturn:
            if not xp.all_finite(norms):
                check_finite(xp, given, self.codec_id)  # NaN/Inf input (else: overflow)
            raise CodecError(f"{self.codec_id}: vector norm exceeds the fp16 range")

        require((norms <= FP16_MAX).all(), fail)

    def _encode_blocks(self, xp: Any, x: Any, given: Any) -> tuple[Any, Any]:
        """:meth:`_encode_rows` over row blocks (:func:`~kvtool.kernels.row_blocks`).

        A strided input is encoded whole, as given: flattening would copy it, and numpy
        multiplies strided matrices without BLAS, so its rows would round (and encode) apart.
        """
        dim, lead = x.shape[-1], tuple(x.shape[:-1])
        blocks = row_blocks(xp, x, prod(lead), dim)
        if len(blocks) == 1 or not xp.is_contiguous(x):
            return self._encode_rows(xp, x, given)
        x = xp.reshape(x, (-1, dim))
        codes = xp.empty((x.shape[0], (dim * self.bits + 7) // 8), "uint8", x)
        norms = xp.empty((x.shape[0],), "float16", x)
        for block in blocks:
            codes[block], norms[block] = self._encode_rows(xp, x[block], given)
        return xp.reshape(codes, (*lead, codes.shape[-1])), xp.reshape(norms, lead)

    def _encode_rows(self, xp: Any, x: Any, given: Any) -> tuple[Any, Any]:
        """(packed codes, fp16 norms) of the vectors ``x[..., dim]``; ``given``: the input."""
        dim = x.shape[-1]
        x = xp.astype(x, "float32")
        norms = xp.norm(x)
        self._check_norms(xp, norms, given)
        # rotate first, normalise after: the rotation is linear and keeps norms
        rotated = xp.matmul(x, xp.const(rotation_matrix_t(dim, self.seed), x))
        rotated *= 1 / xp.where(norms > 0, norms, norms + 1)
        codes = xp.bucketize(rotated, self.codebook(dim).boundaries)
        return xp.pack_bits(codes, self.bits), xp.astype(norms[..., 0], "float16")

    def _rotated_centroids(self, xp: Any, codes: Any, dim: int) -> Any:
        """The centroid of every packed code (float32), straight from the packed bytes."""
        return xp.unpack_lookup(codes, self.bits, dim, self.codebook(dim).centroids)

    def _decode(self, xp: Any, enc: Encoded) -> Any:
        return self._decode_as(xp, enc, "float32")

    def _decode_as(self, xp: Any, enc: Encoded, dtype: str) -> Any:
        """Decode block by block (:func:`~kvtool.kernels.row_blocks`) into the output dtype."""
        dim = enc.shape[-1]
        codes = enc.arrays["codes"]
        codes = xp.reshape(codes, (-1, codes.shape[-1]))
        centered = "mean" in enc.arrays  # the mean is added in float32, after every block
        kernels = self._kernels(codes, dim)
        if kernels is not None:
            out = kernels.turbo_decode(codes, xp.reshape(enc.arrays["norms"], (-1,)), dim,
                                       self.bits, self.seed, "float32" if centered else dtype)
            out = xp.reshape(out, enc.shape)
            if centered:
                out += xp.astype(enc.arrays["mean"], "float32")
            return xp.astype(out, dtype, saturate=True)
        norms = xp.reshape(xp.astype(enc.arrays["norms"], "float32"), (-1, 1))
        out = xp.empty((codes.shape[0], dim), "float32" if centered else dtype, norms)
        # the matmul can write straight into ``out`` (not through mlx slices, which are copies)
        direct = xp.dtype_name(out) == "float32" and getattr(xp, "slices_are_views", True)
        rotation = xp.const(rotation_matrix(dim, self.seed), norms)
        for rows in row_blocks(xp, norms, codes.shape[0], dim):
            y = self._rotated_centroids(xp, codes[rows], dim)
            x = xp.matmul(y, rotation, out=out[rows] if direct else None)
            x *= norms[rows]
            if not direct:
                out[rows] = xp.astype(x, xp.dtype_name(out), saturate=True)
        out = xp.reshape(out, enc.shape)
        if centered:
            out += xp.astype(enc.arrays["mean"], "float32")
        return xp.astype(out, dtype, saturate=True)

    def scores(self, q: Any, enc: Encoded) -> Any:
        """q·k̂ for every stored key without materialising k̂: rotate q once, gather centroids."""
        from kvtool.kernels import ops_for

        self.check_query(q, enc)
        xp = ops_for(q)
        dim, enc = enc.shape[-1], enc.like(q)
        q = xp.astype(q, "float32")
        kernels = self._kernels(q, dim)
        if kernels is not None and hasattr(kernels, "turbo_scores"):  # fused on CUDA (Triton)
            s = kernels.turbo_scores(q, enc.arrays["codes"], enc.arrays["norms"], self.bits,
                                     self.seed)
            if "mean" in enc.arrays:
                s = s + xp.matmul(q, xp.swap_last(xp.astype(enc.arrays["mean"], "float32")))
            return s
        norms = xp.astype(enc.arrays["norms"], "float32")
        q_rot = xp.matmul(q, xp.const(rotation_matrix_t(dim, self.seed), q))
        y = self._rotated_centroids(xp, enc.arrays["codes"], dim)
        s = xp.matmul(q_rot, xp.swap_last(y)) * norms[..., None, :]
        if "mean" in enc.arrays:
            s = s + xp.matmul(q, xp.swap_last(xp.astype(enc.arrays["mean"], "float32")))
        return s


class Turbo2(TurboCodec):
    codec_id = "turbo2"
    bits = 2


class Turbo3(TurboCodec):
    codec_id = "turbo3"
    bits = 3


class Turbo4(TurboCodec):
    codec_id = "turbo4"
    bits = 4


__all__ = ["TurboCodec", "Turbo2", "Turbo3", "Turbo4", "DEFAULT_SEED"]
