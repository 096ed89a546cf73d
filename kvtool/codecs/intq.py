"""Integer baselines: ``int8`` (per-token symmetric absmax) and ``int4`` (per-group asymmetric).

``int8`` maps each vector's largest magnitude to ±127 with one fp16 scale per vector. ``int4``
splits each vector into groups of ``group_size`` channels (clamped to head_dim; a partial last
group is allowed) with an fp16 scale and fp16 minimum per group, and packs two codes per byte.
"""

from __future__ import annotations

from typing import Any

from kvtool.codecs.abc import Codec, Encoded
from kvtool.codecs.groupq import dequantize_groups, nonzero, quantize_groups, to_fp16
from kvtool.errors import CodecError


def check_group_size(who: str, group_size: Any) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise CodecError(f"{who}: group_size must be a positive integer, got {group_size!r}")
    return group_size


class Int8Codec(Codec):
    codec_id = "int8"

    def bits_per_element(self, head_dim: int) -> float:
        return 8 + 16 / head_dim

    def _encode(self, xp: Any, x: Any) -> dict[str, Any]:
        x = xp.astype(x, "float32")
        scale = to_fp16(xp, xp.amax_abs(x, -1) / 127, self.codec_id)
        codes = xp.round_clip(x / nonzero(xp, xp.astype(scale, "float32")), -127, 127, "int8")
        return {"codes": codes, "scale": scale[..., 0]}

    def _decode(self, xp: Any, enc: Encoded) -> Any:
        scale = xp.astype(enc.arrays["scale"], "float32")[..., None]
        return xp.reshape(xp.astype(enc.arrays["codes"], "float32") * scale, enc.shape)


class Int4Codec(Codec):
    codec_id = "int4"
    bits = 4

    def __init__(self, group_size: int = 64):
        self.group_size = check_group_size(self.codec_id, group_size)

    def _params(self) -> dict[str, Any]:
        return {"group_size": self.group_size}

    def bits_per_element(self, head_dim: int) -> float:
        groups = -(-head_dim // min(self.group_size, head_dim))
        return ((head_dim * self.bits + 7) // 8 * 8 + 32 * groups) / head_dim

    def _encode(self, xp: Any, x: Any) -> dict[str, Any]:
        group = min(self.group_size, x.shape[-1])
        x = xp.astype(x, "float32")
        codes, scale, mn = quantize_groups(xp, x, self.bits, group, -1, self.codec_id)
        return {"codes": xp.pack_bits(codes, self.bits), "scale": scale, "min": mn}

    def _decode(self, xp: Any, enc: Encoded) -> Any:
        dim = enc.shape[-1]
        codes = xp.unpack_bits(enc.arrays["codes"], self.bits, dim)
        x = dequantize_groups(xp, codes, enc.arrays["scale"], enc.arrays["min"],
                              min(self.group_size, dim), -1)
        return xp.reshape(x, enc.shape)
