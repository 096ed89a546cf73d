"""The connector's Prometheus metrics, through vLLM's KV-connector stats API.

vLLM V1 runs the scheduler (and, for one device, the worker) in an engine-core process apart
from the API server, so a counter incremented in the connector never reaches the server's
``/metrics`` by itself. vLLM's supported path does: every step, the connector's
``get_kv_connector_stats()`` (worker and scheduler halves) returns a :class:`KvtoolStats`
payload of what changed (:func:`~kvtool.engines.vllm.activity.drain`); vLLM aggregates it
across workers, sends it with the scheduler's stats to the API server, and there hands it to
the :class:`KvtoolPromMetrics` that ``build_prom_metrics`` made (and, summed over each log
interval, to its "KV Transfer metrics" log line).

Exported (labels ``model_name``, ``engine``, plus those shown):

=====================================  ==========================================================
``kvtool_store_requests_total``        requests looked up in the store, ``result`` hit / miss
``kvtool_store_prompt_tokens_total``   their prompt tokens, ``result`` hit (stored prefix) / miss
``kvtool_store_loaded_tokens_total``   tokens loaded into vLLM's cache (also ``_bytes``, ``_files``)
``kvtool_store_saved_tokens_total``    tokens saved to the store (also ``_bytes``, ``_chunks``)
``kvtool_store_evicted_bytes_total``   bytes evicted to stay under ``max_bytes`` (also ``_chunks``)
``kvtool_store_failures_total``        ``kind``: load, save, invalid_file, refused_file,
                                       lookup_timeout, load_timeout, unavailable (skipped while
                                       the store recovers), save_dropped, disk_full, ...
``kvtool_store_lookup_seconds``        histogram: one request's lookup in the store
``kvtool_store_load_seconds``          histogram: one request's load from the store
``kvtool_store_save_seconds``          histogram: one batch of chunks encoded and written
``kvtool_store_policy_info``           1, labelled ``policy`` and ``lossy`` (true / false)
=====================================  ==========================================================

Counters reach ``/metrics`` at the end of the engine step that made them; asynchronous saves
finish after their step and show up with the next one.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvtool.engines.vllm import activity

PREFIX = "kvtool_store_"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 2.5, 5.0,
                   10.0, 30.0)
# counter in the stats payload → (metric, extra label values)
COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "requests_hit": ("requests", ("hit",)),
    "requests_missed": ("requests", ("miss",)),
    "prompt_tokens_hit": ("prompt_tokens", ("hit",)),
    "prompt_tokens_missed": ("prompt_tokens", ("miss",)),
    "tokens_loaded": ("loaded_tokens", ()),
    "bytes_loaded": ("loaded_bytes", ()),
    "files_loaded": ("loaded_files", ()),
    "tokens_saved": ("saved_tokens", ()),
    "bytes_saved": ("saved_bytes", ()),
    "chunks_saved": ("saved_chunks", ()),
    "chunks_evicted": ("evicted_chunks", ()),
    "bytes_evicted": ("evicted_bytes", ()),
    "load_failures": ("failures", ("load",)),
    "save_failures": ("failures", ("save",)),
    "invalid_files": ("failures", ("invalid_file",)),
    "refused_files": ("failures", ("refused_file",)),
    "quarantined_files": ("failures", ("quarantined_file",)),
    "newer_files": ("failures", ("newer_file",)),
    "lookup_timeouts": ("failures", ("lookup_timeout",)),
    "load_timeouts": ("failures", ("load_timeout",)),
    "store_unavailable": ("failures", ("unavailable",)),
    "saves_dropped": ("failures", ("save_dropped",)),
    "disk_full": ("failures", ("disk_full",)),
}
DOCS: dict[str, tuple[str, list[str]]] = {  # metric → (help, extra label names)
    "requests": ("Requests looked up in kvtool's prefix store, by result", ["result"]),
    "prompt_tokens": ("Prompt tokens of those requests: hit = found in the store", ["result"]),
    "loaded_tokens": ("Tokens loaded from kvtool's store into vLLM's KV cache", []),
    "loaded_bytes": ("Bytes of store files loaded", []),
    "loaded_files": ("Store files (chunks, .kvz) loaded", []),
    "saved_tokens": ("Tokens saved to kvtool's store", []),
    "saved_bytes": ("Bytes written to kvtool's store", []),
    "saved_chunks": ("Chunk files written to kvtool's store", []),
    "evicted_chunks": ("Chunks evicted to keep the store under max_bytes", []),
    "evicted_bytes": ("Bytes evicted to keep the store under max_bytes", []),
    "failures": ("Store failures by kind (the prefix is recomputed / left unstored)", ["kind"]),
}


_OP_DOCS = {"lookup": "(one request's prompt, on the scheduler's path)",
            "load": "(one request's prefix)", "save": "(a batch of chunks)"}


class KvtoolStats(KVConnectorStats):
    """One or more :func:`~kvtool.engines.vllm.activity.drain` payloads: ``counters`` summed,
    latencies (``load_seconds``, ``save_seconds``) concatenated."""

    def __post_init__(self) -> None:
        if "counters" not in self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"counters": {}, **{f"{op}_seconds": [] for op in activity.OPS}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        counters = self.data["counters"]
        for k, v in other.data.get("counters", {}).items():
            counters[k] = counters.get(k, 0) + v
        for op in activity.OPS:
            self.data[f"{op}_seconds"] = [*self.data[f"{op}_seconds"],
                                          *other.data.get(f"{op}_seconds", [])]
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: v for k, v in self.data["counters"].items()
                                       if not k.endswith(("_count", "_seconds"))}
        for op in activity.OPS:
            seen = self.data[f"{op}_seconds"]
            if seen:
                out[f"{op}_ms_avg"] = round(1e3 * sum(seen) / len(seen), 1)
        return out

    def is_empty(self) -> bool:
        return not self.data["counters"] and not any(self.data[f"{op}_seconds"]
                                                     for op in activity.OPS)


def _unregister(name: str) -> None:
    """Drop an earlier registration of ``name`` (vLLM re-creates its stat loggers, and clears
    only ``vllm:`` names)."""
    collector = REGISTRY._names_to_collectors.get(name)
    if collector is not None:
        REGISTRY.unregister(collector)


def _fingerprint(vllm_config: Any) -> str | None:
    """The model's fingerprint, which picks a preset fitted to it (the connector resolves its
    policy the same way); None where the config cannot give one: the label is informational."""
    from kvtool.engines.vllm.served_model import model_info

    try:
        return model_info(vllm_config).get("fingerprint")
    except Exception:  # a policy label must never stop vLLM's metrics
        return None


class KvtoolPromMetrics(KVConnectorPromMetrics):
    """Registers the metrics listed in the module docstring and records :class:`KvtoolStats`
    payloads into them, per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        from kvtool.engines.vllm.common import policy_from_extra

        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {}
        for metric, (doc, extra) in DOCS.items():
            _unregister(PREFIX + metric)
            self._counters[metric] = self._counter_cls(name=PREFIX + metric, documentation=doc,
                                                       labelnames=labelnames + extra)
        self._histograms = {}
        for op in activity.OPS:
            _unregister(f"{PREFIX}{op}_seconds")
            self._histograms[op] = self._histogram_cls(
                name=f"{PREFIX}{op}_seconds", buckets=LATENCY_BUCKETS, labelnames=labelnames,
                documentation=f"Seconds per {op} of kvtool's store " + _OP_DOCS[op])
        _unregister(PREFIX + "policy_info")
        info = self._gauge_cls(name=PREFIX + "policy_info", labelnames=labelnames
                               + ["policy", "lossy"], multiprocess_mode="mostrecent",
                               documentation="kvtool store codec policy; lossy=true when "
                               "answers served from the store may differ from recomputing")
        transfer = vllm_config.kv_transfer_config
        policy = policy_from_extra(dict(transfer.kv_connector_extra_config or {}),
                                   _fingerprint(vllm_config))
        dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
        lossy = str(policy.is_lossy(dtype)).lower()
        for values in per_engine_labelvalues.values():
            info.labels(*values, policy.describe(), lossy).set(1)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for key, value in transfer_stats_data.get("counters", {}).items():
            if key in COUNTERS and value > 0:
                metric, extra = COUNTERS[key]
                self._counters[metric].labels(*labels, *extra).inc(value)
        for op in activity.OPS:
            hist = self._histograms[op].labels(*labels)
            for seconds in transfer_stats_data.get(f"{op}_seconds", ()):
                hist.observe(seconds)


class MetricsMixin:
    """The ``KVConnectorBase_V1`` hooks that carry :class:`KvtoolStats` to vLLM."""

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        data = activity.drain()
        return KvtoolStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return KvtoolStats(data=data) if data is not None else KvtoolStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics | None:
        return KvtoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
