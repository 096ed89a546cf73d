"""``kvtool calibrate``: a per-layer codec policy for a model and a bits/element budget."""

from __future__ import annotations

import json

import click

from kvtool.cli._common import DTYPE, FiniteFloatRange, echo_json, handle_errors


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


MIN_SCORED = 16  # scored tokens below which calibrate warns


@click.command("calibrate")
@click.option("--model", "model_name", default="default", show_default=True,
              help="'default' (SmolLM2-135M), a local HF model directory or a .gguf file.")
@click.option("--bits", default=None,
              type=FiniteFloatRange(min=0, min_open=True, max=16, max_open=True),
              help="Budget: mean bits/element over every layer's keys and values (below 16: "
                   "at 16 a cache stays lossless).")
@click.option("--preset", "presets", default=None,
              help="Instead of --bits: fit these presets (comma-separated, or 'all') to the "
                   "model: measure each preset's menu within its budget and keep the least "
                   "KL; --preset NAME then uses it for this model everywhere.")
@click.option("-o", "--output", default=None, type=click.Path(dir_okay=False),
              help="Policy JSON file to write (kvtool.policy_files.load_policy reads it; the vLLM "
                   "connector takes it as its preset); with --preset, optional (one preset).")
@click.option("--text", "text_file", type=click.Path(dir_okay=False), default=None,
              help="UTF-8 calibration text (default: the bundled eval text; with --preset, "
                   "the two bundled texts).")
@click.option("--tokens", default=None, type=click.IntRange(16),
              help="Calibration tokens (the first N of the text; default 512, with --preset "
                   "1024 per text).")
@click.option("--seeds", default=2, show_default=True, type=click.IntRange(1, 8),
              help="With --preset: rotation seeds per text.")
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
def calibrate_command(model_name: str, bits: float | None, presets: str | None,
                      output: str | None, text_file: str | None, tokens: int | None,
                      seeds: int, scored: int, sink_tokens: int, menu: str | None, dtype: str,
                      remeasure: bool, as_json: bool) -> None:
    """Measure, for each layer and each codec option, the next-token KL when only that layer
    is compressed; then choose per layer the options with the least summed KL whose mean
    bits/element fits --bits, and write that policy as JSON (measurements are cached per model,
    so another --bits is instant). With --preset: fit named presets to the model instead."""
    from kvtool.calibrate import calibrate, format_table
    from kvtool.fileio import check_output_path, read_text_file
    from kvtool.models import load_model
    from kvtool.policy_files import save_policy

    if (bits is None) == (presets is None):
        raise click.UsageError("give --bits (a per-layer policy) or --preset (fit presets)"
                               + (", not both" if bits is not None else ""))
    if presets is not None:
        _fit_presets(model_name, presets, output, text_file, tokens, seeds, dtype, as_json)
        return
    if output is None:
        raise click.UsageError("--bits needs -o/--output, the policy file to write")
    options = _menu(menu)
    check_output_path(output, inputs=(text_file, menu))
    text = read_text_file(text_file) if text_file is not None else None
    loaded = load_model(model_name, dtype=dtype)
    cal = calibrate(loaded, bits, text, tokens=tokens or 512, scored=scored, sinks=sink_tokens,
                    menu=options, use_cache=not remeasure)
    if scored < MIN_SCORED:
        from kvtool.progress import info

        info(f"warning: --scored {scored}: a per-layer KL over fewer than {MIN_SCORED} tokens "
             "is mostly noise, so the policy may not hold on other texts (default 64)")
    extra = cal.file_extra(loaded.name, loaded.fingerprints.get("model", ""),
                           (loaded.info or {}).get("weights"))
    save_policy(cal.policy, output, extra)
    if as_json:
        echo_json({"output": output, "policy": cal.policy.to_json(), **extra})
        return
    for line in format_table(cal):
        click.echo(line)
    click.echo(f"policy     {cal.policy.describe()}")
    click.echo(f"wrote      {output}")


def _fit_presets(model_name: str, presets: str, output: str | None, text_file: str | None,
                 tokens: int | None, seeds: int, dtype: str, as_json: bool) -> None:
    """``kvtool calibrate --preset``: fit each named preset to the model and record it."""
    from kvtool.evaluate_grid import seed_list
    from kvtool.fileio import check_output_path, read_text_file
    from kvtool.models import load_model
    from kvtool.policy import CodecPolicy
    from kvtool.policy_files import save_policy
    from kvtool.preset_fit import (
        BUDGETS,
        DEFAULT_TOKENS,
        MENUS,
        check_fit_tokens,
        fit_preset,
        format_fit,
        save_fit,
    )
    from kvtool.progress import info

    names = list(MENUS) if presets.strip() == "all" else \
        [n.strip() for n in presets.split(",") if n.strip()]
    unknown = [n for n in names if n not in MENUS]
    if unknown or not names:
        raise click.UsageError(f"--preset: unknown {', '.join(unknown) or repr(presets)}; choose "
                               f"from {', '.join(MENUS)} or 'all'")
    if output is not None:
        if len(names) != 1:
            raise click.UsageError("-o/--output takes the policy of one fitted preset")
        check_output_path(output, inputs=(text_file,))
    check_fit_tokens(tokens or DEFAULT_TOKENS)  # before the model loads
    texts = None if text_file is None else {text_file: read_text_file(text_file)}
    loaded = load_model(model_name, dtype=dtype)
    fits = []
    for name in names:
        info(f"fitting {name} to {loaded.name}: {len(MENUS[name])} policies × "
             f"{2 if texts is None else 1} texts × {seeds} seeds")
        fit = fit_preset(loaded, name, texts=texts, tokens=tokens or DEFAULT_TOKENS,
                         seeds=seed_list(seeds))
        path = save_fit(fit)
        fits.append(fit)
        if output is not None:
            save_policy(CodecPolicy.from_label(fit.label), output,
                        {"preset_fit": {k: v for k, v in fit.to_json().items()
                                        if k != "candidates"}})
        if not as_json:
            click.echo(f"{name} on {loaded.name} (≤ {BUDGETS[name]} bits/element, "
                       f"{fit.tokens} tokens × {len(fit.texts)} texts × {len(fit.seeds)} "
                       f"seeds, {fit.seconds:.0f} s):")
            for line in format_fit(fit):
                click.echo(f"  {line}")
            click.echo(f"  recorded in {path}")
    if as_json:
        echo_json({"model": loaded.name, "fits": [f.to_json() for f in fits],
                   **({"output": output} if output else {})})
