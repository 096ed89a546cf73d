"""``kvtool serve --engine mlx``: mlx-lm's OpenAI-compatible server on kvtool's compressed cache.

:func:`plan` builds the command line (``python -m kvtool.engines.mlx_serve ...``); running this
module patches ``mlx_lm.server`` and hands over to its ``main``:

* every prompt cache the server makes (``make_prompt_cache``) is a list of
  :class:`~kvtool.engines.mlx_cache.KvtoolMLXCache` layers under the chosen
  :class:`~kvtool.policy.CodecPolicy`, so the prompts that mlx-lm's LRU prompt cache keeps
  between requests stay compressed in memory;
* concurrent requests are batched as mlx-lm batches them, each row of the batch the
  request's own ``KvtoolMLXCache`` (codes, decoded per forward), which goes back to the LRU
  with its prefix's codes kept (:mod:`kvtool.engines.mlx_batch`);
* models load as ``kvtool.engines.mlx.load_mlx`` does (the RoPE settings of transformers-5
  configs, the chosen dtype), and the names ``default`` / the served model name map to it;
* with ``--store DIR`` the LRU prompt cache persists (:mod:`kvtool.engines.mlx_store`): every
  entry it keeps is also written to ``DIR`` as an mlx-lm prompt-cache file
  (``save_prompt_cache``, codes only, checksummed), files of evicted entries are removed, and a
  restarted server loads the files of the same model, dtype and policy back, so a returning
  conversation's prefix is not recomputed. One server owns a store at a time.

The vLLM launcher (:mod:`kvtool.engines.vllm.serve`) returns the same
:class:`~kvtool.engines.vllm.serve.ServePlan`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvtool.errors import KvtoolError

ENTRY_POINT = "kvtool.engines.mlx_serve"
#: what the launcher's command line sets (see ``kvtool.engines.vllm.serve.refuse_own``)
#: (``--kvtool-block-size`` is the entry point's too, but the launcher leaves it to ``--``)
_OWN_ARGS = {"--model": "--model", "--served-model-name": None, "--dtype": "--dtype",
             "--kvtool-policy": "codec options (--codec, --preset, ...)", "--store": "--store",
             "--host": "--host", "--port": "--port"}
BLOCK_ARG = "--kvtool-block-size"
MAX_BLOCK_SIZE = 1 << 16


def plan(model: str = "default", *, host: str = "127.0.0.1", port: int = 8000,
         store: str | None = None, dtype: str | None = None,
         policy_options: dict[str, Any] | None = None, engine_args: tuple[str, ...] = ()):
    """The server's command line and summary (nothing is started)."""
    from kvtool.codecs.params import is_digits
    from kvtool.engines.vllm.common import given_options, policy_from_extra
    from kvtool.engines.vllm.serve import ServePlan, check_listen, engine_value, refuse_own
    from kvtool.engines.vllm.store_backend import URL_SCHEME
    from kvtool.identity import model_fingerprint
    from kvtool.models import resolve_model

    refuse_own(engine_args, _OWN_ARGS, "mlx_lm.server")
    check_listen(host, port, bind=False)
    for arg in engine_args:  # argparse abbreviations included (--kv-b)
        name = arg.split("=", 1)[0].replace("_", "-")
        if len(name) > len("--kv-") and "--kv-bits".startswith(name):
            raise KvtoolError(f"-- {name}: mlx-lm quantizes only its own cache layers; "
                              "kvtool's stay as its codec options make them: give kvtool "
                              "serve codec options (--codec, --preset, ...) instead")
    block = engine_value(engine_args, BLOCK_ARG, len(BLOCK_ARG))
    if block is not None and not (is_digits(block) and 1 <= int(block) <= MAX_BLOCK_SIZE):
        raise KvtoolError(f"-- {BLOCK_ARG} {block[:20]}: tokens per encoded block, a whole "
                          f"number in 1..{MAX_BLOCK_SIZE}")
    if store is not None and (not store.strip() or URL_SCHEME.match(store)):
        raise KvtoolError(f"--store {store[:80]}: the mlx engine's store is a local directory "
                          "(an s3:// store is vLLM's)")
    if store:
        _check_store_path(store)
    name, location = resolve_model(model)
    if location.suffix.lower() == ".gguf":
        raise KvtoolError(f"mlx-lm serves Hugging Face model directories, not GGUF files "
                          f"({location}); use --model default or a converted directory")
    options = given_options(policy_options)
    # the vLLM server's defaults when no codec is given; a preset fitted to this model (and a
    # policy file calibrated for another one, refused) as the vLLM connector resolves them
    config = _config(location)
    policy = policy_from_extra(options, model_fingerprint(config))
    layers = getattr(config.get_text_config(), "num_hidden_layers", None)
    if isinstance(layers, int):  # per-layer codecs of another model: refused before the start
        policy.check_layers(layers)
    dtype = dtype or "float32"  # mlx's CPU matmuls run float32
    argv = [sys.executable, "-m", ENTRY_POINT, "--model", str(location),
            "--served-model-name", name, "--dtype", dtype,
            "--kvtool-policy", json.dumps(policy.to_json(), sort_keys=True),
            "--host", host, "--port", str(port)]
    if store:
        argv += ["--store", store]
    argv += list(engine_args)
    launcher = {"cache": "KvtoolMLXCache", "dtype": dtype, "policy": policy.to_json()}
    if store:
        launcher["store_path"] = store
    out = ServePlan(argv=argv, url=f"http://{host}:{port}/v1", model=name, store=store,
                    policy=policy.describe(), pins=[], connector=launcher)
    # reused prompts attend to decoded K/V unless both codecs are lossless
    out.lossy = policy.is_lossy(dtype)
    from kvtool.engines.mlx_cache import ignored_window
    from kvtool.engines.vllm.windows import model_windows
    from kvtool.identity import kv_layout

    windows = cache_layout(str(location))["windows"]
    window = ignored_window(model_windows({"layout": kv_layout(config)}, len(windows)), windows)
    if window is not None:  # as mlx_lm.server itself
        out.notes.append(f"mlx-lm ignores this model's sliding window of {window} tokens (it "
                         "attends to every token): past it, answers are not the model's; "
                         "--engine vllm serves it as the model")
    return out


def _check_store_path(store: str) -> None:
    """Refuse a ``--store`` that is not a directory the server could create and write, or a
    directory of other files (a model directory, the user's home: a mistyped path)."""
    from kvtool.engines.mlx_store import foreign_entries
    from kvtool.fileio import check_store_dir

    check_store_dir(store)
    foreign = foreign_entries(store)
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise KvtoolError(f"--store {store}: holds files that are not stored prompt caches "
                          f"({shown}); give a new or empty directory")


def _config(location: Path) -> Any:
    """The model directory's transformers config (no weights loaded)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(location, local_files_only=True)


def cache_layout(model_path: str) -> dict[str, Any]:
    """The cache layout of the mlx-lm model at ``model_path``, from its lazily loaded modules
    (no weights read): ``windows`` per layer (None: full attention) and ``kv_shape`` (KV
    heads, head_dim; None where its modules do not say). The store checks each stored ring
    against them before a restart serves it, and a model whose cache kvtool cannot hold is
    refused at the start, not at the first request."""
    from mlx_lm.utils import load_model

    from kvtool.engines.mlx import rope_config
    from kvtool.engines.mlx_cache import kv_shape, sliding_windows

    model, _ = load_model(Path(model_path), lazy=True, model_config=rope_config(model_path))
    return {"windows": sliding_windows(model), "kv_shape": kv_shape(model)}


# -- the patches --------------------------------------------------------------------------------
def install(policy: Any, *, model_path: str, dtype: str, names: list[str],
            store: str | None = None, block_size: int | None = None) -> None:
    """Patch ``mlx_lm.server`` to run on kvtool's cache (see the module docstring)."""
    from mlx_lm import server
    from transformers import AutoConfig

    from kvtool.checkpoint import weights_fingerprint
    from kvtool.engines.mlx import MX_DTYPES, rope_config
    from kvtool.engines.mlx_cache import DEFAULT_BLOCK_SIZE, make_kvtool_cache
    from kvtool.engines.mlx_store import prompt_cache_class
    from kvtool.identity import model_identity

    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    identity = dict(model_identity(config, dtype=dtype,
                                   weights=weights_fingerprint(model_path)),
                    path=model_path, dtype=dtype, **cache_layout(model_path))
    mlx_generate = importlib.import_module("mlx_lm.generate")  # mlx_lm.generate: a function
    original_load, original_init = server.load, server.ModelProvider.__init__

    def load(path: str, *args: Any, **kwargs: Any) -> Any:
        kwargs["model_config"] = {**rope_config(path), **(kwargs.get("model_config") or {})}
        out = original_load(path, *args, **kwargs)
        out[0].set_dtype(MX_DTYPES[dtype])
        return out

    def make_prompt_cache(model: Any, max_kv_size: int | None = None) -> list[Any]:
        if max_kv_size is not None:
            raise KvtoolError("kvtool's mlx server does not support a rotating cache "
                              "(max_kv_size)")
        return make_kvtool_cache(model, policy, block_size=block_size or DEFAULT_BLOCK_SIZE)

    def provider_init(self: Any, cli_args: Any) -> None:
        original_init(self, cli_args)
        for name in names:  # requests may name the model as kvtool does, with its adapter
            self._model_map.setdefault(name, cli_args.model)
            if cli_args.adapter_path is not None:  # (as "default_model" has: mlx-lm finds a
                self._adapter_map.setdefault(name, cli_args.adapter_path)  # request's by name)

    def scan_cache_dir(*args: Any, **kwargs: Any) -> Any:
        """``GET /v1/models`` lists the Hub cache's models: none, not a 200 with an empty body
        and a traceback, when that cache does not exist (kvtool's models live elsewhere)."""
        from huggingface_hub.errors import CacheNotFound

        try:
            return original_scan(*args, **kwargs)
        except CacheNotFound:
            return SimpleNamespace(repos=[])

    original_scan = server.scan_cache_dir
    server.scan_cache_dir = scan_cache_dir
    server.load = load
    server.make_prompt_cache = make_prompt_cache
    mlx_generate.make_prompt_cache = make_prompt_cache  # BatchGenerator's caches for new prompts
    server.ModelProvider.__init__ = provider_init
    server.LRUPromptCache = prompt_cache_class(policy, identity, store)
    # printed: mlx_lm.server configures logging (--log-level) only once it starts
    print(f"kvtool: mlx-lm prompt caches are KvtoolMLXCache ({policy.describe()}, {dtype})",
          file=sys.stderr, flush=True)


_STOPPING: list[int] = []


def _stop(signum: int, frame: Any) -> None:
    """The first SIGINT or SIGTERM stops the server (mlx-lm's server catches the
    KeyboardInterrupt and joins its generation thread); a second one exits at once. Python
    exiting while the generation thread runs mlx aborts the process instead."""
    if _STOPPING:
        os._exit(128 + signum)
    _STOPPING.append(signum)
    print("kvtool: stopping (a second signal exits at once)",
          file=sys.stderr, flush=True)
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    """``python -m kvtool.engines.mlx_serve``: kvtool's options, then mlx_lm.server's."""
    from kvtool.engines.mlx import MX_DTYPES
    from kvtool.policy import CodecPolicy

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=False,
                                 allow_abbrev=False)  # abbreviations are mlx_lm.server's
    ap.add_argument("--model", required=True)
    ap.add_argument("--served-model-name", action="append", default=[])
    ap.add_argument("--dtype", default="float32", choices=sorted(MX_DTYPES))
    ap.add_argument("--kvtool-policy", required=True, help="CodecPolicy JSON")
    ap.add_argument("--store", help="directory the prompt cache persists in")
    ap.add_argument(BLOCK_ARG, "--kvtool_block_size", type=int,
                    help="tokens per encoded block of KvtoolMLXCache (default: 64)")
    args, rest = ap.parse_known_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from kvtool.engines.mlx_store import SAVING, lock_store

    if args.store:
        try:
            lock = lock_store(args.store)  # noqa: F841 (held while the server runs)
        except KvtoolError as e:
            sys.exit(f"kvtool serve: {e}")
    policy = CodecPolicy.from_json(json.loads(args.kvtool_policy))
    install(policy, model_path=args.model, dtype=args.dtype,
            names=["default", *args.served_model_name], store=args.store,
            block_size=args.kvtool_block_size)
    from mlx_lm import server

    # a SIGTERM stops the server as Ctrl-C does: mlx-lm's server then joins its generation
    # thread, which finishes its request and the store write that follows it
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    sys.argv = ["mlx_lm.server", "--model", args.model, *rest]
    try:
        server.main()
    finally:  # (a second signal cut that join short) a write in progress ends first
        if SAVING.acquire(timeout=60):
            SAVING.release()


if __name__ == "__main__":
    main()
