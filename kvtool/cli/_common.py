"""Shared CLI helpers: error mapping, JSON output, codec options."""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import click

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


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Known errors → one stderr line and their exit code; traceback only with KVTOOL_DEBUG=1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from kvtool.errors import KvtoolError

        try:
            return fn(*args, **kwargs)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
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
        click.option("--codec", default=None,
                     help="Codec for keys and values: an id (turbo3), id:opt=val,... or JSON."),
        click.option("--key-codec", default=None, help="Codec for keys (overrides --codec)."),
        click.option("--value-codec", default=None, help="Codec for values (overrides --codec)."),
        click.option("--protect-layers", default=0, show_default=True, type=click.IntRange(0),
                     help="Keep the first and last N layers lossless."),
        click.option("--sink-tokens", default=0, show_default=True, type=click.IntRange(0),
                     help="Keep the first N tokens of every layer lossless."),
        click.option("--recent-tokens", default=0, show_default=True, type=click.IntRange(0),
                     help="Keep the last N tokens of every layer lossless."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def policy_from_options(opts: dict[str, Any], default_codec: str = "raw"):
    from kvtool.policy import CodecPolicy

    return CodecPolicy.from_options(
        codec=opts.get("codec") or default_codec,
        key_codec=opts.get("key_codec"),
        value_codec=opts.get("value_codec"),
        protect_layers=opts.get("protect_layers", 0),
        sink_tokens=opts.get("sink_tokens", 0),
        recent_tokens=opts.get("recent_tokens", 0),
    )
