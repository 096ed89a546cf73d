"""Cross-engine .kvz files: capture in one engine, continue in another, compare with recomputing.

For each source engine (HF transformers, mlx-lm, vLLM) the same prompt is captured and saved as
a raw (lossless) .kvz; every other engine restores it, feeds the question and generates greedily.
The reference is the *target* engine recomputing the whole prompt, so a lossless restore should
give the same tokens and, step by step, the same log-probabilities up to float32 noise. Columns:

* ``agree``: fraction of the generated tokens equal to the target's recompute (position-wise);
* ``max |Δlogit|``: the largest difference of log-softmax values (logits up to each step's
  constant shift) over the recompute's top-20 tokens, on the steps before any divergence;
* ``engines' gap``: the same max difference between the two engines' own recomputes (how far the
  engines' float32 arithmetic is apart anyway).

    python benchmarks/cross_engine.py                 # float32, 8 new tokens
    python benchmarks/cross_engine.py --new 16 --engines hf,mlx

The adapters below (:func:`hf_run`, :func:`mlx_run`, :func:`vllm_run`) are what
``tests/test_cross_engine.py`` drives as well.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtool.cache import KVCache

DOC = ("The lighthouse keeper of Skerry Point kept a logbook for forty years. When he retired, "
       "the logbook")
QUESTION = " went to the"
TOP_K = 20  # vLLM's default max_logprobs


@dataclass
class Run:
    """Greedy tokens and, per step, the top log-probabilities ``{token id: log-prob}``."""

    tokens: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cached: int = 0  # prompt tokens the run restored instead of computing


def _top(logprobs: np.ndarray, k: int = TOP_K) -> dict[int, float]:
    idx = np.argpartition(-logprobs, k)[:k]
    return {int(i): float(logprobs[i]) for i in idx}


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


# -- engines ------------------------------------------------------------------------------------
def hf_run(loaded: Any, ids: list[int], new: int, cache: KVCache | None = None) -> Run:
    """HF transformers: greedy ``new`` tokens after ``ids`` (restoring ``cache`` first)."""
    import torch
    from transformers import DynamicCache

    from kvtool.engines import hf

    if cache is not None:
        hf.check_compatible(cache, loaded)
        past = hf.to_dynamic_cache(cache, model=loaded.model)
    else:
        past = DynamicCache(config=loaded.model.config)
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = loaded.model.generate(input_ids=x, attention_mask=torch.ones_like(x),
                                    past_key_values=past, max_new_tokens=new, do_sample=False,
                                    num_beams=1, top_k=None, top_p=None, temperature=None,
                                    pad_token_id=loaded.tokenizer.eos_token_id,
                                    output_logits=True, return_dict_in_generate=True)
    steps = [_top(_log_softmax(s[0].float().numpy())) for s in out.logits]
    return Run(out.sequences[0, len(ids):].tolist(), steps,
               0 if cache is None else cache.num_tokens)


def mlx_run(lm: Any, ids: list[int], new: int, cache: KVCache | None = None) -> Run:
    """mlx-lm: greedy ``new`` tokens after ``ids`` (restoring ``cache`` first)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models import cache as mlx_cache

    from kvtool.engines import mlx as engine
    from kvtool.engines.common import check_compatible

    if cache is not None:
        check_compatible(cache, lm)
        layers, start = engine.to_prompt_cache(cache, lm.model), cache.num_tokens
    else:
        layers, start = mlx_cache.make_prompt_cache(lm.model), 0
    tokens, steps = [], []
    for token, logprobs in generate_step(mx.array(ids[start:]), lm.model, max_tokens=new,
                                         prompt_cache=layers):
        tokens.append(int(token))
        steps.append(_top(np.array(logprobs.astype(mx.float32)).astype(np.float64)))
    return Run(tokens, steps, start)


def vllm_run(vm: Any, ids: list[int], new: int, kvz: str | None = None) -> Run:
    """vLLM (with KvtoolConnector): greedy ``new`` tokens after ``ids``, the prefix served from
    the .kvz file ``kvz`` (``None``: recomputed, the connector bypassed)."""
    from vllm import SamplingParams

    from kvtool.engines.vllm import connector

    if kvz is not None:
        connector.allow_kvz(kvz)
        params = {"kvtool_kvz": kvz, "kvtool_save": False}
    else:
        params = {"kvtool_load": False, "kvtool_save": False}
    before = connector.stats()["tokens_loaded"]
    sampling = SamplingParams(max_tokens=new, temperature=0.0, logprobs=TOP_K,
                              extra_args={"kv_transfer_params": params})
    out = vm.llm.generate([{"prompt_token_ids": list(ids)}], sampling, use_tqdm=False)[0]
    steps = [{int(t): float(p.logprob) for t, p in step.items()}
             for step in out.outputs[0].logprobs or []]
    return Run(list(out.outputs[0].token_ids), steps,
               connector.stats()["tokens_loaded"] - before)


# -- comparison ---------------------------------------------------------------------------------
def compare(got: Run, want: Run) -> dict[str, float]:
    """Token agreement and max |Δ log-prob| (steps before the first divergence)."""
    n = min(len(got.tokens), len(want.tokens))
    same = [a == b for a, b in zip(got.tokens, want.tokens, strict=False)]
    agree = sum(same) / max(len(want.tokens), 1)
    steps = next((i for i, s in enumerate(same) if not s), n) + (0 if all(same) else 1)
    delta = 0.0
    for a, b in zip(got.logprobs[:steps], want.logprobs[:steps], strict=False):
        common = set(a) & set(b)
        if common:
            delta = max(delta, max(abs(a[t] - b[t]) for t in common))
    return {"agree": agree, "max_dlogit": delta}


def prompt_ids(tokenizer: Any) -> list[int]:
    """The continued sequence: DOC's ids (what is captured) + QUESTION's."""
    from kvtool.engines.common import encode_text

    return encode_text(tokenizer, DOC) + encode_text(tokenizer, QUESTION, special=False)


def captures(engines: dict[str, Any], text: str, out_dir: str) -> dict[str, str]:
    """``{engine: .kvz path}``: ``text`` captured by each engine, saved raw (lossless)."""
    from kvtool.engines import hf
    from kvtool.engines import mlx as mlx_engine
    from kvtool.formats import save

    paths = {}
    for name, obj in engines.items():
        if name == "hf":
            cache = hf.capture(obj.model, obj.tokenizer, text, model_info=obj.info)
        elif name == "mlx":
            cache = mlx_engine.capture(obj, text)
        else:
            from kvtool.engines.vllm import engine as vllm_engine

            cache = vllm_engine.capture(obj, text)
        paths[name] = os.path.join(out_dir, f"{name}.kvz")
        save(cache, paths[name], codec="raw")
    return paths


def restore_run(name: str, obj: Any, path: str, ids: list[int], new: int) -> Run:
    """Target ``name`` continues ``ids`` from the .kvz at ``path``."""
    from kvtool.formats import load

    if name == "hf":
        return hf_run(obj, ids, new, load(path, backend="torch"))
    if name == "mlx":
        return mlx_run(obj, ids, new, load(path, backend="numpy"))
    return vllm_run(obj, ids, new, path)


def recompute_run(name: str, obj: Any, ids: list[int], new: int) -> Run:
    return {"hf": hf_run, "mlx": mlx_run, "vllm": vllm_run}[name](obj, ids, new)


def load_engines(names: list[str], dtype: str) -> dict[str, Any]:
    engines: dict[str, Any] = {}
    for name in names:  # vLLM first: it sizes its memory before the others load
        if name == "vllm":
            from kvtool.engines.vllm import engine as vllm_engine

            engines[name] = vllm_engine.load_vllm("default", dtype, max_model_len=1024)
    for name in names:
        if name == "hf":
            import torch

            from kvtool.models import load_model

            torch.set_num_threads(1)
            engines[name] = load_model("default", dtype=dtype)
        elif name == "mlx":
            from kvtool.engines.mlx import load_mlx

            engines[name] = load_mlx("default", dtype)
    return {n: engines[n] for n in names}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default="hf,mlx,vllm")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--new", type=int, default=8, help="tokens generated per run")
    args = ap.parse_args()
    names = args.engines.split(",")
    engines = load_engines(names, args.dtype)

    first = next(iter(engines.values()))
    ids = prompt_ids(first.tokenizer)
    baselines = {n: recompute_run(n, e, ids, args.new) for n, e in engines.items()}
    print(f"default model, {args.dtype}, prompt {len(ids)} tokens, {args.new} new tokens, "
          "raw .kvz\n")
    print(f"{'capture → restore':<18} {'cached':>6} {'same tokens':>11} {'agree':>6} "
          f"{'max |Δlogit|':>12} {'engines gap':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        paths = captures(engines, DOC, tmp)
        for src in names:
            for dst in names:
                if src == dst:
                    continue
                got = restore_run(dst, engines[dst], paths[src], ids, args.new)
                m = compare(got, baselines[dst])
                gap = compare(baselines[src], baselines[dst])["max_dlogit"]
                print(f"{src + ' → ' + dst:<18} {got.cached:>6} "
                      f"{str(got.tokens == baselines[dst].tokens):>11} {m['agree']:>6.2f} "
                      f"{m['max_dlogit']:>12.2e} {gap:>12.2e}")
    if "vllm" in engines:
        engines["vllm"].close()


if __name__ == "__main__":
    main()
