"""Progress bars, info lines and log verbosity for the CLI: one switch, set by ``-q``/``-v``.

Bars are tqdm on stderr. They show only when stderr is a terminal and the CLI is not quiet
(``kvtool -q``), so pipes, logs and tests stay clean. Library callers get no bars unless they
ask (:func:`set_verbosity`).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterable, Iterator
from typing import Any

QUIET, NORMAL, VERBOSE = -1, 0, 1
_level = NORMAL


def set_verbosity(level: int) -> None:
    """``QUIET`` (-q: no bars, no info lines), ``NORMAL`` or ``VERBOSE`` (-v: debug logs)."""
    global _level
    _level = level
    logging.getLogger("kvtool").setLevel(
        logging.DEBUG if level >= VERBOSE else logging.ERROR if level <= QUIET
        else logging.WARNING)
    if level <= QUIET:  # results and errors only: other packages' notices too
        import os
        import warnings

        warnings.filterwarnings("ignore", category=FutureWarning)
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # read when torch is imported
    if level >= VERBOSE:
        root = logging.getLogger("kvtool")
        if not root.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
            root.addHandler(handler)
        import os

        os.environ["KVTOOL_LOG_LEVEL"] = "DEBUG"  # the vLLM connector's own logger


def verbosity() -> int:
    return _level


def progress_enabled() -> bool:
    """Bars show only on a terminal (stderr) and when not quiet."""
    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):
        tty = False
    return _level > QUIET and tty


def info(message: str) -> None:
    """One line on stderr (what is happening and where), unless quiet."""
    if _level > QUIET:
        print(f"kvtool: {message}", file=sys.stderr, flush=True)


def debug(message: str) -> None:
    logging.getLogger("kvtool").debug(message)


def bar(iterable: Iterable[Any] | None = None, *, total: float | None = None, desc: str = "",
        unit: str = "it", **kwargs: Any) -> Any:
    """A tqdm bar on stderr, disabled off a terminal or when quiet (then nearly free)."""
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr,
                disable=not progress_enabled(), leave=False, dynamic_ncols=True, **kwargs)


@contextlib.contextmanager
def forward_progress(module: Any, total: int | None, desc: str,
                     unit: str = "step") -> Iterator[Any]:
    """A bar that advances on every forward call of the torch ``module`` (``total`` calls).

    A single long forward (a prefill) gets a bar per decoder layer: pass the layers'
    ``ModuleList`` as ``module`` (see :func:`decoder_layers`) and the layer count as ``total``.
    """
    with bar(total=total, desc=desc, unit=unit) as b:
        if b.disable:
            yield b
            return
        def step(*_: Any) -> None:  # a forward hook must return None (else it replaces
            b.update(1)             # the module's output)

        handles = [m.register_forward_hook(step)
                   for m in (module if isinstance(module, (list, tuple)) else [module])]
        try:
            yield b
        finally:
            for h in handles:
                h.remove()


def decoder_layers(model: Any) -> list[Any]:
    """The decoder layers of a transformers causal LM (the longest ``ModuleList``), or []."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []
