"""Chunks between vLLM's paged caches and stored files: the data moves of
:class:`~kvtool.engines.vllm.connector.KvtoolConnector`'s worker side (the connector keeps the
bookkeeping: counters, logs, blocks reported failed).

The caches come as :data:`Layers` (:func:`layer_table`: in model layer order, each with its
:class:`~kvtool.engines.vllm.layout.PagedLayout`); ``on_device`` says which path to take (the
connector's choice: CUDA caches, see :func:`~kvtool.engines.vllm.device_io.on_device`):

* host path: a chunk's K/V copied out for the saver thread to encode (:func:`copy_out`); a
  source read and decoded on the host (:func:`read_source`), then scattered into the blocks;
* device path: a chunk encoded where its K/V are and only its codes copied out; a source's
  codes read on the host and decoded on the device straight into the blocks
  (:mod:`~kvtool.engines.vllm.device_io`).

A store chunk is fetched through the :class:`~kvtool.engines.vllm.guard.StoreGuard` (a
deadline), and a failure to read it is handled by the store: quarantined or skipped, never
deleted. Nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from kvtool.engines.vllm import device_io
from kvtool.engines.vllm.chunk_checks import check_file
from kvtool.engines.vllm.common import Source, check_cache, log
from kvtool.engines.vllm.fp8_cache import layer_fp8
from kvtool.engines.vllm.layout import PagedLayout, detect_layout, kernel_block_ids
from kvtool.engines.vllm.layout_probe import Writer, cpu_layout
from kvtool.engines.vllm.safeio import pin_file
from kvtool.engines.vllm.windows import partial_windows

#: per layer: (paged cache, its layout, kernel blocks per scheduler block)
Layers = Sequence[tuple[torch.Tensor, PagedLayout, int]]


def layer_table(kv_caches: dict[str, torch.Tensor], forward_context: dict[str, Any],
                num_blocks: int, model_info: dict, layer_index: Callable[[str], int],
                cpu_writer: Callable[[str, str], Writer] | None = None,
                ) -> list[tuple[torch.Tensor, PagedLayout, int]]:
    """The caches as :data:`Layers`, ordered by ``layer_index`` of their names: each one's
    layout detected from its attention layer in ``forward_context`` (vLLM's static forward
    context; an fp8 cache's format and scales too), its ratio from ``num_blocks`` (the
    scheduler's blocks; 0: unknown, ratio 1). A CPU cache's layout is checked against (or
    read off) ``cpu_writer(isa, kv_cache_dtype)``, vLLM's own cache writer
    (:func:`~kvtool.engines.vllm.layout_probe.cpu_layout`), once per kind."""
    table = []
    cpu_layouts: dict[tuple, PagedLayout] = {}
    for name in sorted(kv_caches, key=layer_index):
        kv, layer = kv_caches[name], forward_context.get(name)
        backend = layer.attn_backend.get_name() if layer is not None else None
        head_dim = int(getattr(layer, "head_size", model_info["head_dim"]))
        isa = getattr(layer, "isa", None)
        fp8 = layer_fp8(layer, model_info.get("dtype") or "bfloat16") if layer is not None else None
        if (backend or "").upper().startswith("CPU") and cpu_writer is not None and isa:
            kind = (kv.dtype, tuple(kv.shape[1:]), head_dim, isa, fp8 and fp8.format)
            if kind not in cpu_layouts:
                writer = cpu_writer(isa, getattr(layer, "kv_cache_dtype", "auto"))
                cpu_layouts[kind], warning = cpu_layout(kv, head_dim, isa, writer, fp8)
                if warning:
                    log.warning("kvtool store: %s", warning)
            layout = replace(cpu_layouts[kind], fp8=fp8)  # this layer's own scales
            layout.check(kv)
        else:
            layout = detect_layout(kv, head_dim, backend, isa, fp8)
        ratio = layout.num_blocks(kv) // num_blocks if num_blocks else 1
        table.append((kv, layout, max(1, ratio)))
    if len(table) != model_info["num_layers"]:
        raise RuntimeError(f"vLLM has {len(table)} KV cache layers, the model config "
                           f"says {model_info['num_layers']}")
    return table


def gather(layers: Layers, block_ids: list[int], start: int, stop: int) -> tuple[list, list]:
    """Copies of tokens ``[start, stop)`` of the blocks: (keys, values), one per layer."""
    keys, values = [], []
    for kv, layout, ratio in layers:
        k, v = layout.gather(kv, kernel_block_ids(block_ids, ratio), start, stop)
        keys.append(k)
        values.append(v)
    return keys, values


def copy_out(layers: Layers, block_ids: list[int], chunk: Any, store: Any,
             on_device: bool) -> tuple:
    """What the saver writes ``chunk`` from: copies of its K/V (host path), or its codes
    encoded on the device and on their way to pinned host memory (device path)."""
    keys, values = gather(layers, block_ids, chunk.start, chunk.stop)
    if not on_device:
        return keys, values
    encoded = device_io.encode_chunk(keys, values, store.chunk_policy(chunk))
    return (device_io.to_host(encoded),)


def load_source(layers: Layers, block_ids: list[int], src: Source, a: int, b: int,
                store: Any, guard: Any, model_info: dict, on_device: bool) -> list[str]:
    """Tokens ``[a, b)`` of ``src`` into the blocks (at their own positions); raises on any
    failure (the caller recomputes from ``a`` on). Returns what made them inexact
    (:meth:`~kvtool.formats.KvzFile.lossy_sources`)."""
    if on_device:
        found = _load_on_device(layers, block_ids, src, a, b, store, guard, model_info)
        if found is not None:
            return found
    tokens = b - src.start
    cache = read_source(src, tokens, store, guard, model_info)
    for i, (kv, layout, ratio) in enumerate(layers):
        k, v = (_at_positions(x, tokens) for x in cache.layer(i))
        layout.scatter(kv, kernel_block_ids(block_ids, ratio), a,
                       k[:, a - src.start:], v[:, a - src.start:])
    return cache.lossy_sources


def _at_positions(x: torch.Tensor, tokens: int) -> torch.Tensor:
    """A layer's K or V ``[heads, held, dim]`` at positions ``[0, tokens)``: a sliding-window
    layer that kept only its last ``held`` tokens gets zeros before them, which no query past
    the file's end attends (:func:`~kvtool.engines.vllm.common.partial_windows`)."""
    held = int(x.shape[1])
    if held == tokens:
        return x
    pad = torch.zeros((x.shape[0], tokens - held, x.shape[2]), dtype=x.dtype, device=x.device)
    return torch.cat([pad, x], dim=1)


def check_unchanged(src: Source, stamp: tuple[int, int, int]) -> None:
    """A :class:`FormatError` where a served file is not the one whose ids the scheduler
    matched (rewritten since: another text's K/V, or windows the scheduler's rules did not
    judge); the load fails and vLLM recomputes the prefix."""
    from kvtool.errors import FormatError

    if src.stamp is not None and stamp != src.stamp:
        raise FormatError(f"{src.path} changed after its token ids were matched to the request")


def read_source(src: Source, tokens: int, store: Any, guard: Any, model_info: dict) -> Any:
    """The source's first ``tokens`` tokens (a store chunk's failure is handled by
    :meth:`PrefixStore.read`: quarantined or skipped, never deleted)."""
    from kvtool.formats import load

    if src.chunk is not None and store is not None and guard is not None:
        fetched = guard.call("load", store.fetch, src.chunk)  # I/O: a deadline
        return store.read(src.chunk, tokens, fetched)
    with pin_file(src.path) as (path, stamp):
        check_unchanged(src, stamp)
        cache = load(path, tokens=tokens, backend="torch")  # refuses to cut a window it dropped
    check_cache(cache, model_info, tokens, sliding_ok=True)
    return cache


def _load_on_device(layers: Layers, block_ids: list[int], src: Source, a: int, b: int,
                    store: Any, guard: Any, model_info: dict) -> list[str] | None:
    """:func:`load_source` on the device: the codes read on the host, decoded on the caches'
    device (:func:`~kvtool.engines.vllm.device_io.load_file`); a store chunk's failure is
    handled by :meth:`PrefixStore.read_into` as :func:`read_source`'s. None for a file whose
    sliding-window layers kept only their last tokens: the host path places them."""
    from kvtool.formats import open_kvz

    targets = [(kv, layout, kernel_block_ids(block_ids, ratio)) for kv, layout, ratio in layers]
    tokens = b - src.start

    found: list[str] = []

    def into_cache(f: Any) -> None:
        device_io.load_file(f, targets, src.start, a - src.start, tokens)
        found.extend(f.lossy_sources())

    if src.chunk is not None and store is not None and guard is not None:
        fetched = guard.call("load", store.fetch, src.chunk)  # I/O: a deadline
        store.read_into(src.chunk, tokens, fetched, into_cache)
        return found
    with pin_file(src.path) as (path, stamp), open_kvz(path) as f:
        check_unchanged(src, stamp)
        if partial_windows(f):
            return None
        check_file(f, model_info, tokens, sliding_ok=True)
        into_cache(f)
    return found
