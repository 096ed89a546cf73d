"""A model's identity in a cache: what must match for a KV cache to fit a model, and what
converts.

Fingerprints: :func:`model_fingerprint` hashes the config fields that must match for a cache to
fit a model (architecture, layers, KV heads, head_dim, RoPE, sliding-window layer types) but not
the dtype, which converts: a cache captured in float32 restores into a bfloat16 engine with a
cast (:func:`cast_note`). ``model.weights`` (:func:`kvtool.checkpoint.weights_fingerprint`)
tells two checkpoints of one layout apart (a base model and its fine-tune).
:func:`tokenizer_fingerprint` hashes the vocab, merges and special tokens.
:func:`model_identity` is the JSON-safe dict stored as ``KVCache.model``; files written before
the split carry ``dtype`` inside ``layout`` and a fingerprint over it, which
:func:`identity_key` and :func:`portable_identity` see through.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


# -- fingerprints -----------------------------------------------------------------------------
def canonical_sha256(data: Any) -> str:
    """sha256 of ``data`` as canonical JSON (sorted keys, no spaces, ASCII): the fingerprint."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


KEY_SHAPING_FIELDS = ("no_rope_layers", "use_qk_norm", "attention_chunk_size")


def kv_layout(config: Any) -> dict[str, Any]:
    """The config fields that must match for a KV cache to fit a model, JSON-safe (the input of
    the fingerprint). The dtype is not one of them: it converts (see :func:`cast_note`)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    if rope is None and getattr(text, "rope_theta", None) is not None:
        rope = {"rope_theta": text.rope_theta}
    layer_types = getattr(text, "layer_types", None)
    sliding = getattr(text, "sliding_window", None)
    uniform = not layer_types or all(t == "full_attention" for t in layer_types)
    return json.loads(json.dumps({
        "architecture": getattr(config, "model_type", None),  # the family (llama, gemma3, ...)
        "num_layers": text.num_hidden_layers,
        "num_kv_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
        "rope": rope,
        "partial_rotary_factor": getattr(text, "partial_rotary_factor", None),
        "sliding_window": sliding if layer_types is None or not uniform else None,
        "layer_types": None if uniform else list(layer_types),
        "num_kv_shared_layers": getattr(text, "num_kv_shared_layers", None),
        # fields few models set, hashed only where set and not False (Cohere's
        # use_qk_norm=False: every other model's fingerprint stays):
        # which layers rotate their keys (SmolLM3, Llama 4: NoPE layers), a weightless key
        # norm (Llama 4), chunked attention
        **{name: getattr(text, name) for name in KEY_SHAPING_FIELDS
           if getattr(text, name, None) not in (None, False)},
    }, default=str))


def model_fingerprint(config: Any) -> str:
    """sha256 of :func:`kv_layout` (canonical JSON): equal for every dtype of one model."""
    return canonical_sha256(kv_layout(config))


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 over the tokenizer's vocab, merges and added/special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = json.loads(backend.to_str())
        model = state.get("model", {})
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
        vocab = model.get("vocab") or {}
        added = [{"id": t["id"], "content": t["content"], "special": t.get("special", False)}
                 for t in state.get("added_tokens") or []]
        head = {"type": model.get("type"), "added": added}
    else:  # a slow tokenizer: what it exposes
        vocab, merges, head = tokenizer.get_vocab(), [], {"type": type(tokenizer).__name__}
    if isinstance(vocab, list):  # unigram: [[piece, score], ...]
        vocab = {str(piece[0]): i for i, piece in enumerate(vocab)}
    head["special"] = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    h = hashlib.sha256(b"kvtool-tokenizer-1\n")
    h.update(json.dumps(head, sort_keys=True, separators=(",", ":")).encode())
    # length-prefixed records: unambiguous and much faster than canonical JSON of 50k entries
    h.update("".join(f"{i}:{len(t)}:{t}" for t, i in sorted(vocab.items(), key=lambda x: x[1]))
             .encode("utf-8", "surrogatepass"))
    h.update(b"\x00merges\x00")
    h.update("".join(f"{len(m)}:{m}" for m in merges).encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def model_identity(config: Any, name: str | None = None, dtype: str | None = None,
                   architecture: str | None = None, weights: str | None = None) -> dict:
    """The JSON-safe identity stored as ``KVCache.model`` (and in the .kvz header).

    ``fingerprint`` hashes ``layout`` (what must match); ``dtype`` (the engine's, else the
    config's) says what the K/V were computed in, and converts; ``weights`` (when known:
    :func:`kvtool.checkpoint.weights_fingerprint` of the model directory) tells checkpoints
    of one layout apart."""
    layout = kv_layout(config)
    archs = getattr(config, "architectures", None) or [layout["architecture"]]
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if dtype is None:
        dtype = str(getattr(config, "dtype", None) or "float32")
    from kvtool.formats.constants import normalize_dtype

    try:
        dtype = normalize_dtype(dtype)
    except ValueError:  # not a dtype K/V are computed in ("float8_e4m3fn", "auto"): unknown
        dtype = None
    return {
        "name": name or getattr(config, "_name_or_path", None) or layout["architecture"],
        "architecture": architecture or archs[0],
        "fingerprint": canonical_sha256(layout),
        "num_layers": layout["num_layers"],
        "num_kv_heads": layout["num_kv_heads"],
        "num_attention_heads": getattr(text, "num_attention_heads", None),
        "head_dim": layout["head_dim"],
        "dtype": dtype,
        "layout": layout,
        **({"weights": weights} if weights else {}),
    }


# -- portable identity: what must match vs what converts --------------------------------------
def identity_key(model: dict[str, Any] | None) -> str | None:
    """The dtype-free fingerprint of a model identity dict (``KVCache.model``, a .kvz header's
    ``model``): its ``fingerprint``, except for an identity written before the split (``dtype``
    inside ``layout``, hashed into the fingerprint): then sha256 of that layout without
    ``dtype``, which equals today's fingerprint of the same model."""
    model = model or {}
    layout = model.get("layout")
    if isinstance(layout, dict) and "dtype" in layout:
        return canonical_sha256({k: v for k, v in layout.items() if k != "dtype"})
    fp = model.get("fingerprint")
    return str(fp) if fp is not None else None


def same_model(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Whether two identities name the same model up to dtype: the same layout
    (:func:`identity_key`) and weights that may be the same (:func:`same_weights`)."""
    key = identity_key(a)
    return key is not None and key == identity_key(b) and same_weights(a, b)


def same_weights(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """False only when both identities know their weights (``model.weights``) and
    these differ: a file or an engine that does not know them is refused for nothing."""
    theirs, ours = (a or {}).get("weights"), (b or {}).get("weights")
    return theirs is None or ours is None or theirs == ours


def valid_weights(value: Any) -> bool:
    """Whether ``value`` is a ``model.weights`` a writer gives: absent/None or a lower-case
    sha256 hex digest (a reader compares it, so anything else is refused)."""
    return value is None or (isinstance(value, str) and len(value) == 64
                             and all(c in "0123456789abcdef" for c in value))


def other_weights(a: dict[str, Any] | None, b: dict[str, Any] | None) -> str:
    """A clause for a refusal message when two identities share their layout but not their
    weights (a base model and its fine-tune); '' otherwise."""
    if identity_key(a) != identity_key(b) or same_weights(a, b):
        return ""
    return (f" (same layout, other weights: {str((a or {})['weights'])[:12]} vs "
            f"{str((b or {})['weights'])[:12]}, e.g. a fine-tune of the same base model)")


def identity_dtype(model: dict[str, Any] | None) -> str | None:
    """The dtype an identity says its K/V were computed in (None when it does not say)."""
    model = model or {}
    layout = model.get("layout") if isinstance(model.get("layout"), dict) else {}
    from kvtool.formats.constants import FLOAT_DTYPES

    dtype = model.get("dtype") or layout.get("dtype")
    return dtype if dtype in FLOAT_DTYPES else None  # a crafted {"x": 1} or "int8" says nothing


def dtype_problem(model: dict[str, Any] | None) -> str | None:
    """What is wrong with the dtype an identity declares (``dtype``, or a pre-split
    ``layout.dtype``), if anything: null or a kvtool float dtype name only. An alias or other
    name would say nothing (:func:`identity_dtype`), and a cast would then read as exact."""
    model = model or {}
    layout = model.get("layout") if isinstance(model.get("layout"), dict) else {}
    from kvtool.formats.constants import FLOAT_DTYPES

    for name, value in (("dtype", model.get("dtype")), ("layout.dtype", layout.get("dtype"))):
        if value is not None and value not in FLOAT_DTYPES:
            return (f"model.{name} is {json.dumps(value)[:40]}, not null or one of "
                    f"{', '.join(FLOAT_DTYPES)}")
    return None


def portable_identity(model: dict[str, Any]) -> dict[str, Any]:
    """``model`` in today's form: a pre-split identity (``dtype`` inside ``layout``) gets a
    dtype-free ``layout`` and ``fingerprint``, its dtype kept as ``dtype``; others unchanged."""
    layout = model.get("layout")
    if not isinstance(layout, dict) or "dtype" not in layout:
        return dict(model)
    clean = {k: v for k, v in layout.items() if k != "dtype"}
    return {**model, "layout": clean, "fingerprint": canonical_sha256(clean),
            "dtype": identity_dtype(model)}


def cast_note(model: dict[str, Any] | None, dtype: str) -> str | None:
    """A one-line note when K/V computed in the identity's dtype go into an engine running
    ``dtype`` (they are cast), else None."""
    theirs = identity_dtype(model)
    if not theirs or not dtype or theirs == dtype:
        return None
    how = "widened exactly" if dtype == "float32" else f"rounded to {dtype}"
    return (f"the cache was computed in {theirs} and the model runs {dtype}: its K/V are cast "
            f"({how}); continuations may differ slightly from a {dtype} recompute")


_NOTED: set[tuple[str, str]] = set()


def log_cast(model: dict[str, Any] | None, dtype: str, logger: Any = None) -> str | None:
    """Log :func:`cast_note` as a warning, once per process per (from, to) dtype pair; the
    note (also when already logged), or None when no cast happens."""
    import logging

    note = cast_note(model, dtype)
    if note is None:
        return None
    pair = (str(identity_dtype(model)), dtype)
    if pair not in _NOTED:
        _NOTED.add(pair)
        (logger or logging.getLogger("kvtool")).warning("kvtool: %s", note)
    return note
