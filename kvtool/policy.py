"""Cache-level codec policy: which codec encodes which layer, role and token range.

A policy picks a key codec and a value codec (``k4v3`` style), keeps the first/last
``protect_layers`` layers lossless, and keeps ``sink_tokens`` at the start and ``recent_tokens``
at the end of every layer lossless. :meth:`CodecPolicy.segments` turns that into token segments,
each with one codec; the .kvz writer and the runtime compressed cache both speak segments.

A policy may also give single layers their own codecs (:class:`LayerCodecs`, e.g. from
``kvtool calibrate``): it then records the layer count it was made for and refuses other models.
Policies round-trip through :meth:`CodecPolicy.to_json` / :meth:`CodecPolicy.from_json`, JSON
files (:mod:`kvtool.policy_files`) and labels (:meth:`CodecPolicy.describe`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import Any

from kvtool.codecs import Codec, codec_for_role, get_codec
from kvtool.codecs.params import is_digits
from kvtool.errors import CodecError

ROLES = ("key", "value")
AUTO_SINK_SCAN = 16  # leading tokens ``sink=auto`` scans


@dataclass(frozen=True)
class Segment:
    start: int
    stop: int
    codec: Codec


@dataclass(frozen=True)
class LayerCodecs:
    """One layer's own codecs; ``None`` keeps the policy's codec for that role."""

    key: Codec | None = None
    value: Codec | None = None

    def get(self, role: str) -> Codec | None:
        return self.key if role == "key" else self.value


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
    #: per-layer codecs, ``(layer index, LayerCodecs)`` sorted by index; they win over
    #: ``protect_layers`` and the policy's ``key``/``value``
    layers: tuple[tuple[int, LayerCodecs], ...] = ()
    #: the layer count ``layers`` was made for (required with ``layers``); other models refused
    num_layers: int | None = None

    def __post_init__(self) -> None:
        for role in ("key", "value", "lossless"):
            if not isinstance(getattr(self, role), Codec):  # "turbo3": get_codec() it first
                raise CodecError(f"policy: {role} must be a Codec, got "
                                 f"{type(getattr(self, role)).__name__}")
        for name in ("protect_layers", "sink_tokens", "recent_tokens", "auto_sinks"):
            n = getattr(self, name)
            if not is_count(n):  # -1, 0.5 or True would be written, then refused by load
                raise CodecError(f"{name} must be an integer from 0 to {MAX_COUNT}, got "
                                 f"{str(n)[:40]!r}")
        if not self.layers:  # a uniform policy fits any model
            object.__setattr__(self, "num_layers", None)
            return
        if not is_count(self.num_layers) or not self.num_layers:
            raise CodecError("a policy with per-layer codecs needs num_layers (an integer >= 1)")
        seen: set[int] = set()
        for index, own in self.layers:
            if not is_count(index) or index >= self.num_layers:
                raise CodecError(f"policy: layer index {index!r} is out of range for "
                                 f"{self.num_layers} layers")
            if index in seen:
                raise CodecError(f"policy: layer {index} is given twice")
            seen.add(index)
            if not isinstance(own, LayerCodecs):
                raise CodecError(f"policy: layer {index}: expected LayerCodecs")
        object.__setattr__(self, "layers", tuple(sorted(self.layers, key=lambda t: t[0])))

    @classmethod
    def from_options(
        cls,
        codec: str | dict | Codec | None = None,
        key_codec: str | dict | Codec | None = None,
        value_codec: str | dict | Codec | None = None,
        protect_layers: int | None = None,
        sink_tokens: int | None = None,
        recent_tokens: int | None = None,
        auto_sinks: int | None = None,
        preset: str | None = None,
        model_fingerprint: str | None = None,
    ) -> CodecPolicy:
        """Build a policy from CLI-style options; ``codec`` is the default for both roles.

        ``preset`` (``lossless``, ``quality``, ``balanced``, ``small``, or the path of a policy
        JSON file) starts from that policy (fitted to the model with ``model_fingerprint`` where
        ``kvtool calibrate --preset`` fitted it: :mod:`kvtool.preset_fit`); codec options given
        alongside override its codecs (not a file's per-layer codecs), and counts given (0
        included) its counts.
        """
        counts = {"protect_layers": protect_layers, "sink_tokens": sink_tokens,
                  "recent_tokens": recent_tokens, "auto_sinks": auto_sinks}
        given = {name: n for name, n in counts.items() if n is not None}
        if preset is not None:
            from kvtool.presets import preset_policy

            base_policy = preset_policy(preset, model_fingerprint)
            return replace(
                base_policy,
                key=codec_for_role(key_codec or codec or base_policy.key, "key"),
                value=codec_for_role(value_codec or codec or base_policy.value, "value"),
                **given)
        base = codec if codec is not None else "raw"
        return cls(
            key=codec_for_role(key_codec if key_codec is not None else base, "key"),
            value=codec_for_role(value_codec if value_codec is not None else base, "value"),
            **given,
        )

    def is_lossy(self, dtype: str | None = None) -> bool:
        """Whether this policy changes K/V computed in ``dtype``: any codec but ``raw`` at
        that width (``raw:dtype=float16`` narrows a float32 or bfloat16 cache)."""
        for codec in self.codecs():
            if codec.codec_id != "raw":
                return True
            narrow = getattr(codec, "dtype", None)
            if narrow is not None and narrow != dtype:
                return True
        return False

    def codecs(self) -> list[Codec]:
        """Every distinct codec this policy may use, lossless included (e.g. to warm up)."""
        found = [self.key, self.value, self.lossless]
        found += [c for _, own in self.layers for c in (own.key, own.value) if c is not None]
        return list(dict.fromkeys(found))

    def check_layers(self, num_layers: int) -> None:
        """Refuse a model whose layer count is not the one the per-layer codecs were made for."""
        if self.layers and num_layers != self.num_layers:
            raise CodecError(f"this policy has per-layer codecs for {self.num_layers} layers; "
                             f"the model has {num_layers}")

    def codec_for(self, role: str, layer: int, num_layers: int) -> Codec:
        """The main codec of ``role`` in ``layer``: the layer's own, else lossless for protected
        layers, else the policy's."""
        self.check_layers(num_layers)
        own = dict(self.layers).get(layer)
        if own is not None and own.get(role) is not None:
            return own.get(role)
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

    def resolve(self, cache: Any = None) -> CodecPolicy:
        """This policy with its automatic sinks counted on ``cache`` (a KVCache, or (keys,
        values) a layer at a time): ``sink_tokens`` becomes at least the detected count. Without a
        cache (a writer or cache that sees tokens as they come) every scanned token is kept
        exact: a sink is never encoded for want of the whole cache to find it on."""
        if not self.auto_sinks:
            return self
        if cache is None:
            found = self.auto_sinks
        else:
            from kvtool.sinks import detect_sinks

            found = detect_sinks(cache, self.auto_sinks)
        return replace(self, sink_tokens=max(self.sink_tokens, found), auto_sinks=0)

    def check_runtime(self) -> None:
        """Refuse a policy that a cache encoding tokens as they come cannot apply: those keep
        sink and recent tokens and protected layers in the model's dtype, so a lossy
        ``lossless`` codec (``lossless=turbo2``) would be ignored there."""
        if self.lossless.codec_id != "raw":
            raise CodecError(f"policy {self.describe()[:80]!r}: a runtime cache keeps sink and "
                             "recent tokens and protected layers in the model's dtype; its "
                             f"lossless codec must be raw, not {self.lossless.codec_id} (drop "
                             "lossless=)")

    def with_seed(self, seed: int) -> CodecPolicy:
        """The same policy with every seeded codec (turbo, prism, …) rotated by ``seed``."""
        def reseed(codec: Codec) -> Codec:
            config = codec.get_config()
            return get_codec({**config, "seed": seed}) if "seed" in config else codec

        layers = tuple((i, LayerCodecs(*(None if c is None else reseed(c)
                                          for c in (own.key, own.value))))
                       for i, own in self.layers)
        return replace(self, key=reseed(self.key), value=reseed(self.value), layers=layers)

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
        if self.layers:  # likewise: uniform policies keep today's JSON
            out["num_layers"] = self.num_layers
            out["layers"] = {str(i): {role: c.get_config() for role, c in
                                      (("key", own.key), ("value", own.value)) if c is not None}
                             for i, own in self.layers}
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CodecPolicy:
        """The policy :meth:`to_json` wrote; unknown keys are ignored, anything malformed is a
        one-line :class:`CodecError`."""
        if not isinstance(data, dict):
            raise CodecError(f"a policy must be a JSON object, got {type(data).__name__}")
        for name in ("key", "value"):
            if name not in data:
                raise CodecError(f"policy: {name!r} (a codec) is missing")
        lossless = _codec(data.get("lossless", "raw"), "lossless")
        num_layers = data.get("num_layers")
        if num_layers is not None and not is_count(num_layers):
            raise CodecError(f"policy: num_layers must be an integer >= 0, got {num_layers!r}")
        return cls(
            key=_codec(data["key"], "key"),
            value=_codec(data["value"], "value"),
            protect_layers=_count(data, "protect_layers"),
            sink_tokens=_count(data, "sink_tokens"),
            recent_tokens=_count(data, "recent_tokens"),
            lossless=lossless,
            auto_sinks=_count(data, "auto_sinks"),
            layers=_layers_from_json(data.get("layers"), lossless),
            num_layers=num_layers,
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
        if self.lossless.get_config() != get_codec("raw").get_config():
            parts.append(f"lossless={_codec_label(self.lossless, None)}")
        if self.layers:
            parts.append(f"layers={self.num_layers}")
            parts += _layer_labels(self.layers)
        return " ".join(parts)

    @classmethod
    def from_label(cls, label: str, **defaults: Any) -> CodecPolicy:
        """A policy from a :meth:`describe` label or a preset name
        (:data:`kvtool.presets.PRESETS`); ``defaults`` fill what the label omits."""
        from kvtool.presets import PRESETS, preset_policy

        if label.strip() in PRESETS:
            return preset_policy(label.strip())
        opts: dict[str, Any] = dict(defaults)
        given: set[str] = set()  # what the label set: each once ("turbo3 turbo4" is a typo)
        lossless: Codec | None = None
        spans: list[tuple[str, str]] = []
        num_layers = None
        for part in label.split():
            key, sep, value = part.partition("=")
            name = ("codec" if not sep or not (key in LABEL_KEYS or key in ("layers", "lossless"))
                    else LABEL_KEYS.get(key, key))
            if sep and _LAYER_PART.fullmatch(key):
                spans.append((key, value))
                continue
            if name == "sink_tokens" and value.startswith("auto"):
                name = "auto_sinks"
            if name in given:
                raise CodecError(f"policy label {label!r}: {part!r} sets "
                                 f"{'the codec' if name == 'codec' else key + '='} a second time")
            given.add(name)
            if name == "codec":
                opts["codec"] = part
            elif name == "lossless":
                lossless = get_codec(value)
            elif name == "auto_sinks":
                scan = value.partition(":")[2]
                if value != "auto" and not (value.startswith("auto:") and is_digits(scan)):
                    raise CodecError(f"policy label {label!r}: sink=auto:N needs an integer")
                opts["auto_sinks"] = int(scan) if scan else AUTO_SINK_SCAN
            elif name.endswith("codec"):
                opts[name] = value
            elif not is_digits(value):
                raise CodecError(f"policy label {label!r}: {key}= needs an integer")
            elif name == "layers":
                num_layers = int(value)
            else:
                opts[name] = int(value)
        policy = cls.from_options(**opts)
        if lossless is not None:
            policy = replace(policy, lossless=lossless)
        if spans or num_layers is not None:
            if num_layers is None:
                raise CodecError(f"policy label {label!r}: per-layer codecs need layers=N (the "
                                 "model's layer count)")
            own: dict[int, dict[str, Codec]] = {}
            for key, value in spans:
                _parse_layer_part(key, value, own, label, num_layers)
            layers = tuple((i, LayerCodecs(c.get("key"), c.get("value")))
                           for i, c in sorted(own.items()))
            policy = replace(policy, layers=layers, num_layers=num_layers)
        return policy


#: a label's short keys and the policy fields they set (policy files spell the fields out)
LABEL_KEYS = {"k": "key_codec", "v": "value_codec", "protect": "protect_layers",
              "sink": "sink_tokens", "recent": "recent_tokens"}


#: a label part giving layers their own codec: ``L3.k=…``, ``L0,29=raw`` (both roles), ``L2-5.v=…``
_LAYER_PART = re.compile(r"L([0-9]+(?:-[0-9]+)?(?:,[0-9]+(?:-[0-9]+)?)*)(\.[kv])?")


def _parse_layer_part(key: str, value: str, own: dict[int, dict[str, Codec]],
                      label: str, num_layers: int) -> None:
    """Add ``L…[.k|.v]=codec`` to ``own`` (layer → role → codec), its layers checked against
    ``num_layers`` before any is added."""
    match = _LAYER_PART.fullmatch(key)
    assert match is not None
    roles = {".k": ("key",), ".v": ("value",), None: ROLES}[match.group(2)]
    indices: list[int] = []
    for span in match.group(1).split(","):
        first, _, last = span.partition("-")
        a, b = int(first), int(last or first)
        if a > b or b >= num_layers:
            raise CodecError(f"policy label {label!r}: L{span} is not a range of layers "
                             f"0-{num_layers - 1} (first-last, first <= last)")
        indices += range(a, b + 1)
    codecs = {role: codec_for_role(value, role) for role in roles}
    for i in indices:
        for role in roles:
            if role in own.get(i, {}):
                raise CodecError(f"policy label {label!r}: layer {i} {role} given twice")
            own.setdefault(i, {})[role] = codecs[role]


def _spans(indices: list[int]) -> str:
    """[0, 1, 2, 7] → ``0-2,7``."""
    out: list[str] = []
    start = prev = indices[0]
    for i in [*indices[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(out)


def _layer_labels(layers: tuple[tuple[int, LayerCodecs], ...]) -> list[str]:
    """Label parts of per-layer codecs, layers with the same codec grouped."""
    groups: dict[tuple[str, str], list[int]] = {}
    for i, own in layers:
        labels = {role: _codec_label(c, role) for role, c in (("key", own.key),
                                                               ("value", own.value)) if c}
        if len(labels) == 2 and labels["key"] == labels["value"]:
            groups.setdefault(("", labels["key"]), []).append(i)
            continue
        for role, text in labels.items():
            groups.setdefault(("." + role[0], text), []).append(i)
    return [f"L{_spans(ix)}{suffix}={text}" for (suffix, text), ix in groups.items()]


#: the largest count a policy holds (the command-line flags' bound): past 64 bits, a JSON
#: number other readers of a file's header would choke on
MAX_COUNT = 2**31 - 1


def is_count(value: Any) -> bool:
    """Whether ``value`` is a policy count: an integer (not a bool) from 0 to MAX_COUNT."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT


def _count(data: dict[str, Any], name: str) -> int:
    value = data.get(name, 0)
    if not is_count(value):
        raise CodecError(f"policy: {name} must be an integer from 0 to {MAX_COUNT}, got "
                         f"{str(value)[:40]!r}")
    return value


def _codec(value: Any, where: str, role: str | None = None) -> Codec:
    """A codec from a policy's JSON (config object or ``id:opt=val`` string), shaped for
    ``role`` if given (:func:`~kvtool.codecs.codec_for_role`), or CodecError."""
    if not isinstance(value, (str, dict)):
        raise CodecError(f"policy: {where} must be a codec (an object or a string), got "
                         f"{type(value).__name__}")
    try:
        return get_codec(value) if role is None else codec_for_role(value, role)
    except CodecError as e:
        raise CodecError(f"policy: {where}: {e}") from None
    except (TypeError, ValueError, KeyError) as e:
        raise CodecError(f"policy: {where}: not a codec config ({str(e)[:80]})") from None


def _layers_from_json(data: Any, lossless: Codec) -> tuple[tuple[int, LayerCodecs], ...]:
    """``{"3": {"key": codec, "value": codec}, "0": "lossless"}`` → per-layer codecs."""
    if data is None:
        return ()
    if not isinstance(data, dict):
        raise CodecError("policy: layers must be an object (layer index → codecs)")
    out = []
    for index, spec in data.items():
        if not (isinstance(index, str) and is_digits(index)):
            raise CodecError(f"policy: layer index {str(index)[:20]!r} is not an integer >= 0")
        where = f"layer {index}"
        if spec == "lossless":
            spec = {"key": lossless, "value": lossless}
        if not isinstance(spec, dict) or not spec or set(spec) - set(ROLES):
            raise CodecError(f"policy: {where} must be \"lossless\" or an object with "
                             "\"key\" and/or \"value\" codecs")
        codecs = {r: c if isinstance(c, Codec) else _codec(c, f"{where} {r}", r)
                  for r, c in spec.items()}
        out.append((int(index), LayerCodecs(codecs.get("key"), codecs.get("value"))))
    return tuple(out)


def _codec_label(codec: Codec, role: str | None) -> str:
    """``id`` plus the options that differ from the codec's defaults for ``role`` (None: its
    defaults for any role, as ``get_codec(label)`` builds it)."""
    try:  # the class's own defaults, so unregistered codecs work too
        plain = type(codec)()
        default = (plain if role is None else plain.for_role(role)).get_config()
    except (TypeError, CodecError):
        default = {"id": codec.codec_id, "codec_version": codec.codec_version}
    opts = [f"{k}={v if isinstance(v, str) else json.dumps(v)}"
            for k, v in codec.get_config().items() if default.get(k) != v]
    return codec.codec_id + (":" + ",".join(opts) if opts else "")
