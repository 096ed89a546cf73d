"""Attention straight from a :class:`~kvtool.engines.hf_runtime.CompressedCache`'s codes.

How it plugs into transformers (5.x): a decoder's attention module calls
``past_key_values.update(k, v, layer_idx)`` and hands what it returns, unchanged, to
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager)(module, query, key,
value, attention_mask, scaling=..., dropout=..., **kwargs)``. :func:`install` registers
:func:`kvtool_attention` under the name ``"kvtool"`` and also in place of ``"sdpa"`` (the default
implementation), keeping the original sdpa function as its delegate; masks for ``"kvtool"`` are
sdpa's. Every call without a compressed layer's tag goes straight to the delegate, so models,
caches and masks behave exactly as before.

When the cache knows the attention it feeds is this function (:func:`routes_through_kvtool`),
the update comes from a model forward (its mask preparation armed the cache) and the layer
qualifies, ``update`` returns only the exact tokens (sinks, recent window, this forward's tokens)
and tags the key tensor with a :class:`CodesTag` holding a :class:`CodesView`: the layer's encoded
chunks as they were before this forward (they sit between the sinks and the window; the layer
makes one view per change of its store). The attention then runs one softmax
over encoded tokens (read from their codes) and exact tokens, with sdpa's semantics: no mask
means causal over the new tokens (they come last), a mask's columns are matched to the tokens
(the encoded columns must be fully visible). The codes are read

- on the CPU by :func:`kvtool.kernels.numba_attention.attend` (numpy views of the store), or
  :func:`kvtool.kernels.numba_attention_parts.attend` for outlier, pair, trellis and uint8-norm
  ``turbomix`` codes;
- on CUDA by :func:`kvtool.kernels.triton_attention.attend_store` (the store's own tensors,
  no host copy, prepared once per view) for uncentered turbo2/3/4 and scalar ``turbomix``
  codes (the ``quality`` preset), or
  :func:`kvtool.kernels.triton_attention_parts.attend` for outlier, pair, trellis and
  uint8-norm ``turbomix`` codes (``balanced``, ``small``). :data:`DEVICE_ATTENTION_ON_CPU`
  (tests only) sends CPU tensors this way too, for Triton's interpreter.

(The calls themselves, with the numpy views and tables the CPU kernels take, are in
:mod:`kvtool.engines.hf_attention_calls`.)

Anything else decodes the view and calls the delegate on the full K/V
(:meth:`CodesView.materialize`), the same decode-then-attend computation as without the hook:
forwards of many query tokens (more than :data:`~kvtool.kernels.numba_attention.MAX_ROWS` query
rows per KV head on the CPU, :func:`~kvtool.kernels.triton_attention.max_rows` on CUDA, e.g.
prefill chunks: one decode then serves every query), a mask hiding encoded tokens, per-head
masks, ``output_attentions``, dropout, sliding windows, soft-capping, learned sinks, position
biases, gradients, tensors on other devices, a Triton kernel that does not build.
:data:`STATS` counts both paths (tests use it to prove which one ran). On CUDA the one host
sync is the check that a mask hides no encoded token, made once per mask (a forward's layers
share it).
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import torch

from kvtool.codecs import Codec, Encoded
from kvtool.engines import hf_attention_calls as calls
from kvtool.errors import CodecError, KvtoolError
from kvtool.kernels import kernel_mode
from kvtool.kernels.device_checks import own_arrays

CODE_BITS = (2, 3, 4)  # kvtool.kernels.numba_attention.BITS (not imported: numba may be absent)
ATTR = "_kvtool_codes"  # attribute on the key tensor returned by CompressedLayer.update
NAME = "kvtool"
STATS = {"codes": 0, "fallback": 0}  # attention calls served from codes / by decode-then-attend
#: tests only: CPU tensors attend from codes through the Triton kernels (``TRITON_INTERPRET=1``)
DEVICE_ATTENTION_ON_CPU = False
_UNSUPPORTED_KWARGS = frozenset(("sliding_window", "softcap", "s_aux", "position_bias", "cache"))

_lock = threading.Lock()
_delegate: Callable[..., Any] | None = None  # the sdpa function that install() replaced


@dataclass
class CodesView:
    """One layer's encoded tokens as attention reads them, made once per change of the
    layer's store (every attention call until then reads the same view, through a
    :class:`CodesTag` on the key tensor).

    ``codes``/``norms``: per role (key, value) the packed codes ``[B·Hkv, E, bytes]`` (uint8)
    and fp16 norms as ``uint16`` ``[B·Hkv, E]``, numpy views of the cache's own tensors;
    ``chunks``: per role the :class:`Encoded` chunks with their stacking index (0 or 1 when
    keys and values share one stream, else None), for :meth:`materialize`; ``sinks``: how many
    of the exact tokens come before the encoded ones.
    """

    codecs: tuple[Codec, Codec]
    codes: tuple[np.ndarray, np.ndarray]
    norms: tuple[np.ndarray, np.ndarray]
    chunks: tuple[tuple[list[Encoded], int | None], tuple[list[Encoded], int | None]]
    sinks: int
    batch: int
    #: per role, each block's rotation (uint8 [B·Hkv, blocks]; turbomix's candidate) and the
    #: keys' block means (float32 [B·Hkv, blocks, D], or None: uncentered); ``on_device``:
    #: tensors, a role without candidates None, the means fp16
    rotations: tuple[np.ndarray, np.ndarray] | None = None
    key_means: np.ndarray | None = None
    block: int = 0
    #: per role the :class:`~kvtool.kernels.numba_attention_parts.RoleCodes` (``on_device``:
    #: :class:`~kvtool.kernels.triton_attention_parts.RoleTensors`) when the kernel of every
    #: ``turbomix`` option reads this layer (``codes``/``norms`` are then None)
    roles: tuple[Any, Any] | None = None
    on_device: bool = False  # read by the Triton kernel (tensors, not numpy views)
    tokens: int = field(init=False)  # encoded tokens
    heads: int = field(init=False)  # rows of encoded tokens: batch · KV heads
    _store: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.roles:
            role = self.roles[0]
            self.tokens = int(role.tokens if self.on_device else role.norms.shape[2])
            self.heads = int(role.heads if self.on_device else role.norms.shape[1])
        else:
            self.tokens, self.heads = int(self.norms[0].shape[1]), int(self.norms[0].shape[0])

    def device_store(self, dim: int) -> Any:
        """The :class:`kvtool.kernels.triton_attention.Store` of these codes (``on_device``,
        no ``roles``), prepared at the first call that reads them."""
        if self._store is None:
            (kcodec, vcodec), ta = self.codecs, device_kernels()
            self._store = ta.prepare(
                self.codes[0], self.norms[0], self.codes[1], self.norms[1], dim=dim,
                k_bits=kcodec.bits, v_bits=vcodec.bits, k_seeds=rotation_seeds(kcodec),
                v_seeds=rotation_seeds(vcodec), k_rotations=self.rotations[0],
                v_rotations=self.rotations[1], key_means=self.key_means, block=self.block)
        return self._store

    def materialize(self, key: torch.Tensor, value: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The full K/V ``[B, Hkv, tokens, D]``: exact sinks, decoded chunks, exact rest."""
        out, decoded = [], {}
        for exact, codec, (chunks, index) in zip((key, value), self.codecs, self.chunks,
                                                 strict=True):
            if id(chunks) not in decoded:  # keys and values stacked: one decode for both
                with own_arrays():  # the cache's own encodes: no value checks (host syncs)
                    decoded[id(chunks)] = [codec.decode(enc).flatten(-3, -2) for enc in chunks]
            parts = [x if index is None else x[index] for x in decoded[id(chunks)]]
            parts = [exact[..., :self.sinks, :], *(p.to(exact.dtype) for p in parts),
                     exact[..., self.sinks:, :]]
            out.append(torch.cat(parts, dim=-2))
        return out[0], out[1]


class CodesTag:
    """The tag of one attention call's key tensor: the layer's :class:`CodesView` until that
    call reads it (the tag then lets go, so a key tensor kept around pins no chunks that an
    encode has since replaced), and whether it did."""

    __slots__ = ("view", "consumed")

    def __init__(self, view: CodesView):
        self.view: CodesView | None = view
        self.consumed = False


def codes_codec(codec: Codec | None, role: str = "value") -> bool:
    """Whether attention can read this codec's codes directly in ``role``: uncentered
    turbo2/3/4, and ``turbomix`` at 2..4 bits with any other option (the scalar ones through
    :mod:`kvtool.kernels.numba_attention`, see :func:`scalar_codes`; the rest through
    :mod:`kvtool.kernels.numba_attention_parts`)."""
    from kvtool.codecs.turbomix import TurboMixCodec

    if isinstance(codec, TurboMixCodec):
        return codec.bits in CODE_BITS
    return scalar_codes(codec, role)


def scalar_codes(codec: Codec | None, role: str = "value") -> bool:
    """Whether :mod:`kvtool.kernels.numba_attention` (the faster kernel) reads this codec's
    codes in ``role``: uncentered turbo2/3/4, and ``turbomix`` with the scalar codebook at 2..4
    bits, fp16 norms and no outlier channels, any candidates, centered only as keys (a block's
    mean is one dot product per query there)."""
    from kvtool.codecs.turbo import TurboCodec
    from kvtool.codecs.turbomix import TurboMixCodec

    if isinstance(codec, TurboMixCodec):
        return codec.bits in CODE_BITS and codec.quantizer == "scalar" and not codec.outliers \
            and codec.norm_bits == 16 and (role == "key" or not codec.center)
    return isinstance(codec, TurboCodec) and not codec.center and codec.bits in CODE_BITS


_KERNELS: list[ModuleType | None] = []


def kernels() -> ModuleType | None:
    """:mod:`kvtool.kernels.numba_attention`, or None where numba does not import."""
    if not _KERNELS:
        try:
            from kvtool.kernels import numba_attention
        except ImportError:
            numba_attention = None
        _KERNELS.append(numba_attention)
    return _KERNELS[0]


def codes_enabled(device: torch.device | str | None = None) -> bool:
    """Whether the compiled kernels may run now for states on ``device`` (None: the CPU):
    ``KVTOOL_KERNELS``, and numba on the CPU or Triton on CUDA (:func:`device_path`)."""
    mode = kernel_mode()
    if mode == "reference":
        return False
    if device is not None and device_path(device):
        if device_kernels() is None:
            if mode == "compiled":
                raise CodecError("KVTOOL_KERNELS=compiled but Triton cannot run here: attention "
                                 f"from codes on {device} needs it (pip install triton)")
            return False
        return True
    if kernels() is None:
        if mode == "compiled":
            raise CodecError("KVTOOL_KERNELS=compiled but numba is not installed: attention "
                             "from codes needs it (pip install numba)")
        return False
    return True


def device_path(device: torch.device | str) -> bool:
    """Whether states on ``device`` attend through the Triton kernels: CUDA (and the CPU while
    :data:`DEVICE_ATTENTION_ON_CPU` is set)."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    return kind == "cuda" or (DEVICE_ATTENTION_ON_CPU and kind == "cpu")


_DEVICE_KERNELS: list[ModuleType | None] = []


def device_kernels() -> ModuleType | None:
    """:mod:`kvtool.kernels.triton_attention` where Triton runs (CUDA, or the interpreter),
    else None."""
    if not _DEVICE_KERNELS:
        try:
            from kvtool.kernels import triton_attention
        except ImportError:
            triton_attention = None
        _DEVICE_KERNELS.append(triton_attention if triton_attention is not None
                               and triton_attention.available() else None)
    return _DEVICE_KERNELS[0]


def device_codes(key_codec: Codec | None, value_codec: Codec | None, dim: int) -> bool:
    """Whether the Triton kernels read these codecs' codes at head_dim ``dim`` (16..256, a
    power of two): what :func:`codes_codec` accepts (uncentered turbo2/3/4 and scalar
    ``turbomix`` through :mod:`kvtool.kernels.triton_attention`, every other ``turbomix`` at
    2..4 bits through :mod:`kvtool.kernels.triton_attention_parts`)."""
    from kvtool.kernels.triton_cuda import DIMS

    return codes_codec(key_codec, "key") and codes_codec(value_codec) and dim in DIMS


_SEEDS: dict[int, tuple[Codec, tuple[int, ...]]] = {}


def rotation_seeds(codec: Codec) -> tuple[int, ...]:
    """The rotation seed of each of a turbo or turbomix codec's candidates (turbo: one), kept
    per codec (every layer's attention call asks)."""
    hit = _SEEDS.get(id(codec))
    if hit is None or hit[0] is not codec:
        from kvtool.codecs.turbomix import TurboMixCodec, candidate_seed

        seeds = tuple(candidate_seed(codec.seed, c) for c in range(codec.candidates)) \
            if isinstance(codec, TurboMixCodec) else (codec.seed,)
        if len(_SEEDS) > 256:
            _SEEDS.clear()
        hit = _SEEDS[id(codec)] = (codec, seeds)
    return hit[1]


def install() -> None:
    """Register :func:`kvtool_attention` as ``"kvtool"`` and in place of ``"sdpa"`` (once)."""
    global _delegate
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    with _lock:
        if _delegate is not None:  # once: never wrap a wrapper of this function
            return
        _delegate = ALL_ATTENTION_FUNCTIONS.get("sdpa")
        AttentionInterface.register(NAME, kvtool_attention)
        AttentionInterface.register("sdpa", kvtool_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def uninstall() -> None:
    """Put the original sdpa function back (``"kvtool"`` stays registered)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    global _delegate
    with _lock:
        if _delegate is not None and ALL_ATTENTION_FUNCTIONS.get("sdpa") is kvtool_attention:
            AttentionInterface.register("sdpa", _delegate)
            _delegate = None


def routes_through_kvtool(config: Any) -> bool:
    """Whether a model with this config sends its attention calls to :func:`kvtool_attention`,
    once per update: its implementation is kvtool's, its modeling module dispatches through
    transformers' attention functions (Falcon calls torch's sdpa itself), and no layer
    attends again to another layer's states (Gemma 3n's shared K/V: a tag reads once)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = getattr(config, "_attn_implementation", None)
    return (isinstance(impl, str) and ALL_ATTENTION_FUNCTIONS.get(impl) is kvtool_attention
            and not getattr(config, "num_kv_shared_layers", 0)
            and _dispatches(getattr(config, "model_type", None)))


@functools.cache
def _dispatches(model_type: str | None) -> bool:
    """Whether transformers' modeling module of ``model_type`` looks its attention up in
    ``ALL_ATTENTION_FUNCTIONS`` (one it cannot import, remote code: taken as yes)."""
    import importlib

    if not isinstance(model_type, str) or not model_type.isidentifier():
        return True
    try:
        module = importlib.import_module(f"transformers.models.{model_type}."
                                         f"modeling_{model_type}")
    except ImportError:
        return True
    return hasattr(module, "ALL_ATTENTION_FUNCTIONS")


def _sdpa() -> Callable[..., Any]:
    if _delegate is not None:
        return _delegate
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def kvtool_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers attention function: from codes for tagged keys, else sdpa."""
    tag: CodesTag | None = getattr(key, ATTR, None)
    if tag is None:
        return _sdpa()(module, query, key, value, attention_mask, dropout=dropout,
                       scaling=scaling, **kwargs)
    view, tag.view, tag.consumed = tag.view, None, True
    if view is None:
        raise KvtoolError("this key tensor's encoded tokens were already attended to: a "
                          "CompressedCache's update serves one attention call")
    bias = _plan(module, query, key, value, attention_mask, dropout, view, kwargs)
    if bias is not False:
        causal = attention_mask is None and query.shape[2] > 1 \
            and kwargs.get("is_causal", getattr(module, "is_causal", True)) is not False
        out = _attend(query, key, value, view, bias, causal, scaling)
        if out is not None:
            STATS["codes"] += 1
            return out, None
    STATS["fallback"] += 1
    key, value = view.materialize(key, value)
    return _sdpa()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                   **kwargs)


def _plan(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          mask: Any, dropout: float, view: CodesView,
          kwargs: dict[str, Any]) -> torch.Tensor | None | bool:
    """The exact tokens' additive bias [1 or B, Q, X] (None: none), or False: fall back."""
    batch, hq, nq, dim = query.shape
    hkv, n_exact = key.shape[1], key.shape[2]
    if (dropout and module.training) or kwargs.get("output_attentions") or (
            not _UNSUPPORTED_KWARGS.isdisjoint(kwargs)
            and any(kwargs.get(k) is not None for k in _UNSUPPORTED_KWARGS)):
        return False
    if view.on_device:  # the layer's update found the key's device on the Triton path
        if key.device != query.device or value.device != query.device:
            return False
    elif query.device.type != "cpu" or key.device.type != "cpu":
        return False
    if batch != view.batch or key.shape[-1] != dim or value.shape[-1] != dim or hq % hkv \
            or view.heads != batch * hkv or value.shape[2] != n_exact:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return False
    # the cache's update made the view where the kernels may run (codes_enabled), once per
    # forward: a kernel that failed to build since then is None here
    ops = device_kernels() if view.on_device else kernels()
    if ops is None or nq * (hq // hkv) > (ops.max_rows(dim) if view.on_device
                                          else ops.MAX_ROWS):
        return False
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.ndim != 4 or mask.shape[1] != 1 \
            or mask.shape[0] not in (1, batch) or mask.shape[2] != nq \
            or mask.shape[3] != n_exact + view.tokens:
        return False
    if view.on_device:
        return _device_bias(mask, view.sinks, view.sinks + view.tokens)
    s, e = view.sinks, view.sinks + view.tokens
    encoded = mask[..., s:e]
    if not bool(encoded.all() if mask.dtype == torch.bool else (encoded == 0).all()):
        return False  # padding or a window hides encoded tokens: only the decoded path has them
    cols = torch.cat([mask[:, 0, :, :s], mask[:, 0, :, e:]], dim=-1)
    if cols.dtype == torch.bool:
        return torch.zeros(cols.shape, dtype=torch.float32).masked_fill_(~cols, -torch.inf)
    return cols.float().contiguous()


_MASK_MEMO: list[tuple[Any, ...]] = []  # (mask, encoded columns, bias or False): the last one


def _device_bias(mask: torch.Tensor, s: int, e: int) -> torch.Tensor | bool:
    """:func:`_plan`'s bias for a device mask, or False when it hides an encoded column. The
    check reads the mask back (a host sync), so it is made once per mask: every layer of a
    forward gets the same mask object."""
    hit = _MASK_MEMO[0] if _MASK_MEMO else None
    if hit is not None and hit[0] is mask and hit[1] == (s, e):
        return hit[2]
    encoded = mask[..., s:e]
    out: torch.Tensor | bool = False
    if bool(encoded.all() if mask.dtype == torch.bool else (encoded == 0).all()):
        cols = torch.cat([mask[:, 0, :, :s], mask[:, 0, :, e:]], dim=-1)
        out = torch.zeros(cols.shape, dtype=torch.float32, device=cols.device) \
            .masked_fill_(~cols, -torch.inf) if cols.dtype == torch.bool \
            else cols.float().contiguous()
    _MASK_MEMO[:] = [(mask, (s, e), out)]
    return out


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, view: CodesView,
            bias: torch.Tensor | None, causal: bool, scaling: float | None
            ) -> torch.Tensor | None:
    """The kernel's output [B, Q, Hq, D] in the query's dtype (None: it failed to build; the
    kernels stay off from then on, unless ``KVTOOL_KERNELS=compiled``)."""
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    if view.on_device:
        ops, call, failures = device_kernels(), calls.on_device, _DEVICE_KERNELS
        errors = ops.BUILD_ERRORS
    else:
        ops, call, failures = kernels(), calls.on_cpu, _KERNELS
        errors = ops.BuildError
    try:
        out = call(ops, query, key, value, view, bias, causal, scale)
    except errors as e:
        if kernel_mode() == "compiled":
            raise
        if view.on_device:
            warnings.warn(f"kvtool: attention from codes on {query.device} is off (the Triton "
                          f"kernel does not build here: {e}); decoding instead", RuntimeWarning,
                          stacklevel=2)
        else:
            ops.warn_fallback("attention from codes", e)
        failures[:] = [None]
        return None
    return out if query.dtype == torch.float32 else out.to(query.dtype)


__all__ = ["ATTR", "DEVICE_ATTENTION_ON_CPU", "NAME", "STATS", "CodesTag", "CodesView",
           "codes_codec", "codes_enabled", "device_codes", "device_kernels", "device_path",
           "install", "kvtool_attention", "rotation_seeds", "routes_through_kvtool",
           "scalar_codes", "uninstall"]
