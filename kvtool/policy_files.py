"""Policy files: a :class:`~kvtool.policy.CodecPolicy` as JSON on disk (``kvtool calibrate``
writes them; ``--policy FILE``, the servers and :func:`~kvtool.presets.preset_policy` read
them), refused when misspelt or calibrated for a model of another KV layout."""

from __future__ import annotations

import json
import os
from typing import Any

from kvtool.errors import CodecError, FormatError, did_you_mean
from kvtool.policy import LABEL_KEYS, CodecPolicy

MAX_POLICY_BYTES = 4 << 20  # a policy file is a few KB; refuse anything absurd unread


def load_policy(path: str | os.PathLike, model_fingerprint: str | None = None) -> CodecPolicy:
    """The policy in a JSON file (:func:`save_policy`, ``kvtool calibrate``); keys other than
    the policy's (e.g. ``calibration``) are ignored, but with ``model_fingerprint`` a file
    ``kvtool calibrate`` made for a model of another KV layout is refused (its per-layer choices
    were measured there: :class:`~kvtool.errors.ModelMismatchError`)."""
    try:
        if os.path.getsize(path) > MAX_POLICY_BYTES:
            raise CodecError(f"{os.fspath(path)}: too large for a policy file")
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CodecError(f"cannot read policy file {os.fspath(path)}: "
                         f"{e.strerror or e}") from None
    from kvtool.formats.container import parse_json

    try:  # strict: a key given twice would be read as its last value, silently
        data = parse_json(raw, "policy file")
    except FormatError as e:
        raise CodecError(f"{os.fspath(path)}: not a JSON policy file ({str(e)[:120]})") from None
    if isinstance(data, dict):  # a misspelt key would be ignored: no sinks, silently
        known = ("key", "value", "lossless", "protect_layers", "sink_tokens", "recent_tokens",
                 "auto_sinks", "layers", "num_layers")
        for name in data:
            hint = did_you_mean(name, known) if name not in known else ""
            if name in LABEL_KEYS:  # a label's spelling: sink=4 is sink_tokens here
                hint = f"; in a policy file it is {LABEL_KEYS[name].removesuffix('_codec')!r}"
            if hint:
                raise CodecError(f"{os.fspath(path)}: unknown policy key {name!r}{hint}")
    try:
        policy = CodecPolicy.from_json(data)
    except CodecError as e:
        raise CodecError(f"{os.fspath(path)}: {e}") from None
    made_for = _calibrated_for(data)
    if model_fingerprint and made_for and made_for[1] != model_fingerprint:
        from kvtool.errors import ModelMismatchError

        raise ModelMismatchError(f"{os.fspath(path)} was calibrated for {made_for[0]}, whose KV "
                                 "layout differs from this model's: run kvtool calibrate on "
                                 "this model")
    return policy


def _calibrated_for(data: Any) -> tuple[str, str, str | None] | None:
    """(model name, fingerprint, weights or None) that ``kvtool calibrate`` recorded in a
    policy file, if any: under ``calibration`` (a per-layer fit) or ``preset_fit`` (a fitted
    preset)."""
    for section in ("calibration", "preset_fit"):
        record = data.get(section) if isinstance(data, dict) else None
        if isinstance(record, dict) and isinstance(record.get("fingerprint"), str) \
                and record["fingerprint"]:
            weights = record.get("weights")
            return (str(record.get("model") or "another model")[:80], record["fingerprint"],
                    weights if isinstance(weights, str) and weights else None)
    return None


def calibrated_weights(path: str | os.PathLike) -> tuple[str, str] | None:
    """(model name, weights fingerprint) a policy file was calibrated on, where recorded."""
    from kvtool.formats.container import parse_json

    try:
        with open(path, "rb") as f:
            made_for = _calibrated_for(parse_json(f.read(MAX_POLICY_BYTES), "policy file"))
    except (OSError, FormatError):
        return None
    return (made_for[0], made_for[2]) if made_for and made_for[2] else None


def save_policy(policy: CodecPolicy, path: str | os.PathLike,
                extra: dict[str, Any] | None = None) -> None:
    """Write ``policy`` (plus ``extra`` keys, which readers ignore) as JSON, atomically."""
    from kvtool.fileio import atomic_write

    text = json.dumps({**(extra or {}), **policy.to_json()}, indent=1, sort_keys=True) + "\n"
    data = text.encode("utf-8")
    atomic_write(path, lambda f: f.write(data) or len(data))
