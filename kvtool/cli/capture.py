"""``kvtool capture``: prefill a prompt with a model and save its KV cache as a .kvz file."""

from __future__ import annotations

import time
from typing import Any

import click

from kvtool.cli._common import (
    DTYPE,
    MAX_THREADS,
    codec_policy_options,
    context_limit,
    echo_json,
    fitted_for_model,
    handle_errors,
    policy_from_options,
    read_prompt,
)

MODEL_HELP = "'default' (SmolLM2-135M), a local HF model directory, or a .gguf file."
ENGINE_CHOICE = click.Choice(["hf", "vllm", "mlx"])
ENGINE_HELP = ("Engine that runs the model: Hugging Face transformers, vLLM or mlx-lm (same .kvz "
               "files; mlx ignores --threads).")


def model_options(fn: Any) -> Any:
    """--model, --dtype and --threads, shared by capture and generate."""
    fn = click.option("--threads", type=click.IntRange(1, MAX_THREADS), default=None,
                      help="torch CPU threads (default: torch's choice).")(fn)
    fn = click.option("--dtype", type=DTYPE, default=None,
                      help="Model (and cache) dtype [default: the model's own, from its config "
                      "(bf16 for the default model); float32 for a .gguf]. A cache restores "
                      "into any dtype of its model, cast.")(fn)
    return click.option("--model", "model_name", default="default", show_default=True,
                        help=MODEL_HELP)(fn)


def model_dtype(model_name: str, dtype: str | None) -> str:
    """``--dtype``, else the model's own (:func:`kvtool.models.native_dtype`)."""
    if dtype:
        return dtype
    from kvtool.models import model_location, resolve_dtype

    return resolve_dtype(None, model_location(model_name)[1])


def load_for_cli(model_name: str, dtype: str | None, threads: int | None):
    from kvtool.models import load_model

    if threads:
        import torch

        torch.set_num_threads(threads)
    return load_model(model_name, dtype=dtype)


@click.command("capture")
@model_options
@click.option("--engine", type=ENGINE_CHOICE, default="hf", show_default=True, help=ENGINE_HELP)
@click.option("--prompt", default=None, help="The text to prefill.")
@click.option("--prompt-file", type=click.Path(dir_okay=False, allow_dash=True), default=None,
              help="Read the text to prefill from a file (UTF-8); - reads stdin.")
@click.option("--force", is_flag=True, help="Go past the model's context length.")
@codec_policy_options
@click.option("--zstd", is_flag=True, help="zstd-compress each stored tensor where it helps.")
@click.option("--entropy", is_flag=True,
              help="rANS-code each stored tensor (codes at their entropy) where it helps.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="The .kvz file to write (atomically).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@handle_errors
def capture_command(model_name: str, dtype: str | None, threads: int | None, engine: str,
                    prompt: str | None, prompt_file: str | None, force: bool, zstd: bool,
                    entropy: bool, output: str, as_json: bool, **codec_opts: Any) -> None:
    """Prefill a prompt and save the model's KV cache to a .kvz file."""
    from kvtool.fileio import check_output_path

    # before the slow part: a bad -o fails in milliseconds
    check_output_path(output, inputs=(prompt_file,))
    text = read_prompt(prompt, prompt_file)
    policy = policy_from_options(codec_opts)  # fail on a bad codec before loading the model
    dtype = model_dtype(model_name, dtype)
    from kvtool.kernels import warm_up_async

    warm_up_async([policy.key, policy.value], dtype)  # overlaps the model's load and prefill
    from kvtool.formats import save
    from kvtool.models import check_context_length
    from kvtool.progress import progress_enabled

    if engine == "vllm":
        from kvtool.engines.vllm import engine as vllm_engine

        loaded = vllm_engine.load_vllm(model_name, dtype, threads=threads)
        start = time.perf_counter()
        cache = vllm_engine.capture(loaded, text)
    elif engine == "mlx":
        from kvtool.engines import mlx as mlx_engine

        loaded = mlx_engine.load_mlx(model_name, dtype)
        start = time.perf_counter()
        cache = mlx_engine.capture(loaded, text)
    else:
        from kvtool.engines.hf import capture, encode_text
        from kvtool.progress import decoder_layers, forward_progress

        loaded = load_for_cli(model_name, dtype, threads)
        ids = encode_text(loaded.tokenizer, text)
        check_context_length(len(ids), context_limit(loaded), force, loaded.name,
                             f"the prompt ({len(ids)} tokens)")
        start = time.perf_counter()
        layers = decoder_layers(loaded.model)
        with forward_progress(layers, len(layers), f"prefill {len(ids)} tokens", "layer"):
            cache = capture(loaded.model, loaded.tokenizer, token_ids=ids,
                            model_info=loaded.info)
    capture_s = time.perf_counter() - start
    policy = fitted_for_model(codec_opts, policy, cache.model.get("fingerprint"), loaded.name,
                              cache.model.get("weights"))
    start = time.perf_counter()
    report = save(cache, output, policy, zstd=zstd, entropy=entropy, progress=progress_enabled())
    save_s = time.perf_counter() - start
    dtype = str(getattr(loaded, "dtype", None) or dtype)  # what the engine ran
    report.update(model=loaded.name, engine=engine, dtype=dtype, num_tokens=len(cache.token_ids),
                  load_model_s=round(loaded.load_seconds, 4), capture_s=round(capture_s, 4),
                  save_s=round(save_s, 4), cache_bytes=cache.nbytes)
    if as_json:
        echo_json(report)
        return
    from kvtool.cli.inspect import human_bytes, size_ratio

    click.echo(f"captured {report['num_tokens']} tokens × {cache.num_layers} layers from "
               f"{loaded.name} ({dtype}, {engine}) in {capture_s:.2f} s")
    click.echo(f"wrote {output}: {human_bytes(report['file_bytes'])} "
               f"({size_ratio(report['ratio_vs_source'])} than its {report['source_dtype']} "
               f"K/V; {report['policy']}) "
               f"in {save_s:.2f} s")
