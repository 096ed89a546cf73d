"""``raw``: lossless passthrough, optionally converting to a narrower float type.

With ``dtype=None`` the input is stored as-is (a private contiguous copy, so later writes to a
caller's cache buffer cannot change it) and decodes bit-exactly. ``dtype`` stores a converted
copy instead ("float16" halves fp32 input; "bfloat16" keeps fp32's range at 16 bits).
"""

from __future__ import annotations

from typing import Any

from kvtool.codecs.abc import ArraySpec, Codec, Encoded
from kvtool.codecs.groupq import FP16_MAX
from kvtool.codecs.params import check_choice
from kvtool.errors import CodecError
from kvtool.kernels import FLOAT_DTYPES

_WIDTH = {"float32": 32, "float16": 16, "bfloat16": 16}


class RawCodec(Codec):
    codec_id = "raw"

    def __init__(self, dtype: str | None = None):
        self.dtype = check_choice("raw", "dtype", dtype, (None, *FLOAT_DTYPES))

    def _params(self) -> dict[str, Any]:
        return {"dtype": self.dtype}

    def bits_per_element(self, head_dim: int) -> float:
        # dtype=None keeps the input's width; 16 is the nominal (fp16/bf16 KV cache) figure
        return float(_WIDTH[self.dtype] if self.dtype else 16)

    def expected_arrays(self, shape: tuple[int, ...], dtype: str) -> dict[str, ArraySpec]:
        return {"data": ArraySpec(tuple(shape), self.dtype or dtype)}

    def _encode(self, xp: Any, x: Any) -> dict[str, Any]:
        if self.dtype is None or self.dtype == xp.dtype_name(x):
            return {"data": xp.copy(x)}
        if self.dtype == "float16" and not bool((abs(xp.astype(x, "float32")) <= FP16_MAX).all()):
            raise CodecError("raw: values exceed the float16 range; use dtype bfloat16 or null")
        return {"data": xp.copy(xp.astype(x, self.dtype))}

    def _decode(self, xp: Any, enc: Encoded) -> Any:
        # stored dtype as-is: _decode_as converts once, to the requested dtype only
        return xp.reshape(enc.arrays["data"], enc.shape)

    def _decode_as(self, xp: Any, enc: Encoded, dtype: str) -> Any:
        """A new array in every case: a view of the stored data would let a caller's in-place
        write to its decoded cache change what is stored (and every later decode)."""
        data = self._decode(xp, enc)
        if xp.dtype_name(data) == dtype:
            return xp.copy(data)
        return xp.astype(data, dtype, saturate=True)
