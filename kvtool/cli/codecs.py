"""``kvtool codecs``: list codecs with bits/element and the backends available here."""

from __future__ import annotations

import click

from kvtool.cli._common import echo_json, handle_errors


@click.command("codecs")
@click.option("--head-dim", default=128, show_default=True, type=click.IntRange(2),
              help="head_dim at which to report bits/element.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@handle_errors
def codecs_command(head_dim: int, as_json: bool) -> None:
    """List every registered codec (built-ins and plugins)."""
    from kvtool.codecs import get_codec, list_codecs
    from kvtool.kernels import available_backends

    backends = available_backends()
    rows = []
    for codec_id in list_codecs():
        codec = get_codec(codec_id)
        bits = codec.bits_per_element(head_dim)
        rows.append({"id": codec_id, "bits_per_element": round(bits, 4),
                     "ratio_vs_fp16": round(16 / bits, 3), "backends": backends,
                     "config": codec.get_config()})
    if as_json:
        echo_json({"head_dim": head_dim, "codecs": rows})
        return
    click.echo(f"{'codec':<10} {'bits/elem':>9} {'vs fp16':>8}  backends   (head_dim={head_dim})")
    for r in rows:
        click.echo(f"{r['id']:<10} {r['bits_per_element']:>9.3f} {r['ratio_vs_fp16']:>7.2f}x  "
                   f"{', '.join(r['backends'])}")
