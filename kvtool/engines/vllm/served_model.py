"""The model a vLLM engine runs, as kvtool identifies it: the identity its chunks and files are
keyed by (:func:`model_info`: the checkpoint, as quantized on load), its tokenizer's fingerprint,
and the parallel layouts the store refuses. Needs vLLM only where a quantization config is
resolved."""

from __future__ import annotations

import json
from typing import Any

from kvtool.engines.vllm.common import log


def refuse_parallel(vllm_config: Any) -> None:
    """ValueError for an engine split over workers (tensor, pipeline or context parallel):
    each then holds some heads, layers or tokens of a chunk, and computes over the others'
    loads; the store keeps whole chunks written and read by one worker."""
    parallel = getattr(vllm_config, "parallel_config", None)
    sizes = {f"{name.replace('_', ' ')} parallel": int(getattr(parallel, f"{name}_parallel_size",
                                                                 1) or 1)
             for name in ("tensor", "pipeline", "prefill_context", "decode_context")}
    world = int(getattr(parallel, "world_size", 1) or 1)
    if world > 1 and all(size == 1 for size in sizes.values()):
        sizes["world"] = world  # another way of splitting an engine over workers
    if any(size > 1 for size in sizes.values()):
        raise ValueError("KvtoolConnector serves one worker per engine; this engine runs "
                         + ", ".join(f"{name} size {size}"
                                     for name, size in sizes.items() if size > 1)
                         + " (run one engine per GPU, e.g. vLLM's --data-parallel-size)")


def refuse_dropped_blocks(kv_cache_config: Any, max_model_len: int) -> None:
    """ValueError where vLLM's KV cache manager lets go of a request's blocks before its end:
    a model whose every layer slides (Mistral-7B-v0.1, Phi-3-mini-4k) or attends in chunks
    keeps its own window spec even without the hybrid manager (only a mix of full and local
    layers is promoted to full attention). Its blocks outside the window are freed, and a
    prefix-cache hit hands a request the null block for them: chunks saved or captured from
    them would hold another request's K/V or zeros. Within a ``max_model_len`` no longer than
    the window, no block is let go."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        CircularBufferSpec,
        RSWASpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        spec = group.kv_cache_spec
        specs = spec.kv_cache_specs.values() if isinstance(spec, UniformTypeKVCacheSpecs) \
            else (spec,)
        for one in specs:
            if isinstance(one, SlidingWindowSpec) and one.sliding_window < max_model_len:
                span = f"a sliding window of {one.sliding_window}"
                fit = one.sliding_window
            elif isinstance(one, ChunkedLocalAttentionSpec) \
                    and one.attention_chunk_size < max_model_len:
                span = f"attention chunks of {one.attention_chunk_size}"
                fit = one.attention_chunk_size
            elif isinstance(one, RSWASpec | CircularBufferSpec):
                raise ValueError(f"KvtoolConnector needs every position in the paged blocks; "
                                 f"vLLM's {type(one).__name__} layers evict some")
            else:
                continue
            raise ValueError(
                f"KvtoolConnector needs every position in the paged blocks, but every layer of "
                f"this model has {span}, and vLLM frees a request's blocks outside it (a "
                f"saved chunk would hold freed blocks); serve it with --max-model-len {fit} "
                f"or less, where none is freed")


def model_info(vllm_config: Any, name: str | None = None) -> dict[str, Any]:
    """The model identity kvtool's HF engine would write for the model vLLM runs."""
    from pathlib import Path

    from kvtool.checkpoint import quantized_on_load
    from kvtool.identity import model_identity
    from kvtool.models import DEFAULT_MODEL_NAME, weights_of

    mc = vllm_config.model_config
    path = Path(str(mc.model))
    if name is None:
        converted = (path / "kvtool-conversion.json").is_file()
        name = DEFAULT_MODEL_NAME if converted and path.name.startswith(DEFAULT_MODEL_NAME) \
            else path.name
    dtype = str(mc.dtype).removeprefix("torch.")
    weights = weights_of(str(mc.model), getattr(mc, "revision", None),
                         _download_dir(vllm_config))
    method = quantization_method(getattr(mc, "quantization", None),
                                 getattr(mc, "quantization_config", None))
    weights = quantized_on_load(weights, method, mc.hf_config)
    return model_identity(mc.hf_config, name=name, dtype=dtype, weights=weights)


def quantization_method(quantization: str | None, config: Any) -> str | None:
    """How vLLM quantizes the weights as it loads them: ``--quantization``, and where
    ``--quantization-config`` makes vLLM's resolved config (``config``) other than the
    method's own, that config as canonical JSON after it (other layers quantized, another
    format: other K/V)."""
    if config is None:
        return quantization
    import dataclasses

    from vllm.config.quantization import resolve_quantization_config

    if config == resolve_quantization_config(quantization, None):
        return quantization
    from kvtool.identity import canonical_sha256

    data = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else config
    digest = canonical_sha256(json.loads(json.dumps(data, default=str)))
    return f"{quantization or ''}+config:{digest}"


def resolved_quantization(quantization: str | None, given: Any) -> str | None:
    """:func:`quantization_method` of ``--quantization`` and a ``--quantization-config``
    value (decoded JSON, or the dotted form's dict) as vLLM resolves them (needs vLLM)."""
    from vllm.config.quantization import resolve_quantization_config

    return quantization_method(quantization, resolve_quantization_config(quantization, given))


def _download_dir(vllm_config: Any) -> str | None:
    """vLLM's ``--download-dir`` (where it keeps Hub snapshots), when set."""
    return getattr(getattr(vllm_config, "load_config", None), "download_dir", None) or None


def tokenizer_fingerprint_of(vllm_config: Any) -> str:
    """The kvtool tokenizer fingerprint of vLLM's tokenizer ('' when it cannot be loaded)."""
    try:
        from transformers import AutoTokenizer

        from kvtool.identity import tokenizer_fingerprint

        mc = vllm_config.model_config
        tok = AutoTokenizer.from_pretrained(mc.tokenizer or mc.model, local_files_only=True)
        return tokenizer_fingerprint(tok)
    except Exception as e:
        log.warning("kvtool: no tokenizer fingerprint (%s); files will not record one", e)
        return ""
