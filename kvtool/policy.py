"""Cache-level codec policy: which codec encodes which layer, role and token range.

A policy picks a key codec and a value codec (``k4v3`` style), keeps the first/last
``protect_layers`` layers lossless, and keeps ``sink_tokens`` at the start and ``recent_tokens``
at the end of every layer lossless. :meth:`CodecPolicy.segments` turns that into token segments,
each with one codec; the .kvz writer and the runtime compressed cache both speak segments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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

    @classmethod
    def from_options(
        cls,
        codec: str | dict | Codec | None = None,
        key_codec: str | dict | Codec | None = None,
        value_codec: str | dict | Codec | None = None,
        protect_layers: int = 0,
        sink_tokens: int = 0,
        recent_tokens: int = 0,
    ) -> CodecPolicy:
        """Build a policy from CLI-style options; ``codec`` is the default for both roles."""
        base = codec if codec is not None else "raw"
        for name, n in (("protect_layers", protect_layers), ("sink_tokens", sink_tokens),
                        ("recent_tokens", recent_tokens)):
            if n < 0:
                raise CodecError(f"{name} must be >= 0, got {n}")
        return cls(
            key=get_codec(key_codec if key_codec is not None else base).for_role("key"),
            value=get_codec(value_codec if value_codec is not None else base).for_role("value"),
            protect_layers=protect_layers,
            sink_tokens=sink_tokens,
            recent_tokens=recent_tokens,
        )

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
        sink = min(self.sink_tokens, num_tokens)
        recent = min(self.recent_tokens, num_tokens - sink)
        parts = [(0, sink, self.lossless), (sink, num_tokens - recent, main),
                 (num_tokens - recent, num_tokens, self.lossless)]
        return [Segment(a, b, c) for a, b, c in parts if b > a]

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key.get_config(),
            "value": self.value.get_config(),
            "protect_layers": self.protect_layers,
            "sink_tokens": self.sink_tokens,
            "recent_tokens": self.recent_tokens,
            "lossless": self.lossless.get_config(),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CodecPolicy:
        return cls(
            key=get_codec(data["key"]),
            value=get_codec(data["value"]),
            protect_layers=int(data.get("protect_layers", 0)),
            sink_tokens=int(data.get("sink_tokens", 0)),
            recent_tokens=int(data.get("recent_tokens", 0)),
            lossless=get_codec(data.get("lossless", "raw")),
        )

    def describe(self) -> str:
        """Short label (``k=turbo3:center=true v=turbo3 sink=4``) that :meth:`from_label` reads."""
        k, v = _codec_label(self.key, "key"), _codec_label(self.value, "value")
        parts = [k if k == v else f"k={k} v={v}"]
        parts += [f"{name}={n}" for name, n in (("protect", self.protect_layers),
                                                 ("sink", self.sink_tokens),
                                                 ("recent", self.recent_tokens)) if n]
        return " ".join(parts)

    @classmethod
    def from_label(cls, label: str, **defaults: Any) -> CodecPolicy:
        """A policy from a :meth:`describe` label; ``defaults`` fill what the label omits."""
        opts: dict[str, Any] = dict(defaults)
        for part in label.split():
            key, sep, value = part.partition("=")
            if not sep or key not in _LABEL_KEYS:
                opts["codec"] = part
                continue
            name = _LABEL_KEYS[key]
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
