"""``kvtool codecs``: list codecs with bits/element and the kernels that serve each here."""

from __future__ import annotations

import click

from kvtool.cli._common import echo_json, handle_errors

MAX_HEAD_DIM = 4096  # kvtool.formats.constants.MAX_HEAD_DIM (not imported: numpy at start-up)


@click.command("codecs")
@click.option("--head-dim", default=128, show_default=True,
              type=click.IntRange(2, MAX_HEAD_DIM),
              help="head_dim at which to report bits/element.")
@click.option("--options", "show_options", is_flag=True,
              help="List each codec's options (id:name=value,...) with types and defaults.")
@click.option("--presets", "show_presets", is_flag=True,
              help="List the policy presets (--preset NAME) with bits/element and quality.")
@click.option("--measure", is_flag=True,
              help="With --presets: measure each preset's encode/decode MB/s on this machine.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@handle_errors
def codecs_command(head_dim: int, show_options: bool, show_presets: bool, measure: bool,
                   as_json: bool) -> None:
    """List every registered codec (built-ins and plugins)."""
    if measure and not show_presets:
        raise click.UsageError("--measure needs --presets (it times each preset)")
    if show_presets:
        _print_presets(head_dim, measure, as_json)
        return
    if show_options:
        _print_options(as_json)
        return
    from kvtool.codecs import get_codec, list_codecs
    from kvtool.kernels import KERNELS_ENV, available_backends, cpu_kernels, kernel_mode

    backends = available_backends()
    compiled = cpu_kernels()
    rows = []
    for codec_id in list_codecs():
        codec = get_codec(codec_id)
        bits = codec.bits_per_element(head_dim)
        ops = list(codec.compiled_ops(head_dim))
        cpu = f"{compiled.name}: {', '.join(ops)}" if compiled is not None and ops \
            else "reference"
        rows.append({"id": codec_id, "bits_per_element": round(bits, 4),
                     "ratio_vs_fp16": round(16 / bits, 3), "backends": backends,
                     "cpu_kernels": cpu, "compiled_ops": ops, "config": codec.get_config()})
    mode = kernel_mode()
    if as_json:
        echo_json({"head_dim": head_dim, "kernel_mode": mode,
                   "compiled_backend": None if compiled is None else compiled.name,
                   "codecs": rows})
        return
    click.echo(f"{'codec':<10} {'bits/elem':>9} {'vs fp16':>8}  {'arrays':<18} CPU kernels   "
               f"(head_dim={head_dim}, {KERNELS_ENV}={mode})")
    for r in rows:
        click.echo(f"{r['id']:<10} {r['bits_per_element']:>9.3f} {r['ratio_vs_fp16']:>7.2f}x  "
                   f"{', '.join(r['backends']):<18} {r['cpu_kernels']}")


def _print_presets(head_dim: int, measure: bool, as_json: bool) -> None:
    """``kvtool codecs --presets``: bits, quality and speed of each preset."""
    from kvtool.presets import presets_table

    rows = presets_table(head_dim)
    if measure:
        from kvtool.presets import preset_policy

        for r in rows:
            if "unfit" in r:
                continue
            policy = preset_policy(r["name"])
            speeds = [measure_mbps(c, head_dim) for c in (policy.key, policy.value)]
            r["encode_mbps"], r["decode_mbps"] = (
                {"key": round(speeds[0][i]), "value": round(speeds[1][i])} for i in (0, 1))
    if as_json:
        echo_json({"head_dim": head_dim, "presets": rows})
        return
    where = (f"this machine, head_dim {head_dim}" if measure else
             "2-core AMD EPYC, head_dim 128 (--measure: this machine)")
    click.echo(f"codec bits/element at head_dim {head_dim} (sinks and centering aside); "
               "measured: benchmarks/quality.py, SmolLM2-135M, mean over 3 seeds x 2 texts; "
               f"key/value MB/s of fp16 input: {where}")
    for r in rows:
        speed = ""
        if "encode_mbps" in r:
            enc, dec = r["encode_mbps"], r["decode_mbps"]
            speed = (f"\n          encode {enc['key']}/{enc['value']} MB/s, "
                     f"decode {dec['key']}/{dec['value']} MB/s")
        bits = "     — " if "unfit" in r else f"{r['bits_per_element']:>6.3f} b"
        unfit = f"\n          not at head_dim {head_dim}: {r['unfit']}" if "unfit" in r else ""
        click.echo(f"{r['name']:<9} {bits}  {r['measured']}{speed}{unfit}"
                   f"\n          {r['label']}")


def measure_mbps(codec: object, head_dim: int, vectors: int = 1 << 16) -> tuple[float, float]:
    """(encode, decode) MB/s of fp16 input for ``codec`` on Gaussian rows, best of 3 after a
    warm-up call."""
    import time

    import numpy as np

    x = np.random.default_rng(0).standard_normal((vectors, head_dim), np.float32)
    x = x.astype(np.float16)
    enc = codec.encode(x)
    codec.decode(enc)
    times = []
    for fn in (lambda: codec.encode(x), lambda: codec.decode(enc)):
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        times.append(best)
    return x.nbytes / times[0] / 1e6, x.nbytes / times[1] / 1e6


def _option_text(opt: dict) -> str:
    import json

    if opt["name"].startswith("**"):
        return f"{opt['name']} (checked by the codec)"
    if opt["required"]:
        return f"{opt['name']}: {opt['type']} (required)"
    return f"{opt['name']}: {opt['type']} = {json.dumps(opt['default'])}"


def _print_options(as_json: bool) -> None:
    """``kvtool codecs --options``: every codec's options, written as in a codec spec."""
    from kvtool.codecs import list_codecs
    from kvtool.codecs.registry import option_table

    table = {codec_id: option_table(codec_id) for codec_id in list_codecs()}
    if as_json:
        echo_json({"codecs": table})
        return
    for codec_id, options in table.items():
        shown = ", ".join(_option_text(o) for o in options) or "(no options)"
        click.echo(f"{codec_id:<10} {shown}")
    click.echo("\nSet options as id:name=value,... (turbo3:center=true,seed=7) or as JSON "
               '({"id": "int4", "group_size": 32}).')
