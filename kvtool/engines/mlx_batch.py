"""Batched generation (mlx-lm's ``BatchGenerator``) on compressed mlx cache layers.

mlx-lm batches requests by merging each layer's per-request caches into one left-padded batch
cache (``cache.merge``), runs every forward on it, and extracts a request's row again when the
request ends (``extract``). :class:`KvtoolBatchCache` is that batch cache for compressed layers.
It keeps every row compressed: a row *is* the request's own ``KvtoolMLXCache``, which holds
only the row's real tokens (never padding), encodes them as they leave its recent window and
decodes them when attention needs them. So a batched request holds and attends to what it would
alone (``update_and_fetch`` of a single cache), and the batch's resident memory is the rows'
codes, not an exact ``[batch, heads, tokens, dim]`` buffer.

The batch layout is mlx-lm's ``BatchKVCache``'s (its ``left_padding``, ``offset`` and column
count ``_idx``, and its mask), kept as host integers and rebuilt at each forward from the
rows::

    row i:  [ left padding (zeros) | its tokens, decoded | right padding (zeros) | this forward ]

Padding columns hold zeros: the mask hides left padding, and right padding (a prefill of prompts
of unequal length, before ``finalize``) lies after every real token of its row. Sliding-window
layers stay mlx-lm's own ``RotatingKVCache`` and batch as they do in mlx-lm.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

log = logging.getLogger("kvtool.mlx_batch")


class KvtoolBatchCache(mlx_cache._BaseCache):
    """One layer of a batch of ``KvtoolMLXCache`` rows, laid out as mlx-lm's ``BatchKVCache``
    (module docstring)."""

    def __init__(self, rows: list[Any], left_padding: list[int]):
        self.rows = list(rows)
        self._pad = [int(p) for p in left_padding]
        self._idx = max((p + r.offset for p, r in zip(self._pad, self.rows, strict=True)),
                        default=0)
        self._pending: list[int] | None = None  # real tokens still to come in a padded prefill
        self._right_padding: list[int] | None = None

    @property
    def left_padding(self) -> mx.array:
        return mx.array(self._pad, dtype=mx.int32)

    @property
    def offset(self) -> mx.array:
        """Per row, the columns after its left padding (the positions RoPE starts from)."""
        return mx.array([self._idx - p for p in self._pad], dtype=mx.int32)

    @classmethod
    def merge(cls, caches: list[Any]) -> KvtoolBatchCache:
        """A batch of ``caches`` (``KvtoolMLXCache`` layers, now its rows), right-aligned."""
        if len(caches) > 1:
            log.debug("kvtool: %d requests batched (one layer)", len(caches))
        longest = max((c.offset for c in caches), default=0)
        return cls(caches, [longest - c.offset for c in caches])

    # -- the forward -----------------------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Give each row its real tokens of ``keys``/``values`` ``[B, heads, new, dim]``;
        return the batch's states ``[B, heads, columns, dim]``: the rows' tokens as each row's
        own ``update_and_fetch`` returns them, padded to mlx-lm's layout."""
        new = keys.shape[2]
        out_k, out_v = [], []
        for i, (row, pad) in enumerate(zip(self.rows, self._pad, strict=True)):
            skip = min(max(0, pad - self._idx), new)  # left padding in this forward's columns
            shown = min(pad, self._idx)  # left padding in earlier forwards' columns
            real = new - skip
            if self._pending is not None:
                real = min(real, self._pending[i])
                self._pending[i] -= real
            held = row.offset
            if real:
                k, v = row.update_and_fetch(keys[i:i + 1, :, skip:skip + real],
                                            values[i:i + 1, :, skip:skip + real])
                k, v = k[..., :held, :], v[..., :held, :]  # this forward's go in exact, below
            else:
                k, v = row.materialize()
            gap = self._idx - shown - held  # right padding of earlier forwards
            out_k.append(_row(k, shown, gap, keys[i:i + 1]))
            out_v.append(_row(v, shown, gap, values[i:i + 1]))
        self._idx += new
        return mx.concatenate(out_k), mx.concatenate(out_v)

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        return mlx_cache.create_causal_mask(N, offset=self._idx, left_padding=self.left_padding,
                                            **kwargs)

    def prepare(self, *, left_padding: list[int] | None = None, lengths: list[int] | None = None,
                right_padding: list[int] | None = None) -> None:
        """mlx-lm's prefill of prompts of unequal length: ``left_padding`` before anything is
        held; or ``lengths`` real tokens per row, each followed by ``right_padding``."""
        if left_padding is not None:
            if self._idx:
                raise ValueError("left padding can only be added to an empty batch cache")
            self._pad = [p + int(x) for p, x in zip(self._pad, left_padding, strict=True)]
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = list(right_padding)
            self._pending = list(lengths) if lengths is not None else [
                max(right_padding) - p for p in right_padding]

    def finalize(self) -> None:
        """After a padded prefill: the right padding becomes left padding (rows hold none)."""
        if self._right_padding is not None:
            self._pad = [p + r for p, r in zip(self._pad, self._right_padding, strict=True)]
            self._right_padding = self._pending = None

    # -- the batch's rows ------------------------------------------------------------------------
    def filter(self, batch_indices: Any) -> None:
        """Keep the rows ``batch_indices``, dropping the left padding all of them share."""
        keep = [int(i) for i in (batch_indices.tolist() if hasattr(batch_indices, "tolist")
                                 else batch_indices)]
        self.rows = [self.rows[i] for i in keep]
        if self._pending is not None:  # mid-prefill (mlx-lm filters between prefills only)
            self._pending = [self._pending[i] for i in keep]
            self._right_padding = [self._right_padding[i] for i in keep]
        shift = min((self._pad[i] for i in keep), default=0)
        self._pad = [self._pad[i] - shift for i in keep]
        self._idx -= shift

    def extend(self, other: KvtoolBatchCache) -> None:
        """Append ``other``'s rows, both right-aligned to the longer one's columns."""
        if not isinstance(other, KvtoolBatchCache):
            raise TypeError(f"a kvtool batch cache extends with another, not "
                            f"{type(other).__name__}")
        if self.rows and other.rows:
            log.debug("kvtool: %d requests join a batch of %d (one layer)", len(other.rows),
                      len(self.rows))
        columns = max(self._idx, other._idx)
        self._pad = [p + columns - self._idx for p in self._pad] + [
            p + columns - other._idx for p in other._pad]
        self.rows.extend(other.rows)
        self._idx = columns

    def extract(self, idx: int) -> Any:
        """Row ``idx``: a copy of its ``KvtoolMLXCache`` (its codes as they are, never
        re-encoded)."""
        return copy.deepcopy(self.rows[idx])

    # -- the cache protocol ------------------------------------------------------------------
    @property
    def state(self) -> list[Any]:
        """What ``mx.eval`` forces after a prefill step: the rows' arrays."""
        return [row.state for row in self.rows]

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` columns: each row's last ``n`` tokens."""
        n = min(self._idx, n)
        for row in self.rows:
            row.trim(n)
        self._idx -= n
        return n

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return all(row.empty() for row in self.rows)

    @property
    def nbytes(self) -> int:
        """Resident bytes: the rows' (codes, exact sinks and windows)."""
        return sum(row.nbytes for row in self.rows)


def _row(held: mx.array | None, pad: int, gap: int, new: mx.array) -> mx.array:
    """One row of the batch's states: ``pad`` zero columns, the ``held`` tokens, ``gap`` zero
    columns, then this forward's ``new`` ones ``[1, heads, new, dim]``."""
    shape = (1, new.shape[1], 0, new.shape[3])
    parts = [mx.zeros(shape[:2] + (pad,) + shape[3:], new.dtype) if pad else None, held,
             mx.zeros(shape[:2] + (gap,) + shape[3:], new.dtype) if gap else None, new]
    return mx.concatenate([p for p in parts if p is not None], axis=2)


__all__ = ["KvtoolBatchCache"]
