"""Strict validation of codec options: wrong types and out-of-range values are a CodecError.

Options arrive from JSON files and command lines, so ``True`` is not an integer, ``"maybe"`` is
not a boolean and ``1`` is not ``true``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtool.errors import CodecError


def check_bool(who: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise CodecError(f"{who}: {name} must be true or false, got {value!r}")
    return value


def check_int(who: str, name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise CodecError(f"{who}: {name} must be an integer in [{low}, {high}], got {value!r}")
    return value


def check_choice(who: str, name: str, value: Any, choices: Sequence[Any]) -> Any:
    if not any(type(value) is type(c) and value == c for c in choices):
        from kvtool.errors import did_you_mean

        shown = ", ".join("null" if c is None else str(c) for c in choices)
        hint = did_you_mean(value, choices)
        raise CodecError(f"{who}: {name} must be one of {shown}, got {value!r}{hint}")
    return value


SEED_MAX = 2**63 - 1
GROUP_MAX = 1 << 20


def is_digits(text: str) -> bool:
    """Whether ``text`` is ASCII decimal digits: what ``int`` reads as a count or index
    (``str.isdigit`` also takes "²", which ``int`` refuses)."""
    return text.isascii() and text.isdigit()
