"""A transformers ``Cache`` that keeps K/V compressed in memory while a model generates.

:class:`CompressedCache` follows transformers 5.x's layer-based design (like ``QuantizedCache``):
one :class:`CompressedLayer` per model layer, each holding keys and values as three parts,
decided by a :class:`~kvtool.policy.CodecPolicy`:

``[ sinks (full precision) | encoded blocks (policy codec) | recent window (full precision) ]``

New tokens land in the recent window. Once the window holds ``recent_tokens + block_size``
tokens or more, its oldest whole blocks of ``block_size`` tokens are encoded (one ``encode`` call
for all of them) and appended to the encoded store, so at least ``recent_tokens`` (and fewer than
``recent_tokens + block_size``) of the latest tokens always stay exact. Protected layers (and a
policy whose codec is the lossless one) never encode: they behave like ``DynamicLayer``.

Sliding-window layers (Gemma 3: ``layer_types``/``sliding_window`` in the config) keep no sinks
and let go of whole blocks once they fall out of the window, so they hold fewer than
``sliding_window + block_size`` tokens; the mask (``get_mask_sizes``' offset) hides the older
tokens of a partly visible block. Their attention always decodes, then attends. While
transformers' assisted decoding records the past (``activate_past_recording``), they let go at
its crops instead, so a rejected draft never takes the window's oldest tokens with it.

Memory/speed trade-off: **no decoded copy is kept**; the resident footprint is the encoded
bytes plus the full-precision sinks and window (:meth:`CompressedCache.nbytes`). A decoded copy
would hold *more* memory than ``DynamicCache`` (copy + codes), and any lower-precision copy
(fp8, unpacked 8-bit codes) costs more bits than the whole turbo3 store it would speed up.

Attention from codes (the default for turbo codecs on CPU and CUDA). Decoding the whole store at
every step is O(context) work per layer — for turbo mostly the inverse rotation, a ``head_dim``²
matmul per token — and about halves decode speed at 2K tokens. Instead, attention reads the
encoded tokens straight from their packed codes (on the CPU
:mod:`kvtool.kernels.numba_attention`, on CUDA :mod:`kvtool.kernels.triton_attention`): a
query is rotated once, each score is its dot product with the centroids of a code row, values
are summed in the rotated domain and rotated back once per query row; exact tokens (sinks,
window, this forward's tokens) join the same softmax. No K̂/V̂ is materialised, and a step
reads ~8× fewer bytes than ``DynamicCache``'s attention: on the default model with one CPU thread
(``benchmarks/runtime_cache.py``) decoding at 4K tokens runs at ~1.2× ``DynamicCache``'s speed
(~1.0× at 1K), against ~0.5× when the store is decoded first.

The hook (:mod:`kvtool.engines.hf_attention`): creating a cache registers transformers attention
function ``"kvtool"`` and puts it in place of ``"sdpa"`` (it forwards every call that does not
come from this cache to the original sdpa, so other models and caches are unaffected). Each
model forward first prepares its masks, which calls :meth:`CompressedCache.get_mask_sizes`; that
arms every layer's next ``update`` to return only the exact tokens, the key tensor tagged (a
:class:`~kvtool.engines.hf_attention.CodesTag`) with the
:class:`~kvtool.engines.hf_attention.CodesView` of the layer's encoded chunks (one per change of
the store), which the attention function reads. The decode-then-attend path (every token's
states decoded and returned, any attention) is used instead when:
``attention_from_codes=False``; ``KVTOOL_KERNELS=reference``; numba (CPU) or Triton (CUDA) is
missing; the model's attention implementation is not routed
through the hook (eager, flash, a model's own override: Falcon calls torch's sdpa itself), a
layer attends again to another's states (Gemma 3n's shared K/V), or the cache has no
``config``; a layer's
codecs are not read from codes (:func:`~kvtool.engines.hf_attention.codes_codec`; on CUDA
:func:`~kvtool.engines.hf_attention.device_codes`); head_dim is not a power of two ≥ 8 (CUDA:
16..256); tensors are neither on the CPU nor on CUDA; or ``update`` is called directly, outside a
model forward. At attention time the function still decodes the view and runs sdpa on the full
K/V for forwards of many query tokens (prefill chunks: one decode serves all their queries and
BLAS attention is faster there) and when the call asks for something the kernel does not do: a
mask that hides encoded tokens (padding inside them, sliding windows) or differs per head,
``output_attentions``, dropout, soft-capping, learned sinks, position biases, gradients.

Blocks are not kept as one ``Encoded`` per block (one decode or kernel call per block per step
would be dominated by per-call overhead): they are encoded as ``[batch, heads, n_blocks, block,
dim]`` and consecutive encodings are concatenated along the block axis, so each layer holds a
short list of :class:`~kvtool.codecs.Encoded` chunks (normally one, which the attention kernel
reads in place through zero-copy numpy views). When keys and values share a codec they are
stacked and encoded/decoded together, so a step costs one decode or kernel call per layer.

Tokens of the current forward are returned exactly (they attend to themselves uncompressed, as
with ``QuantizedCache``); they are compressed for the steps that follow.

On CUDA an encode never stalls the host: its input check (NaN/Inf, a norm past fp16's range)
is read back asynchronously (:mod:`kvtool.kernels.device_checks`) and a failure raises
:class:`~kvtool.errors.CodecError` at the layer's next update, a step later; ``from_kvcache`` and
``materialize`` wait for the checks. On the CPU the encode raises at once.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from transformers.cache_utils import Cache

from kvtool.engines.hf_attention import codes_enabled, install, routes_through_kvtool
from kvtool.engines.hf_layer import DEFAULT_BLOCK_SIZE, CompressedLayer
from kvtool.errors import KvtoolError, ModelMismatchError
from kvtool.policy import CodecPolicy


def _text_config(config: Any) -> Any:
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def attention_windows(config: Any) -> list[int | None]:
    """Per layer: the window of a sliding-window attention layer, None for full attention, as
    transformers' ``DynamicCache`` lays them out (a ``sliding_window`` with no ``layer_types``:
    every layer slides, as in Mistral-7B-v0.1). A :class:`KvtoolError` for a model whose cache
    holds other layers (a hybrid model's convolution, linear-attention or state-space layers
    keep no K/V to compress or store; chunked attention is another mask)."""
    text = _text_config(config)
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None) or int(text.num_hidden_layers) * [
        "sliding_attention" if window is not None else "full_attention"]
    other = sorted(set(types) - {"full_attention", "sliding_attention"})
    if other:
        raise KvtoolError("kvtool handles full and sliding-window attention layers; this "
                          f"model ({getattr(config, 'model_type', '?')}) also has {other} "
                          "layers, which it does not")
    if "sliding_attention" in types and not (isinstance(window, int) and window >= 1):
        raise KvtoolError("the model has sliding_attention layers but no sliding_window")
    return [window if t == "sliding_attention" else None for t in types]


class CompressedCache(Cache):
    """A transformers ``Cache`` that keeps K/V compressed by ``policy`` while generating.

    ``config`` (the model's config) or ``num_layers`` tells which layers the policy protects
    and which are sliding-window layers (``sliding_windows`` per layer with ``num_layers``).
    Sinks and the recent window come from ``policy.sink_tokens``/``policy.recent_tokens``;
    ``block_size`` is the number of tokens encoded together. Use it like ``DynamicCache``::

        past = CompressedCache(CodecPolicy.from_options("turbo3", recent_tokens=128),
                               config=model.config)
        model.generate(input_ids, past_key_values=past, max_new_tokens=64)
        past.nbytes()  # resident bytes
    """

    def __init__(self, policy: CodecPolicy, config: Any = None, *, num_layers: int | None = None,
                 sliding_windows: list[int | None] | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE, attention_from_codes: bool | None = None):
        if (config is None) == (num_layers is None):
            raise KvtoolError("CompressedCache needs exactly one of config or num_layers")
        if not isinstance(policy, CodecPolicy):  # "turbo3": a codec, not a policy
            raise KvtoolError(f"CompressedCache takes a CodecPolicy, not "
                              f"{type(policy).__name__} (CodecPolicy.from_label({policy!r:.40}))")
        for name, n in (("num_layers", num_layers), ("block_size", block_size)):
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
                raise KvtoolError(f"CompressedCache: {name} must be an integer >= 1, got {n!r}")
        if config is not None:
            windows = attention_windows(config)
        else:
            windows = list(sliding_windows or [None] * int(num_layers))
            if len(windows) != num_layers:
                raise KvtoolError(f"{len(windows)} sliding windows for {num_layers} layers")
        n = len(windows)
        policy.check_runtime()
        policy = policy.resolve()  # sink=auto (no cache to count on): every scanned token exact
        self.policy, self.block_size = policy, block_size
        self.attention_from_codes = attention_from_codes
        self._armed_layers: set[int] = set()  # see get_mask_sizes
        self._codes_now: dict[torch.device, bool] = {}  # uses_codes per device, this forward
        self._text_config = None if config is None else _text_config(config)
        layers = []
        for i in range(n):
            key, value = (policy.codec_for(role, i, n) for role in ("key", "value"))
            layers.append(CompressedLayer(
                None if key == policy.lossless else key,
                None if value == policy.lossless else value,
                policy.sink_tokens, policy.recent_tokens, block_size, windows[i]))
        super().__init__(layers=layers)
        if attention_from_codes is not False and any(x.codes_capable for x in layers):
            install()
            impl = getattr(self._text_config, "_attn_implementation", None)
            if attention_from_codes is True and impl is not None \
                    and not routes_through_kvtool(self._text_config):  # None: not chosen yet
                raise KvtoolError(f"attention_from_codes=True, but this model's attention "
                                  f"({impl}) does not read kvtool's codes: leave it unset (the "
                                  "model's sdpa attention reads them) or pass False")

    def uses_codes(self, device: torch.device | str | None = None) -> bool:
        """Whether attention reads encoded tokens from their codes (for model forwards) of
        states on ``device`` (None: the CPU).

        ``attention_from_codes``: None (default) — when the model's attention implementation
        routes through kvtool's attention function (``sdpa`` or ``kvtool``, known from
        ``config``), for the updates of a model forward (see :meth:`get_mask_sizes`); True —
        for every update, also without a config (the caller guarantees that whatever reads the
        returned states is kvtool's attention); False — never (every step decodes the store,
        then attends). ``KVTOOL_KERNELS=reference`` or a missing numba (CPU) or Triton (CUDA)
        also means never.
        """
        if self.attention_from_codes is False:
            return False
        if self.attention_from_codes is None and (
                self._text_config is None or not routes_through_kvtool(self._text_config)):
            return False
        return codes_enabled(device)

    def crop(self, max_length: int) -> None:
        """Every layer's newest ``-max_length`` tokens removed (see :meth:`CompressedLayer.crop`),
        or none when a layer refuses (a sliding-window one that let go of a token the kept
        ones attend to): never some layers cropped and others not."""
        if isinstance(max_length, bool) or not isinstance(max_length, int):
            raise TypeError(f"crop takes an integer number of tokens, got {max_length!r}")
        for layer in self.layers:
            layer._to_crop(max_length)
        super().crop(max_length)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """transformers' mask preparation calls this once at the start of every forward: it arms
        each layer's next update for attention from codes (a direct ``update`` outside a model
        forward keeps returning every token's states)."""
        self._armed_layers = set(range(len(self.layers)))
        self._codes_now = {}
        return super().get_mask_sizes(query_length, layer_idx)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            index = -1 if isinstance(layer_idx, bool) else operator.index(layer_idx)
        except TypeError:
            index = -1
        if not 0 <= index < len(self.layers):
            raise KvtoolError(f"CompressedCache.update: layer_idx {layer_idx!r} is not one of "
                              f"its {len(self.layers)} layers")
        layer = self.layers[index]
        armed = self.attention_from_codes is True or index in self._armed_layers
        self._armed_layers.discard(index)
        return layer.update(key_states, value_states, *args,
                            from_codes=armed and layer.codes_capable
                            and self._uses_codes_now(key_states.device),
                            **kwargs)

    def _uses_codes_now(self, device: torch.device) -> bool:
        """:meth:`uses_codes`, worked out once per model forward (every layer asks)."""
        hit = self._codes_now.get(device)
        if hit is None:
            hit = self.uses_codes(device)
            if self.attention_from_codes is not True:  # a forward's get_mask_sizes resets it
                self._codes_now[device] = hit
        return hit

    @classmethod
    def from_kvcache(cls, cache: Any, policy: CodecPolicy, model: Any = None, **kwargs: Any):
        """A CompressedCache holding a :class:`~kvtool.cache.KVCache` (batch 1), encoded now.

        Usable as ``past_factory`` of :func:`kvtool.engines.hf.continue_generation` via
        ``lambda c, m: CompressedCache.from_kvcache(c, policy, m)``.
        """
        from kvtool.cache import layer_windows
        from kvtool.engines.hf import _total_tokens, check_layer, check_window, kv_shape
        from kvtool.kernels import to_torch

        policy = policy.resolve(cache)  # sink=auto: counted on the cache it holds
        want = None
        if model is not None:
            out = cls(policy, config=model.config, **kwargs)
            dtype, device = model.dtype, next(model.parameters()).device
            want = kv_shape(model)
        else:
            out = cls(policy, num_layers=cache.num_layers,
                      sliding_windows=layer_windows(cache.layer_info, cache.num_layers), **kwargs)
            dtype = device = None
        if len(out.layers) != cache.num_layers:
            raise ModelMismatchError(f"cache has {cache.num_layers} layers, model has "
                                     f"{len(out.layers)}")
        total = _total_tokens(cache)
        for i, (layer, (k, v)) in enumerate(zip(out.layers, zip(cache.keys, cache.values,
                                                                 strict=True), strict=True)):
            k, v = to_torch(k), to_torch(v)
            check_layer(i, k, v, want, dtype)  # as to_dynamic_cache: not a crash mid-forward
            k, v = (a[None].to(device=device, dtype=dtype) for a in (k, v))
            if layer.is_sliding:  # the last window - 1 tokens are all the next step can see
                check_window(i, int(k.shape[-2]), total, layer.sliding_window)
                keep = layer.sliding_window - 1
                k, v = k[..., -keep:, :], v[..., -keep:, :]
            elif k.shape[-2] != total:
                raise KvtoolError(f"layer {i} holds {k.shape[-2]} of {total} tokens (a "
                                  "sliding-window cache?) but is full attention here")
            layer.update(k, v)
            if layer.is_sliding:
                layer.dropped, layer.cumulative_length = total - k.shape[-2], total
        for layer in out.layers:  # refuse a bad input here, not at the first step
            for stream in layer.streams:
                stream.settle(wait=True)
        return out

    def nbytes(self) -> int:
        """Resident bytes actually held: encoded arrays plus full-precision sinks/windows."""
        return sum(sum(layer.nbytes()) for layer in self.layers)

    def encoded_tokens(self) -> int:
        """Tokens held encoded by the layer that holds the most (0: every token held exact)."""
        return max((stream.stored for layer in self.layers for stream in layer.streams
                    if stream.codec is not None), default=0)

    def nbytes_breakdown(self) -> dict[str, int]:
        enc = sum(layer.nbytes()[0] for layer in self.layers)
        full = sum(layer.nbytes()[1] for layer in self.layers)
        return {"encoded": enc, "full_precision": full, "total": enc + full}


def cache_nbytes(cache: Any) -> int:
    """Resident K/V bytes of a ``CompressedCache`` or of a ``DynamicCache``-like cache."""
    if isinstance(cache, CompressedCache):
        return cache.nbytes()
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


__all__ = ["CompressedCache", "CompressedLayer", "cache_nbytes", "DEFAULT_BLOCK_SIZE"]
