"""The kernel calls behind :func:`kvtool.engines.hf_attention.kvtool_attention`: the numba
kernels on the CPU (numpy views of the query, the exact tokens and the store; each codec's
centroid table and rotations, kept) and the Triton kernels on CUDA (the store's own tensors).
A kernel that does not build raises; the caller turns that into decode-then-attend."""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvtool.codecs import Codec
from kvtool.codecs.rotation import rotation_matrix, rotation_matrix_t

if TYPE_CHECKING:
    from kvtool.engines.hf_attention import CodesView


def on_cpu(na: ModuleType, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           view: CodesView, bias: torch.Tensor | None, causal: bool,
           scale: float) -> torch.Tensor:
    """fp32 [B, Q, Hq, D] through :mod:`kvtool.kernels.numba_attention` (``na``), or
    :mod:`kvtool.kernels.numba_attention_parts` where the view has per-role parts."""
    batch, hq, nq, dim = query.shape
    out = torch.empty((batch, nq, hq, dim), dtype=torch.float32)
    if view.roles is not None:
        from kvtool.kernels import numba_attention_parts

        numba_attention_parts.attend(_numpy(query), *view.roles, _numpy(key), _numpy(value),
                                     None if bias is None else bias.numpy(), causal, scale,
                                     out.numpy(), view.block, _numba_threads())
        return out
    (kcodec, ktab, k_rt, _), (vcodec, vtab, _, v_r) = (_constants(na, c, dim)
                                                       for c in view.codecs)
    na.attend(_numpy(query), view.codes[0], view.norms[0], kcodec.bits, ktab, k_rt,
              view.codes[1], view.norms[1], vcodec.bits, vtab, v_r, _numpy(key),
              _numpy(value), None if bias is None else bias.numpy(), causal, scale, out.numpy(),
              _numba_threads(), *(view.rotations or (None, None)), view.key_means, view.block)
    return out


def on_device(ta: ModuleType, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              view: CodesView, bias: torch.Tensor | None, causal: bool,
              scale: float) -> torch.Tensor:
    """[B, Q, Hq, D] in the query's dtype where it is 16-bit, else fp32, through
    :func:`kvtool.kernels.triton_attention.attend_store` (``ta``), or
    :func:`kvtool.kernels.triton_attention_parts.attend` where the view has per-role parts."""
    out_dtype = query.dtype if query.dtype in (torch.float16, torch.bfloat16) else torch.float32
    if view.roles is not None:
        from kvtool.kernels import triton_attention_parts

        return triton_attention_parts.attend(query, *view.roles, key, value, scale=scale,
                                             bias=bias, causal=causal, out_dtype=out_dtype)
    return ta.attend_store(query, view.device_store(query.shape[-1]), key, value, scale=scale,
                           bias=bias, causal=causal, out_dtype=out_dtype)


def _numpy(t: torch.Tensor) -> np.ndarray:
    """float32 C-contiguous numpy view (or copy) of ``t``."""
    if t.dtype != torch.float32 or not t.is_contiguous():
        t = t.to(torch.float32).contiguous()
    return t.detach().numpy()


_CONSTANTS: dict[tuple[int, int], tuple[Codec, np.ndarray, np.ndarray, np.ndarray]] = {}


def _constants(na: ModuleType, codec: Codec,
               dim: int) -> tuple[Codec, np.ndarray, np.ndarray, np.ndarray]:
    """(codec, centroid chunk table, R_kᵀ, R_v) of a turbo or turbomix codec at ``dim``, the
    rotations stacked [C, D, D] (turbomix: one per candidate), cached per codec."""
    hit = _CONSTANTS.get((id(codec), dim))
    if hit is None or hit[0] is not codec:
        from kvtool.codecs.lloyd_max import sphere_marginal_codebook
        from kvtool.engines.hf_attention import rotation_seeds

        if len(_CONSTANTS) > 64:
            _CONSTANTS.clear()
        table = na.chunk_table(codec.bits,
                               sphere_marginal_codebook(dim, 1 << codec.bits).centroids)
        seeds = rotation_seeds(codec)
        hit = (codec, table, np.stack([rotation_matrix_t(dim, s) for s in seeds]),
               np.stack([rotation_matrix(dim, s) for s in seeds]))
        _CONSTANTS[(id(codec), dim)] = hit
    return hit


def role_codes(codec: Codec, arrays: dict[str, np.ndarray], heads: int, tokens: int,
               block: int, dim: int) -> Any:
    """:func:`kvtool.kernels.numba_attention_parts.role_codes` (numba imported only here)."""
    from kvtool.kernels.numba_attention_parts import role_codes as build

    return build(codec, arrays, heads, tokens, block, dim)


def _numba_threads() -> int:
    """torch's thread count, applied to numba's pool (capped by ``NUMBA_NUM_THREADS``)."""
    threads = torch.get_num_threads()
    if threads <= 1:
        return 1
    import numba

    from kvtool.kernels.numba_support import num_threads

    threads = min(threads, numba.config.NUMBA_NUM_THREADS)
    if threads > 1 and num_threads() != threads:
        numba.set_num_threads(threads)
    return threads


def warm_up(presets: tuple[str, ...] = ("quality", "balanced", "small")) -> int:
    """Compile (or load) the CPU attention-from-codes kernels ``presets`` use, serial and
    parallel, so that a first decode step does not pay it (cold, ~80 s for the four kernels and
    the presets' encode on 2 cores, the GIL held). A tiny random-init Llama runs the real path:
    a prefill, a decode step and a chunk through ``CompressedCache``, whose argument types (not
    shapes) numba compiles for. Returns how many attention calls read codes (0: no compiled
    CPU kernels here)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvtool.engines import hf_attention
    from kvtool.engines.hf_runtime import CompressedCache
    from kvtool.policy import CodecPolicy

    if hf_attention.kernels() is None:
        return 0
    import numba

    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=256)
    torch_threads = torch.get_num_threads()
    ids = torch.arange(40).reshape(1, -1) % 64
    before = hf_attention.STATS["codes"]
    try:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = LlamaForCausalLM(config).eval()
        for threads in (1, 2) if numba.config.NUMBA_NUM_THREADS > 1 else (1,):
            torch.set_num_threads(threads)
            for preset in presets:
                past = CompressedCache(CodecPolicy.from_options(preset=preset, recent_tokens=8),
                                       config=config, block_size=16, attention_from_codes=True)
                with torch.inference_mode():
                    model(ids, past_key_values=past, use_cache=True)
                    model(ids[:, :1], past_key_values=past, use_cache=True)
                    model(ids[:, :2], past_key_values=past, use_cache=True)
    finally:
        torch.set_num_threads(torch_threads)
    return hf_attention.STATS["codes"] - before


__all__ = ["on_cpu", "on_device", "role_codes", "warm_up"]
