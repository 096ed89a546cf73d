"""``fp8``: float8 e4m3 (``float8_e4m3fn``) with a per-token absmax scale.

Each vector (last axis) is scaled so its largest magnitude maps to 448, e4m3's maximum, then
rounded to e4m3 (round-to-nearest-even, identical in ml_dtypes and torch). The codes are stored
as their raw bytes (uint8) so every backend and file format can carry them; the scale is fp16.
"""

from __future__ import annotations

from typing import Any

from kvtool.codecs.abc import ArraySpec, Codec, Encoded
from kvtool.codecs.groupq import nonzero, to_fp16
from kvtool.errors import CodecError

E4M3_MAX = 448.0


class Fp8Codec(Codec):
    codec_id = "fp8"

    def bits_per_element(self, head_dim: int) -> float:
        return 8 + 16 / head_dim

    def expected_arrays(self, shape: tuple[int, ...], dtype: str) -> dict[str, ArraySpec]:
        return {"codes": ArraySpec(tuple(shape), "uint8"),
                "scale": ArraySpec(tuple(shape[:-1]), "float16", low=0.0)}

    def check_stored(self, arrays: dict[str, Any]) -> None:
        """e4m3fn's NaN codes (0x7F, 0xFF): the encode clips to ±448 and never writes one."""
        if bool(((arrays["codes"] & 0x7F) == 0x7F).any()):
            raise CodecError("fp8: a NaN code (0x7F or 0xFF), which no writer stores")

    def _encode(self, xp: Any, x: Any) -> dict[str, Any]:
        x = xp.astype(x, "float32")
        scale = to_fp16(xp, xp.amax_abs(x, -1) / E4M3_MAX, self.codec_id)
        y = x / nonzero(xp, xp.astype(scale, "float32"))
        # e4m3fn has no Inf: values past 448 (fp16-rounded scale) would become NaN, so clip
        y = xp.clip(y, -E4M3_MAX, E4M3_MAX)
        codes = xp.view(xp.astype(y, "float8_e4m3fn"), "uint8")
        return {"codes": codes, "scale": scale[..., 0]}

    def _decode(self, xp: Any, enc: Encoded) -> Any:
        y = xp.astype(xp.view(enc.arrays["codes"], "float8_e4m3fn"), "float32")
        x = y * xp.astype(enc.arrays["scale"], "float32")[..., None]
        return xp.reshape(x, enc.shape)
