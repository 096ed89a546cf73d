"""Integer baselines: ``int8`` (per-token symmetric absmax) and ``int4`` (per-group asymmetric).

``int8`` maps each vector's largest magnitude to ±127 with one fp16 scale per vector. ``int4``
splits each vector into groups of ``group_size`` channels (clamped to head_dim; a partial last
group is allowed) with an fp16 scale and fp16 minimum per group, and packs two codes per byte.
"""

from __future__ import annotations

from typing import Any

from kvtool.codecs.abc import ArraySpec, Codec, Encoded
from kvtool.codecs.groupq import (
    check_scales,
    dequantize_groups,
    nonzero,
    quantize_groups,
    to_fp16,
)
from kvtool.codecs.params import GROUP_MAX, check_int
from kvtool.kernels import packing_ops


def check_group_size(who: str, group_size: Any) -> int:
    return check_int(who, "group_size", group_size, 1, GROUP_MAX)


def group_specs(lead: tuple[int, ...], groups: int) -> dict[str, ArraySpec]:
    """fp16 ``scale`` and ``min`` of shape ``(*lead, groups)``. A scale can be a hair below 0
    (the fp16-rounded minimum of a constant group lies above its maximum), so no range."""
    return {"scale": ArraySpec((*lead, groups), "float16"),
            "min": ArraySpec((*lead, groups), "float16")}


class Int8Codec(Codec):
    codec_id = "int8"

    def bits_per_element(self, head_dim: int) -> float:
        return 8 + 16 / head_dim

    def expected_arrays(self, shape: tuple[int, ...], dtype: str) -> dict[str, ArraySpec]:
        return {"codes": ArraySpec(tuple(shape), "int8", low=-127, high=127),
                "scale": ArraySpec(tuple(shape[:-1]), "float16", low=0.0)}

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

    def compiled_ops(self, head_dim: int) -> tuple[str, ...]:
        return packing_ops(self.bits)

    def bits_per_element(self, head_dim: int) -> float:
        groups = -(-head_dim // min(self.group_size, head_dim))
        return ((head_dim * self.bits + 7) // 8 * 8 + 32 * groups) / head_dim

    def expected_arrays(self, shape: tuple[int, ...], dtype: str) -> dict[str, ArraySpec]:
        lead, dim = tuple(shape[:-1]), shape[-1]
        groups = -(-dim // min(self.group_size, dim))
        return {"codes": ArraySpec((*lead, (dim * self.bits + 7) // 8), "uint8"),
                **group_specs(lead, groups)}

    def check_stored(self, arrays: dict[str, Any]) -> None:
        check_scales(arrays["scale"], arrays["min"], self.bits, self.codec_id)

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
