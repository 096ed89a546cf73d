"""The ``kvtool`` root command: wires the command groups, nothing else.

Imports stay light here (no torch, no transformers): each command imports what it needs when it
runs, so ``kvtool --help`` is fast.
"""

from __future__ import annotations

import sys

import click

from kvtool import __version__
from kvtool.cli._common import (
    EXIT_CODES_HELP,
    apply_verbosity,
    close_broken_pipe,
    verbosity_options,
)
from kvtool.cli.calibrate import calibrate_command
from kvtool.cli.capture import capture_command
from kvtool.cli.codecs import codecs_command
from kvtool.cli.eval import eval_command
from kvtool.cli.generate import generate_command
from kvtool.cli.inspect import inspect_command
from kvtool.cli.patch_vllm import patch_vllm_command
from kvtool.cli.serve import serve_command
from kvtool.cli.store import store_group
from kvtool.cli.transcode import compress_command, decompress_command


@click.group(epilog=EXIT_CODES_HELP)
@click.version_option(__version__, prog_name="kvtool")
@verbosity_options
def cli(quiet: bool, verbose: bool) -> None:
    """kvtool: capture, compress, store and restore LLM KV caches.

    Progress bars go to stderr when it is a terminal; -q turns them (and info lines) off.
    """
    apply_verbosity(quiet, verbose)


# One short line per command for `kvtool --help` (docstrings are longer: click would cut them).
COMMANDS = [
    (capture_command, "Prefill a prompt and save its KV cache as a .kvz file."),
    (generate_command, "Generate text, from a saved cache or from scratch."),
    (inspect_command, "Show what a .kvz file holds (--verify: check it)."),
    (compress_command, "Re-encode a .kvz file (or an mlx-lm cache) with codecs."),
    (decompress_command, "Decode a .kvz file to lossless .kvz or mlx-lm."),
    (eval_command, "Perplexity change and K/V error of a codec policy."),
    (codecs_command, "List codecs, their bits/element and options."),
    (calibrate_command, "Choose per-layer codecs for a bits/element budget."),
    (serve_command, "Serve an OpenAI API (vLLM) with a persistent KV store."),
    (store_group, "Inspect, verify, prune and pin a prefix store."),
    (patch_vllm_command, "Add (or revert) kvtool's cache hook in vLLM."),
]
for command, short in COMMANDS:
    command.short_help = short
    cli.add_command(command)

def main() -> None:
    try:
        cli(prog_name="kvtool", standalone_mode=True)
    except BrokenPipeError:
        close_broken_pipe()
    finally:
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            close_broken_pipe()


if __name__ == "__main__":
    main()
