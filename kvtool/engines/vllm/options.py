"""The connector's options (``kv_connector_extra_config``), checked by name and type.

A user may pass them to ``vllm serve --kv-transfer-config`` directly, so every value is checked
before the connector reads it: an unknown name is refused (a typo would be ignored), and so is
a value of the wrong JSON type. A string where a list belongs would be read character by
character (``"kvz_dirs": "/srv"`` would allow ``/``), ``"false"`` where a boolean belongs would
mean true, and a misspelt ``save_mode`` would quietly fall back to the default. A ``null``
value is the option left out. Sizes, durations and ``store_timeout`` are checked where they are
parsed (:func:`~kvtool.engines.vllm.common.budget_options`,
:func:`~kvtool.engines.vllm.common.store_timeout`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from kvtool.errors import KvtoolError, did_you_mean
from kvtool.policy import MAX_COUNT, is_count

MAX_CHUNK_TOKENS = 1 << 20  # a chunk longer than any context: nothing would ever be stored
MAX_STATS_INTERVAL = 86400.0  # seconds


def _text(value: Any) -> bool:
    return isinstance(value, str) and value.strip() != ""


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _paths(value: Any) -> bool:
    return isinstance(value, list) and all(_text(v) for v in value)


def _one_of(*choices: str) -> tuple[Callable[[Any], bool], str]:
    return (lambda value: value in choices), " or ".join(f'"{c}"' for c in choices)


_BOOL = (lambda value: isinstance(value, bool)), "true or false"
_TEXT = _text, "a non-empty string"
_COUNT = is_count, f"an integer from 0 to {MAX_COUNT}"
_CODEC = (lambda value: _text(value) or isinstance(value, dict)), \
    "a codec (an id, id:opt=val,... or a JSON object)"
_SECONDS = (lambda value: not isinstance(value, (bool, str)),
            "a number of seconds")  # parsed by store_timeout

#: every ``kv_connector_extra_config`` key the connector reads, with its check and what it takes
OPTION_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "store_path": (_text, "a directory or an s3:// URL"),
    "storage_options": ((lambda value: isinstance(value, dict)), "a JSON object"),
    "model_name": _TEXT,
    "tokenizer_fingerprint": _TEXT,
    "chunk_tokens": ((lambda value: _count(value) and 1 <= value <= MAX_CHUNK_TOKENS),
                     f"a whole number of tokens in 1..{MAX_CHUNK_TOKENS}"),
    "preset": (_text, "a preset name or a policy file"),
    "codec": _CODEC, "key_codec": _CODEC, "value_codec": _CODEC,
    "protect_layers": _COUNT, "sink_tokens": _COUNT, "recent_tokens": _COUNT,
    "zstd": ((lambda value: isinstance(value, bool) or (_count(value) and 1 <= value <= 22)),
             "true, false or a level in 1..22"),
    "entropy": _BOOL, "load": _BOOL, "save": _BOOL, "capture_all": _BOOL,
    "save_mode": _one_of("async", "sync"),
    "on_load_error": _one_of("recompute", "fail"),
    "kvz_files": (_paths, "a list of paths"),
    "kvz_dirs": (_paths, "a list of directories"),
    "capture_dir": (_text, "a directory"),
    "stats_interval": ((lambda value: isinstance(value, (int, float))
                        and not isinstance(value, bool) and math.isfinite(value)
                        and 0 <= value <= MAX_STATS_INTERVAL),
                       f"seconds in [0, {MAX_STATS_INTERVAL:g}] (0: no stats files)"),
    "store_timeout": _SECONDS,
    "max_bytes": (lambda value: _text(value) or _count(value), "a size (2GB, 500MB or bytes)"),
    "quarantine_max_bytes": (lambda value: _text(value) or _count(value),
                             "a size (1GB, 500MB or bytes)"),
    "quarantine_max_age": (lambda value: _text(value), "a duration (7d, 12h)"),
}
CONNECTOR_OPTIONS = frozenset(OPTION_KINDS)


def check_extra(extra: dict[str, Any]) -> dict[str, Any]:
    """The connector options without their ``null`` values; a one-line :class:`KvtoolError`
    for an option kvtool does not read or a value of the wrong type."""
    if not isinstance(extra, dict):
        raise KvtoolError("kv_connector_extra_config must be a JSON object")
    for key in sorted(set(extra) - CONNECTOR_OPTIONS, key=str):
        raise KvtoolError(f"kv_connector_extra_config: unknown kvtool option {str(key)[:40]!r}"
                          f"{did_you_mean(key, CONNECTOR_OPTIONS)} (it takes: "
                          f"{', '.join(sorted(CONNECTOR_OPTIONS))})")
    given = {k: v for k, v in extra.items() if v is not None}
    for key, value in given.items():
        check, wanted = OPTION_KINDS[key]
        if not check(value):
            raise KvtoolError(f"kv_connector_extra_config: {key} must be {wanted}, got "
                              f"{_shown(value)}")
    if "store_path" in given:
        from kvtool.engines.vllm.store_backend import check_location

        check_location(given["store_path"], "kv_connector_extra_config: store_path")
    return given


def _shown(value: Any) -> str:
    import json

    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
