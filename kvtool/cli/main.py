"""The ``kvtool`` root command: wires the command groups, nothing else.

Imports stay light here (no torch, no transformers): each command imports what it needs when it
runs, so ``kvtool --help`` is fast.
"""

from __future__ import annotations

import click

from kvtool import __version__
from kvtool.cli._common import EXIT_CODES_HELP
from kvtool.cli.codecs import codecs_command


@click.group(epilog=EXIT_CODES_HELP)
@click.version_option(__version__, prog_name="kvtool")
def cli() -> None:
    """kvtool: capture, compress, store and restore LLM KV caches."""


cli.add_command(codecs_command)


def main() -> None:
    cli(prog_name="kvtool")


if __name__ == "__main__":
    main()
