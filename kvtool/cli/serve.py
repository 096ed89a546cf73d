"""``kvtool serve``: an OpenAI-compatible server whose prefix cache persists, compressed."""

from __future__ import annotations

import os
from typing import Any

import click

from kvtool.cli._common import (
    DTYPE,
    FiniteFloatRange,
    codec_policy_options,
    connector_options,
    echo_json,
    handle_errors,
)


def _store_line(store: str | None) -> str:
    if not store:
        return "none (give --store DIR to keep prefixes across restarts and servers)"
    from kvtool.cli.inspect import human_bytes
    from kvtool.engines.vllm import store_admin

    if "://" not in store and not os.path.isdir(store):  # an s3:// URL is scanned
        return f"{store} (new)"
    found = store_admin.scan(store)
    if found.pins_problem:  # serving goes on; eviction and pinning refuse
        click.echo(f"warning: {found.pins_problem}", err=True)
    info = store_admin.stats(found)
    return f"{store} ({info['chunks']} chunks, {human_bytes(info['bytes'])})"


@click.command("serve", context_settings={"ignore_unknown_options": True})
@click.option("--model", default="default", show_default=True,
              help="'default' (SmolLM2-135M) or a local Hugging Face model directory.")
@click.option("--engine", type=click.Choice(["vllm", "mlx"]), default="vllm", show_default=True,
              help="The engine whose OpenAI-compatible server runs (mlx: mlx-lm's server, its "
              "prompt cache kept compressed by kvtool).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535))
@click.option("--store", help="Prefix store directory or s3://bucket/prefix URL: prompts' K/V "
              "persist here, compressed.")
@click.option("--max-store-bytes", help="Bound the store (e.g. 2GB): least recently hit chunks "
              "are evicted.")
@click.option("--store-timeout", type=FiniteFloatRange(0.001, 3600),
              help="Seconds a store lookup, or one chunk's read, may take before the prefix is "
              "computed instead (default 1).")
@click.option("--dtype", type=DTYPE,
              help="Model dtype (default: bfloat16 on CPU, the model's on CUDA).")
@click.option("--max-model-len", type=click.IntRange(16), help="Context length (default: the "
              "model's, at most 4096).")
@click.option("--pin", "pins", multiple=True, type=click.Path(dir_okay=False),
              help="A .kvz file served as an always-available prefix (repeatable).")
@codec_policy_options
@click.option("--dry-run", is_flag=True, help="Print the engine's command line and exit.")
@click.option("--json", "as_json", is_flag=True, help="With --dry-run: print JSON.")
@click.argument("engine_args", nargs=-1, type=click.UNPROCESSED)
@handle_errors
def serve_command(model: str, engine: str, host: str, port: int, store: str | None,
                  max_store_bytes: str | None, store_timeout: float | None, dtype: str | None,
                  max_model_len: int | None,
                  pins: tuple[str, ...], dry_run: bool, as_json: bool,
                  engine_args: tuple[str, ...], **codec_opts: Any) -> None:
    """Start an OpenAI-compatible server with kvtool's persistent prefix store.

    Arguments after ``--`` go to the engine unchanged, e.g.
    ``kvtool serve --store ~/kvstore -- --max-num-seqs 8``.
    """
    codec_opts = connector_options(codec_opts)
    from kvtool.engines.vllm.serve import check_listen

    check_listen(host, port, bind=not dry_run)
    if engine == "mlx":
        from kvtool.engines import mlx_serve

        if pins or max_store_bytes or max_model_len or store_timeout:
            raise click.UsageError("--pin, --max-store-bytes, --store-timeout and "
                                   "--max-model-len are vLLM-only; --engine mlx takes --store DIR")
        plan = mlx_serve.plan(model, host=host, port=port, store=store, dtype=dtype,
                              policy_options=codec_opts, engine_args=engine_args)
    else:
        from kvtool.engines.vllm import serve

        plan = serve.plan(model, host=host, port=port, store=store, dtype=dtype,
                          max_model_len=max_model_len, policy_options=codec_opts,
                          max_store_bytes=max_store_bytes, store_timeout=store_timeout,
                          pins=pins, engine_args=engine_args)
    # scanned in both dry runs: an unreachable bucket or a foreign directory fails either way
    store_line = _store_line(plan.store) if engine == "vllm" else plan.store
    if not dry_run and plan.store and "://" not in plan.store:  # not at the first save
        from kvtool.fileio import check_store_dir

        check_store_dir(plan.store, create=True)
    if dry_run and as_json:
        echo_json({"argv": plan.argv, "url": plan.url, "model": plan.model, "store": plan.store,
                   "policy": plan.policy, "lossy": plan.lossy, "pins": plan.pins,
                   "notes": plan.notes, "connector": plan.connector})
        return
    click.echo(f"kvtool serve: {plan.model} ({engine}) at {plan.url}")
    click.echo(f"  store:  {store_line}")
    click.echo(f"  policy: {plan.policy}" + (
        "" if not plan.lossy else " (lossy pins: see their notes)" if plan.lossy_pins else
        " (lossy: answers served from the store may differ slightly from a cold run; "
        "--codec raw for exact)"))
    if engine == "vllm" and (plan.store or plan.pins):  # mlx_lm.server has no /metrics
        click.echo(f"  metrics: {plan.url.removesuffix('/v1')}/metrics (kvtool_store_*)")
    for pin in plan.pins:
        click.echo(f"  pinned: {pin}")
    for note in plan.notes:
        click.echo(f"  note:   {note}")
    if dry_run:
        click.echo(" ".join(plan.argv))
        return
    env = dict(os.environ, HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"),
               TRANSFORMERS_OFFLINE=os.environ.get("TRANSFORMERS_OFFLINE", "1"))
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    os.execve(plan.argv[0], plan.argv, env)  # the server owns the process from here
