"""Pinning a .kvz's prefix in a prefix store (``kvtool store pin`` / ``unpin``): its full chunks
stored as a server of its model would key and encode them, and listed in the store's pins file,
so that neither ``kvtool store prune`` nor a server's ``max_bytes`` ever removes them."""

from __future__ import annotations

import json
import os
from typing import Any

from kvtool.engines.vllm.store_admin import backend_of, read_pins, refuse_foreign, write_pins
from kvtool.engines.vllm.store_backend import is_url
from kvtool.errors import KvtoolError


def pin_file(root: str | os.PathLike, path: str, *, chunk_tokens: int = 256,
             policy_options: dict[str, Any] | None = None,
             force: bool = False, model: str | None = None,
             quantization: str | None = None,
             quantization_config: str | None = None) -> tuple[int, int, int]:
    """Store a .kvz's full chunks as the connector would (same keys, for its model) and pin
    them; (chunks pinned, chunks written, of those the ones that replaced a chunk stored
    lossy or damaged: an exact file pinned losslessly replaces another server's lossy chunks,
    which a lossless server never loads). ``policy_options``: the connector's codec options
    new chunks are encoded with (default: none, its default policy); a lossy policy refuses
    a file that is already lossy unless ``force``. ``model``: the model the server runs (a
    directory, a Hub id or ``default``), whose checkpoint keys the chunks, as loaded with
    vLLM's ``quantization`` and ``quantization_config`` (JSON; :func:`served_identity`)."""
    from kvtool.engines.vllm.chunk_checks import exact_dtype
    from kvtool.engines.vllm.common import policy_from_extra, unservable
    from kvtool.engines.vllm.store import PrefixStore
    from kvtool.engines.vllm.windows import partial_windows
    from kvtool.formats import load, open_kvz
    from kvtool.formats.transcode import refuse_requantizing

    read_pins(root)  # a damaged pins file is refused before anything is written
    refuse_foreign(root)  # as is a directory that is not a store
    cache = load(path)
    why = unservable(cache, sliding_ok=True) or (
        "its sliding-window layers keep only their last tokens" if partial_windows(cache)
        else None)  # chunks hold every position of every layer
    if why:
        raise KvtoolError(f"{path}: {why}, so the server cannot serve its chunks")
    if not cache.model.get("fingerprint"):
        raise KvtoolError(f"{path}: names no model fingerprint")
    identity = served_identity(path, cache.model, model,
                               served_quantization(quantization, quantization_config))
    policy = policy_from_extra(dict(policy_options or {}), cache.model["fingerprint"])
    with open_kvz(path, verify=False) as f:
        stored_lossy = exact_dtype(f) is None
    if not force:
        refuse_requantizing(path, policy, f"pinning it with {policy.describe()}",
                            cache.lossy_sources)
    if stored_lossy and not policy.is_lossy():
        raise KvtoolError(f"{path} is stored lossy: pinning it with {policy.describe()} would "
                          "store its decoded K/V as exact chunks, which lossless servers trust; "
                          "pin it with a lossy policy (--preset quality), or pin the raw capture")
    if not is_url(str(root)):
        os.makedirs(root, exist_ok=True)
    backend = backend_of(root)
    store = PrefixStore(backend.location, identity, chunk_tokens,
                        policy,
                        tokenizer_fingerprint=cache.tokenizer_fingerprint, backend=backend)
    ids = [int(t) for t in cache.token_ids]
    chunks = store.chunks(ids)
    if not chunks:
        raise KvtoolError(f"{path}: {len(ids)} tokens is less than one chunk "
                          f"({chunk_tokens} tokens)")
    written = 0
    for c in chunks:
        keys = [k[:, c.start:c.stop] for k in cache.keys]
        values = [v[:, c.start:c.stop] for v in cache.values]
        wrote = bool(store.write(c, keys, values, ids, lossy_sources=cache.lossy_sources))
        written += wrote
    pins = read_pins(backend)
    source = os.path.realpath(path)
    for c in chunks:
        pins[c.key] = {"file": source, "model": store.fingerprint[:16]}
    write_pins(backend, pins)
    return len(chunks), written, store.replaced


def served_quantization(quantization: str | None, config: str | None) -> str | None:
    """How the server quantizes its checkpoint as it loads it: vLLM's ``--quantization``, and
    its ``--quantization-config`` (JSON), resolved by vLLM as the connector resolves them."""
    if config is None:
        return quantization
    from kvtool.engines.vllm.served_model import resolved_quantization

    try:
        given = json.loads(config)
    except ValueError as e:
        raise KvtoolError(f"--quantization-config: not JSON ({e})") from None
    try:
        return resolved_quantization(quantization, given)
    except ImportError:
        raise KvtoolError("--quantization-config needs vLLM installed: it is read as the "
                          "server reads it") from None
    except Exception as e:  # noqa: BLE001  (vLLM's own refusal, as the server would give it)
        raise KvtoolError(f"--quantization-config: vLLM refuses it: "
                          f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def served_identity(path: str, identity: dict[str, Any], model: str | None,
                    quantization: str | None = None) -> dict[str, Any]:
    """The identity a server of ``model`` keys a file's chunks by: the file's, with the
    checkpoint (``model.weights``) the server knows. A server seeds its keys with its weights
    when it knows them, so a file that names none (older, or captured from a model built in
    memory) would be stored where no server looks: without ``model``, that is warned about.
    A file of another model or checkpoint than ``model`` is refused. ``quantization``: the
    server's vLLM ``--quantization``, which makes an unquantized checkpoint another model
    (:func:`~kvtool.checkpoint.quantized_on_load`)."""
    from kvtool.engines.vllm.common import log

    if model is None:
        if quantization:
            raise KvtoolError("--quantization (or --quantization-config) names how the server "
                              "loads --model: give both")
        if identity.get("weights") is None:
            log.warning("kvtool store pin: %s names no checkpoint (model.weights): a server "
                        "that knows its model's weights will not find these chunks; give "
                        "--model, the model the server runs", path)
        return identity
    from transformers import AutoConfig

    from kvtool.checkpoint import quantized_on_load, weights_fingerprint
    from kvtool.errors import ModelMismatchError
    from kvtool.identity import model_identity, other_weights, same_model
    from kvtool.models import resolve_model

    _, location = resolve_model(model)
    if not location.is_dir():
        raise KvtoolError(f"--model {model}: the server runs a model directory, not {location}")
    if quantization and identity.get("weights") is None:
        raise KvtoolError(f"{path} names no checkpoint (model.weights), so nothing says its K/V "
                          f"were computed with --quantization {quantization}; capture it again "
                          "with vLLM running so")
    config = AutoConfig.from_pretrained(location, local_files_only=True)
    weights = quantized_on_load(weights_fingerprint(location), quantization, config)
    served = model_identity(config, weights=weights)
    if not same_model(identity, served):
        loaded = f" loaded with --quantization {quantization}" if quantization else ""
        raise ModelMismatchError(f"{path}: it belongs to another model than {model}{loaded}"
                                 f"{other_weights(identity, served)}")
    kept = {k: v for k, v in identity.items() if k != "weights"}
    return kept | ({"weights": served["weights"]} if served.get("weights") else {})


def unpin_file(root: str | os.PathLike, path: str) -> int:
    """Unpin the chunks pinned from ``path`` (they stay, prunable); how many (a
    :class:`KvtoolError` if none were)."""
    backend = backend_of(root)
    backend.check()  # no store there: an error, as for ls, stats and prune
    pins = read_pins(backend)
    source = os.path.realpath(path)
    keep = {k: v for k, v in pins.items() if v.get("file") != source}
    if len(keep) == len(pins):  # a mistyped path would read as done
        files = sorted({str(v.get("file")) for v in pins.values()})
        shown = ", ".join(files[:3]) + (", ..." if len(files) > 3 else "")
        raise KvtoolError(f"no chunks pinned from {path} in {backend.location} (pinned from: "
                          f"{shown or 'none'})")
    write_pins(backend, keep)
    return len(pins) - len(keep)
