"""KIVI baselines ``kivi2``/``kivi4``: asymmetric min/max quantisation, per channel or per token.

KIVI (Liu et al., 2024) observes that keys carry large fixed per-channel offsets (outlier
channels) while values do not, so it quantises keys *per channel* over groups of consecutive
tokens (the offset then sits inside each group's minimum and costs no resolution) and values
*per token* over groups of channels. :meth:`KiviCodec.for_role` picks the axis per role.

- ``axis="channel"``: x[..., tokens, D]; one fp16 (scale, min) per (group of ``group_size``
  tokens, channel). A 1-D input is one token. A final partial token group is padded internally
  and stripped on decode; it still stores a full (scale, min) row.
- ``axis="token"``: one fp16 (scale, min) per (token, group of ``group_size`` channels), the
  group clamped to head_dim.

Codes are bit-packed LSB-first over the last axis. ``bits_per_element`` is nominal for the
channel axis: ``bits + 32/group_size`` is exact only when the token count is a multiple of
``group_size`` (fewer tokens amortise the side information over fewer rows).
"""

from __future__ import annotations

from typing import Any, ClassVar

from kvtool.codecs.abc import ArraySpec, Codec, Encoded
from kvtool.codecs.groupq import check_scales, dequantize_groups, quantize_groups
from kvtool.codecs.intq import check_group_size, group_specs
from kvtool.codecs.params import check_choice
from kvtool.errors import CodecError
from kvtool.kernels import packing_ops

AXES = ("channel", "token")


class KiviCodec(Codec):
    bits: ClassVar[int]

    def __init__(self, axis: str = "channel", group_size: int = 128):
        self.axis = check_choice(self.codec_id, "axis", axis, AXES)
        self.group_size = check_group_size(self.codec_id, group_size)

    def _params(self) -> dict[str, Any]:
        return {"axis": self.axis, "group_size": self.group_size}

    def for_role(self, role: str) -> Codec:
        """Keys per channel, values per token (KIVI's recipe), same bits and group size."""
        if role not in ("key", "value"):
            raise CodecError(f"{self.codec_id}: role must be 'key' or 'value', got {role!r}")
        return type(self)(axis="channel" if role == "key" else "token",
                          group_size=self.group_size)

    def compiled_ops(self, head_dim: int) -> tuple[str, ...]:
        return packing_ops(self.bits)

    def bits_per_element(self, head_dim: int) -> float:
        code_bits = (head_dim * self.bits + 7) // 8 * 8 / head_dim
        if self.axis == "channel":
            return code_bits + 32 / self.group_size
        groups = -(-head_dim // min(self.group_size, head_dim))
        return code_bits + 32 * groups / head_dim

    def expected_arrays(self, shape: tuple[int, ...], dtype: str) -> dict[str, ArraySpec]:
        shape = tuple(shape) if len(shape) > 1 else (1, *shape)  # a 1-D input is one token
        dim = shape[-1]
        codes = ArraySpec((*shape[:-1], (dim * self.bits + 7) // 8), "uint8")
        group, _ = self._layout(dim)
        if self.axis == "channel":  # one row per token group, one column per channel
            specs = group_specs((*shape[:-2], -(-shape[-2] // group)), dim)
        else:
            specs = group_specs(shape[:-1], -(-dim // group))
        return {"codes": codes, **specs}

    def check_stored(self, arrays: dict[str, Any]) -> None:
        check_scales(arrays["scale"], arrays["min"], self.bits, self.codec_id)

    def _layout(self, dim: int) -> tuple[int, int]:
        """(group, axis) for a given head_dim."""
        if self.axis == "channel":
            return self.group_size, -2
        return min(self.group_size, dim), -1

    def _encode(self, xp: Any, x: Any) -> dict[str, Any]:
        x = xp.astype(x, "float32")
        if x.ndim == 1:
            x = xp.reshape(x, (1, x.shape[0]))
        group, axis = self._layout(x.shape[-1])
        codes, scale, mn = quantize_groups(xp, x, self.bits, group, axis, self.codec_id)
        return {"codes": xp.pack_bits(codes, self.bits), "scale": scale, "min": mn}

    def _decode(self, xp: Any, enc: Encoded) -> Any:
        dim = enc.shape[-1]
        group, axis = self._layout(dim)
        codes = xp.unpack_bits(enc.arrays["codes"], self.bits, dim)
        x = dequantize_groups(xp, codes, enc.arrays["scale"], enc.arrays["min"], group, axis)
        return xp.reshape(x, enc.shape)


class Kivi2(KiviCodec):
    codec_id = "kivi2"
    bits = 2


class Kivi4(KiviCodec):
    codec_id = "kivi4"
    bits = 4


__all__ = ["KiviCodec", "Kivi2", "Kivi4"]
