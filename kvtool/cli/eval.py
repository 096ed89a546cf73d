"""``kvtool eval``: perplexity change, cache error and bits/element of a codec policy."""

from __future__ import annotations

import click

from kvtool.cli._common import (
    DTYPE,
    codec_policy_options,
    echo_json,
    fitted_for_model,
    handle_errors,
    policy_from_options,
)


@click.command("eval")
@click.option("--model", "model_name", default="default", show_default=True,
              help="'default' (SmolLM2-135M), a local HF model directory or a .gguf file.")
@codec_policy_options
@click.option("--text", "text_file", type=click.Path(dir_okay=False), default=None,
              help="UTF-8 text to evaluate on (default: the bundled eval text, ~3.8K tokens).")
@click.option("--chunk", default=256, show_default=True, type=click.IntRange(1),
              help="Tokens per chunk; each chunk attends to the compressed past.")
@click.option("--max-tokens", default=None, type=click.IntRange(2),
              help="Evaluate on the first N tokens only.")
@click.option("--block-size", default=64, show_default=True, type=click.IntRange(1),
              help="Tokens the runtime cache encodes together.")
@click.option("--prompt", default=None,
              help="Prompt for the side-by-side continuation (default: the demo document and "
                   "a question about it).")
@click.option("--max-new-tokens", default=32, show_default=True, type=click.IntRange(0),
              help="Tokens of greedy continuation to compare (0: skip).")
@click.option("--dtype", default="float32", show_default=True,
              type=DTYPE,
              help="Dtype the model runs in.")
@click.option("--seeds", default=1, show_default=True, type=click.IntRange(1, 64),
              help="With N >= 2: mean and spread over N rotation seeds x texts (--text, else "
                   "both bundled texts at --max-tokens, default 2048), ranked by next-token KL.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@handle_errors
def eval_command(model_name: str, text_file: str | None, chunk: int, max_tokens: int | None,
                 block_size: int, prompt: str | None, max_new_tokens: int, dtype: str,
                 seeds: int, as_json: bool, **policy_opts) -> None:
    """Chunked perplexity with a compressed past against the exact cache, K/V error, bits/element
    and a greedy continuation side by side."""
    from kvtool.evaluate import evaluate
    from kvtool.fileio import read_text_file
    from kvtool.models import load_model
    from kvtool.progress import forward_progress

    if prompt is not None and not prompt.strip():
        raise click.UsageError("--prompt is empty: give text, or leave it out for the demo "
                               "document and a question about it")
    policy = policy_from_options(policy_opts)
    if seeds > 1:
        _check_sweep(policy, prompt)
    text = read_text_file(text_file) if text_file is not None else None
    loaded = load_model(model_name, dtype=dtype)
    policy = fitted_for_model(policy_opts, policy, loaded.fingerprints.get("model"), loaded.name,
                              (loaded.info or {}).get("weights"))
    if seeds > 1:
        from kvtool.evaluate_grid import eval_sweep

        eval_sweep(loaded, policy, text_file, text, seeds, chunk=chunk, block_size=block_size,
                   max_tokens=max_tokens, as_json=as_json)
        return
    with forward_progress(loaded.model, _forward_calls(loaded, text, chunk, max_tokens,
                                                       max_new_tokens), "evaluating", "step"):
        report = evaluate(loaded, policy, text, chunk=chunk, block_size=block_size,
                          max_tokens=max_tokens, prompt=prompt, max_new_tokens=max_new_tokens)
    if as_json:
        echo_json({"model": loaded.name, **report.to_json()})
        return
    m = report.metrics
    click.echo(f"model      {loaded.name} ({dtype})")
    click.echo(f"policy     {report.label}")
    click.echo(f"text       {report.tokens} tokens in chunks of {report.chunk}")
    click.echo(f"perplexity {report.ppl:.4f}  (baseline {report.baseline_ppl:.4f}, "
               f"{report.delta_ppl_pct:+.3f}%)")
    past = report.tokens - 1 - report.chunk  # scored positions after the first chunk
    click.echo(f"KL         {report.kl:.5f}  (next token, mean over the {report.tokens - 1} "
               "scored tokens" + (f"; {report.kl_past:.5f} over the {past} after the first "
                                  "chunk, which attend to the compressed past)" if past > 0
                                  else ")"))
    click.echo(f"bits/elem  {m['bits_per_element']:.3f}  (keys {m['key_bits_per_element']:.3f}, "
               f"values {m['value_bits_per_element']:.3f})")
    click.echo(f"keys       cosine {m['key_cosine']:.5f}  rel. MSE {m['key_rel_mse']:.5f}")
    click.echo(f"values     cosine {m['value_cosine']:.5f}  rel. MSE {m['value_rel_mse']:.5f}")
    if "attention_kl" in m:
        click.echo(f"attention  KL {m['attention_kl']:.5f}  (of the last queries' scores)  "
                   f"top-8 overlap {m['attention_topk_overlap']:.3f}")
    gen = report.generation
    if gen:
        diff = "identical" if gen["identical"] else f"first difference at token " \
                                                    f"{gen['first_difference']}"
        click.echo(f"\ncontinuation of a {gen['prompt_tokens']}-token prompt ({diff}):")
        click.echo(f"  baseline:   {gen['baseline']!r}")
        click.echo(f"  compressed: {gen['compressed']!r}")


def _forward_calls(loaded, text: str | None, chunk: int, max_tokens: int | None,
                   max_new_tokens: int) -> int:
    """Model forward calls ``evaluate`` makes: every chunk twice (exact, then compressed) and
    each continuation token twice (the progress bar's total)."""
    from kvtool.evaluate import data_text

    n = len(loaded.tokenizer(text if text is not None else data_text("eval_text.md"))
            ["input_ids"])
    n = min(n, max_tokens) if max_tokens else n
    return 2 * -(-n // chunk) + 2 * max_new_tokens


def _check_sweep(policy, prompt: str | None) -> None:
    """Refuse what ``--seeds N`` would drop: a seed of the user's own (the sweep runs its
    seeds) and the side-by-side continuation."""
    from kvtool.evaluate_grid import DEFAULT_SEEDS

    if policy.with_seed(DEFAULT_SEEDS[0]) != policy:
        raise click.UsageError("--seeds N runs the codecs under N seeds of its own; drop seed= "
                               "from the codec, or leave out --seeds")
    given = click.get_current_context().get_parameter_source("max_new_tokens")
    if prompt is not None or given is not click.core.ParameterSource.DEFAULT:
        raise click.UsageError("--seeds N measures KL and perplexity only: leave out --prompt "
                               "and --max-new-tokens, or --seeds")
