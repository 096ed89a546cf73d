"""``kvtool calibrate``: a per-layer codec policy for a model and a bits/element budget."""

from __future__ import annotations

import json

import click

from kvtool.cli._common import DTYPE, echo_json, handle_errors


def _menu(value: str | None) -> dict[str, str] | None:
    """``--menu``: names from the default menu (``2b,4b,lossless``) or a JSON file
    ``{"name": "codec label", …}``; None: the default menu."""
    from kvtool.calibrate import DEFAULT_MENU, menu_codec
    from kvtool.errors import KvtoolError

    if value is None:
        return None
    if value.endswith(".json"):
        from kvtool.fileio import read_text_file

        try:
            menu = json.loads(read_text_file(value))
        except ValueError as e:
            raise KvtoolError(f"--menu {value}: not JSON ({str(e)[:80]})") from None
        if not (isinstance(menu, dict) and menu
                and all(isinstance(k, str) and isinstance(v, str) for k, v in menu.items())):
            raise KvtoolError(f"--menu {value}: expected a JSON object of name → codec label")
        for name, spec in menu.items():  # before the model loads
            try:
                menu_codec(spec, "key", 64)
            except (KeyError, IndexError, ValueError) as e:
                raise KvtoolError(f"--menu {value}: option {name!r}: {spec[:60]!r} is not a "
                                  f"codec label ({e})") from None
            except KvtoolError as e:
                raise KvtoolError(f"--menu {value}: option {name!r}: {e}") from None
        return menu
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in DEFAULT_MENU]
    if unknown or not names:
        raise KvtoolError(f"--menu: unknown option {', '.join(unknown) or value!r}; choose from "
                          f"{', '.join(DEFAULT_MENU)} or give a JSON file")
    return {n: DEFAULT_MENU[n] for n in names}


@click.command("calibrate")
@click.option("--model", "model_name", default="default", show_default=True,
              help="'default' (SmolLM2-135M), a local HF model directory or a .gguf file.")
@click.option("--bits", required=True, type=click.FloatRange(min=0, min_open=True),
              help="Budget: mean bits/element over every layer's keys and values.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="Policy JSON file to write (kvtool.policy.load_policy reads it; the vLLM "
                   "connector takes it as its preset).")
@click.option("--text", "text_file", type=click.Path(dir_okay=False), default=None,
              help="UTF-8 calibration text (default: the bundled eval text).")
@click.option("--tokens", default=512, show_default=True, type=click.IntRange(16),
              help="Calibration tokens (the first N of the text).")
@click.option("--scored", default=64, show_default=True, type=click.IntRange(1),
              help="The last N tokens, whose next-token KL is measured.")
@click.option("--sink-tokens", default=4, show_default=True, type=click.IntRange(0),
              help="Leading tokens kept lossless (in the measurement and the policy).")
@click.option("--menu", default=None,
              help="Options to choose from: names of the default menu (comma-separated) or a "
                   "JSON file of name → codec label ({outliers}: a quarter of head_dim).")
@click.option("--dtype", default="float32", show_default=True, type=DTYPE,
              help="Dtype the model runs in while measuring.")
@click.option("--remeasure", is_flag=True,
              help="Ignore cached measurements for this model, text and menu.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@handle_errors
def calibrate_command(model_name: str, bits: float, output: str, text_file: str | None,
                      tokens: int, scored: int, sink_tokens: int, menu: str | None, dtype: str,
                      remeasure: bool, as_json: bool) -> None:
    """Measure, for each layer and each codec option, the next-token KL when only that layer
    is compressed; then choose per layer the options with the least summed KL whose mean
    bits/element fits --bits, and write that policy as JSON (measurements are cached per model,
    so another --bits is instant)."""
    from kvtool.calibrate import calibrate, format_table
    from kvtool.fileio import check_output_path, read_text_file
    from kvtool.models import load_model
    from kvtool.policy import save_policy

    options = _menu(menu)
    check_output_path(output)
    text = read_text_file(text_file) if text_file is not None else None
    loaded = load_model(model_name, dtype=dtype)
    cal = calibrate(loaded, bits, text, tokens=tokens, scored=scored, sinks=sink_tokens,
                    menu=options, use_cache=not remeasure)
    extra = cal.file_extra(loaded.name, loaded.fingerprints.get("model", ""))
    save_policy(cal.policy, output, extra)
    if as_json:
        echo_json({"output": output, "policy": cal.policy.to_json(), **extra})
        return
    for line in format_table(cal):
        click.echo(line)
    click.echo(f"policy     {cal.policy.describe()}")
    click.echo(f"wrote      {output}")
