"""Parse the short policy labels the benchmarks take (the format ``CodecPolicy.describe`` prints).

``turbo3``, ``k=turbo4 v=turbo3``, ``k=turbo3:center=true v=turbo3 sink=8 protect=1 recent=128``.
"""

from __future__ import annotations

from kvtool.policy import CodecPolicy

_NAMES = {"k": "key_codec", "v": "value_codec", "protect": "protect_layers",
          "sink": "sink_tokens", "recent": "recent_tokens"}


def parse_policy(label: str, **defaults: int) -> CodecPolicy:
    """A policy from a label; ``defaults`` (e.g. ``recent_tokens=128``) fill what it omits."""
    opts: dict = dict(defaults)
    for part in label.split():
        key, sep, value = part.partition("=")
        if not sep or key not in _NAMES:
            opts["codec"] = part
        else:
            name = _NAMES[key]
            opts[name] = int(value) if name.endswith(("layers", "tokens")) else value
    return CodecPolicy.from_options(**opts)
