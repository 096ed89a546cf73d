"""Attention sinks found by norm, for ``sink=auto`` policies (:meth:`CodecPolicy.resolve`).

A sink token's key and value vectors stand apart from the rest in norm: on SmolLM2 the first
token's keys are ~0.3x and its values ~0.25x the median norm of their head, in most layers.
Such tokens carry attention mass out of proportion to their size, so a relative error on them
costs more than elsewhere. :func:`detect_sinks` flags, among the first ``scan`` tokens, those
whose norm differs from the head's median by more than :data:`SINK_RATIO` (either way) in at
least half of the layers, and returns how many leading tokens to keep exact: the prefix up to the
last flagged one (sinks are kept as a prefix, the segment layout every reader knows).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvtool.kernels import to_torch

SINK_RATIO = 2.0  # norm / median beyond this factor (or below its inverse) flags a token


def sink_flags(x: Any, scan: int) -> torch.Tensor:
    """Per leading token (``scan`` of them) of one layer's keys or values: whether some head's
    vector norm differs from that head's median norm by more than :data:`SINK_RATIO`."""
    x = to_torch(x).float()
    x = x.reshape(-1, *x.shape[-2:])  # [heads, tokens, dim]
    norms = x.norm(dim=-1)
    med = norms.median(dim=-1, keepdim=True).values.clamp_min(1e-30)
    dev = (norms[:, :scan] / med).clamp_min(1e-30).log().abs()
    return (dev > math.log(SINK_RATIO)).any(0)


def detect_sinks(cache: Any, scan: int, share: float = 0.5) -> int:
    """How many leading tokens of ``cache`` (``.keys``/``.values`` per layer, or an iterable of
    a layer's (keys, values) at a time: one pass, a layer held at once) to keep exact."""
    if scan <= 0:
        return 0
    layers = zip(cache.keys, cache.values, strict=True) if hasattr(cache, "keys") else cache
    seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (tokens, key, value flags)
    for k, v in layers:
        tokens = int(to_torch(k).shape[-2])
        if tokens:
            n = min(scan, tokens)
            seen.append((tokens, sink_flags(k, n), sink_flags(v, n)))
    if not seen:
        return 0
    tokens = max(t for t, _, _ in seen)
    # sliding-window layers that dropped the first tokens say nothing about them
    full = [(kf, vf) for t, kf, vf in seen if t == tokens]
    score = torch.maximum(torch.stack([kf for kf, _ in full]).float().mean(0),
                          torch.stack([vf for _, vf in full]).float().mean(0))
    flagged = torch.nonzero(score >= share).flatten()
    return int(flagged.max()) + 1 if len(flagged) else 0
