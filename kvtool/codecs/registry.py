"""Codec registry: built-ins in a lazy table, third-party codecs through entry points.

A plugin distribution declares, e.g. in its pyproject::

    [project.entry-points."kvtool.codecs"]
    mycodec = "my_package.codec:MyCodec"

The entry point's name must equal the class's ``codec_id``. A duplicate id (a plugin shadowing a
built-in, or two plugins) is an error rather than a silent override.
"""

from __future__ import annotations

import importlib
import json
from importlib.metadata import entry_points
from typing import Any

from kvtool.codecs.abc import Codec
from kvtool.errors import CodecError, CodecVersionError, UnknownCodecError, did_you_mean

ENTRY_POINT_GROUP = "kvtool.codecs"

BUILTIN_CODECS: dict[str, str] = {
    "raw": "kvtool.codecs.raw:RawCodec",
    "fp8": "kvtool.codecs.fp8:Fp8Codec",
    "int8": "kvtool.codecs.intq:Int8Codec",
    "int4": "kvtool.codecs.intq:Int4Codec",
    "kivi2": "kvtool.codecs.kivi:Kivi2",
    "kivi4": "kvtool.codecs.kivi:Kivi4",
    "turbo2": "kvtool.codecs.turbo:Turbo2",
    "turbo3": "kvtool.codecs.turbo:Turbo3",
    "turbo4": "kvtool.codecs.turbo:Turbo4",
    "prism": "kvtool.codecs.prism:PrismCodec",
    "turbomix": "kvtool.codecs.turbomix:TurboMixCodec",
}

_registry: dict[str, str | type[Codec]] | None = None


def _load_table() -> dict[str, str | type[Codec]]:
    global _registry
    if _registry is None:
        table: dict[str, str | type[Codec]] = dict(BUILTIN_CODECS)
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in table:
                dist = getattr(ep.dist, "name", "?")
                raise CodecError(f"codec id {ep.name!r} from plugin {dist!r} is already "
                                 "registered; uninstall one of them")
            table[ep.name] = ep.value
        _registry = table
    return _registry


def reset_registry() -> None:
    """Forget discovered plugins (tests, or after installing a plugin at run time)."""
    global _registry
    _registry = None


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Register ``cls`` under ``cls.codec_id`` at run time (usable as a decorator)."""
    table = _load_table()
    if cls.codec_id in table:
        raise CodecError(f"codec id {cls.codec_id!r} is already registered")
    table[cls.codec_id] = cls
    return cls


def _resolve(codec_id: str) -> type[Codec]:
    table = _load_table()
    target = table.get(codec_id)
    if target is None:
        from kvtool.presets import PRESETS  # here, not at import: presets import codecs

        if codec_id in PRESETS:
            raise UnknownCodecError(
                f"{codec_id!r} is a preset (a whole policy: a codec per role, sinks, protected "
                f"layers), not a codec: give it as a preset (--preset {codec_id}, "
                f"CodecPolicy.from_label({codec_id!r}) alone, or "
                f"CodecPolicy.from_options(preset={codec_id!r}, ...) to change its counts)")
        hint = did_you_mean(str(codec_id), table)
        raise UnknownCodecError(f"unknown codec {codec_id!r}{hint} (not built in and no "
                                "installed plugin provides it through the entry-point group "
                                f"{ENTRY_POINT_GROUP!r}; known: {', '.join(sorted(table))})")
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise CodecError(f"codec {codec_id!r} could not be loaded from {target}: {e}") from e
        if getattr(cls, "codec_id", None) != codec_id:
            raise CodecError(f"codec {target} declares id {getattr(cls, 'codec_id', None)!r}, "
                             f"but is registered as {codec_id!r}")
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        if missing:
            raise CodecError(f"codec {codec_id!r} ({target}) does not implement "
                             f"{', '.join(missing)}, which the codec contract requires")
        table[codec_id] = cls
        target = cls
    return target


def parse_codec_spec(spec: str) -> dict[str, Any]:
    """``"turbo3"``, ``"turbo3:center=true,seed=7"`` or a JSON object → a config dict."""
    spec = spec.strip()
    if spec.startswith("{"):
        from kvtool.errors import FormatError
        from kvtool.formats.container import parse_json  # strict: no duplicate keys, no NaN

        try:
            config = parse_json(spec, "codec config")
        except FormatError as e:
            raise CodecError(str(e)) from None
        if not isinstance(config, dict) or "id" not in config:
            raise CodecError("codec config JSON must be an object with an 'id'")
        return config
    codec_id, _, rest = spec.partition(":")
    config: dict[str, Any] = {"id": codec_id}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise CodecError(f"codec option {item!r} must be key=value")
        if key.strip() in config:  # the codec's id, or an option given twice
            raise CodecError(f"codec option {key.strip()!r} is given twice in {spec!r}")
        try:
            config[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            config[key.strip()] = value.strip()
    return config


def get_codec(spec: str | dict[str, Any] | Codec, **params: Any) -> Codec:
    """The codec for an id, a spec string, a config dict (as from ``get_config()``) or a codec."""
    if isinstance(spec, Codec):
        return spec
    if not isinstance(spec, str | dict):
        raise CodecError(f"a codec is an id or spec string, a config dict or a Codec, not "
                         f"{type(spec).__name__} {str(spec)[:40]!r}")
    config = parse_codec_spec(spec) if isinstance(spec, str) else dict(spec)
    config.update(params)
    codec_id = config.pop("id", None)
    if not isinstance(codec_id, str):
        raise CodecError("codec config needs a string 'id'")
    cls = _resolve(codec_id)
    version = config.pop("codec_version", cls.codec_version)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CodecError(f"codec {codec_id!r}: codec_version must be a positive integer, "
                         f"got {version!r}")
    if version > cls.codec_version:
        raise CodecVersionError(f"codec {codec_id!r} version {version} is newer than this "
                                f"kvtool supports ({cls.codec_version}); upgrade kvtool")
    _check_option_names(cls, codec_id, config)
    if version < cls.codec_version:  # by that version's rules, or not at all (format.md §7)
        if "codec_version" not in codec_options(cls):
            raise UnknownCodecError(  # as a missing codec: the file is fine, others read it
                f"codec {codec_id!r} version {version} is not installed: the installed codec "
                f"implements version {cls.codec_version} only; read it with the kvtool or "
                f"plugin release that wrote it")
        config["codec_version"] = version
    try:
        return cls(**config)
    except TypeError as e:
        raise CodecError(f"invalid options for codec {codec_id!r}: {e}") from e


def codec_for_role(spec: str | dict[str, Any] | Codec, role: str) -> Codec:
    """:func:`get_codec` shaped for ``role`` (:meth:`Codec.for_role`: KIVI's keys per channel,
    values per token), keeping every option that ``spec`` names: ``kivi2:axis=token`` for keys
    stays per token. A Codec given as it is takes the role's shape."""
    codec = get_codec(spec)
    shaped = codec.for_role(role)
    if shaped is codec or isinstance(spec, Codec):
        return shaped
    config = parse_codec_spec(spec) if isinstance(spec, str) else dict(spec)
    given = {k: v for k, v in config.items() if k not in ("id", "codec_version")}
    return get_codec({**shaped.get_config(), **given}) if given else shaped


def codec_options(cls: type[Codec]) -> dict[str, Any]:
    """The options a codec class takes, with their defaults (``inspect.Parameter.empty``: none)."""
    import inspect

    if cls.__init__ is object.__init__:
        return {}
    params = inspect.signature(cls.__init__).parameters
    return {name: p.default for name, p in params.items() if name != "self"
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def option_table(codec_id: str) -> list[dict[str, Any]]:
    """``[{"name", "type", "default"}]`` for each option of a codec (``kvtool codecs --options``).

    ``type`` is the constructor's annotation as written (``"int"``, ``"bool"``, ``"str | None"``);
    ``default`` is JSON-ready (``None`` for none); ``required`` says the option has no default.
    A plugin whose constructor takes ``**options`` lists ``{"name": "**options"}``.
    """
    import inspect

    cls = _resolve(codec_id)
    if cls.__init__ is object.__init__:
        return []
    rows = []
    for name, p in inspect.signature(cls.__init__).parameters.items():
        if name == "self":
            continue
        if p.kind == p.VAR_KEYWORD:
            rows.append({"name": f"**{name}", "type": "any", "default": None, "required": False})
            continue
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            continue
        ann = p.annotation
        kind = "any" if ann is p.empty else ann if isinstance(ann, str) else \
            getattr(ann, "__name__", str(ann))
        required = p.default is p.empty
        rows.append({"name": name, "type": kind, "default": None if required else p.default,
                     "required": required})
    return rows


def _check_option_names(cls: type[Codec], codec_id: str, config: dict[str, Any]) -> None:
    """Unknown option names are an error that names the options the codec does take."""
    import inspect

    if cls.__init__ is not object.__init__ and any(
            p.kind == p.VAR_KEYWORD for p in inspect.signature(cls.__init__).parameters.values()):
        return  # a plugin that takes **options validates them itself
    known = codec_options(cls)
    for name in config:
        if name not in known:
            hint = did_you_mean(str(name), known)
            takes = ", ".join(known) or "no options"
            raise CodecError(f"codec {codec_id!r} has no option {str(name)[:40]!r}{hint} "
                             f"(it takes: {takes})")


def list_codecs() -> list[str]:
    """Every registered codec id (built-ins and plugins), sorted."""
    return sorted(_load_table())
