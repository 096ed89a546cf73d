"""What ``kvtool patch-vllm`` changes in one vLLM attention-backend file, as text.

The cache-write call (one of ``ANCHOR_CALLS``, found with :mod:`ast` inside one of
``ANCHOR_FUNCS``, never by line number) gets a marked ``SITE_BLOCK`` right after it, and the file
a marked ``HELPER_BLOCK`` at its end. Blocks are whole lines between ``BEGIN_RE`` and ``END_RE``
markers, so :func:`strip_blocks` gives back the original bytes. Pure functions of bytes: the
file side (backups, manifest, rollback) is :mod:`.patch` and :mod:`.patch_files`.
"""

from __future__ import annotations

import ast
import io
import re
from dataclasses import dataclass
from pathlib import Path

from kvtool.errors import PatchError

BACKENDS_DIR = "v1/attention/backends"
TARGETS = tuple(f"{BACKENDS_DIR}/{name}" for name in (
    "cpu_attn.py", "flash_attn.py", "flashinfer.py", "triton_attn.py", "flex_attention.py"))
ANCHOR_CALLS = ("reshape_and_cache_flash", "triton_reshape_and_cache_flash",
                "cpu_attn_reshape_and_cache", "reshape_and_cache")
ANCHOR_FUNCS = ("do_kv_cache_update", "forward")  # searched in this order
CALL_ARGS = ("key", "value", "key_cache", "value_cache", "slot_mapping")
ENV_MODE = "KVTOOL_VLLM_HOOK"
BEGIN_RE = re.compile(r"^[ \t]*# >>> kvtool-hook .*>>>[ \t]*\r?\n?$")
END_RE = re.compile(r"^[ \t]*# <<< kvtool-hook .*<<<[ \t]*\r?\n?$")

SITE_BLOCK = """\
# >>> kvtool-hook {version} (kvtool patch-vllm; undo: kvtool patch-vllm --revert) >>>
if "{env}" in _kvtool_environ:
    _kvtool_cache_write({backend!r}, {layer}, {args})
# <<< kvtool-hook {version} <<<
"""
HELPER_BLOCK = """\
# >>> kvtool-hook {version} (kvtool patch-vllm; undo: kvtool patch-vllm --revert) >>>
from os import environ as _kvtool_environ  # noqa: E402
_kvtool_hook_failed = []


def _kvtool_cache_write(backend, layer, key, value, key_cache, value_cache, slot_mapping):
    \"\"\"kvtool's cache-write hook: reports its first error once, never raises into vLLM.\"\"\"
    if _kvtool_hook_failed:
        return
    try:
        from kvtool.engines.vllm.hook import on_cache_write

        on_cache_write(getattr(layer, "layer_name", None), key, value,
                       (key_cache, value_cache), slot_mapping, backend=backend)
    except Exception as e:
        _kvtool_hook_failed.append(e)
        import sys

        sys.stderr.write(f"kvtool: vLLM cache-write hook off after {{type(e).__name__}}: {{e}}\\n")
# <<< kvtool-hook {version} <<<
"""


@dataclass
class FilePlan:
    """One backend file: its original text and the patched text."""

    rel: str
    original: bytes  # what a revert restores
    patched: bytes
    sites: int
    current: bytes = b""  # the file as read (differs from ``original`` only after --force)


def lines_of(text: str) -> list[str]:
    """Lines with their endings, split exactly where Python's tokenizer splits them."""
    return io.StringIO(text, newline="").readlines()


def has_markers(data: bytes) -> bool:
    return any(BEGIN_RE.match(line) for line in lines_of(data.decode("utf-8")))


def strip_blocks(data: bytes) -> bytes:
    """``data`` without kvtool's marked blocks (the original bytes of a patched file)."""
    out, inside = [], False
    for line in lines_of(data.decode("utf-8")):
        if not inside and BEGIN_RE.match(line):
            inside = True
        elif inside and END_RE.match(line):
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise PatchError("unterminated kvtool-hook block; reinstall vLLM")
    return "".join(out).encode("utf-8")


def _call_name(node: ast.Call) -> str | None:
    f = node.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _call_args(text: str, call: ast.Call) -> list[str] | None:
    """Source of the call's key, value, key_cache, value_cache, slot_mapping arguments."""
    if any(isinstance(a, ast.Starred) for a in call.args):
        return None
    nodes: list[ast.expr | None] = list(call.args[:len(CALL_ARGS)])
    nodes += [None] * (len(CALL_ARGS) - len(nodes))
    for kw in call.keywords:
        if kw.arg in CALL_ARGS:
            nodes[CALL_ARGS.index(kw.arg)] = kw.value
    if any(n is None for n in nodes):
        return None
    segs = [ast.get_source_segment(text, n) for n in nodes]  # type: ignore[arg-type]
    return None if None in segs else [" ".join(s.split()) for s in segs]  # type: ignore


def _sites(text: str, tree: ast.Module) -> list[tuple[ast.stmt, list[str], str]]:
    """(statement, argument sources, layer expression) of each cache-write call to hook."""
    for func_name in ANCHOR_FUNCS:
        found = []
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name != func_name:
                continue
            params = [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs]
            layer = "layer" if "layer" in params else "None"
            for stmt in ast.walk(fn):
                if any(stmt is s for s, _, _ in found):
                    continue
                if (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
                        and _call_name(stmt.value) in ANCHOR_CALLS):
                    args = _call_args(text, stmt.value)
                    if args is not None:
                        found.append((stmt, args, layer))
        if found:
            return found
    return []


def plan_file(rel: str, original: bytes, version: str) -> FilePlan:
    """The patched text of one backend file, its blocks marked with kvtool ``version``;
    :class:`PatchError` if its anchor is missing."""
    try:
        text = original.decode("utf-8")
        tree = ast.parse(text, filename=rel)
    except (UnicodeDecodeError, SyntaxError) as e:
        raise PatchError(f"{rel}: cannot parse ({e}); nothing was modified") from e
    if has_markers(original):
        raise PatchError(f"{rel} already contains kvtool-hook blocks but is not recorded in a "
                         "manifest; run 'kvtool patch-vllm --revert --force' first")
    sites = _sites(text, tree)
    if not sites:
        raise PatchError(f"{rel}: no KV-cache write ({' / '.join(ANCHOR_CALLS)} inside "
                         f"{' or '.join(ANCHOR_FUNCS)}) found — this vLLM version is not "
                         "supported by this kvtool; nothing was modified")
    lines = lines_of(text)
    newline = "\r\n" if lines and lines[0].endswith("\r\n") else "\n"
    for stmt, args, layer in sorted(sites, key=lambda s: -s[0].lineno):
        first = lines[stmt.lineno - 1]
        indent = first[:len(first) - len(first.lstrip())]
        last = lines[stmt.end_lineno - 1]  # type: ignore[index]
        tail = last[stmt.end_col_offset:].strip()  # type: ignore[index]
        if len(indent) != stmt.col_offset or (tail and not tail.startswith("#")):
            raise PatchError(f"{rel}:{stmt.lineno}: the cache-write call shares its line with "
                             "other code; cannot insert the hook safely; nothing was modified")
        block = SITE_BLOCK.format(version=version, env=ENV_MODE, backend=Path(rel).stem,
                                  layer=layer, args=", ".join(args))
        block_lines = [indent + ln + newline for ln in block.splitlines()]
        lines[stmt.end_lineno:stmt.end_lineno] = block_lines  # type: ignore[misc]
    if lines and not lines[-1].endswith(("\n", "\r")):
        lines[-1] += newline
    helper = HELPER_BLOCK.format(version=version)
    lines += [ln + newline for ln in helper.splitlines()]
    patched = "".join(lines).encode("utf-8")
    try:
        compile(patched, rel, "exec", dont_inherit=True)
    except SyntaxError as e:
        raise PatchError(f"{rel}: the patched file does not compile ({e}); nothing was "
                         "modified") from e
    return FilePlan(rel, original, patched, len(sites), original)
