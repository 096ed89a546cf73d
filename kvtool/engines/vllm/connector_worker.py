"""The worker half of :class:`~kvtool.engines.vllm.connector.KvtoolConnector`: loads decoded
into vLLM's paged cache before the forward pass (``start_load_kv``), chunks gathered and saved
after it (``wait_for_save``), captures, and what a failed load reports back to the scheduler
half (:mod:`~kvtool.engines.vllm.load_failures`)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtool.engines.vllm import activity, device_io, paged_io
from kvtool.engines.vllm.common import (
    LoadSpec,
    SaveSpec,
    add_time,
    count,
    flush,
    log,
    saves_full,
    submit,
)
from kvtool.engines.vllm.fp8_cache import FP8_LOSSLESS, fp8_sources
from kvtool.engines.vllm.layout import PagedLayout
from kvtool.engines.vllm.layout_probe import vllm_cpu_writer
from kvtool.engines.vllm.saver import held_bytes, save_failed, write_capture, write_chunks
from kvtool.engines.vllm.served_model import tokenizer_fingerprint_of
from kvtool.errors import KvtoolError

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # an older vLLM: failures are then tied to no step (see load_failures)
    KVConnectorWorkerMetadata = object  # type: ignore[assignment,misc]


# -- metadata (worker → scheduler) -------------------------------------------------------------
@dataclass
class KvtoolWorkerMetadata(KVConnectorWorkerMetadata):
    failed_steps: set[int] = field(default_factory=set)  # steps whose loads failed

    def aggregate(self, other: Any) -> KvtoolWorkerMetadata:
        return KvtoolWorkerMetadata(self.failed_steps | set(getattr(other, "failed_steps", ())))


class WorkerHalf:
    """The connector's worker-side methods, and its ``shutdown`` (state set up in
    ``KvtoolConnector.__init__``)."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)
        self._layers, self._layers_refused = None, None
        if self.store is not None:
            # before the engine serves: a warm-up beside the first loads held the GIL for
            # seconds while they waited (a 4.7 s load after a restart)
            from kvtool.kernels import warm_up
            warm_up(self.policy.codecs(), self.model_info["dtype"])
            if self._on_device():  # GPU kernels autotuned at a chunk's shape, too
                with contextlib.suppress(Exception):  # the first load or save reports it
                    kv, layout, _ = self._layer_table()[0]
                    device_io.warm_up(self.policy, kv, layout, self.chunk_tokens)

    def _on_device(self) -> bool:
        """Whether this worker's paged caches are saved and loaded on their device (CUDA:
        codes, never raw K/V, cross to the host; see :mod:`~kvtool.engines.vllm.device_io`)."""
        return bool(self._kv_caches) and device_io.on_device(next(iter(self._kv_caches.values())))

    def _layer_table(self) -> list[tuple[torch.Tensor, PagedLayout, int]]:
        """The caches as :data:`paged_io.Layers`: (cache, layout, kernel blocks per scheduler
        block), in model layer order; made once per :meth:`register_kv_caches` (and a reason
        they cannot be read is raised at every save and load, never probed for again)."""
        if self._layers is None:
            if getattr(self, "_layers_refused", None) is not None:
                raise self._layers_refused
            from vllm.model_executor.models.utils import extract_layer_index

            try:
                layers = paged_io.layer_table(
                    self._kv_caches, self._vllm_config.compilation_config.static_forward_context,
                    int(getattr(self._kv_cache_config, "num_blocks", 0) or 0), self.model_info,
                    extract_layer_index, vllm_cpu_writer)
                if any(layout.fp8 for _, layout, _ in layers) and \
                        not self.policy.is_lossy(self.model_info["dtype"]):
                    raise KvtoolError(FP8_LOSSLESS)
            except Exception as e:
                self._layers_refused = e
                raise
            self._layers = layers
            if self.store is not None:
                self.store.lossy_sources = fp8_sources(layers)
        return self._layers

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        self._withheld.reported()  # the last step's failures, if vLLM did not ask for them
        self._withheld.heard(getattr(meta, "heard_failed", ()))
        self._step = getattr(meta, "step", 0)
        start = time.perf_counter()
        for spec in getattr(meta, "loads", ()):
            before, began = activity.totals(), time.perf_counter()
            self._load(spec)
            seconds, after = time.perf_counter() - began, activity.totals()
            activity.observe("load", seconds)
            log.info("kvtool store: loaded %d tokens (%d bytes) for request %s in %.0f ms (%s)",
                     after["tokens_loaded"] - before["tokens_loaded"],
                     after["bytes_loaded"] - before["bytes_loaded"], spec.req_id, seconds * 1e3,
                     activity.summary())
        add_time("load_seconds", time.perf_counter() - start)

    def _load(self, spec: LoadSpec) -> None:
        """Scatter the sources' tokens ``[spec.start, spec.stop)`` into the request's blocks;
        on any failure, report the blocks from there on so that vLLM recomputes them."""
        covered = spec.start
        for src in spec.sources:
            a, b = max(covered, src.start), min(spec.stop, src.stop)
            if a >= b:
                continue
            try:
                if src.start > covered:
                    raise ValueError(f"no source for tokens {covered}..{src.start}")
                self._loaded_lossy.update(paged_io.load_source(
                    self._layer_table(), spec.block_ids, src, a, b, self.store, self.guard,
                    self.model_info, self._on_device()))
            except Exception as e:  # any damage: recompute from here on
                log.warning("kvtool: cannot load %s (%s: %s); recomputing tokens %d..%d",
                            src.path, type(e).__name__, str(e)[:200], covered, spec.stop)
                break
            count("tokens_loaded", b - a)
            count("files_loaded")
            activity.record("bytes_loaded", activity.file_bytes(src.path))
            covered = b
        if covered < spec.stop:
            count("load_failures")
            first, last = covered // self.block_size, -(-spec.stop // self.block_size)
            self._failed_blocks.update(spec.block_ids[first:last])
            self._withheld.load_failed(spec.req_id, spec.block_ids[first:last])
            self._failed_steps.add(self._step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loads every layer synchronously

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # wait_for_save gathers finished chunks from the registered caches

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        start = time.perf_counter()
        for spec in getattr(meta, "saves", ()):
            if not self._withheld.withheld(spec.req_id, spec.block_ids):
                self._save(spec)
        add_time("save_seconds", time.perf_counter() - start)

    def _save(self, spec: SaveSpec) -> None:
        """Copy the chunks out of the paged cache now (their blocks may be reused after this
        step); encode and write them on the saver thread unless ``save_mode`` is ``sync``. On
        a GPU the chunks are encoded now, on the device, and only their codes are copied out
        (:func:`paged_io.copy_out`)."""
        if spec.chunks and self.store.tokenizer_fingerprint is None:
            self.store.tokenizer_fingerprint = self._tokenizer_fingerprint()
        chunks = spec.chunks
        if chunks and (self.guard.is_down or (self.async_save and saves_full())):
            count("saves_dropped", len(chunks))  # a stalled store: a future miss, not a pile-up
            chunks = []
        copies = []
        for chunk in chunks:
            try:
                copies.append((chunk, *paged_io.copy_out(
                    self._layer_table(), spec.block_ids, chunk, self.store, self._on_device())))
            except Exception as e:
                save_failed(chunk, e)
                break
        if copies:
            ids = spec.token_ids[:copies[-1][0].stop]
            if not self.async_save:
                self._write(copies, ids)
            elif submit(self._write, copies, ids, bounded=True,
                        nbytes=sum(held_bytes(data) for _, *data in copies)) is None:
                count("saves_dropped", len(copies))
        if spec.capture_path:
            self._capture(spec)

    def _write(self, copies: list, token_ids: list[int]) -> None:
        write_chunks(self.store, self.budget, copies, token_ids, self.guard)

    def shutdown(self) -> None:
        flush()
        if self.guard is not None:
            self.guard.shutdown()
        if self._stats_file is not None:
            self._stats_file.write()

    def _capture(self, spec: SaveSpec) -> None:
        gather = lambda: paged_io.gather(  # noqa: E731
            self._layer_table(), spec.block_ids, 0, len(spec.token_ids))
        write_capture(spec.capture_path, gather, spec.token_ids, self.model_info,
                      [*fp8_sources(self._layer_table()), *self._loaded_lossy],
                      self._tokenizer_fingerprint())

    def _tokenizer_fingerprint(self) -> str | None:
        if self._tokenizer_fp is None:
            self._tokenizer_fp = tokenizer_fingerprint_of(self._vllm_config)
        return self._tokenizer_fp or None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[None, None]:
        return None, None  # no transfer outlives its step

    def build_connector_worker_meta(self) -> Any:
        if not self._failed_steps:
            return None
        meta, self._failed_steps = KvtoolWorkerMetadata(self._failed_steps), set()
        return meta

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        self._withheld.reported()
        return failed
