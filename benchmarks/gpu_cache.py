"""The cache table of ``benchmarks/gpu.py``: ``DynamicCache`` against ``CompressedCache``.

A random-init ``LlamaForCausalLM`` (no weights needed: speed and memory do not depend on them)
prefills a context of random tokens into each cache in one forward, then decodes ``--steps``
tokens greedily in a manual loop (``model(tok, past_key_values=cache, logits_to_keep=1)``, the
argmax fed back on the device; the loop itself never syncs). Each (context, cache) first runs
once untimed (it compiles and autotunes every kernel variant the run meets, block flushes
included), then ``--rounds`` timed runs, each paired with a timed ``DynamicCache`` run (the
baseline first in even rounds, second in odd ones): a ratio is the median over those pairs
of this cache / ``DynamicCache``, so drift in the host's or the GPU's speed between rows
(single runs swung ±30% on an H200) cancels within a pair; "x range" gives the pairs' lowest
and highest decode ratio. Prefill seconds and decode tokens/s are medians over the rounds
(the JSON also keeps the paired ``DynamicCache`` runs' medians, ``base_*``); peak allocated
memory (``torch.cuda.max_memory_allocated``, reset before a run, minus what was allocated
before it; CUDA only) and resident K/V bytes (:func:`kvtool.engines.hf_runtime.cache_nbytes`)
are the last run's. "codes" counts the attention calls a run served from codes
(``hf_attention.STATS``).

A third run, under ``torch.profiler``, says what bounds each phase: "busy" is the share of the
timed prefill, and of the timed decode step, that the device spent running kernels and copies
(their summed durations) against the timed run's wall time. Far under 100%, the host (Python,
launches, a sync) is the limit; near it, the kernels are. The JSON rows keep the five costliest
kernels of each phase and, on CUDA, the runtime calls the host spent longest in (``host_waits``:
synchronisations, blocking copies, allocations), printed under the row. On the CPU
(``--device cpu``) it sums aten ops' self time instead, a check of the code path more than a
measure: the two runs meet different loads.
"""

from __future__ import annotations

import gc
from statistics import median
from typing import Any

from gpu_common import (  # benchmarks/ is the script's directory
    Bench,
    Table,
    device_work,
    human,
    ratio,
    waits_text,
)


def build_model(b: Bench) -> Any:
    """The random-init Llama of ``--layers``/``--hidden``/… in bfloat16 on the device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    a, torch = b.args, b.torch
    config = LlamaConfig(num_hidden_layers=a.layers, hidden_size=a.hidden,
                         num_attention_heads=a.model_heads, num_key_value_heads=a.model_kv_heads,
                         head_dim=a.model_head_dim, intermediate_size=a.intermediate,
                         vocab_size=a.vocab, max_position_embeddings=max(a.contexts) + a.steps + 8)
    torch.manual_seed(0)
    with torch.device(b.device):
        model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16).eval()


def cache_makers(b: Bench, model: Any) -> dict[str, Any]:
    """Cache name → a function building a fresh empty cache for ``model``."""
    from transformers import DynamicCache

    from kvtool.engines.hf_runtime import CompressedCache
    from kvtool.policy import CodecPolicy
    from kvtool.presets import PRESETS

    makers = {"DynamicCache": lambda: DynamicCache(config=model.config)}
    for label in b.args.policy:
        policy = CodecPolicy.from_label(label, recent_tokens=b.args.recent)
        name = label if label in PRESETS else f"{label} recent={b.args.recent}"
        makers[name] = lambda p=policy: CompressedCache(p, config=model.config)
    return makers


def _run(b: Bench, model: Any, make: Any, ids: Any, steps: int) -> dict:
    """One prefill of ``ids`` into a fresh cache and ``steps`` greedy decode steps, timed."""
    from kvtool.engines import hf_attention
    from kvtool.engines.hf_runtime import cache_nbytes

    torch, clock = b.torch, b.clock
    cuda = b.device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    codes_before = hf_attention.STATS["codes"]
    cache = make()

    def prefill():
        return model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits

    def decode(tok):
        for _ in range(steps):
            logits = model(tok, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            tok = logits[:, -1:].argmax(-1)
        return tok

    with torch.inference_mode():
        logits, prefill_s = clock.once(prefill)
        _, decode_s = clock.once(lambda: decode(logits[:, -1:].argmax(-1)))
    out = {"prefill_s": prefill_s, "decode_tok_s": steps / decode_s,
           "kv_bytes": cache_nbytes(cache), "codes_calls": hf_attention.STATS["codes"]
           - codes_before, "peak_bytes": None, "peak_over_base_bytes": None}
    if cuda:
        peak = torch.cuda.max_memory_allocated()
        out.update(peak_bytes=peak, peak_over_base_bytes=peak - base)
    return out  # the cache goes with this frame (callers collect garbage before the next run)


def _profile(b: Bench, model: Any, make: Any, ids: Any, steps: int) -> dict:
    """Device-busy milliseconds of a prefill and per decode step
    (:func:`gpu_common.device_work`)."""
    cache = make()
    with b.torch.inference_mode():
        logits, prefill_ms, prefill_top, prefill_waits = device_work(b, lambda: model(
            ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits)
        tok = logits[:, -1:].argmax(-1)

        def decode():
            t = tok
            for _ in range(steps):
                t = model(t, past_key_values=cache, use_cache=True,
                          logits_to_keep=1).logits[:, -1:].argmax(-1)

        _, decode_ms, decode_top, decode_waits = device_work(b, decode)
    return {"prefill_busy_ms": prefill_ms, "step_busy_ms": decode_ms / steps,
            "prefill_top": prefill_top,
            "decode_top": [[name, ms / steps] for name, ms in decode_top],
            "prefill_waits": prefill_waits,
            "decode_waits": [[name, ms / steps, calls / steps]
                             for name, ms, calls in decode_waits]}


def _rounds(b: Bench, model: Any, make: Any, base_make: Any | None, ids: Any) -> dict:
    """One untimed run of ``make``, then ``--rounds`` timed ones, each paired with a timed run
    of ``base_make`` (``DynamicCache``; None: the row is the baseline), the baseline first in
    even rounds and second in odd ones (a drift within a pair cancels over the rounds).
    Medians of the runs and of their baselines, the last run's bytes, and the median and
    range of the paired ratios."""
    steps = b.args.steps

    def one(fn: Any) -> dict:
        out = _run(b, model, fn, ids, steps)
        gc.collect()
        return out

    one(make)  # untimed: compiles and autotunes all
    runs, pairs = [], []
    for i in range(max(1, b.args.rounds)):
        if base_make is None:
            run = base = one(make)
        elif i % 2 == 0:
            base = one(base_make)
            run = one(make)
        else:
            run = one(make)
            base = one(base_make)
        runs.append(run)
        pairs.append((run, base))
    out = {**runs[-1], "rounds": len(runs),
           "prefill_s": median([r["prefill_s"] for r in runs]),
           "decode_tok_s": median([r["decode_tok_s"] for r in runs]),
           "base_prefill_s": median([base["prefill_s"] for _, base in pairs]),
           "base_decode_tok_s": median([base["decode_tok_s"] for _, base in pairs])}
    decode = [ratio(r["decode_tok_s"], base["decode_tok_s"]) for r, base in pairs]
    out.update(prefill_ratio=median([ratio(r["prefill_s"], base["prefill_s"])
                                      for r, base in pairs]),
               decode_ratio=median(decode), decode_ratio_min=min(decode),
               decode_ratio_max=max(decode))
    return out


def cache(b: Bench) -> dict:
    """Prefill seconds, decode tok/s, peak memory and K/V bytes of each cache per context."""
    torch, args = b.torch, b.args
    model = build_model(b)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    makers = cache_makers(b, model)
    table = Table(f"DynamicCache vs CompressedCache: random-init Llama, {args.layers} layers, "
                  f"hidden {args.hidden}, {args.model_heads}/{args.model_kv_heads} heads, "
                  f"head_dim {args.model_head_dim}, bf16 ({weights / 2**30:.2f} GiB of weights), "
                  f"batch 1; prefill in one forward, {args.steps} greedy decode steps in a manual "
                  f"loop\n  ratios (x) are this cache / DynamicCache, medians of {args.rounds} "
                  "paired runs (x range: the pairs' decode ratios); peak: "
                  "max_memory_allocated over the run minus what was allocated before it "
                  "(weights); K/V: cache_nbytes after the run; busy: the share of the "
                  "prefill and of a decode step the device spent in kernels and copies "
                  "(torch.profiler; far under 100%: host-bound)",
                  ["context", "cache", "prefill s", "x", "tok/s", "x", "x range", "peak GiB",
                   "x", "K/V MiB", "x", "codes", "busy: prefill", "step"],
                  [7, 34, 9, 5, 7, 5, 9, 8, 5, 8, 5, 6, 13, 5])
    rows = []
    generator = torch.Generator().manual_seed(0)
    for n in args.contexts:
        ids = torch.randint(100, args.vocab - 100, (1, n), generator=generator).to(b.device)
        base: dict = {}
        base_make = None
        for name, make in makers.items():
            label = f"{human(n)} {name}"
            if not base and name != "DynamicCache":  # no baseline at this context
                b.deadline.skipped.append(label)
                table.note(f"{label}: skipped, no DynamicCache row at this context")
                continue
            if not b.deadline.allows(label):
                continue
            with b.deadline.attempt(label) as attempt:
                run = _rounds(b, model, make, base_make, ids)
                run.update(_profile(b, model, make, ids, min(args.steps, 8)))
                run["prefill_busy"] = ratio(run["prefill_busy_ms"], run["prefill_s"] * 1e3)
                run["step_busy"] = ratio(run["step_busy_ms"] * run["decode_tok_s"], 1e3)
            gc.collect()
            if attempt.failed:
                continue
            if not base:  # DynamicCache's, the first: the others pair their runs with it
                base, base_make = run, make
                rounds = max(1, args.rounds)  # a paired row runs 2R + 1 times, this one R + 1
                b.deadline.last *= (2 * rounds + 1) / (rounds + 1)
            row = {"context": n, "cache": name, **run,
                   "kv_ratio": ratio(run["kv_bytes"], base["kv_bytes"]),
                   "peak_ratio": None if run["peak_bytes"] is None else
                   ratio(run["peak_over_base_bytes"], base["peak_over_base_bytes"])}
            rows.append(row)
            peak, peak_x = ("-", "-") if run["peak_bytes"] is None else \
                (f"{run['peak_over_base_bytes'] / 2**30:.2f}", f"{row['peak_ratio']:.2f}")
            table.row([human(n), name[:34], f"{run['prefill_s']:.3f}",
                       f"{row['prefill_ratio']:.2f}", f"{run['decode_tok_s']:.1f}",
                       f"{row['decode_ratio']:.2f}",
                       f"{row['decode_ratio_min']:.2f}-{row['decode_ratio_max']:.2f}", peak,
                       peak_x,
                       f"{run['kv_bytes'] / 2**20:.1f}", f"{row['kv_ratio']:.2f}",
                       str(run["codes_calls"]), f"{run['prefill_busy']:.0%}",
                       f"{run['step_busy']:.0%}"])
            if run["prefill_waits"]:
                table.note(f"{label} host waits on CUDA, prefill: "
                           f"{waits_text(run['prefill_waits'])}; per decode step: "
                           f"{waits_text(run['decode_waits'])}")
    del model
    gc.collect()
    if b.device == "cuda":
        torch.cuda.empty_cache()
    return {"rows": rows, "weights_bytes": weights, "decode_loop": "manual greedy loop"}
