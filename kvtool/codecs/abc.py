"""The codec contract (modelled on numcodecs' ``Codec``).

A codec turns an array ``x[..., tokens, head_dim]`` into an :class:`Encoded` — a small set of
named arrays — and back. Codecs are stateless apart from their configuration, which round-trips
through JSON via :meth:`Codec.get_config` and :func:`kvtool.codecs.get_codec`.

Arrays may be numpy or torch; the backend is chosen from the input's type (see
:mod:`kvtool.kernels`), and every backend decodes every other backend's bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from kvtool.errors import CodecError
from kvtool.kernels import Array, check_finite, ops_for

_FLOATS = ("float32", "float16", "bfloat16")  # what a codec encodes from and decodes to


@dataclass(frozen=True)
class ArraySpec:
    """One array a codec writes: exact shape and dtype, and the value range every writer keeps.

    ``low``/``high`` bound the values (e.g. norms and scales are >= 0, int8 codes >= -127);
    float arrays are always finite. Readers refuse stored arrays that break any of this.
    """

    shape: tuple[int, ...]
    dtype: str
    low: float | None = None
    high: float | None = None


@dataclass
class Encoded:
    """The output of :meth:`Codec.encode`.

    ``arrays`` holds the named parts (e.g. ``codes``, ``norms``); ``shape`` and ``dtype`` describe
    the array that was encoded, so :meth:`Codec.decode` can rebuild it exactly.
    """

    arrays: dict[str, Array]
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        """Bytes of every stored array, side information included."""
        return int(sum(a.nbytes for a in self.arrays.values()))

    def to_numpy(self) -> Encoded:
        from kvtool.kernels import to_numpy

        return Encoded({k: to_numpy(v) for k, v in self.arrays.items()}, self.shape, self.dtype)

    def to_torch(self, device: Any = None) -> Encoded:
        from kvtool.kernels import to_torch

        arrays = {k: to_torch(v, device) for k, v in self.arrays.items()}
        return Encoded(arrays, self.shape, self.dtype)

    def like(self, x: Array) -> Encoded:
        """These arrays on ``x``'s backend and device (``self`` where they are already):
        :meth:`Codec.scores` of numpy codes for torch queries, or CPU codes for CUDA ones."""
        from kvtool.kernels import to_mlx

        want = ops_for(x).name
        if all(ops_for(a).name == want and (want != "torch" or a.device == x.device)
               for a in self.arrays.values()):
            return self
        if want == "torch":
            return self.to_torch(x.device)
        if want == "mlx":
            return Encoded({k: to_mlx(v) for k, v in self.arrays.items()}, self.shape, self.dtype)
        return self.to_numpy()


class Codec(ABC):
    """Base class of every codec.

    Subclasses set ``codec_id`` (the on-disk identity) and ``codec_version`` (raised when the
    encoded bytes change meaning) and implement ``_encode``/``_decode`` in terms of the array ops
    namespace ``xp`` handed to them, so one implementation serves numpy and torch alike.

    A codec that still decodes files of an older version takes a ``codec_version`` keyword in
    ``__init__``, keeps it as ``self.codec_version`` and follows that version's rules;
    :func:`~kvtool.codecs.get_codec` refuses an older version for a codec that takes none, as it
    refuses a codec that is not installed.
    """

    codec_id: ClassVar[str]
    codec_version: ClassVar[int] = 1
    #: set by codecs whose own first pass exposes NaN/Inf (turbo: the vector norms) and that call
    #: :func:`~kvtool.kernels.check_finite` themselves then, saving a separate pass over the input
    checks_finite: ClassVar[bool] = False

    # -- configuration -------------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        """JSON-safe configuration; ``get_codec(codec.get_config())`` rebuilds an equal codec."""
        return {"id": self.codec_id, "codec_version": self.codec_version, **self._params()}

    def _params(self) -> dict[str, Any]:
        return {}

    def for_role(self, role: str) -> Codec:
        """The codec to use for ``role`` ("key" or "value"); KIVI, e.g., differs per role."""
        return self

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and self.get_config() == other.get_config()

    def __hash__(self) -> int:
        import json

        return hash(json.dumps(self.get_config(), sort_keys=True))

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self._params().items())
        return f"{type(self).__name__}({params})"

    # -- sizes ---------------------------------------------------------------------------------
    @abstractmethod
    def bits_per_element(self, head_dim: int) -> float:
        """Stored bits per input element, counting every side-info byte (norms, scales)."""

    @abstractmethod
    def expected_arrays(self, shape: tuple[int, ...], dtype: str) -> dict[str, ArraySpec]:
        """The arrays :meth:`encode` produces for an input of ``shape`` and ``dtype``.

        Readers check every stored segment against this before decoding, so a file whose arrays
        a writer could not have produced (shrunk, relabelled, reshaped) is refused rather than
        decoded into garbage through broadcasting.
        """

    def check_stored(self, arrays: dict[str, Any]) -> None:
        """:class:`CodecError` for stored values no encode writes that an :class:`ArraySpec`
        range cannot state (a forbidden code, a bound one array sets another). Readers call it
        on the host arrays of every segment, after the ranges; the default checks nothing."""
        return None

    def compiled_ops(self, head_dim: int) -> tuple[str, ...]:
        """The ops a compiled backend (:func:`~kvtool.kernels.compiled_for`) runs fused for this
        codec at ``head_dim``; everything else runs on the array-op reference path."""
        return ()

    # -- encode / decode -------------------------------------------------------------------------
    def encode(self, x: Array) -> Encoded:
        """Encode ``x[..., head_dim]`` (fp32/fp16/bf16, numpy or torch)."""
        xp = ops_for(x)
        dtype = xp.dtype_name(x)
        if dtype not in _FLOATS:
            raise CodecError(f"{self.codec_id}: cannot encode dtype {dtype}; "
                             "expected float32, float16 or bfloat16")
        if x.ndim < 1 or x.shape[-1] == 0:
            raise CodecError(f"{self.codec_id}: input must have a non-empty last axis (head_dim)")
        if not self.checks_finite:
            check_finite(xp, x, self.codec_id)
        arrays = self._encode(xp, x)
        return Encoded(arrays, tuple(int(s) for s in x.shape), dtype)

    def decode(self, enc: Encoded, dtype: str | None = None) -> Array:
        """Rebuild x̂ with the encoded shape, in ``dtype`` (default: the original dtype).

        Every backend saturates a float16 output at ±65504: a lossy reconstruction of a value
        near fp16's limit can land past it, and must not become ±inf."""
        dtype = dtype or enc.dtype
        if not isinstance(dtype, str) or dtype not in _FLOATS:  # np.dtype("f4") == "float32"
            raise CodecError(f"{self.codec_id}: cannot decode to {_named(dtype)}; expected "
                             "float32, float16 or bfloat16 (a name)")
        self.check_encoded(enc)
        first = next(iter(enc.arrays.values()))
        xp = ops_for(first)
        return self._decode_as(xp, enc, dtype)

    def check_encoded(self, enc: Encoded) -> None:
        """:class:`CodecError` unless ``enc`` holds exactly the arrays this codec writes for its
        shape and dtype (:meth:`expected_arrays`): another codec's output, a relabelled shape
        or a non-float dtype would otherwise decode into garbage through reshapes."""
        if not isinstance(enc.dtype, str) or enc.dtype not in _FLOATS:
            raise CodecError(f"{self.codec_id}: encoded dtype {_named(enc.dtype)} is not "
                             "float32, float16 or bfloat16 (a name)")
        ops = {k: ops_for(a) for k, a in enc.arrays.items()}
        if len(set(ops.values())) > 1 or not all(hasattr(a, "shape") and hasattr(a, "dtype")
                                                 for a in enc.arrays.values()):
            kinds_given = sorted({type(a).__name__ for a in enc.arrays.values()})
            raise CodecError(f"codec {self.codec_id!r}: the encoded arrays must be arrays of "
                             f"one backend, got {kinds_given}")
        want = {k: (spec.dtype, tuple(spec.shape))
                for k, spec in self.expected_arrays(tuple(enc.shape), enc.dtype).items()}
        got = {k: (ops[k].dtype_name(a), tuple(int(n) for n in a.shape))
               for k, a in enc.arrays.items()}
        if got != want:
            raise CodecError(f"codec {self.codec_id!r}: arrays {got} are not what it writes for "
                             f"{list(enc.shape)} {enc.dtype} ({want})")

    def scores(self, q: Array, enc: Encoded) -> Array:
        """``q @ k̂ᵀ`` for q[..., M, D] against the encoded keys [..., N, D] → [..., M, N].

        The default decodes; codecs that can do better (turbo) override it. The scores are on
        ``q``'s backend and device, wherever the codes are.
        """
        self.check_query(q, enc)
        xp = ops_for(q)
        k = self.decode(enc.like(q), "float32")
        return xp.matmul(xp.astype(q, "float32"), xp.swap_last(k))

    def check_query(self, q: Array, enc: Encoded) -> None:
        """:class:`CodecError` unless queries ``q[..., M, D]`` can be scored against ``enc``
        (keys ``[..., N, D]``): the same ``D``, and leading axes that broadcast."""
        import numpy as np

        shape, keys = tuple(q.shape), tuple(enc.shape)
        try:
            if len(shape) < 2 or len(keys) < 2 or shape[-1] != keys[-1]:
                raise ValueError
            np.broadcast_shapes(shape[:-2], keys[:-2])
        except ValueError:
            raise CodecError(f"{self.codec_id}: scores takes queries [..., M, D] that broadcast "
                             f"against the keys {list(keys)}, got {list(shape)}") from None

    @abstractmethod
    def _encode(self, xp: Any, x: Array) -> dict[str, Array]: ...

    @abstractmethod
    def _decode(self, xp: Any, enc: Encoded) -> Array:
        """x̂ with ``enc.shape``, in float32 or any float dtype ``decode`` then converts."""

    def _decode_as(self, xp: Any, enc: Encoded, dtype: str) -> Array:
        """x̂ in ``dtype``, saturating at float16's ±65504 (see :meth:`decode`). Codecs able to
        write ``dtype`` directly override this (it saves a float32 copy of the whole output)."""
        return xp.astype(self._decode(xp, enc), dtype, saturate=True)


def _named(dtype: Any) -> str:
    """A dtype as given, in words: ``'int8'`` for a name, ``dtype('float16')`` for an object."""
    return repr(dtype[:20]) if isinstance(dtype, str) else repr(dtype)[:40]
