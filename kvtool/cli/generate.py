"""``kvtool generate``: continue a prompt, from a saved .kvz cache or from scratch.

With ``--cache`` it restores the cache, continues the cached tokens + ``--prompt`` greedily, and
(unless ``--no-compare``) also recomputes the whole prefix without the cache, printing time to
first token for both.
"""

from __future__ import annotations

import time
from typing import Any

import click

from kvtool.cli._common import echo_json, handle_errors
from kvtool.cli.capture import ENGINE_CHOICE, ENGINE_HELP, load_for_cli, model_options


def runtime_policy(spec: str | None):
    """The :class:`~kvtool.policy.CodecPolicy` of ``--runtime-codec`` (None without it)."""
    if spec is None:
        return None
    from kvtool.policy import CodecPolicy

    return CodecPolicy.from_options(codec=spec)


def runtime_past_factory(spec: str | None):
    """``past_factory`` for ``--runtime-codec``: keep the cache compressed while generating.

    RUNTIME-CODEC SPOT: this needs ``kvtool.engines.hf_runtime.CompressedCache`` (a separate
    work item); until it exists the option fails with a clear message.
    """
    if spec is None:
        return None
    from kvtool.errors import KvtoolError

    try:
        from kvtool.engines.hf_runtime import CompressedCache
    except ImportError:
        raise KvtoolError("--runtime-codec needs kvtool.engines.hf_runtime.CompressedCache, "
                          "which this kvtool does not have yet") from None
    policy = runtime_policy(spec)
    return lambda cache, model: CompressedCache.from_kvcache(cache, policy, model=model)


@click.command("generate")
@model_options
@click.option("--engine", type=ENGINE_CHOICE, default="hf", show_default=True, help=ENGINE_HELP)
@click.option("--cache", "cache_path", type=click.Path(exists=True, dir_okay=False),
              default=None, help="A .kvz file captured from this model: the prefix to restore.")
@click.option("--prompt", default="", help="Text that follows the cached prefix (or the whole "
              "prompt without --cache).")
@click.option("--max-new-tokens", default=32, show_default=True, type=click.IntRange(1))
@click.option("--force", is_flag=True,
              help="Restore a cache from another model or tokenizer fingerprint anyway.")
@click.option("--no-compare", is_flag=True,
              help="With --cache: skip recomputing the prefix for the time comparison.")
@click.option("--runtime-codec", default=None,
              help="Keep the restored cache compressed with this codec while generating "
              "(hf and mlx engines).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@handle_errors
def generate_command(model_name: str, dtype: str, threads: int | None, engine: str,
                     cache_path: str | None, prompt: str, max_new_tokens: int, force: bool,
                     no_compare: bool, runtime_codec: str | None, as_json: bool) -> None:
    """Generate greedily; with --cache, compare restore vs recompute time to first token."""
    if cache_path is None and not prompt:
        raise click.UsageError("give --prompt (and/or --cache)")
    if runtime_codec and cache_path is None:
        raise click.UsageError("--runtime-codec applies to a restored --cache")
    if cache_path is not None:
        from kvtool.fileio import check_input_file

        check_input_file(cache_path)  # before loading the model; a FIFO would block open()
    if engine == "mlx":
        from kvtool.engines import mlx as mlx_engine

        policy = runtime_policy(runtime_codec)
        lm = mlx_engine.load_mlx(model_name, dtype)
        report = mlx_engine.generate_report(lm, cache_path, prompt, max_new_tokens, force=force,
                                            compare=not no_compare, policy=policy)
        for warning in report.pop("warnings", []):
            click.echo(f"warning: {warning}", err=True)
        _output(report, as_json)
        return
    if engine == "vllm":
        if runtime_codec:
            raise click.UsageError("--runtime-codec needs --engine hf or mlx")
        from kvtool.engines.vllm import engine as vllm_engine

        vm = vllm_engine.load_vllm(model_name, dtype, threads=threads)
        report = vllm_engine.generate_report(vm, cache_path, prompt, max_new_tokens,
                                             force=force, compare=not no_compare)
        for warning in report.pop("warnings", []):
            click.echo(f"warning: {warning}", err=True)
        _output(report, as_json)
        return
    past_factory = runtime_past_factory(runtime_codec)
    from kvtool.engines import hf

    report: dict[str, Any] = {}
    if cache_path is None:
        loaded = load_for_cli(model_name, dtype, threads)
        result = hf.recompute_generation(loaded, prompt=prompt, max_new_tokens=max_new_tokens)
        report = {"model": loaded.name, "text": result.text, "recompute": result.to_json()}
        _output(report, as_json)
        return
    import torch  # noqa: F401  (imported before the clock: not part of reading the file)

    from kvtool.formats import load

    start = time.perf_counter()
    cache = load(cache_path, backend="torch")
    read_s = time.perf_counter() - start
    loaded = load_for_cli(model_name, dtype, threads)
    problems = hf.check_compatible(cache, loaded, force=force)
    for p in problems:
        click.echo(f"warning: {p}; restoring anyway (--force)", err=True)
    restored = hf.continue_generation(loaded, cache, prompt, max_new_tokens, force=True,
                                      past_factory=past_factory)
    report = {"model": loaded.name, "cache": cache_path, "text": restored.text,
              "read_file_s": round(read_s, 4),
              "restore": restored.to_json() | {"ttft_with_read_s": restored.ttft_s + read_s}}
    if not no_compare:
        full = hf.full_ids_for(cache, loaded.tokenizer, prompt)
        baseline = hf.recompute_generation(loaded, full, max_new_tokens)
        report["recompute"] = baseline.to_json()
        report["same_text"] = baseline.new_token_ids == restored.new_token_ids
    _output(report, as_json)


def _output(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        echo_json(report)
        return
    click.echo(report["text"])
    click.echo("---")
    restore, recompute = report.get("restore"), report.get("recompute")
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
