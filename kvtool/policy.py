"""Cache-level codec policy: which codec encodes which layer, role and token range.

A policy picks a key codec and a value codec (``k4v3`` style), keeps the first/last
``protect_layers`` layers lossless, and keeps ``sink_tokens`` at the start and ``recent_tokens``
at the end of every layer lossless. :meth:`CodecPolicy.segments` turns that into token segments,
each with one codec; the .kvz writer and the runtime compressed cache both speak segments.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from kvtool.codecs import Codec, get_codec
from kvtool.errors import CodecError

ROLES = ("key", "value")


@dataclass(frozen=True)
class Segment:
    start: int
    stop: int
    codec: Codec


@dataclass(frozen=True)
class CodecPolicy:
    key: Codec
    value: Codec
    protect_layers: int = 0
    sink_tokens: int = 0
    recent_tokens: int = 0
    lossless: Codec = field(default_factory=lambda: get_codec("raw"))
    #: scan this many leading tokens for attention sinks by norm (:meth:`resolve`); 0: off
    auto_sinks: int = 0

    @classmethod
    def from_options(
        cls,
        codec: str | dict | Codec | None = None,
        key_codec: str | dict | Codec | None = None,
        value_codec: str | dict | Codec | None = None,
        protect_layers: int = 0,
        sink_tokens: int = 0,
        recent_tokens: int = 0,
        auto_sinks: int = 0,
        preset: str | None = None,
    ) -> CodecPolicy:
        """Build a policy from CLI-style options; ``codec`` is the default for both roles.

        ``preset`` (``lossless``, ``quality``, ``balanced``, ``small``) starts from that measured
        policy; codec options given alongside override its codecs.
        """
        if preset is not None:
            base_policy = preset_policy(preset)
            return cls(
                key=get_codec(key_codec or codec or base_policy.key).for_role("key"),
                value=get_codec(value_codec or codec or base_policy.value).for_role("value"),
                protect_layers=protect_layers or base_policy.protect_layers,
                sink_tokens=sink_tokens or base_policy.sink_tokens,
                recent_tokens=recent_tokens or base_policy.recent_tokens,
                auto_sinks=auto_sinks or base_policy.auto_sinks)
        base = codec if codec is not None else "raw"
        for name, n in (("protect_layers", protect_layers), ("sink_tokens", sink_tokens),
                        ("recent_tokens", recent_tokens), ("auto_sinks", auto_sinks)):
            if n < 0:
                raise CodecError(f"{name} must be >= 0, got {n}")
        return cls(
            key=get_codec(key_codec if key_codec is not None else base).for_role("key"),
            value=get_codec(value_codec if value_codec is not None else base).for_role("value"),
            protect_layers=protect_layers,
            sink_tokens=sink_tokens,
            recent_tokens=recent_tokens,
            auto_sinks=auto_sinks,
        )

    def is_lossy(self, dtype: str | None = None) -> bool:
        """Whether this policy changes K/V computed in ``dtype``: any codec but ``raw`` at
        that width (``raw:dtype=float16`` narrows a float32 or bfloat16 cache)."""
        for codec in (self.key, self.value):
            if codec.codec_id != "raw":
                return True
            narrow = getattr(codec, "dtype", None)
            if narrow is not None and narrow != dtype:
                return True
        return False

    def codec_for(self, role: str, layer: int, num_layers: int) -> Codec:
        """The main codec of ``role`` in ``layer`` (lossless for protected layers)."""
        if layer < self.protect_layers or layer >= num_layers - self.protect_layers:
            return self.lossless
        return self.key if role == "key" else self.value

    def segments(self, role: str, layer: int, num_layers: int, num_tokens: int) -> list[Segment]:
        """Token segments of one layer and role, in order, covering ``[0, num_tokens)``."""
        main = self.codec_for(role, layer, num_layers)
        if main == self.lossless:
            return [Segment(0, num_tokens, main)] if num_tokens else []
        sink = min(self.sink_tokens, num_tokens)  # unresolved auto sinks: the fixed count
        recent = min(self.recent_tokens, num_tokens - sink)
        parts = [(0, sink, self.lossless), (sink, num_tokens - recent, main),
                 (num_tokens - recent, num_tokens, self.lossless)]
        return [Segment(a, b, c) for a, b, c in parts if b > a]

    def resolve(self, cache: Any) -> CodecPolicy:
        """This policy with its automatic sinks counted on ``cache`` (a KVCache or per-layer
        key arrays' owner): ``sink_tokens`` becomes at least the detected count."""
        if not self.auto_sinks:
            return self
        from kvtool.sinks import detect_sinks

        found = detect_sinks(cache, self.auto_sinks)
        return replace(self, sink_tokens=max(self.sink_tokens, found), auto_sinks=0)

    def with_seed(self, seed: int) -> CodecPolicy:
        """The same policy with every seeded codec (turbo, prism, …) rotated by ``seed``."""
        def reseed(codec: Codec) -> Codec:
            config = codec.get_config()
            return get_codec({**config, "seed": seed}) if "seed" in config else codec

        return replace(self, key=reseed(self.key), value=reseed(self.value))

    def to_json(self) -> dict[str, Any]:
        out = {
            "key": self.key.get_config(),
            "value": self.value.get_config(),
            "protect_layers": self.protect_layers,
            "sink_tokens": self.sink_tokens,
            "recent_tokens": self.recent_tokens,
            "lossless": self.lossless.get_config(),
        }
        if self.auto_sinks:  # only when set: files of resolved policies stay as before
            out["auto_sinks"] = self.auto_sinks
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CodecPolicy:
        return cls(
            key=get_codec(data["key"]),
            value=get_codec(data["value"]),
            protect_layers=int(data.get("protect_layers", 0)),
            sink_tokens=int(data.get("sink_tokens", 0)),
            recent_tokens=int(data.get("recent_tokens", 0)),
            lossless=get_codec(data.get("lossless", "raw")),
            auto_sinks=int(data.get("auto_sinks", 0)),
        )

    def describe(self) -> str:
        """Short label (``k=turbo3:center=true v=turbo3 sink=4``) that :meth:`from_label` reads."""
        k, v = _codec_label(self.key, "key"), _codec_label(self.value, "value")
        parts = [k if k == v else f"k={k} v={v}"]
        parts += [f"{name}={n}" for name, n in (("protect", self.protect_layers),
                                                 ("sink", self.sink_tokens),
                                                 ("recent", self.recent_tokens)) if n]
        if self.auto_sinks:
            parts.append("sink=auto" if self.auto_sinks == AUTO_SINK_SCAN
                         else f"sink=auto:{self.auto_sinks}")
        return " ".join(parts)

    @classmethod
    def from_label(cls, label: str, **defaults: Any) -> CodecPolicy:
        """A policy from a :meth:`describe` label or a preset name (:data:`PRESETS`);
        ``defaults`` fill what the label omits."""
        if label.strip() in PRESETS:
            return preset_policy(label.strip())
        opts: dict[str, Any] = dict(defaults)
        for part in label.split():
            key, sep, value = part.partition("=")
            if not sep or key not in _LABEL_KEYS:
                opts["codec"] = part
                continue
            name = _LABEL_KEYS[key]
            if name == "sink_tokens" and value.startswith("auto"):
                scan = value.partition(":")[2]
                if not scan.isdigit() and scan:
                    raise CodecError(f"policy label {label!r}: sink=auto:N needs an integer")
                opts["auto_sinks"] = int(scan) if scan else AUTO_SINK_SCAN
                continue
            try:
                opts[name] = value if name.endswith("codec") else int(value)
            except ValueError:
                raise CodecError(f"policy label {label!r}: {key}= needs an integer") from None
        return cls.from_options(**opts)


_LABEL_KEYS = {"k": "key_codec", "v": "value_codec", "protect": "protect_layers",
               "sink": "sink_tokens", "recent": "recent_tokens"}


def _codec_label(codec: Codec, role: str) -> str:
    """``id`` plus the options that differ from the codec's defaults for ``role``."""
    import json

    try:  # the class's own defaults, so unregistered codecs work too
        default = type(codec)().for_role(role).get_config()
    except (TypeError, CodecError):
        default = {"id": codec.codec_id, "codec_version": codec.codec_version}
    opts = [f"{k}={v if isinstance(v, str) else json.dumps(v)}"
            for k, v in codec.get_config().items() if default.get(k) != v]
    return codec.codec_id + (":" + ",".join(opts) if opts else "")


AUTO_SINK_SCAN = 16  # leading tokens ``sink=auto`` scans

#: name → (policy label, what was measured): ``python benchmarks/quality.py``, SmolLM2-135M
#: float32, mean over 3 rotation seeds × the 2 bundled texts (2048 tokens, chunks of 256),
#: bits/element of the whole cache (4 exact sinks included). Keys get the bits; ``candidates=4``
#: (the best of 4 rotations per head and block, by reconstruction error) and ``trellis=true``
#: (trellis-coded quantisation) are the methods that won. Outlier counts are channels, so at
#: head_dim 128 ``balanced`` is 2.9 bits/element and ``small`` 2.25.
PRESETS: dict[str, tuple[str, str]] = {
    "lossless": ("raw", "exact"),
    "quality": ("k=turbomix:bits=4,center=true,candidates=4 v=turbomix:candidates=4 sink=4",
                "3.78 b: KL 0.0026, Δppl +0.10% (seed spread 0.22)"),
    "balanced": ("k=turbomix:outliers=16,center=true,candidates=4,trellis=true,norm_bits=8 "
                 "v=turbomix:bits=2,outliers=48,outlier_bits=3,candidates=4,trellis=true,"
                 "norm_bits=8 sink=4",
                 "3.28 b: KL 0.0031, Δppl +0.30% (seed spread 0.49)"),
    "small": ("k=turbomix:bits=2,outliers=16,outlier_bits=3,center=true,candidates=4,"
              "trellis=true v=turbomix:bits=2,candidates=4,trellis=true sink=4",
              "2.53 b: KL 0.0123, Δppl +1.01% (seed spread 0.72)"),
}


#: each preset's key/value codec speed in MB/s of fp16 input, encode and decode, measured with
#: ``benchmarks/codecs.py --vectors 262144 --codecs NAME/k,NAME/v --backends numpy+numba``
#: (head_dim 128, 2 threads of a 2-core AMD EPYC, compiled CPU kernels); ``kvtool codecs
#: --presets --measure`` measures this machine
PRESET_SPEEDS: dict[str, dict[str, tuple[int, int]]] = {
    "quality": {"encode": (389, 442), "decode": (1886, 1882)},
    "balanced": {"encode": (76, 79), "decode": (822, 648)},
    "small": {"encode": (79, 85), "decode": (773, 1379)},
}


def preset_policy(name: str) -> CodecPolicy:
    """The policy a preset names."""
    if name not in PRESETS:
        raise CodecError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return CodecPolicy.from_label(PRESETS[name][0])


def presets_table(head_dim: int = 64) -> list[dict[str, Any]]:
    """Every preset: its label, encoded bits/element at ``head_dim`` (mean of keys and values,
    sinks excluded) and what was measured for it."""
    rows = []
    for name, (label, measured) in PRESETS.items():
        policy = preset_policy(name)
        bits = (policy.key.bits_per_element(head_dim) + policy.value.bits_per_element(head_dim))
        speed = PRESET_SPEEDS.get(name, {})
        rows.append({"name": name, "label": label, "bits_per_element": round(bits / 2, 4),
                     "measured": measured,
                     **{f"{op}_mbps": dict(zip(("key", "value"), mbps, strict=True))
                        for op, mbps in speed.items()}})
    return rows
