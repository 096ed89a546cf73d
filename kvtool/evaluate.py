"""Quality of a codec policy on real caches: metrics, chunked perplexity, side-by-side text.

Pure metric functions (numpy or torch in, float out): :func:`cosine`, :func:`relative_mse`,
:func:`softmax_kl`, :func:`topk_overlap`, :func:`attention_error`.

:func:`evaluate` runs a model over a text in chunks twice: once with an exact ``DynamicCache``
(the baseline) and once with a :class:`~kvtool.engines.hf_runtime.CompressedCache`, so every chunk
attends to a past that went through encode→decode with the policy, exactly as during compressed
generation. It reports both perplexities, K/V cosine and relative MSE and the attention-score
error over the captured cache (as a .kvz file would store it: :meth:`CodecPolicy.segments`), the
bits per element the encoded bytes actually use, and optionally a greedy continuation of a prompt
with both caches.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

import torch

from kvtool.cache import KVCache
from kvtool.engines.hf_runtime import DEFAULT_BLOCK_SIZE, CompressedCache, attention_windows
from kvtool.errors import KvtoolError
from kvtool.kernels import Array, to_torch
from kvtool.models import check_context_length, max_positions
from kvtool.policy import ROLES, CodecPolicy


# -- pure metrics -----------------------------------------------------------------------------
def _f64(x: Array) -> torch.Tensor:
    return to_torch(x).detach().to(torch.float64)


def cosine(x: Array, x_hat: Array) -> float:
    """Mean cosine similarity of the vectors along the last axis (zero vectors count as 1
    when both are zero, 0 otherwise)."""
    a, b = _f64(x).flatten(0, -2), _f64(x_hat).flatten(0, -2)
    na, nb = a.norm(dim=-1), b.norm(dim=-1)
    dot = (a * b).sum(-1)
    both_zero = (na == 0) & (nb == 0)
    cos = torch.where(both_zero, torch.ones_like(dot), dot / (na * nb).clamp_min(1e-300))
    return float(cos.mean())


def relative_mse(x: Array, x_hat: Array) -> float:
    """‖x − x̂‖² / ‖x‖² over the whole array."""
    a, b = _f64(x), _f64(x_hat)
    den = float((a * a).sum())
    num = float(((a - b) ** 2).sum())
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def _masked(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return scores if mask is None else scores.masked_fill(~mask, -math.inf)


def softmax_kl(scores: Array, scores_hat: Array, mask: Array | None = None) -> float:
    """Mean over rows of KL(softmax(scores) ‖ softmax(scores_hat)) along the last axis.

    ``mask`` (bool, True = may attend) excludes positions, e.g. for causal attention.
    """
    m = None if mask is None else to_torch(mask).bool()
    p_log = torch.log_softmax(_masked(_f64(scores), m), dim=-1)
    q_log = torch.log_softmax(_masked(_f64(scores_hat), m), dim=-1)
    terms = p_log.exp() * (p_log - q_log)
    terms = torch.where(torch.isfinite(p_log), terms, torch.zeros_like(terms))
    return float(terms.sum(-1).mean())


def topk_overlap(scores: Array, scores_hat: Array, k: int = 8, mask: Array | None = None) -> float:
    """Mean fraction of each row's top-``k`` positions that both score arrays share."""
    m = None if mask is None else to_torch(mask).bool()
    s, s_hat = _masked(_f64(scores), m), _masked(_f64(scores_hat), m)
    k = min(k, s.shape[-1])
    top = s.topk(k, dim=-1).indices
    top_hat = s_hat.topk(k, dim=-1).indices
    shared = (top.unsqueeze(-1) == top_hat.unsqueeze(-2)).any(-1).sum(-1)
    return float((shared.to(torch.float64) / k).mean())


def attention_error(q: Array, k: Array, k_hat: Array, *, top_k: int = 8,
                    scale: float | None = None, mask: Array | None = None) -> dict[str, float]:
    """Attention-score error of approximate keys: softmax(q·k̂ᵀ) against softmax(q·kᵀ).

    ``q[..., M, D]``, ``k``/``k_hat[..., N, D]``; returns ``{"kl": …, "topk_overlap": …}``.
    """
    qf, kf, khf = _f64(q), _f64(k), _f64(k_hat)
    scale = scale if scale is not None else 1 / math.sqrt(qf.shape[-1])
    s, s_hat = qf @ kf.transpose(-1, -2) * scale, qf @ khf.transpose(-1, -2) * scale
    return {"kl": softmax_kl(s, s_hat, mask), "topk_overlap": topk_overlap(s, s_hat, top_k, mask)}


# -- bundled texts ----------------------------------------------------------------------------
def data_text(name: str) -> str:
    """A file from ``kvtool/data`` (``eval_text.md``, ``demo_document.md``, …)."""
    return resources.files("kvtool").joinpath("data", name).read_text(encoding="utf-8")


def demo_prompt(tokenizer: Any, question: int = 0) -> str:
    """The demo document and one of its questions, as a chat prompt when the model has one."""
    doc = data_text("demo_document.md")
    q = json.loads(data_text("demo_questions.json"))["questions"][question]["question"]
    user = f"{doc}\n\nAnswer from the document above: {q}"
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": user}],
                                             tokenize=False, add_generation_prompt=True)
    return f"{user}\nAnswer:"


# -- the captured cache through a policy ------------------------------------------------------
def _through_policy(x: torch.Tensor, policy: CodecPolicy, role: str, layer: int,
                    num_layers: int) -> tuple[torch.Tensor, int, list]:
    """x [heads, tokens, dim] → (x̂, bytes, [(segment, Encoded)]): encoded bytes, and tokens
    kept exact in the input's own dtype (``raw``) at 16 bits, a bf16/fp16 cache's width, as
    every bits/element kvtool reports counts them (a float32 run's are twice that)."""
    parts, nbytes, encoded = [], 0, []
    for seg in policy.segments(role, layer, num_layers, x.shape[-2]):
        enc = seg.codec.encode(x[..., seg.start:seg.stop, :])
        exact = seg.codec.codec_id == "raw" and getattr(seg.codec, "dtype", None) is None
        nbytes += 2 * int(math.prod(enc.shape)) if exact else enc.nbytes
        encoded.append((seg, enc))
        parts.append(seg.codec.decode(enc, "float32"))
    return (torch.cat(parts, dim=-2) if parts else x.float()), nbytes, encoded


def _scores_hat(q: torch.Tensor, encoded: list) -> torch.Tensor:
    """q·k̂ᵀ over every segment, through ``codec.scores`` (no k̂ materialised for turbo)."""
    return torch.cat([seg.codec.scores(q, enc) for seg, enc in encoded], dim=-1)


def cache_metrics(cache: KVCache, policy: CodecPolicy, *,
                  queries: list[torch.Tensor] | None = None, top_k: int = 8) -> dict[str, Any]:
    """K/V cosine, relative MSE and bits/element of ``cache`` encoded by ``policy``.

    The cache is encoded as it is, as the run that measures perplexity holds it (a lossless
    policy: no error); tokens kept exact count 16 bits (:func:`_through_policy`). With
    ``queries`` (per layer ``[q_heads, M, D]`` for the last M positions) also the attention KL
    and top-k overlap of the compressed keys, averaged over layers.
    """
    n_layers, out = cache.num_layers, {}
    attn_kl, attn_top = [], []
    for role in ROLES:
        arrays = cache.keys if role == "key" else cache.values
        cos_sum = num = den = 0.0
        nbytes = elements = 0
        for i, a in enumerate(arrays):
            x = to_torch(a)
            x_hat, b, encoded = _through_policy(x, policy, role, i, n_layers)
            xf = x.double()
            cos_sum += cosine(xf, x_hat) * (x.numel() // x.shape[-1])
            num += float(((xf - x_hat.double()) ** 2).sum())
            den += float((xf * xf).sum())
            nbytes, elements = nbytes + b, elements + x.numel()
            if role == "key" and queries is not None:
                kl, top = _layer_attention(queries[i], xf, encoded, top_k)
                attn_kl.append(kl)
                attn_top.append(top)
        vectors = elements // arrays[0].shape[-1]
        out[f"{role}_cosine"] = cos_sum / vectors
        out[f"{role}_rel_mse"] = num / den if den else 0.0
        out[f"{role}_bits_per_element"] = 8 * nbytes / elements
    out["bits_per_element"] = (out["key_bits_per_element"] + out["value_bits_per_element"]) / 2
    if attn_kl:
        out["attention_kl"] = sum(attn_kl) / len(attn_kl)
        out["attention_topk_overlap"] = sum(attn_top) / len(attn_top)
    return out


def _layer_attention(q: torch.Tensor, k: torch.Tensor, encoded: list,
                     top_k: int) -> tuple[float, float]:
    """Attention error of one layer: the last M queries (GQA-grouped) against all keys."""
    kv_heads, n, dim = k.shape
    m = q.shape[-2]
    qg = q.double().reshape(kv_heads, -1, dim)  # query heads grouped per kv head (repeat_kv)
    scale = 1 / math.sqrt(dim)
    s = qg @ k.transpose(-1, -2) * scale
    s_hat = _scores_hat(qg.float(), encoded).double() * scale
    pos = torch.arange(n - m, n).repeat(qg.shape[1] // m)  # query positions, per group row
    mask = torch.arange(n)[None, :] <= pos[:, None]
    return softmax_kl(s, s_hat, mask), topk_overlap(s, s_hat, top_k, mask)


# -- queries ----------------------------------------------------------------------------------
class _QueryCapture:
    """Forward pre-hooks that rebuild each attention layer's post-RoPE queries (Llama-style:
    ``q_proj``, optional ``q_norm``, the modeling module's ``apply_rotary_pos_emb``)."""

    def __init__(self, model: Any, last: int):
        import sys

        self.last, self.active, self.queries, self.handles = last, False, {}, []
        for mod in model.modules():
            idx = getattr(mod, "layer_idx", None)
            if idx is None or not hasattr(mod, "q_proj") or not hasattr(mod, "head_dim"):
                continue
            rope = getattr(sys.modules[type(mod).__module__], "apply_rotary_pos_emb", None)
            if rope is None:
                continue
            self.handles.append(mod.register_forward_pre_hook(
                self._hook(idx, rope), with_kwargs=True))

    def _hook(self, idx: int, rope: Any):
        def hook(mod: Any, args: tuple, kwargs: dict) -> None:
            if not self.active:
                return
            h = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            h, cos, sin = h[:, -self.last:], cos[:, -self.last:], sin[:, -self.last:]
            q = mod.q_proj(h).view(*h.shape[:-1], -1, mod.head_dim)
            if getattr(mod, "q_norm", None) is not None:
                q = mod.q_norm(q)
            q = q.transpose(1, 2)
            self.queries[idx] = rope(q, q, cos, sin)[0][0].float()
        return hook

    def remove(self) -> list[torch.Tensor] | None:
        for h in self.handles:
            h.remove()
        n = len(self.queries)
        return [self.queries[i] for i in range(n)] if n and set(self.queries) == set(range(n)) \
            else None


# -- chunked perplexity -----------------------------------------------------------------------
@torch.inference_mode()
def chunked_nll(model: Any, ids: torch.Tensor, past: Any, chunk: int,
                on_last_chunk: Any = None, on_logp: Any = None) -> tuple[float, int]:
    """Sum of next-token NLL over ``ids`` [1, T], processed ``chunk`` tokens at a time.

    ``on_logp(start, logp)`` sees each chunk's next-token log-probabilities ``[n, vocab]``
    (positions ``start …``), e.g. to compare distributions with :func:`next_token_kl`.
    """
    total, count, n = 0.0, 0, ids.shape[1]
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        if stop == n and on_last_chunk is not None:
            on_last_chunk()
        logits = model(input_ids=ids[:, start:stop], past_key_values=past, use_cache=True).logits
        targets = ids[0, start + 1:stop + 1]
        logp = torch.log_softmax(logits[0, : len(targets)].float(), dim=-1)
        total -= float(logp.gather(-1, targets[:, None]).sum())
        count += len(targets)
        if on_logp is not None and len(targets):
            on_logp(start, logp)
    return total, count


#: exact next-token probabilities kept per position for the KL: a lower bound, 1-2% under the
#: full-vocabulary KL of the default model's turbo3/turbo4/quality runs (128 read 15-18% under)
KL_TOP = 4096


def top_logp(logp: torch.Tensor, k: int = KL_TOP) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest log-probabilities of each row and their token ids (int32: a baseline
    keeps them for every position)."""
    values, idx = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return values, idx.int()


def next_token_kl(p_top: torch.Tensor, idx: torch.Tensor, q_logp: torch.Tensor) -> torch.Tensor:
    """Per-position KL(p ‖ q) in nats over p's top tokens plus one bucket for the rest.

    ``p_top``/``idx`` from :func:`top_logp` of the exact run; ``q_logp`` the full
    log-probabilities of the compressed run. Merging the tail into one bucket can only lower
    the KL (data processing): see :data:`KL_TOP`.
    """
    p_top, q_top = p_top.double(), q_logp.gather(-1, idx.long()).double()
    head = (p_top.exp() * (p_top - q_top)).sum(-1)
    # a tail below float32 rounding of the sums is no tail (its log ratio would be noise)
    p_rest = (1 - p_top.exp().sum(-1)).clamp_min(1e-12)
    q_rest = (1 - q_top.exp().sum(-1)).clamp_min(1e-12)
    tail = torch.where(p_rest > 1e-6, p_rest * (p_rest / q_rest).log(), torch.zeros_like(p_rest))
    return (head + tail).clamp_min(0)


@dataclass
class Baseline:
    """The exact run over a text: its NLL, the captured cache and the last queries."""

    ids: torch.Tensor
    chunk: int
    nll: float
    count: int
    cache: KVCache
    queries: list[torch.Tensor] | None
    top: tuple[torch.Tensor, torch.Tensor] | None = None  # (log p, ids) of the top tokens

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count)


def run_baseline(loaded: Any, text: str | None = None, *, chunk: int = 256,
                 max_tokens: int | None = None, n_queries: int = 16) -> Baseline:
    """Tokenise ``text`` (default: the bundled eval text) and run it with an exact cache."""
    from transformers import DynamicCache

    model, tok = loaded.model, loaded.tokenizer
    ids = tok(text if text is not None else data_text("eval_text.md"),
              return_tensors="pt").input_ids[:, :max_tokens]
    if ids.shape[1] < 2:
        raise KvtoolError("the evaluation text needs at least 2 tokens")
    check_context_length(ids.shape[1], max_positions(model.config), None, loaded.name,
                         "the evaluation text", "give fewer --max-tokens")
    if chunk < 1:
        raise KvtoolError(f"chunk must be >= 1, got {chunk}")
    attention_windows(model.config)  # a hybrid model's other layers hold no K/V
    ids = ids.to(next(model.parameters()).device)
    past = DynamicCache(config=model.config)
    capture = _QueryCapture(model, min(n_queries, ids.shape[1])) if n_queries else None
    tops: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        nll, count = chunked_nll(model, ids, past, chunk,
                                 (lambda: setattr(capture, "active", True)) if capture else None,
                                 lambda start, logp: tops.append(top_logp(logp)))
    finally:
        queries = capture.remove() if capture else None
    cache = KVCache([layer.keys[0] for layer in past.layers],
                    [layer.values[0] for layer in past.layers])
    top = (torch.cat([t[0] for t in tops]), torch.cat([t[1] for t in tops]))
    return Baseline(ids, chunk, nll, count, cache, queries, top)


# -- the report -------------------------------------------------------------------------------
@dataclass
class EvalReport:
    policy: dict[str, Any]
    label: str
    tokens: int
    chunk: int
    ppl: float
    baseline_ppl: float
    delta_ppl_pct: float
    metrics: dict[str, Any]
    generation: dict[str, Any] | None = None
    kl: float = math.nan  # mean next-token KL(exact ‖ compressed), nats
    #: the same over the positions after the first chunk (those that attend to the past)
    kl_past: float = math.nan
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def compare_generation(loaded: Any, policy: CodecPolicy, prompt: str, max_new_tokens: int = 32,
                       block_size: int = DEFAULT_BLOCK_SIZE) -> dict[str, Any]:
    """Greedy continuations of ``prompt`` with an exact and a compressed cache, side by side."""
    from transformers import DynamicCache

    model, tok = loaded.model, loaded.tokenizer
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    ids = ids.to(next(model.parameters()).device)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    outs = {}
    for name, past in (("baseline", DynamicCache(config=model.config)),
                       ("compressed", CompressedCache(policy, config=model.config,
                                                      block_size=block_size))):
        seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             past_key_values=past, max_new_tokens=max_new_tokens,
                             do_sample=False, top_k=None, top_p=None, temperature=None,
                             pad_token_id=pad)
        outs[name] = seq[0, ids.shape[1]:].tolist()
    a, b = outs["baseline"], outs["compressed"]
    same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a),
                                                                                         len(b)))
    return {"prompt_tokens": int(ids.shape[1]), "baseline": tok.decode(a, skip_special_tokens=True),
            "compressed": tok.decode(b, skip_special_tokens=True), "identical": a == b,
            "first_difference": None if a == b else same}


class PastRun(NamedTuple):
    """A text's run with a (compressed) past: perplexity, and the mean next-token KL against
    the exact run over every scored position and over those after the first chunk alone
    (which attend to the past; the first chunk's KL is 0 by construction)."""

    ppl: float
    kl: float
    kl_past: float


def run_with_past(model: Any, base: Baseline, past: Any, before_last: Any = None) -> PastRun:
    """:class:`PastRun` of ``base``'s text run with ``past`` (any transformers ``Cache``:
    kvtool's, or a peer's such as ``QuantizedCache``); ``before_last()`` runs before the last
    chunk (the past then holds all it will attend)."""
    kls: list[torch.Tensor] = []

    def on_logp(start: int, logp: torch.Tensor) -> None:
        if base.top is not None:
            sl = slice(start, start + logp.shape[0])
            kls.append(next_token_kl(base.top[0][sl], base.top[1][sl], logp))

    nll, count = chunked_nll(model, base.ids, past, base.chunk, on_last_chunk=before_last,
                             on_logp=on_logp)
    kl = torch.cat(kls) if kls else torch.empty(0)
    return PastRun(math.exp(nll / count), float(kl.mean()) if kls else math.nan,
                   float(kl[base.chunk:].mean()) if kl.numel() > base.chunk else math.nan)


def evaluate(loaded: Any, policy: CodecPolicy, text: str | None = None, *, chunk: int = 256,
             block_size: int = DEFAULT_BLOCK_SIZE, max_tokens: int | None = None,
             baseline: Baseline | None = None, prompt: str | None = None,
             max_new_tokens: int = 0, n_queries: int = 16) -> EvalReport:
    """Chunked perplexity with a compressed past against the exact run, plus cache metrics.

    Pass ``baseline`` (from :func:`run_baseline`) to evaluate many policies on one text.
    ``max_new_tokens > 0`` adds a side-by-side greedy continuation of ``prompt`` (default: the
    bundled demo document and its first question).
    """
    base = baseline or run_baseline(loaded, text, chunk=chunk, max_tokens=max_tokens,
                                    n_queries=n_queries)
    if base.ids.shape[1] <= base.chunk:  # "+0.000%" would read as "lossless"
        raise KvtoolError(f"the text's {base.ids.shape[1]} tokens fit in one chunk of "
                          f"{base.chunk}: no chunk attends to a compressed past, so the "
                          "perplexity cannot change; give a smaller --chunk or more tokens")
    model = loaded.model
    policy = policy.resolve(base.cache)
    past = CompressedCache(policy, config=model.config, block_size=block_size)
    if policy.is_lossy() and all(s.codec is None for layer in past.layers
                                 for s in layer.streams):
        raise KvtoolError(f"the policy keeps all {len(past.layers)} layers lossless "
                          "(protected), so the result would read as lossless: protect fewer")

    def some_encoded() -> None:  # else "+0.000%" and KL 0 would read as "lossless"
        if not past.encoded_tokens() and policy.is_lossy():
            raise KvtoolError(
                f"no chunk of {base.chunk} tokens attends to an encoded token: the "
                f"{policy.sink_tokens} sink and {policy.recent_tokens} recent tokens stay "
                f"exact, and blocks of {block_size} are encoded behind them, so the result "
                "would read as lossless; give more tokens, a smaller --chunk or --block-size")

    run = run_with_past(model, base, past, before_last=some_encoded)
    metrics = cache_metrics(base.cache, policy, queries=base.queries)
    metrics["runtime_resident_bytes"] = past.nbytes()
    gen = None
    if max_new_tokens > 0:
        if prompt is not None and not prompt.strip():
            raise KvtoolError("the prompt is empty: give text, or None for the demo document "
                              "and a question about it")
        gen = compare_generation(loaded, policy,
                                 demo_prompt(loaded.tokenizer) if prompt is None else prompt,
                                 max_new_tokens, block_size)
    return EvalReport(policy.to_json(), policy.describe(), int(base.ids.shape[1]), base.chunk,
                      run.ppl, base.ppl, 100 * (run.ppl / base.ppl - 1), metrics, gen, run.kl,
                      run.kl_past)


def read_text(path: str | Path | None) -> str | None:
    """The text of ``path`` (None: the bundled eval text is used by :func:`evaluate`)."""
    from kvtool.fileio import read_text_file

    return None if path is None else read_text_file(str(path))
