"""``kvtool compress`` / ``kvtool decompress``: re-encode a .kvz file with another policy.

mlx-lm prompt caches (``.safetensors`` from ``mlx_lm``'s ``save_prompt_cache``) go through the
same two commands: ``compress --from mlx`` imports one into a .kvz (any policy), ``decompress
--to mlx`` exports a .kvz as one (lossless ``KVCache`` layers, loadable by stock mlx-lm).
"""

from __future__ import annotations

import os
from typing import Any

import click

from kvtool.cli._common import (
    DTYPE,
    codec_policy_options,
    echo_json,
    fitted_for_model,
    handle_errors,
    policy_from_options,
)
from kvtool.progress import progress_enabled

zstd_options = [
    click.option("--zstd", is_flag=True, help="Also compress each tensor with zstd."),
    click.option("--zstd-level", default=None, type=click.IntRange(1, 22),
                 help="zstd level (with --zstd; default 3)."),
]


def _with_zstd_options(fn: Any) -> Any:
    for option in reversed(zstd_options):
        fn = option(fn)
    return fn


def _zstd(zstd: bool, level: int | None) -> int | bool:
    """The writer's ``zstd`` argument; a level without ``--zstd`` is refused (it would do
    nothing)."""
    if level is not None and not zstd:
        raise click.UsageError("--zstd-level needs --zstd")
    return (level or 3) if zstd else False


def _check_paths(src: str, output: str) -> None:
    """Refuse a non-regular IN and an unwritable -o before decoding anything."""
    from kvtool.fileio import check_input_file, check_output_path

    check_input_file(src)
    check_output_path(output)


def _report(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        echo_json(report)
        return
    from kvtool.cli.inspect import human_bytes, size_ratio

    click.echo(f"wrote {report['path']}: {human_bytes(report['file_bytes'])}, "
               f"{size_ratio(report['ratio_vs_source'])} than its {report['source_dtype']} K/V "
               f"({report['num_layers']} layers, {report['num_tokens']} tokens, "
               f"{report['policy']})")


def _mlx_engine():
    """``kvtool.engines.mlx``, or a one-line error where mlx-lm is not installed."""
    try:
        from kvtool.engines import mlx as mlx_engine
    except ImportError as e:
        from kvtool.errors import KvtoolError

        raise KvtoolError(f"mlx-lm prompt caches need mlx-lm ({e}): pip install "
                          "'kvtool[mlx]'") from None
    return mlx_engine


@click.command("compress")
@click.argument("src", metavar="IN", type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="Output .kvz file (written atomically; may equal IN).")
@click.option("--from", "src_format", type=click.Choice(["kvz", "mlx"]), default="kvz",
              show_default=True,
              help="What IN is: a .kvz file, or an mlx-lm prompt cache (.safetensors) to import.")
@codec_policy_options
@_with_zstd_options
@click.option("--entropy", is_flag=True,
              help="rANS-code each tensor (codes at their entropy: turbo3 ~2.7 bits/element; "
                   "with --zstd, each tensor keeps the smaller of the two).")
@click.option("--force", is_flag=True,
              help="Re-encode an already lossy IN with a lossy policy (errors add up).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@handle_errors
def compress_command(src: str, output: str, src_format: str, zstd: bool, zstd_level: int | None,
                     entropy: bool, force: bool, as_json: bool, **opts: Any) -> None:
    """Re-encode the .kvz file IN (or import the mlx-lm prompt cache IN) with a codec policy."""
    if not any(opts.get(k) for k in ("codec", "key_codec", "value_codec", "policy_file",
                                     "preset")):
        raise click.UsageError("give --codec (or --key-codec/--value-codec, --preset NAME or "
                               "--policy FILE; raw: lossless)")
    _check_paths(src, output)
    policy = policy_from_options(opts)
    if src_format != "mlx" and (opts.get("preset") or opts.get("policy_file")):
        from kvtool.formats import open_kvz

        with open_kvz(src, verify=False) as f:
            model = f.model
        policy = fitted_for_model(opts, policy, model.get("fingerprint"),
                                  str(model.get("name") or src))
    level = _zstd(zstd, zstd_level)
    if src_format == "mlx":
        from kvtool.formats import save
        from kvtool.formats.transcode import refuse_requantizing

        mlx_engine = _mlx_engine()
        cache = mlx_engine.import_prompt_cache(src)
        model = cache.model or {}
        policy = fitted_for_model(opts, policy, model.get("fingerprint"),
                                  str(model.get("name") or src))
        if not force:  # KvtoolMLXCache layers hold codes: decoded, they are lossy already
            refuse_requantizing(src, policy, "compressing it again", cache.lossy_sources)
        report = save(cache, output, policy, zstd=level, entropy=entropy,
                      progress=progress_enabled())
    else:
        from kvtool.formats import transcode
        from kvtool.formats.transcode import refuse_requantizing

        if not force:
            refuse_requantizing(src, policy, "compressing it again")
        report = transcode(src, output, policy, zstd=level, progress=progress_enabled(),
                           entropy=entropy)
    _report(report, as_json)


@click.command("decompress")
@click.argument("src", metavar="IN", type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="Output file (written atomically; may equal IN).")
@click.option("--to", "dst_format", type=click.Choice(["kvz", "mlx"]), default="kvz",
              show_default=True,
              help="What to write: a .kvz file, or an mlx-lm prompt cache (name it "
              "*.safetensors; no zstd).")
@click.option("--dtype", type=DTYPE, default=None,
              help="Store in this dtype (default: the dtype the cache was saved from).")
@click.option("--model", "model", default=None, metavar="MODEL",
              help="--to mlx: the model mlx_lm.generate --prompt-cache-file loads (a directory, "
                   "a Hub id or 'default'), checked against IN (default: IN's model where kvtool "
                   "knows its directory, else its name).")
@_with_zstd_options
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@handle_errors
def decompress_command(src: str, output: str, dst_format: str, dtype: str | None,
                       model: str | None, zstd: bool, zstd_level: int | None,
                       as_json: bool) -> None:
    """Decode the .kvz file IN and store it lossless (raw codec, or an mlx-lm prompt cache)."""
    _check_paths(src, output)
    if dst_format == "mlx":
        if zstd or zstd_level is not None:
            raise click.UsageError("--zstd and --zstd-level apply to .kvz output only")
        mlx_engine = _mlx_engine()
        from kvtool.formats import load

        cache = load(src, dtype=dtype, progress=progress_enabled())
        report = mlx_engine.export_prompt_cache(cache, output, model=model)
        if as_json:
            echo_json(report)
        else:
            from kvtool.cli.inspect import human_bytes

            click.echo(f"wrote {report['path']}: {human_bytes(report['file_bytes'])}, mlx-lm "
                       f"prompt cache ({report['num_layers']} layers, {report['num_tokens']} "
                       f"tokens) of model {report['model']}")
        if not _loadable(report["model"]):
            click.echo(f"note: mlx_lm.generate --prompt-cache-file loads model "
                       f"{report['model']!r}, which is neither a directory nor a Hub id: give "
                       "--model DIR", err=True)
        return
    if model is not None:
        raise click.UsageError("--model applies to --to mlx only")
    from kvtool.formats import transcode

    report = transcode(src, output, policy_from_options({}, "raw"), dtype=dtype,
                       zstd=_zstd(zstd, zstd_level), progress=progress_enabled())
    _report(report, as_json)


def _loadable(model: str) -> bool:
    """Whether mlx-lm can load ``model``: a directory, or a Hub id."""
    from kvtool.models import HUB_ID

    return os.path.isdir(model) or bool(HUB_ID.match(model))
