"""The ``kvtool`` root command: wires the command groups, nothing else.

Imports stay light here (no torch, no transformers): each command imports what it needs when it
runs, so ``kvtool --help`` is fast.
"""

from __future__ import annotations

import click

from kvtool import __version__
from kvtool.cli._common import EXIT_CODES_HELP
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
def cli() -> None:
    """kvtool: capture, compress, store and restore LLM KV caches."""


cli.add_command(codecs_command)
cli.add_command(eval_command)
cli.add_command(inspect_command)
cli.add_command(compress_command)
cli.add_command(decompress_command)
cli.add_command(capture_command)
cli.add_command(generate_command)
cli.add_command(patch_vllm_command)
cli.add_command(serve_command)
cli.add_command(store_group)


def main() -> None:
    cli(prog_name="kvtool")


if __name__ == "__main__":
    main()
