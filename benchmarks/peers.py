"""Peer schemes the benchmarks compare kvtool against, in one place.

- :class:`ManthanQuant`: the ManthanQuant scheme (per-vector norm, ×√D, 8-level Gaussian
  Lloyd–Max, no rotation, 3-bit pack), in plain numpy — ``benchmarks/codecs.py``'s peer row;
- :func:`peer_cache`: a transformers ``Cache`` for a peer — ``QuantizedCache`` (quanto, or hqq
  with its recommended axis 1; group 64, 128 exact recent tokens) or ManthanQuant on every past
  token (:func:`round_trip_cache`) — for ``benchmarks/quality.py``'s peer rows.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np

from kvtool.codecs.lloyd_max import lloyd_max
from kvtool.identity import kv_layout
from kvtool.kernels import bitpack, numpy_ops

# (backend, bits) of every peer row benchmarks/quality.py measures where the backend is installed
QUALITY_PEERS = [("quanto", 4), ("quanto", 2), ("hqq", 4), ("hqq", 3), ("hqq", 2),
                 ("manthanquant", 3)]
_MODULES = {"quanto": "optimum.quanto", "hqq": "hqq"}


class ManthanQuant:
    """Peer scheme: per-vector norm, ×√D, 8-level Gaussian Lloyd–Max, no rotation, 3-bit pack."""

    bits = 3

    @staticmethod
    @cache
    def codebook():
        t = np.linspace(-8, 8, 1 << 18)
        return lloyd_max(t, np.exp(-t * t / 2), 8)

    def encode(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = x.astype(np.float32)
        norms = np.sqrt(np.einsum("nd,nd->n", x, x))[:, None]
        u = x * (np.sqrt(x.shape[-1]) / np.where(norms > 0, norms, 1))
        codes = numpy_ops.bucketize(u, self.codebook().boundaries)
        return bitpack.pack_bits(numpy_ops, codes, self.bits), norms.astype(np.float16)

    def decode(self, enc: tuple[np.ndarray, np.ndarray], dim: int) -> np.ndarray:
        codes, norms = enc
        y = bitpack.unpack_lookup(numpy_ops, codes, self.bits, dim, self.codebook().centroids)
        return (y * (norms.astype(np.float32) / np.sqrt(dim))).astype(np.float16)

    def round_trip(self, x: Any) -> Any:
        """A torch tensor [..., D] encoded and decoded, same shape and dtype."""
        import torch

        flat = x.detach().reshape(-1, x.shape[-1]).float().numpy()
        out = self.decode(self.encode(flat), x.shape[-1])
        return torch.from_numpy(out.astype(np.float32)).reshape(x.shape).to(x.dtype)

    def bits_per_element(self, dim: int) -> float:
        return self.bits + 16 / dim  # the fp16 norm


def _round_trip_layer(fn: Callable[[Any], Any]) -> Any:
    from transformers.cache_utils import DynamicLayer

    class RoundTripLayer(DynamicLayer):
        """Keeps past K/V as ``fn`` returns them; a forward attends to its own K/V exactly."""

        def update(self, key_states, value_states, *args, **kwargs):
            import torch

            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            keys = torch.cat([self.keys, key_states], dim=-2)
            values = torch.cat([self.values, value_states], dim=-2)
            self.keys = torch.cat([self.keys, fn(key_states)], dim=-2)
            self.values = torch.cat([self.values, fn(value_states)], dim=-2)
            return keys, values

    return RoundTripLayer()


def round_trip_cache(config: Any, fn: Callable[[Any], Any]) -> Any:
    """A transformers ``Cache`` whose past keys and values went through ``fn`` (e.g. a peer's
    encode→decode) — what kvtool's ``CompressedCache`` does with a codec, for peers that are not
    kvtool codecs."""
    from transformers.cache_utils import Cache

    layers = config.get_text_config(decoder=True).num_hidden_layers
    return Cache(layers=[_round_trip_layer(fn) for _ in range(layers)])


def peer_available(backend: str) -> bool:
    module = _MODULES.get(backend)
    return module is None or importlib.util.find_spec(module) is not None


def peer_label(backend: str, nbits: int) -> str:
    """The row label of a peer in benchmarks/quality.py's tables and plot."""
    if backend == "manthanquant":
        return "peer: ManthanQuant scheme (norm, Lloyd–Max, no rotation)"
    return f"peer: {backend}-{nbits} QuantizedCache"


def peer_cache(config: Any, backend: str, nbits: int) -> tuple[Any, float]:
    """(a fresh transformers ``Cache`` for the peer, its bits/element)."""
    if backend == "manthanquant":
        peer = ManthanQuant()
        if nbits != peer.bits:
            raise ValueError(f"manthanquant is {peer.bits}-bit only")
        dim = kv_layout(config)["head_dim"]
        return round_trip_cache(config, peer.round_trip), peer.bits_per_element(dim)
    from transformers import QuantizedCache

    axis = 1 if backend == "hqq" else 0  # hqq's README: "start with ... group_size=64, axis=1"
    past = QuantizedCache(backend=backend, config=config, nbits=nbits, axis_key=axis,
                          axis_value=axis, q_group_size=64, residual_length=128)
    return past, nbits + 32 / 64  # fp16 scale and zero per group of 64
