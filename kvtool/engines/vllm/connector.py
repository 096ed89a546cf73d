"""``KvtoolConnector``: a persistent, compressed prefix store for vLLM (KV connector API v1).

Load it with ``--kv-transfer-config '{"kv_connector": "KvtoolConnector", "kv_role": "kv_both",
"kv_connector_extra_config": {"store_path": "/var/cache/kvtool"}}'`` (registered through kvtool's
``vllm.general_plugins`` entry point; or add ``"kv_connector_module_path":
"kvtool.engines.vllm.connector"``). ``kv_role`` ``kv_both`` loads and saves, ``kv_consumer`` only
loads (a read-only shared store), ``kv_producer`` only saves. Extra config keys (all optional):

``store_path``   the prefix store (:mod:`~kvtool.engines.vllm.store`): a directory or an
                 ``s3://bucket/prefix`` URL (endpoint and credentials from the standard AWS
                 environment); none: no store
``storage_options`` for an S3 store: options of its boto3 client (``endpoint_url``, ...)
                 and its timeouts ``connect_timeout`` (2 s), ``read_timeout`` (5 s),
                 ``max_attempts`` (2) (see :mod:`~kvtool.engines.vllm.store_s3`)
``store_timeout`` seconds a lookup, or one chunk's read, may take before it counts as a
                 miss and the prefix is computed (default 1); a store that times out or is
                 unreachable is skipped, and saves to it dropped, for a backoff that doubles
                 from 2 s to 30 s while it lasts (:mod:`~kvtool.engines.vllm.guard`)
``codec``, ``key_codec``, ``value_codec``, ``protect_layers``, ``sink_tokens``, ``zstd``
                 the codec policy of stored chunks; ``preset``: a named one. Default: the
                 ``quality`` preset (3.78 bits/element, zstd on; see ``DEFAULT_PRESET``).
                 Still lossy: the startup log says so; ``codec: raw`` stores exact K/V
                 (identical answers).
``entropy``      rANS-code stored chunks (codes at their entropy: ~12% smaller for 3-bit
                 codes, loads ~2.5× slower to decode than fixed-width; default off)
``chunk_tokens`` tokens per stored chunk, rounded up to whole blocks (default: ≥ 256; smaller
                 chunks share finer prefixes but cost more per-file overhead on load)
``max_bytes``    bound the whole store (every model; chunks, quarantine and temp files): a
                 writer makes room before each write, evicting least recently hit chunks down
                 to 90% of it (``500MB``, ``2GiB`` or bytes; default: unbounded; see
                 ``kvtool store prune``). A full disk (ENOSPC, EDQUOT) makes room the same way
                 and the write is tried once more (:mod:`~kvtool.engines.vllm.saver`)
``quarantine_max_bytes``, ``quarantine_max_age`` bound the quarantine folder (default: 10%
                 of ``max_bytes`` or 1 GiB, and 7 days); the oldest files go first
``load``, ``save`` turn reading / writing the store off (default: both on)
``save_mode``    ``async`` (default: chunks are copied out of the paged cache in the step that
                 computes them, then encoded and written by a background thread — on a GPU
                 encoded in the step and only their codes copied out; see :func:`flush`) or
                 ``sync`` (written before the step returns)
``kvz_files``    .kvz files (e.g. from ``kvtool capture``) served read-only as prefixes to
                 every request (each must be a regular file, not a symlink)
``kvz_dirs``     directories whose .kvz files a request may name as ``kvtool_kvz``; a
                 request's path must resolve (symlinks resolved) to a regular file under one
                 of them or to one of ``kvz_files``, else it is refused, unopened, with a
                 warning (default: none; in-process callers may use :func:`allow_kvz`)
``capture_dir``  where requests that ask for it get their whole prompt's K/V written, lossless,
                 as ``<capture_name(ids)>.kvz`` (``capture_all``: every request)
``model_name``, ``tokenizer_fingerprint``  identity written into the files' headers
``on_load_error`` ``"recompute"`` (default; sets vLLM's ``kv_load_failure_policy``) or ``"fail"``
``stats_interval`` seconds between writes of the process's counters to ``<store>/stats/``
                 (``kvtool store stats``; default 5; 0: none; see ``activity``)

Hits, misses, loads and saves (with latencies and failure counts) are logged at INFO and
exported on a vLLM server's ``/metrics`` (:mod:`~kvtool.engines.vllm.metrics`).

Requests whose K/V the token ids alone do not determine (multimodal inputs, LoRA adapters, a
``cache_salt``, prompt embeddings) bypass the connector. Per request,
``SamplingParams(extra_args={"kv_transfer_params": {...}})`` may carry
``kvtool_load``/``kvtool_save`` (false: bypass the store), ``kvtool_kvz`` (a .kvz file served to
this request only) and ``kvtool_capture`` (true: capture its prompt).

A damaged or foreign file, or a failed write (full disk), never stops the engine: the file is
skipped (or its blocks reported to vLLM as failed, so the prefix is recomputed) with a warning,
and :func:`stats` counts it. The recomputed chunks are stored in its place; nothing computed
over the failed blocks is (:mod:`~kvtool.engines.vllm.load_failures`). No file is ever deleted
on a load error: a damaged chunk is moved to the store's quarantine folder by a role that
writes, only skipped by ``kv_consumer``; chunks of a newer kvtool are left alone; symlinks in
the store are not followed (see :mod:`~kvtool.engines.vllm.store`). A writing scheduler removes
stale temp files of killed writers on start-up (on the saver thread).

The scheduler-side half finds the longest stored prefix and plans loads and saves into
:class:`KvtoolMetadata`; the worker-side half (:mod:`~kvtool.engines.vllm.connector_worker`)
decodes files into the paged cache before the forward pass (``start_load_kv``) and gathers newly
computed chunks after it (``wait_for_save``) through :mod:`~kvtool.engines.vllm.paged_io` and
:mod:`~kvtool.engines.vllm.layout`. On CUDA caches both happen on the GPU, and only codes cross
to and from the host (:mod:`~kvtool.engines.vllm.device_io`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtool.engines.vllm import activity
from kvtool.engines.vllm.common import (  # noqa: F401  (stats etc. re-exported)
    DEFAULT_ZSTD,
    MIN_CHUNK_TOKENS,
    LoadSpec,
    ReqState,
    SaveSpec,
    Source,
    add_time,
    allow_kvz,
    budget_options,
    capture_name,
    check_cache,
    common_prefix,
    count,
    ensure_visible_logs,
    flush,
    log,
    policy_from_extra,
    read_kvz_ids,
    refreshed,
    request_kvz,
    request_switch,
    reset_stats,
    saves_full,
    stats,
    store_timeout,
    submit,
)
from kvtool.engines.vllm.connector_worker import KvtoolWorkerMetadata, WorkerHalf  # noqa: F401
from kvtool.engines.vllm.guard import StoreGuard
from kvtool.engines.vllm.layout import PagedLayout
from kvtool.engines.vllm.load_failures import PoisonedBlocks, WithheldSaves
from kvtool.engines.vllm.metrics import MetricsMixin
from kvtool.engines.vllm.options import check_extra
from kvtool.engines.vllm.served_model import model_info, refuse_dropped_blocks, refuse_parallel
from kvtool.engines.vllm.stats_files import stats_writer
from kvtool.engines.vllm.store import open_store

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


# -- metadata (scheduler → worker) -------------------------------------------------------------
@dataclass
class KvtoolMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    heard_failed: list[int] = field(default_factory=list)  # failed blocks the scheduler knows
    step: int = 0  # this step's number, which a failure report names


# -- the connector -------------------------------------------------------------------------------
class KvtoolConnector(MetricsMixin, WorkerHalf, KVConnectorBase_V1):
    """See the module docstring."""

    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = check_extra(dict(self._kv_transfer_config.kv_connector_extra_config or {}))
        refuse_parallel(vllm_config)
        if kv_cache_config is not None:
            refuse_dropped_blocks(kv_cache_config, int(vllm_config.model_config.max_model_len))
        self.block_size = int(vllm_config.cache_config.block_size)
        chunk = int(extra.get("chunk_tokens") or MIN_CHUNK_TOKENS)
        self.chunk_tokens = -(-chunk // self.block_size) * self.block_size
        self.model_info = model_info(vllm_config, extra.get("model_name"))
        self._tokenizer_fp = extra.get("tokenizer_fingerprint")
        self.policy = policy_from_extra(extra, self.model_info.get("fingerprint"))
        if isinstance(self.model_info.get("num_layers"), int):  # not at every save, failing
            self.policy.check_layers(self.model_info["num_layers"])
        ensure_visible_logs()
        self.zstd = extra.get("zstd", DEFAULT_ZSTD)
        self.capture_dir = extra.get("capture_dir")
        self.capture_all = extra.get("capture_all", False)
        kv_role = self._kv_transfer_config.kv_role  # kv_producer: save only; kv_consumer: load
        self.store = None
        self.guard: StoreGuard | None = None
        if extra.get("store_path"):
            self.store = open_store(
                extra["store_path"], self.model_info, self.chunk_tokens, self.policy,
                zstd=self.zstd, entropy=extra.get("entropy", False),
                writable=kv_role != "kv_consumer",
                storage_options=extra.get("storage_options"))
            if role == KVConnectorRole.SCHEDULER and self.store.writable:
                submit(self.store.collect_garbage)
            if role == KVConnectorRole.SCHEDULER:
                activity.log_policy(self.policy, self.model_info.get("dtype"))
            self.guard = StoreGuard(str(self.store.root), store_timeout(extra))
        self._stats_file = None
        if self.store is not None and self.store.writable:
            self._stats_file = stats_writer(self.store, self.model_info.get("dtype"),
                                            float(extra.get("stats_interval", 5)))
        self.budget = None
        if self.store is not None and self.store.writable:
            from kvtool.engines.vllm.store_budget import StoreBudget

            self.budget = StoreBudget(self.store.backend, **budget_options(extra))
        self.load_enabled = extra.get("load", True) and kv_role != "kv_producer"
        self.save_enabled = extra.get("save", True) and self.store is not None \
            and kv_role != "kv_consumer"
        self.async_save = extra.get("save_mode", "async") == "async"
        if extra.get("on_load_error", "recompute") == "recompute":
            # read by vLLM's scheduler right after it creates this connector
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        # scheduler side
        self._reqs: dict[str, ReqState] = {}
        self._pending: dict[str, tuple[int, list[Source]]] = {}
        self._poisoned = PoisonedBlocks(self.block_size)  # what failed loads left wrong
        self._heard: list[int] = []  # failed blocks heard of since the last step's metadata
        self._kvz_dirs = [os.path.realpath(d) for d in extra.get("kvz_dirs") or []]
        self._kvz_files = list(dict.fromkeys(os.path.realpath(p)
                                             for p in extra.get("kvz_files") or []))
        # unknown: taken as on (a file with partial windows is then not served)
        self._prefix_caching = bool(getattr(vllm_config.cache_config, "enable_prefix_caching",
                                            True))
        self._files = [read_kvz_ids(p, self.model_info, self._prefix_caching)
                       for p in self._kvz_files] if role == KVConnectorRole.SCHEDULER \
            else []
        # worker side
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layers: list[tuple[torch.Tensor, PagedLayout, int]] | None = None
        self._layers_refused: Exception | None = None  # why they cannot be read, once known
        self._failed_blocks: set[int] = set()  # reported to vLLM after this step
        self._withheld = WithheldSaves()  # saves computed over failed loads
        self._step = 0  # the number of the step being run
        self._failed_steps: set[int] = set()  # steps whose loads failed, for the scheduler
        #: the lossy sources of every file loaded into the paged caches so far: vLLM's own
        #: prefix cache may hand their blocks to any later request, so every capture says so
        self._loaded_lossy: set[str] = set()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    # ==== scheduler side ==========================================================================
    def on_new_request(self, request: Request) -> None:
        params = getattr(request, "kv_transfer_params", None) or {}
        own = params.get("kvtool_kvz")
        # K/V that the token ids alone do not determine: never shared through the store
        keyed = not (getattr(request, "mm_features", None) or getattr(request, "lora_request", None)
                     or getattr(request, "cache_salt", None)
                     or getattr(request, "prompt_embeds", None) is not None)
        self._reqs[request.request_id] = ReqState(
            list(request.prompt_token_ids or []),
            load=request_switch(params, "kvtool_load", True) and self.load_enabled and keyed,
            save=request_switch(params, "kvtool_save", True) and keyed,
            capture=request_switch(params, "kvtool_capture", self.capture_all) and keyed,
            files=[request_kvz(own, self._kvz_dirs, self._kvz_files, self.model_info,
                               self._prefix_caching)] if own else [])

    def _state(self, request: Request) -> ReqState:
        if request.request_id not in self._reqs:
            self.on_new_request(request)
        return self._reqs[request.request_id]

    def _match(self, req: ReqState) -> tuple[int, list[Source]]:
        """The longest loadable prefix of the prompt (at least one token left to compute),
        looked up once per request: vLLM asks again while a request waits for blocks. A store
        that does not answer within ``store_timeout`` counts as a miss (see :mod:`guard`)."""
        if req.match is None:
            req.match = self._lookup(req)
        return req.match

    def _lookup(self, req: ReqState) -> tuple[int, list[Source]]:
        limit = len(req.prompt) - 1
        best, sources = 0, []
        if self.store is not None and self.guard is not None:
            chunks = self.guard.lookup(self.store.lookup, req.prompt, limit)
            req.stored = len(chunks)
            if chunks:
                best = chunks[-1].stop
                sources = [Source(c.path, c.start, c.stop, c) for c in chunks]
        self._files = [refreshed(f, self.model_info, self._prefix_caching)
                       for f in self._files]
        for path, ids, whole, stamp in self._files + req.files:
            n = min(common_prefix(ids, req.prompt), limit)
            if whole and 0 < n < len(ids):
                log.info("kvtool: %s serves only a prompt that continues all of its %d tokens "
                         "(its sliding-window layers keep only their last ones); this one "
                         "shares %d", path, len(ids), n)
                n = 0
            if n > best:
                best, sources = n, [Source(path, 0, n, stamp=stamp)]
                req.from_file, req.partial_windows = n, whole
        if req.partial_windows and req.capture:
            log.warning("kvtool: no capture of this prompt: its prefix comes from a file whose "
                        "sliding-window layers keep only their last tokens")
            req.capture = False
        return best, sources

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        req = self._state(request)
        if not req.load or (self.store is None and not self._files and not req.files):
            return 0, False
        count("lookups")
        began = time.perf_counter()
        matched, sources = self._match(req)
        if not req.logged:
            req.logged = True
            activity.lookup(request.request_id, matched, len(req.prompt), len(sources),
                            time.perf_counter() - began, num_computed_tokens)
        return max(0, matched - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: Any,
                                 num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        req = self._state(request)
        matched, sources = self._match(req)
        self._pending[request.request_id] = (num_external_tokens, sources)
        count("hits")
        count("tokens_matched", num_external_tokens)
        log.info("kvtool: request %s: %d prompt tokens found in the store (of %d)",
                 request.request_id, num_external_tokens, len(req.prompt))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvtoolMetadata(heard_failed=self._heard)
        self._heard = []
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            if req_id in self._reqs:  # its blocks are freed (resumed: it gets new ones)
                self._poisoned.gone(self._reqs[req_id])
                self._reqs[req_id].block_ids = []
        scheduled = scheduler_output.num_scheduled_tokens
        steps = []  # (id, state, first token written, computed, after) of each request

        def add(req_id: str, req: ReqState, computed: int) -> None:
            loaded = self._pending.get(req_id, (0,))[0]  # written this step by a load
            steps.append((req_id, req, computed - loaded, computed,
                          computed + scheduled.get(req_id, 0)))

        for new in scheduler_output.scheduled_new_reqs:
            req = self._reqs.setdefault(new.req_id, ReqState(list(new.prompt_token_ids or [])))
            req.block_ids = list(new.block_ids[0])
            add(new.req_id, req, new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            req = self._reqs.get(req_id)
            if req is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                req.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                req.block_ids.extend(new_blocks[0])
            add(req_id, req, cached.num_computed_tokens[i])
        self._poisoned.step(steps, self.chunk_tokens)
        meta.step = self._poisoned.steps
        for req_id, req, _, computed, after in steps:
            self._plan(meta, req_id, req, computed, after)
        return meta

    def _plan(self, meta: KvtoolMetadata, req_id: str, req: ReqState, computed: int,
              after: int) -> None:
        """Add this step's load (if one is pending) and saves of chunks it completes."""
        pending = self._pending.pop(req_id, None)
        if pending is not None:
            ext, sources = pending
            meta.loads.append(LoadSpec(req_id, list(req.block_ids), computed - ext, computed,
                                       sources))
        done = min(after, len(req.prompt))
        spec = SaveSpec(req_id, list(req.block_ids), [])
        if self.save_enabled and req.save and self.store is not None:
            if req.chunks is None:
                req.chunks = self.store.chunks(req.prompt)
            ready = [c for c in req.chunks[req.next_chunk:] if c.stop <= done]
            req.next_chunk += len(ready)
            # chunks the lookup found are stored; the writer skips any other that exists
            # (no existence check here: on S3 it would be a request on the scheduler's path).
            # Tokens a .kvz file served hold its values (lossy, or cast): never stored as
            # computed ones, which a lossless server would take as exact
            spec.chunks = [c for c in ready if c.stop > req.stored * self.chunk_tokens
                           and c.start >= req.from_file]
            if spec.chunks and self.guard.is_down:  # a store out of service: no save planned
                count("saves_dropped", len(spec.chunks))
                spec.chunks = []
        if self.capture_dir and req.capture and not req.captured \
                and done >= len(req.prompt) > 0:
            req.captured = True
            spec.capture_path = os.path.join(self.capture_dir,
                                             f"{capture_name(req.prompt)}.kvz")
        if spec.chunks or spec.capture_path:
            last = len(req.prompt) if spec.capture_path else spec.chunks[-1].stop
            spec.token_ids = req.prompt[:last]
            meta.saves.append(spec)

    def update_connector_output(self, connector_output: Any) -> None:
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if invalid:
            worker = getattr(connector_output, "kv_connector_worker_meta", None)
            self._poisoned.heard(self._reqs, invalid, getattr(worker, "failed_steps", ()))
            self._heard.extend(invalid)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req = self._reqs.pop(request.request_id, None)
        if req is not None:
            self._poisoned.gone(req)
        self._pending.pop(request.request_id, None)
        return False, None
