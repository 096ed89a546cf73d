"""Greedy generation on kvtool's mlx caches, one request alone and several in mlx-lm's
``BatchGenerator`` (tests/test_mlx_batch.py, tests/test_mlx_sliding.py)."""

from __future__ import annotations

import copy
import importlib
from typing import Any

import mlx.core as mx

mlx_generate = importlib.import_module("mlx_lm.generate")  # mlx_lm.generate is a function


def greedy(logits: mx.array) -> mx.array:
    return mx.argmax(logits, axis=-1)


def alone(model: Any, prompt: list[int], cache: list[Any], max_tokens: int, *,
          prefill_step: int = 8) -> list[int]:
    """Greedy tokens of ``prompt`` after what ``cache`` holds (mlx-lm's ``generate_step``).
    ``prefill_step`` as :func:`batched`'s: under a lossy codec, a prompt's tokens attend to
    those of their own forward exactly and to earlier forwards' decoded."""
    return [int(t) for t, _ in mlx_generate.generate_step(
        mx.array(prompt), model, prompt_cache=cache, max_tokens=max_tokens, sampler=greedy,
        prefill_step_size=prefill_step)]


def batched(model: Any, groups: list[list[tuple[list[int], list[Any] | None, int]]],
            make_cache: Any, *, prefill_step: int = 8, watch: Any = None,
            ) -> tuple[list[list[int]], list[list[Any]]]:
    """Greedy tokens and final caches of ``(prompt, cache or None, max_tokens)`` requests in
    one ``BatchGenerator``: the first group at once, each later group once the batch runs.
    ``make_cache(model)`` makes the cache of a request given None (mlx-lm's
    ``make_prompt_cache``). ``watch(generator)`` is called after every step."""
    saved = mlx_generate.make_prompt_cache
    mlx_generate.make_prompt_cache = lambda m, max_kv_size=None: make_cache(m)
    try:
        gen = mlx_generate.BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8,
                                          prefill_step_size=prefill_step)
        uids: list[int] = []
        tokens: dict[int, list[int]] = {}
        caches: dict[int, list[Any]] = {}
        pending = list(groups)
        while pending or len(caches) < len(uids):
            if pending and (not uids or tokens[uids[-1]]):
                prompts, given, limits = zip(*pending.pop(0), strict=True)
                new = gen.insert(list(prompts), max_tokens=list(limits),
                                 caches=[copy.deepcopy(c) for c in given]
                                 if any(c is not None for c in given) else None)
                uids.extend(new)
                tokens.update({u: [] for u in new})
            _, responses = gen.next()
            for r in responses:
                tokens[r.uid].append(int(r.token))
                if r.finish_reason is not None:
                    caches[r.uid] = r.prompt_cache
            if watch is not None:
                watch(gen)
        gen.close()
    finally:
        mlx_generate.make_prompt_cache = saved
    return [tokens[u] for u in uids], [caches[u] for u in uids]
