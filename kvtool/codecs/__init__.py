"""Codecs: the contract (:mod:`.abc`), the registry (:mod:`.registry`), one module per family."""

from kvtool.codecs.abc import Codec, Encoded
from kvtool.codecs.registry import (
    ENTRY_POINT_GROUP,
    codec_for_role,
    get_codec,
    list_codecs,
    parse_codec_spec,
    register_codec,
    reset_registry,
)

__all__ = [
    "Codec",
    "Encoded",
    "ENTRY_POINT_GROUP",
    "codec_for_role",
    "get_codec",
    "list_codecs",
    "parse_codec_spec",
    "register_codec",
    "reset_registry",
]
