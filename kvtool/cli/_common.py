"""Shared CLI helpers: error mapping, JSON output, codec options."""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import click

MAX_COUNT = 2**31 - 1  # tokens or layers: a count past int32 is a typo, not a request
EXIT_CODES_HELP = """\b
Exit codes:
  0  success
  1  other kvtool error
  2  bad command-line usage
  3  codec error (unknown codec, bad options, input it cannot encode)
  4  file format error (corrupt, truncated, foreign or unsupported .kvz)
  5  cache belongs to another model or tokenizer
  6  model not found
  7  vLLM patch refused or rolled back (kvtool patch-vllm)
"""


def debug_enabled() -> bool:
    return os.environ.get("KVTOOL_DEBUG", "") not in ("", "0")


def os_error_message(e: BaseException) -> str:
    """``strerror: filename`` (``-> filename2`` for a rename) when the error names a file."""
    if not isinstance(e, OSError) or not e.strerror or e.filename is None:
        return str(e)
    name = os.fsdecode(e.filename) if isinstance(e.filename, bytes) else e.filename
    message = f"{e.strerror}: {name}"
    return message if e.filename2 is None else f"{message} -> {e.filename2}"


def close_broken_pipe() -> None:
    """The reader of stdout went away (``kvtool inspect f.kvz | head -3``): exit 0, quietly.

    stdout is pointed at /dev/null so that the interpreter's final flush cannot fail again.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real stdout (a test runner)
        pass
    sys.exit(0)


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Known errors → one stderr line and their exit code; traceback only with KVTOOL_DEBUG=1.

    A broken pipe on stdout ends the command quietly (see :func:`close_broken_pipe`).
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from kvtool.errors import KvtoolError

        try:
            return fn(*args, **kwargs)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except BrokenPipeError:
            close_broken_pipe()
        except KvtoolError as e:
            if debug_enabled():
                raise
            click.echo(f"Error: {e}", err=True)
            sys.exit(e.exit_code)
        except (OSError, MemoryError) as e:
            if debug_enabled():
                raise
            click.echo(f"Error: {os_error_message(e)}", err=True)
            sys.exit(1)
        except Exception as e:  # unexpected: still one line, but say how to see more
            if debug_enabled():
                raise
            click.echo(f"Error: {type(e).__name__}: {e} (set KVTOOL_DEBUG=1 for a traceback)",
                       err=True)
            sys.exit(1)

    return wrapper


def echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def codec_policy_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The options that choose a :class:`kvtool.policy.CodecPolicy`."""
    options = [
        click.option("--preset", default=None,
                     type=click.Choice(["lossless", "quality", "balanced", "small"]),
                     help="A measured policy (kvtool codecs --presets); codec options given "
                          "too override its codecs."),
        click.option("--policy", "policy_file", default=None,
                     type=click.Path(dir_okay=False, exists=True),
                     help="A policy JSON file (kvtool calibrate writes one, per-layer codecs "
                          "included); codec options given too override its default codecs."),
        click.option("--codec", default=None,
                     help="Codec for keys and values: an id (turbo3), id:opt=val,... or JSON."),
        click.option("--key-codec", default=None, help="Codec for keys (overrides --codec)."),
        click.option("--value-codec", default=None, help="Codec for values (overrides --codec)."),
        click.option("--protect-layers", default=None, type=click.IntRange(0, MAX_COUNT),
                     help="Keep the first and last N layers lossless (default: the "
                          "preset's, else 0)."),
        click.option("--sink-tokens", default=None, type=click.IntRange(0, MAX_COUNT),
                     help="Keep the first N tokens of every layer lossless (default: "
                          "the preset's, else 0)."),
        click.option("--recent-tokens", default=None, type=click.IntRange(0, MAX_COUNT),
                     help="Keep the last N tokens of every layer lossless (default: "
                          "the preset's, else 0)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def policy_from_options(opts: dict[str, Any], default_codec: str = "raw",
                        model_fingerprint: str | None = None):
    """The policy of the command's codec options; a ``--preset`` fitted to the model with
    ``model_fingerprint`` (``kvtool calibrate --preset``) starts from its fitted policy."""
    from kvtool.policy import CodecPolicy

    if opts.get("preset") and opts.get("policy_file"):
        from kvtool.errors import CodecError

        raise CodecError("give --preset or --policy, not both")
    if opts.get("preset") or opts.get("policy_file"):
        return CodecPolicy.from_options(
            codec=opts.get("codec"), key_codec=opts.get("key_codec"),
            value_codec=opts.get("value_codec"), protect_layers=opts.get("protect_layers"),
            sink_tokens=opts.get("sink_tokens"), recent_tokens=opts.get("recent_tokens"),
            preset=opts.get("preset") or opts["policy_file"],
            model_fingerprint=model_fingerprint)
    return CodecPolicy.from_options(
        codec=opts.get("codec") or default_codec,
        key_codec=opts.get("key_codec"),
        value_codec=opts.get("value_codec"),
        protect_layers=opts.get("protect_layers"),
        sink_tokens=opts.get("sink_tokens"),
        recent_tokens=opts.get("recent_tokens"),
    )


def connector_options(opts: dict[str, Any]) -> dict[str, Any]:
    """The command's codec options as the connector takes them (``kvtool serve``, ``store
    pin``): a ``--policy`` file goes where a preset name goes (as an absolute path), and
    options left at their default are dropped."""
    opts = dict(opts)
    policy_file = opts.pop("policy_file", None)
    if policy_file:
        if opts.get("preset"):
            raise click.UsageError("give --preset or --policy, not both")
        opts["preset"] = os.path.abspath(policy_file)
    from kvtool.engines.vllm.common import given_options

    return given_options(opts)


# -- one dtype vocabulary ---------------------------------------------------------------------
DTYPE_NAMES = {"fp32": "float32", "float32": "float32", "f32": "float32",
               "bf16": "bfloat16", "bfloat16": "bfloat16",
               "fp16": "float16", "float16": "float16", "f16": "float16", "half": "float16"}


class FiniteFloatRange(click.FloatRange):
    """click's ``FloatRange`` that also refuses NaN and ±inf: a NaN passes every comparison,
    so ``FloatRange`` alone let ``--store-timeout nan`` or ``--top-p nan`` through."""

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return rv


#: most torch threads ``--threads`` takes (100000 made torch fail to start threads, then crash)
MAX_THREADS = 1024


class DtypeParam(click.ParamType):
    """``fp16|bf16|fp32`` or ``float16|bfloat16|float32`` (any case), normalised to the long
    spelling that torch, the .kvz header and the model fingerprint use."""

    name = "dtype"

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "[fp32|bf16|fp16]"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> str:
        name = str(value).strip().lower().removeprefix("torch.")
        if name in DTYPE_NAMES:
            return DTYPE_NAMES[name]
        self.fail(f"{value!r} is not a dtype; use fp32, bf16 or fp16 (or float32, bfloat16, "
                  "float16)", param, ctx)

    def shell_complete(self, ctx: click.Context, param: click.Parameter, incomplete: str):
        from click.shell_completion import CompletionItem

        return [CompletionItem(n) for n in DTYPE_NAMES if n.startswith(incomplete)]


DTYPE = DtypeParam()


# -- input and checks before the slow work ----------------------------------------------------
def read_prompt(prompt: str | None, prompt_file: str | None, *, required: bool = True) -> str:
    """The text of ``--prompt`` or ``--prompt-file`` (a UTF-8 file, or ``-``: stdin)."""
    if prompt is not None and prompt_file is not None:
        raise click.UsageError("give either --prompt or --prompt-file, not both")
    if prompt is None and prompt_file is None:
        if required:
            raise click.UsageError("give --prompt or --prompt-file (- reads stdin)")
        return ""
    if prompt_file == "-":
        stdin = sys.stdin
        data = stdin.buffer.read() if hasattr(stdin, "buffer") else stdin.read().encode()
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            from kvtool.errors import KvtoolError

            raise KvtoolError(f"<stdin>: not UTF-8 text (invalid byte at offset {e.start})") \
                from None
    if prompt_file is not None:
        from kvtool.fileio import read_text_file

        return read_text_file(prompt_file)
    return prompt or ""


def verbosity_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``-q/--quiet`` and ``-v/--verbose`` as ``quiet``/``verbose`` arguments (see
    :func:`apply_verbosity`)."""
    fn = click.option("-v", "--verbose", is_flag=True, help="Debug logs on stderr.")(fn)
    return click.option("-q", "--quiet", is_flag=True,
                        help="No progress bars or info lines: results and errors only.")(fn)


def apply_verbosity(quiet: bool, verbose: bool) -> None:
    from kvtool import progress

    progress.set_verbosity(progress.QUIET if quiet else progress.VERBOSE if verbose
                           else progress.NORMAL)


def context_limit(loaded: Any) -> int | None:
    """The context length of a loaded model of any engine (its config, else config.json)."""
    from kvtool.models import max_positions

    config = getattr(getattr(loaded, "model", None), "config", None)
    if config is not None and not isinstance(config, dict):
        found = max_positions(config)
        if found is not None:
            return found
    where = getattr(loaded, "path", None) or getattr(loaded, "location", None)
    path = os.path.join(str(where), "config.json") if where else None
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    from types import SimpleNamespace

    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else data
    return max_positions(SimpleNamespace(**text))


def fitted_for_model(opts: dict[str, Any], policy: Any, model_fingerprint: str | None,
                     model_name: str, weights: str | None = None) -> Any:
    """``policy`` again once the model is known: where ``--preset NAME`` was fitted to this
    model (``kvtool calibrate --preset NAME``), the fitted policy, said in one info line; a
    ``--policy`` file calibrated for a model of another KV layout is refused, and one fitted
    to other ``weights`` of this layout (a fine-tune, its base) warned of."""
    from kvtool.presets import fitted_weights
    from kvtool.progress import info

    name = opts.get("preset") or opts.get("policy_file")
    if not name or not model_fingerprint:
        return policy
    fitted = policy_from_options(opts, model_fingerprint=model_fingerprint)
    if fitted != policy:
        info(f"--preset {name} fitted to {model_name} (kvtool calibrate --preset): "
             f"{fitted.describe()}")
    made = fitted_weights(name, model_fingerprint) if weights else None
    if made is not None and made[1] != weights:
        option = "--preset" if opts.get("preset") else "--policy"
        info(f"warning: {option} {name} was fitted to {made[0]}, which has this model's KV "
             "layout but other weights: its choices were measured there; run kvtool "
             "calibrate on this model to fit them here")
    return fitted
