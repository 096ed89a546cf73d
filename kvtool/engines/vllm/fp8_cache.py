"""The values of an fp8 paged cache (vLLM's ``--kv-cache-dtype fp8``, ``fp8_e4m3``,
``fp8_e5m2``): each element is the fp8 code of a key or value divided by its layer's scale
(``k_scale``/``v_scale``, 1.0 unless the checkpoint gives them).

The store keeps real K/V, not codes: a save dequantizes (code × scale, in the model's dtype),
so a chunk serves any server of the model, fp8 or not; a load quantizes into this cache's
format with its own scales: round to nearest even, saturated at the format's largest finite
value, as vLLM's CUDA kernels do (vLLM's CPU writer truncates instead; a value either one
writes reads back the same, see :func:`~kvtool.engines.vllm.layout_probe.agrees`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kvtool.errors import KvtoolError

#: format → (torch dtype of its codes, largest finite value)
FORMATS = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}
#: vLLM's ``--kv-cache-dtype`` values of an fp8 cache → format
KV_CACHE_DTYPES = {"fp8": "e4m3", "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2"}
VALUE_DTYPES = ("float16", "bfloat16", "float32")
FP8_LOSSLESS = ("an fp8 paged cache holds K/V rounded to fp8, and a lossless store policy would "
                "file them as exact for every server of the model: use a lossy policy (a "
                "preset), or a float --kv-cache-dtype")


def fp8_format(kv_cache_dtype: str | None) -> str | None:
    """The fp8 format of vLLM's ``kv_cache_dtype``; None for an unquantized cache (``auto``,
    a float dtype); KvtoolError for a quantized one kvtool cannot read (``fp8_inc``, ...)."""
    name = str(kv_cache_dtype or "auto").lower()
    if name in KV_CACHE_DTYPES:
        if torch.version.hip:  # ROCm's fp8 is e4m3fnuz: other codes for the same bytes
            raise KvtoolError(f"--kv-cache-dtype {name} on ROCm holds e4m3fnuz codes, which "
                              "kvtool does not read")
        return KV_CACHE_DTYPES[name]
    if name == "auto" or name in VALUE_DTYPES or name in ("half", "float", "bf16", "fp16"):
        return None
    raise KvtoolError(f"--kv-cache-dtype {name}: kvtool reads fp8 (e4m3, e5m2) and float "
                      "caches only")


@dataclass(frozen=True)
class Fp8Cache:
    """One layer's fp8 cache: its format, scales, and the dtype its K/V are read out in."""

    format: str
    k_scale: float = 1.0
    v_scale: float = 1.0
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"unknown fp8 format {self.format!r} (known: {', '.join(FORMATS)})")
        for scale in (self.k_scale, self.v_scale):
            if not (math.isfinite(scale) and scale > 0):
                raise KvtoolError(f"an fp8 cache's scale must be a positive number, got {scale}")
        if self.dtype not in VALUE_DTYPES:
            raise ValueError(f"an fp8 cache reads out in {', '.join(VALUE_DTYPES)}, "
                             f"not {self.dtype!r}")

    @property
    def code_dtype(self) -> torch.dtype:
        return FORMATS[self.format][0]

    def scale(self, role: str) -> float:
        return self.k_scale if role == "key" else self.v_scale

    def decode(self, codes: torch.Tensor, role: str) -> torch.Tensor:
        """Codes (bytes or fp8) → K or V in :attr:`dtype`."""
        values = codes.view(self.code_dtype).to(torch.float32) * self.scale(role)
        return values.to(getattr(torch, self.dtype))

    def encode(self, x: torch.Tensor, role: str) -> torch.Tensor:
        """K or V → codes as bytes (uint8): round to nearest even, saturating."""
        top = FORMATS[self.format][1]
        scaled = (x.to(torch.float32) / self.scale(role)).clamp(-top, top)
        return scaled.to(self.code_dtype).view(torch.uint8)


def fp8_sources(layers: list[tuple[Any, Any, int]]) -> list[str]:
    """The lossy sources (``"fp8_e4m3"``) of K/V read from these paged caches
    (:data:`~kvtool.engines.vllm.paged_io.Layers`): their fp8 formats' rounding."""
    return sorted({f"fp8_{layout.fp8.format}" for _, layout, _ in layers if layout.fp8})


def layer_fp8(layer: object, dtype: str) -> Fp8Cache | None:
    """The fp8 cache of vLLM attention ``layer`` (its ``kv_cache_dtype`` and scales, set when
    the weights loaded), read out in the model's ``dtype``; None for a float cache.
    KvtoolError where the layer holds no scales: guessing 1.0 would misread every value."""
    fmt = fp8_format(getattr(layer, "kv_cache_dtype", "auto"))
    if fmt is None:
        return None
    scales = []
    for role in ("k", "v"):
        scale = getattr(layer, f"_{role}_scale_float", None)
        if scale is None and getattr(layer, f"_{role}_scale", None) is not None:
            scale = float(getattr(layer, f"_{role}_scale"))  # a one-element tensor
        if scale is None:
            raise KvtoolError(f"an fp8 attention layer without its {role}_scale: kvtool cannot "
                              "read or write its cache")
        scales.append(float(scale))
    return Fp8Cache(fmt, scales[0], scales[1], dtype)


def checkpoint_kv_cache_dtype(config: object) -> str | None:
    """The KV cache dtype a checkpoint's ``quantization_config`` makes vLLM use under
    ``--kv-cache-dtype auto`` (``fp8`` for a ``kv_cache_scheme`` or ``kv_cache_quant_algo``
    of 8-bit floats), as vLLM resolves it; None where it names none or vLLM is absent."""
    quant = getattr(config, "quantization_config", None)
    if not quant:
        return None
    if not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else vars(quant)
    if quant.get("kv_cache_scheme") is not None:  # llm-compressor: vLLM's Attention says fp8
        return "fp8"
    try:
        from vllm.utils.torch_utils import get_kv_cache_quant_algo_string
    except Exception:  # no vLLM (a dry run elsewhere), or one without the helper
        return None
    name = get_kv_cache_quant_algo_string(quant)
    return None if name in (None, "auto") else name
