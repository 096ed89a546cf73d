"""What every engine (HF, vLLM, mlx-lm) shares, without importing any of them or torch.

* :func:`encode_text` — token ids as each engine's Hugging Face tokenizer gives them;
  :func:`prompt_ids` — a whole prompt's, in the chat template (:func:`chat_prompt`);
* :func:`check_compatible` — refuse a cache of another model or tokenizer;
* :func:`full_ids_for` / :func:`recompute_ids` — the sequence a restore or a baseline continues;
* :class:`GenerationResult` — what a restored or recomputed generation reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtool.cache import KVCache
from kvtool.errors import KvtoolError, ModelMismatchError, PrefixMismatchError


def encode_text(tokenizer: Any, text: str, *, special: bool = True) -> list[int]:
    """Token ids of ``text`` (``special``: the tokenizer's BOS etc., as for a fresh prompt)."""
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def chat_prompt(tokenizer: Any, text: str) -> str | None:
    """``text`` as one user turn in the tokenizer's chat template, ready for the assistant's
    answer (as ``mlx_lm.generate`` does); None when the tokenizer has no template."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


def prompt_ids(tokenizer: Any, text: str, chat_template: bool = True) -> list[int]:
    """Token ids of a whole prompt: in the chat template (when asked and the tokenizer has one;
    the template writes its own special tokens), else tokenized fresh."""
    templated = chat_prompt(tokenizer, text) if chat_template else None
    if templated is None:
        return encode_text(tokenizer, text)
    return encode_text(tokenizer, templated, special=False)


def check_compatible(cache: KVCache, loaded: Any, force: bool = False) -> list[str]:
    """What differs between the cache's model/tokenizer and ``loaded`` (an engine's model with
    ``info``, ``fingerprints`` and ``name``).

    The model must be the same up to dtype (:func:`kvtool.identity.same_model`): a cache computed
    in another dtype is accepted, cast, with a logged note (:func:`kvtool.identity.log_cast`);
    one of the same layout but other weights (a fine-tune: its K/V differ) is not.
    Raises :class:`ModelMismatchError` naming the differences unless ``force``; returns them
    (empty when compatible) so a forced caller can warn.
    """
    from kvtool.identity import identity_dtype, log_cast, other_weights, same_model

    problems = []
    want = cache.model or {}
    weights = other_weights(want, loaded.info)
    if weights:
        problems.append(f"model weights differ{weights}: cache is from "
                        f"{want.get('name', 'an unknown model')}, loaded is {loaded.name}")
    elif not same_model(want, loaded.info):
        a, b = want.get("layout") or {}, loaded.info.get("layout") or {}
        keys = sorted(k for k in set(a) | set(b) if k != "dtype" and a.get(k) != b.get(k))
        detail = (" (" + ", ".join(f"{k}: {_short(a.get(k))} vs {_short(b.get(k))}"
                                   for k in keys) + ")" if keys else "")
        name = want.get("name", "an unknown model")
        problems.append(f"model fingerprint differs{detail}: cache is from {name}, "
                        f"loaded is {loaded.name}")
    if cache.tokenizer_fingerprint != loaded.fingerprints.get("tokenizer"):
        problems.append("tokenizer fingerprint differs")
    if problems and not force:
        raise ModelMismatchError("cache does not belong to this model: " + "; ".join(problems)
                                 + " (use --force to restore anyway)")
    if not problems:
        log_cast(want, identity_dtype(loaded.info) or "")
    return problems


def _short(value: Any, width: int = 48) -> str:
    """A layout value for a one-line message (a 30-layer ``layer_types`` list is ~900 chars)."""
    text = str(value)
    return text if len(text) <= width else text[:width - 3] + "..."


@dataclass
class GenerationResult:
    text: str
    new_token_ids: list[int]
    prompt_tokens: int  # the whole sequence the model continues from
    cached_tokens: int  # of which restored from the cache (0 for recompute)
    restore_s: float  # building the in-memory cache (0 for recompute)
    ttft_s: float  # restore + prefill of uncached tokens + first token
    total_s: float
    # the scores that chose the first new token: HF's logits (torch [vocab] float32), mlx-lm's
    # log-probabilities (numpy float32); None where the engine gives none (vLLM)
    first_logits: Any = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "first_logits"}


def full_ids_for(cache: KVCache, tokenizer: Any, prompt: str | None = None,
                 input_ids: Any = None) -> list[int]:
    """The sequence to continue: ``input_ids``, or the cached ids + ``prompt``'s tokens.

    Raises :class:`PrefixMismatchError` when the cached ids are not a prefix of it.
    """
    if cache.token_ids is None:
        raise PrefixMismatchError("the cache stores no token ids, so kvtool cannot check that "
                                  "the prompt extends the cached prefix")
    cached = [int(t) for t in cache.token_ids]
    vocab = len(tokenizer) if hasattr(tokenizer, "__len__") else None
    top = max(cached, default=0)
    if vocab and not 0 <= top < vocab:  # its own tokenizer made every id
        raise ModelMismatchError(f"the cache holds token id {top}, past this tokenizer's "
                                 f"{vocab} tokens: it was not computed with it")
    if input_ids is not None:
        full = [int(t) for t in input_ids]
    else:
        full = cached + (encode_text(tokenizer, prompt, special=False) if prompt else [])
    if full[:len(cached)] != cached:
        at = next((i for i, (a, b) in enumerate(zip(cached, full, strict=False)) if a != b),
                  len(full))
        raise PrefixMismatchError(f"the cached {len(cached)} tokens are not a prefix of the "
                                  f"prompt ({len(full)} tokens; first difference at token {at})")
    return full


def check_window(layer: int, held: int, total: int, window: int) -> None:
    """A :class:`ModelMismatchError` unless a sliding-window layer holding ``held`` of a
    ``total``-token sequence holds the last tokens its window of ``window`` attends to (the
    model's window: a file's own ``layer_info`` may claim a smaller one)."""
    if held < min(total, window - 1):
        raise ModelMismatchError(f"layer {layer} holds {held} of {total} tokens, fewer than "
                                 f"the last {min(total, window - 1)} its sliding window of "
                                 f"{window} attends to")


def holds_every_token(cache: KVCache) -> bool:
    """Whether every layer of ``cache`` holds all its tokens (no sliding window has slid), so
    that a prompt it covers whole can be continued by feeding its last token again."""
    return all(int(k.shape[1]) == len(cache.token_ids) for k in cache.keys)


def recompute_ids(tokenizer: Any, input_ids: Any = None, prompt: str | None = None) -> list[int]:
    """The ids a recompute baseline runs: ``input_ids``, else ``prompt`` tokenized fresh."""
    if input_ids is None:
        if prompt is None:
            raise KvtoolError("recompute_generation needs input_ids or prompt")
        input_ids = encode_text(tokenizer, prompt)
    return [int(t) for t in input_ids]
