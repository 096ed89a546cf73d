"""Exception types that the CLI maps to one-line messages and exit codes."""

from __future__ import annotations

from collections.abc import Iterable


class KvtoolError(Exception):
    """Base class of every error kvtool reports to a user. Its message is one line: control
    characters that a crafted file or request put into it are escaped."""

    exit_code = 1

    def __init__(self, *args: object) -> None:
        if len(args) == 1 and isinstance(args[0], str):
            args = (_one_line(args[0]),)
        super().__init__(*args)


def did_you_mean(value: object, choices: Iterable[object]) -> str:
    """``"; did you mean 'x'?"`` with the closest of ``choices`` to a mistyped string, or ``""``."""
    import difflib

    if not isinstance(value, str):
        return ""
    close = difflib.get_close_matches(value, [str(c) for c in choices], n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _one_line(message: str) -> str:
    if message.isprintable():
        return message
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)


def not_the_files(error: BaseException) -> bool:
    """Whether ``error``, raised while decoding a file's checked codes, is the process's or the
    machine's (memory, the OS, a device, a kernel compiler) rather than the file's: readers
    raise it as it is, not as a :class:`FormatError`, so a store never judges a file by it."""
    if isinstance(error, (MemoryError, OSError)):
        return True
    kind = type(error)
    return kind.__name__ in ("OutOfMemoryError", "AcceleratorError") \
        or (kind.__module__ or "").split(".")[0] in ("numba", "triton")


class CodecError(KvtoolError):
    """Unknown codec id, invalid codec config, or input a codec cannot encode."""

    exit_code = 3


class UnknownCodecError(CodecError):
    """No installed codec (built in or plugin) has the requested id."""


class CodecVersionError(CodecError):
    """A codec config names a ``codec_version`` newer than the installed codec implements."""


class FormatError(KvtoolError):
    """A .kvz file is corrupt, truncated, foreign or of an unsupported version."""

    exit_code = 4


class NewerVersionError(FormatError):
    """A file (or a codec config inside it) was written by a newer kvtool: a reader skips it and
    leaves it alone; it is not damaged."""


class MissingCodecError(FormatError):
    """A file names a codec that no installed codec (built in or plugin) implements: like a
    newer version, a shared store skips it and leaves it alone for the servers that have it."""


class ModelMismatchError(KvtoolError):
    """A cache belongs to a different model or tokenizer than the one in use."""

    exit_code = 5


class ModelNotFoundError(KvtoolError):
    """A model name or path cannot be resolved to local weights."""

    exit_code = 6


class PrefixMismatchError(ModelMismatchError):
    """The cached token ids are not a prefix of the prompt to continue (another document, or a
    tokenizer that splits the text differently); ``--force`` does not apply."""


class PatchError(KvtoolError):
    """``kvtool patch-vllm`` cannot patch or revert safely (unsupported vLLM, files changed
    since patching, a failed compile check); nothing was left half-patched."""

    exit_code = 7
