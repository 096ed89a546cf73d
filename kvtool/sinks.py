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


def sink_scores(arrays: list[Any], scan: int) -> torch.Tensor:
    """Per leading token (``scan`` of them): the share of layers in which some head's vector
    norm differs from that head's median norm by more than :data:`SINK_RATIO`."""
    flags = []
    for a in arrays:
        x = to_torch(a).float()
        x = x.reshape(-1, *x.shape[-2:])  # [heads, tokens, dim]
        norms = x.norm(dim=-1)
        med = norms.median(dim=-1, keepdim=True).values.clamp_min(1e-30)
        dev = (norms[:, :scan] / med).clamp_min(1e-30).log().abs()
        flags.append((dev > math.log(SINK_RATIO)).any(0))
    return torch.stack(flags).float().mean(0)


def detect_sinks(cache: Any, scan: int, share: float = 0.5) -> int:
    """How many leading tokens of ``cache`` (``.keys``/``.values`` per layer) to keep exact."""
    if scan <= 0 or not cache.keys:
        return 0
    tokens = max(to_torch(k).shape[-2] for k in cache.keys)
    scan = min(scan, tokens)
    # sliding-window layers that dropped the first tokens say nothing about them
    full = [i for i, k in enumerate(cache.keys) if to_torch(k).shape[-2] == tokens]
    score = torch.maximum(sink_scores([cache.keys[i] for i in full], scan),
                          sink_scores([cache.values[i] for i in full], scan))
    flagged = torch.nonzero(score >= share).flatten()
    return int(flagged.max()) + 1 if len(flagged) else 0
