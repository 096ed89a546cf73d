"""``kvtool generate``: continue a prompt, from a saved .kvz cache or from scratch.

With ``--cache`` it restores the cache, continues the cached tokens + ``--prompt``, and (unless
``--no-compare``) also recomputes the whole prefix without the cache, printing time to first
token for both. ``--prompt-cache FILE`` is llama-cli's flow: the first run captures the prompt
into FILE, later runs restore it. Sampling options are mlx_lm's (``--max-tokens``,
``--temperature``, ``--top-p``, ``--seed``); the default is greedy.
"""

from __future__ import annotations

import time
from typing import Any

import click

from kvtool.cli._common import (
    FiniteFloatRange,
    context_limit,
    echo_json,
    handle_errors,
    read_prompt,
)
from kvtool.cli.capture import ENGINE_CHOICE, ENGINE_HELP, load_for_cli, model_options


def runtime_policy(spec: str | None):
    """The :class:`~kvtool.policy.CodecPolicy` of ``--runtime-codec`` (None without it)."""
    if spec is None:
        return None
    from kvtool.policy import CodecPolicy

    return CodecPolicy.from_options(codec=spec)


def runtime_past_factory(spec: str | None):
    """``past_factory`` for ``--runtime-codec``: keep the cache compressed while generating.

    """
    if spec is None:
        return None
    from kvtool.engines.hf_runtime import CompressedCache

    policy = runtime_policy(spec)
    return lambda cache, model: CompressedCache.from_kvcache(cache, policy, model=model)


def sampling_options(fn: Any) -> Any:
    """--max-tokens (alias --max-new-tokens), --temperature, --top-p and --seed."""
    options = [
        click.option("--max-tokens", "--max-new-tokens", "max_tokens", default=32,
                     show_default=True, type=click.IntRange(1),
                     help="Most tokens to generate (--max-new-tokens: the old name)."),
        click.option("--temperature", "--temp", default=None, type=FiniteFloatRange(0.0),
                     help="Sampling temperature; 0 (the default) picks the most likely token "
                     "(greedy)."),
        click.option("--top-p", default=1.0, show_default=True,
                     type=FiniteFloatRange(0.0, 1.0, min_open=True),
                     help="Nucleus sampling: sample from the smallest set of tokens whose "
                     "probabilities add up to P (with --temperature > 0)."),
        click.option("--seed", default=None, type=click.IntRange(0, 2**64 - 1),
                     help="Random seed (0 to 2^64 - 1): the same seed gives the same sampled "
                     "text."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


@click.command("generate")
@model_options
@click.option("--engine", type=ENGINE_CHOICE, default="hf", show_default=True, help=ENGINE_HELP)
@click.option("--cache", "cache_path", type=click.Path(exists=True, dir_okay=False),
              default=None, help="A .kvz file captured from this model: the prefix to restore "
              "(--prompt continues it as plain text, no chat template).")
@click.option("--prompt-cache", "prompt_cache", type=click.Path(dir_okay=False), default=None,
              help="llama-cli style: capture the prompt into FILE on the first run, restore it "
              "on later runs (hf engine).")
@click.option("--prompt", default=None, help="The prompt (with --cache: the text that follows "
              "the cached prefix).")
@click.option("--prompt-file", type=click.Path(dir_okay=False, allow_dash=True), default=None,
              help="Read the prompt from a UTF-8 file; - reads stdin.")
@click.option("--no-chat-template", is_flag=True,
              help="Feed the prompt as is, not as a user turn in the model's chat template.")
@sampling_options
@click.option("--force", is_flag=True, help="Restore a cache from another model or tokenizer "
              "fingerprint anyway; go past the model's context length; re-encode a lossy "
              "--cache with a lossy --runtime-codec.")
@click.option("--no-compare", is_flag=True,
              help="With --cache: skip recomputing the prefix for the time comparison.")
@click.option("--runtime-codec", default=None,
              help="Keep the KV cache compressed with this codec while generating "
              "(hf and mlx engines).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@handle_errors
def generate_command(model_name: str, dtype: str, threads: int | None, engine: str,
                     cache_path: str | None, prompt_cache: str | None, prompt: str | None,
                     prompt_file: str | None, no_chat_template: bool, max_tokens: int,
                     temperature: float | None, top_p: float, seed: int | None, force: bool,
                     no_compare: bool, runtime_codec: str | None, as_json: bool) -> None:
    """Generate text from a prompt; with --cache, restore a saved prefix first and compare
    time to first token against recomputing it.

    The prompt goes into the model's chat template when it has one (--no-chat-template: as is),
    except after --cache, whose prompt continues the cached text.
    """
    from kvtool.engines.hf import Sampling

    text = read_prompt(prompt, prompt_file, required=cache_path is None)
    if cache_path is None and not text and no_chat_template:
        raise click.UsageError("the prompt is empty: nothing to continue (give text, or "
                               "--cache FILE)")
    if cache_path is not None and prompt_cache is not None:
        raise click.UsageError("give either --cache or --prompt-cache, not both")
    if temperature is None and (top_p != 1.0 or seed is not None):  # an explicit 0 is a sweep's
        raise click.UsageError("--top-p and --seed take effect with --temperature > 0 (the "
                               "default, 0, picks the most likely token)")
    sampling = Sampling(temperature or 0.0, top_p, seed)
    if cache_path is not None:
        from kvtool.fileio import check_input_file

        check_input_file(cache_path)  # before loading the model; a FIFO would block open()
    if prompt_cache is not None:
        _check_prompt_cache(prompt_cache, engine)
    runtime_policy(runtime_codec)  # a bad codec fails before the model loads
    if engine == "vllm" and runtime_codec:
        raise click.UsageError("--runtime-codec needs --engine hf or mlx")
    import os

    for restored in (cache_path, prompt_cache):
        if restored is not None and runtime_codec and not force and os.path.exists(restored):
            _refuse_requantizing(restored, runtime_codec)
    chat = not no_chat_template and cache_path is None
    if engine in ("mlx", "vllm"):
        _other_engine(engine, model_name, dtype, threads, cache_path, text, chat, max_tokens,
                      sampling, force, no_compare, runtime_codec, as_json)
        return
    from kvtool.engines import hf
    from kvtool.models import check_context_length

    loaded = load_for_cli(model_name, dtype, threads)
    limit = context_limit(loaded)
    if cache_path is not None:
        report = _restore(loaded, cache_path, text, max_tokens, sampling, force, no_compare,
                          runtime_codec, limit)
    else:
        ids = hf.prompt_ids(loaded.tokenizer, text, chat)
        check_context_length(len(ids) + max_tokens, limit, force, loaded.name,
                             f"the prompt ({len(ids)} tokens) + --max-tokens {max_tokens}")
        if prompt_cache is not None:
            report = _with_prompt_cache(loaded, prompt_cache, ids, max_tokens, sampling, force,
                                        runtime_codec)
        else:
            past = None
            if runtime_codec:
                from kvtool.engines.hf_runtime import CompressedCache

                past = CompressedCache(runtime_policy(runtime_codec), config=loaded.model.config)
            with _generating(loaded, max_tokens):
                result = hf.recompute_generation(loaded, ids, max_tokens, past=past,
                                                 sampling=sampling)
            report = {"model": loaded.name, "text": result.text,
                      "recompute": result.to_json()}
            if past is not None:
                from kvtool.engines.hf_runtime import DEFAULT_BLOCK_SIZE

                report["runtime_codec"] = _runtime_report(
                    past.get_seq_length(), past.encoded_tokens(), DEFAULT_BLOCK_SIZE)
    _output(report, as_json)


def _runtime_report(held: int, encoded: int, block: int) -> dict[str, int]:
    """What a ``--runtime-codec`` cache held; a warning when it encoded nothing (a cache
    encodes whole ``block``-token blocks once they leave its exact sinks and recent window)."""
    if not encoded:
        click.echo(f"warning: --runtime-codec encoded none of the {held} tokens (it encodes "
                   f"whole {block}-token blocks past the exact sinks and recent "
                   "window): the cache stayed exact", err=True)
    return {"tokens": held, "encoded_tokens": encoded}


def _tracked_past(runtime_codec: str | None) -> tuple[Any, list[Any]]:
    """(``past_factory`` of ``--runtime-codec``, the list it puts the cache it makes in)."""
    factory, made = runtime_past_factory(runtime_codec), []
    if factory is None:
        return None, made
    return (lambda cache, model: made.append(factory(cache, model)) or made[-1]), made


def _made_report(made: list[Any]) -> dict[str, Any]:
    """``{"runtime_codec": ...}`` of the cache :func:`_tracked_past` made, if it made one."""
    if not made:
        return {}
    from kvtool.engines.hf_runtime import DEFAULT_BLOCK_SIZE

    return {"runtime_codec": _runtime_report(made[0].get_seq_length(), made[0].encoded_tokens(),
                                             DEFAULT_BLOCK_SIZE)}


def _refuse_requantizing(cache_path: str, runtime_codec: str) -> None:
    """A lossy ``--cache`` (or ``--prompt-cache``) re-encoded by a lossy ``--runtime-codec``:
    refused, as ``compress`` refuses it (a file that is not a .kvz is left to the engine to
    refuse)."""
    from kvtool.errors import FormatError
    from kvtool.formats.transcode import refuse_requantizing

    try:
        refuse_requantizing(cache_path, runtime_policy(runtime_codec),
                            f"--runtime-codec {runtime_codec} re-encoding it")
    except FormatError:
        return


def _generating(loaded: Any, max_tokens: int):
    from kvtool.progress import forward_progress

    return forward_progress(loaded.model, max_tokens, "generating", unit="tok")


def _check_prompt_cache(path: str, engine: str) -> None:
    """A prompt cache is read when it exists, else written: check it can be, before the model."""
    import os

    from kvtool.fileio import check_input_file, check_output_path

    if engine != "hf":
        raise click.UsageError("--prompt-cache needs --engine hf")
    if os.path.lexists(path):
        check_input_file(path)
    check_output_path(path)


def _other_engine(engine: str, model_name: str, dtype: str, threads: int | None,
                  cache_path: str | None, text: str, chat: bool, max_tokens: int,
                  sampling: Any, force: bool, no_compare: bool, runtime_codec: str | None,
                  as_json: bool) -> None:
    """``--engine mlx`` / ``vllm``: their own report functions (greedy only)."""
    if sampling.temperature > 0:
        raise click.UsageError(f"--temperature needs --engine hf ({engine} generates greedily)")
    if engine == "mlx":
        from kvtool.engines import mlx as mlx_engine

        loaded = mlx_engine.load_mlx(model_name, dtype)
    else:
        from kvtool.engines.vllm import engine as vllm_engine

        loaded = vllm_engine.load_vllm(model_name, dtype, threads=threads)
    ids = None
    if cache_path is None:  # the whole prompt, templated as the HF engine does (one BOS)
        from kvtool.engines.common import prompt_ids
        from kvtool.models import check_context_length

        ids = prompt_ids(loaded.tokenizer, text, chat)
        check_context_length(len(ids) + max_tokens, context_limit(loaded), force, loaded.name,
                             f"the prompt ({len(ids)} tokens) + --max-tokens {max_tokens}")
    if engine == "mlx":
        report = mlx_engine.generate_report(loaded, cache_path, text, max_tokens, force=force,
                                            compare=not no_compare,
                                            policy=runtime_policy(runtime_codec),
                                            input_ids=ids)
    else:
        report = vllm_engine.generate_report(loaded, cache_path, text, max_tokens, force=force,
                                             compare=not no_compare, input_ids=ids)
    for warning in report.pop("warnings", []):
        click.echo(f"warning: {warning}", err=True)
    if "runtime_codec" in report:
        from kvtool.engines.mlx_cache import DEFAULT_BLOCK_SIZE

        held = report["runtime_codec"]
        report["runtime_codec"] = _runtime_report(held["tokens"], held["encoded_tokens"],
                                                  DEFAULT_BLOCK_SIZE)
    _output(report, as_json)


def _decode_device(loaded: Any) -> Any:
    """The model's device when it is a GPU (the file's codes then decode there), else None."""
    device = next(loaded.model.parameters()).device
    return device if device.type == "cuda" else None


def _restore(loaded: Any, cache_path: str, prompt: str, max_tokens: int, sampling: Any,
             force: bool, no_compare: bool, runtime_codec: str | None,
             limit: int | None) -> dict[str, Any]:
    """``--cache``: restore the file, continue it with ``prompt``, optionally recompute."""
    import torch  # noqa: F401  (imported before the clock: not part of reading the file)

    from kvtool.engines import hf
    from kvtool.formats import load
    from kvtool.models import check_context_length
    from kvtool.progress import progress_enabled

    start = time.perf_counter()
    cache = load(cache_path, backend="torch", progress=progress_enabled(),
                 device=_decode_device(loaded))
    read_s = time.perf_counter() - start
    _check_compatible(cache, loaded, force)
    full = hf.full_ids_for(cache, loaded.tokenizer, prompt)
    check_context_length(len(full) + max_tokens, limit, force, loaded.name,
                         f"{cache_path} ({len(cache.token_ids)} tokens) + the prompt + "
                         f"--max-tokens {max_tokens}")
    factory, made = _tracked_past(runtime_codec)
    with _generating(loaded, max_tokens):
        restored = hf.continue_generation(loaded, cache, prompt, max_tokens, force=True,
                                          sampling=sampling, past_factory=factory)
    report = {"model": loaded.name, "cache": cache_path, "text": restored.text,
              "read_file_s": round(read_s, 4),
              "restore": restored.to_json() | {"ttft_with_read_s": restored.ttft_s + read_s},
              **_made_report(made)}
    if not no_compare:
        with _generating(loaded, max_tokens):
            baseline = hf.recompute_generation(loaded, full, max_tokens, sampling=sampling)
        report["recompute"] = baseline.to_json()
        report["same_text"] = baseline.new_token_ids == restored.new_token_ids
    return report


def _check_compatible(cache: Any, loaded: Any, force: bool) -> None:
    """Refuse a cache of another model or tokenizer; with ``force``, warn of each difference."""
    from kvtool.engines import hf

    for problem in hf.check_compatible(cache, loaded, force=force):
        click.echo(f"warning: {problem}; restoring anyway (--force)", err=True)


def _with_prompt_cache(loaded: Any, path: str, ids: list[int], max_tokens: int, sampling: Any,
                       force: bool, runtime_codec: str | None) -> dict[str, Any]:
    """``--prompt-cache FILE``: restore FILE when it holds a prefix of the prompt, else prefill
    the prompt, save it to FILE (raw, lossless) and continue from it."""
    import os

    from kvtool.engines import hf
    from kvtool.formats import load, save
    from kvtool.progress import decoder_layers, forward_progress, info, progress_enabled

    start = time.perf_counter()
    cache, action = None, "saved"
    if os.path.exists(path):
        cache = load(path, backend="torch", progress=progress_enabled(),
                     device=_decode_device(loaded))
        _check_compatible(cache, loaded, force)
        cached = [int(t) for t in cache.token_ids] if cache.token_ids is not None else None
        prefix = cached is not None and 0 < len(cached) <= len(ids) \
            and ids[:len(cached)] == cached
        if prefix and (len(cached) < len(ids) or hf.holds_every_token(cache)):
            action = "restored"
        else:
            info(f"{path} holds this whole prompt, but a sliding window let go of its oldest "
                 "tokens, so its last token cannot be fed again: capturing it again" if prefix
                 else f"{path} holds another prompt: capturing this one into it")
            cache = None
    if cache is None:
        # a sliding window lets go of its oldest tokens, so such a cache cannot give its last
        # token back to be fed again: it keeps the prompt's last token for generate to feed
        keep = ids[:-1] if len(ids) > 1 and hf.layer_types(loaded.model) else ids
        layers = decoder_layers(loaded.model)
        with forward_progress(layers, len(layers), f"prefill {len(keep)} tokens", "layer"):
            cache = hf.capture(loaded.model, loaded.tokenizer, token_ids=keep,
                               model_info=loaded.info)
        save(cache, path, progress=progress_enabled())
    info(f"prompt cache {path}: {action} {len(cache.token_ids)} of {len(ids)} prompt tokens")
    prepare_s = time.perf_counter() - start
    factory, made = _tracked_past(runtime_codec)
    with _generating(loaded, max_tokens):
        result = hf.continue_generation(loaded, cache, input_ids=ids, max_new_tokens=max_tokens,
                                        force=True, sampling=sampling, past_factory=factory)
    return {"model": loaded.name, "text": result.text, **_made_report(made),
            "prompt_cache": {"path": path, "action": action,
                             "cached_tokens": len(cache.token_ids),
                             "seconds": round(prepare_s, 4)},
            "restore": result.to_json() | {"ttft_with_read_s": result.ttft_s + prepare_s},
            "read_file_s": round(prepare_s, 4) if action == "restored" else 0.0}


def _output(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        echo_json(report)
        return
    click.echo(report["text"])
    click.echo("---")
    restore, recompute = report.get("restore"), report.get("recompute")
    pc = report.get("prompt_cache")
    runtime = report.get("runtime_codec")
    if runtime:
        click.echo(f"runtime codec: {runtime['encoded_tokens']} of {runtime['tokens']} tokens "
                   "held encoded")
    if pc:
        done = "restored from" if pc["action"] == "restored" else "saved to"
        click.echo(f"prompt cache: {pc['cached_tokens']} tokens {done} {pc['path']} in "
                   f"{pc['seconds']:.3f} s; time to first token "
                   f"{restore['ttft_with_read_s']:.3f} s")
        return
    if restore:
        click.echo(f"restore:   time to first token {restore['ttft_with_read_s']:.3f} s "
                   f"(read file {report['read_file_s']:.3f} s, restore "
                   f"{restore['restore_s']:.3f} s, {restore['cached_tokens']} cached + "
                   f"{restore['prompt_tokens'] - restore['cached_tokens']} new tokens)")
    if recompute:
        click.echo(f"recompute: time to first token {recompute['ttft_s']:.3f} s "
                   f"(prefill {recompute['prompt_tokens']} tokens)")
    if restore and recompute:
        speedup = recompute["ttft_s"] / max(restore["ttft_with_read_s"], 1e-9)
        same = "identical" if report["same_text"] else "different"
        click.echo(f"speed-up {speedup:.1f}x; continuations {same}")
