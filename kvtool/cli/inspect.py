"""``kvtool inspect``: what a .kvz file holds, its sizes, and (with --verify) its integrity."""

from __future__ import annotations

from typing import Any

import click

from kvtool.cli._common import echo_json, handle_errors


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def size_ratio(ratio: float) -> str:
    """``"3.20x smaller"``, or ``"1.06x larger"`` for a file bigger than its K/V (a lossless
    file of few tokens: the header, ids and checksums weigh more than the K/V saved)."""
    if ratio >= 1 or ratio <= 0:
        return f"{ratio:.2f}x smaller"
    return f"{1 / ratio:.2f}x larger"


def _codecs(role: dict[str, Any], decoded_from_lossy: bool) -> str:
    """A role's codecs; ``raw*`` where its values were decoded from lossy K/V."""
    mark = "*" if decoded_from_lossy else ""
    return "+".join(c + mark * (c == "raw") for c in role["codecs"]) or "-"


def _lossy(info: dict[str, Any]) -> str:
    if not info["lossy_sources"]:
        return "no: exact K/V of the model's dtype"
    before = info["decoded_from_lossy"]
    return ", ".join(info["lossy_sources"]) + (
        f" (decoded from lossy K/V: {', '.join(before)}; raw* segments are not exact)"
        if before else "")


def _policy(policy: dict[str, Any] | None) -> str:
    if policy is None:
        return "-"
    from kvtool.errors import KvtoolError
    from kvtool.policy import CodecPolicy

    try:
        return CodecPolicy.from_json(policy).describe()
    except (KvtoolError, KeyError, TypeError, ValueError):
        return "(uses codecs not installed here)"


def print_info(info: dict[str, Any]) -> None:
    model = info["model"]
    ident = " ".join(str(model[k]) for k in ("name", "architecture") if model.get(k)) or "-"
    marks = [f"{k} {str(model[k])[:16]}" for k in ("fingerprint", "weights") if model.get(k)]
    if marks:
        ident += f" ({', '.join(marks)})"
    first = info["layers"][0] if info["layers"] else None
    shape = (f"{first['key']['shape'][0]} kv heads, head_dim {first['key']['shape'][2]}"
             if first else "-")
    ids = info["num_token_ids"]
    rows = [
        ("file", f"{info['path']} ({human_bytes(info['file_bytes'])})"),
        ("format", f"kvz v{info['format_version']} "
                   f"(written by {info['creator'].get('name', '?')} "
                   f"{info['creator'].get('version', '?')})"),
        ("model", ident),
        ("tokenizer", info["tokenizer_fingerprint"] or "-"),
        ("tokens", f"{info['num_tokens']} ({'no' if ids is None else ids} token ids stored)"),
        ("layers", f"{info['num_layers']} x [{shape}] {info['dtype']}"),
        *([("chunk", f"prefix-store chunk {info['store_chunk']['key'][:16]}, tokens from "
                     f"{info['store_chunk']['start']}")] if info["store_chunk"] else []),
        ("policy", _policy(info["policy"]) + (f" (declared, not checked: "
                                                f"{info['policy_unchecked']})"
                                                if info.get("policy_unchecked") else "")),
        ("lossy", _lossy(info)),
        ("size", f"{human_bytes(info['file_bytes'])} file, "
                 f"{human_bytes(info['payload_bytes'])} payload, "
                 f"{human_bytes(info['fp16_bytes'])} as fp16"),
        ("ratio", f"{info['ratio']:.2f}x vs fp16 (fp16 bytes / file bytes, "
                  f"{info['bits_per_element']:.3f} bits/element)"),
        ("zstd", f"{info['zstd_tensors']} of {info['tensors']} tensors"),
    ]
    verify = info.get("verify")
    if verify is None:
        rows.append(("checksums", f"{info['checksum']}: not checked (use --verify)"))
    elif verify["ok"]:
        rows.append(("checksums", f"{info['checksum']}: all {info['tensors']} tensors ok"))
    else:
        rows.append(("checksums", f"FAILED: {len(verify['problems'])} problem(s)"))
    for name, value in rows:
        click.echo(f"{name:<10} {value}")
    click.echo("")
    click.echo(f"{'layer':>5} {'tokens':>7}  {'key codecs':<22} {'value codecs':<22} "
               f"{'bytes':>10} {'bits/elem':>9}")
    for lay in info["layers"]:
        k, v = lay["key"], lay["value"]
        stored = k["stored_bytes"] + v["stored_bytes"]
        elements = (k["fp16_bytes"] + v["fp16_bytes"]) // 2
        bits = 8 * stored / elements if elements else 0.0
        before = bool(info["decoded_from_lossy"])
        click.echo(f"{lay['index']:>5} {lay['tokens']:>7}  {_codecs(k, before):<22} "
                   f"{_codecs(v, before):<22} "
                   f"{stored:>10} {bits:>9.3f}")
    for problem in (verify or {}).get("problems", [])[:20]:
        click.echo(f"problem: {problem}")


@click.command("inspect")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--verify", is_flag=True,
              help="Check every checksum and codec; exit code 4 if anything is wrong.")
@handle_errors
def inspect_command(file: str, as_json: bool, verify: bool) -> None:
    """Show what a .kvz FILE holds: model, tokens, codecs per layer, sizes, ratio vs fp16."""
    from kvtool.errors import FormatError
    from kvtool.formats import open_kvz

    with open_kvz(file) as f:
        info = f.info()
        problems = f.verify() if verify else None
    if problems is not None:
        info["verify"] = {"ok": not problems, "problems": problems}
    if as_json:
        echo_json(info)
    else:
        print_info(info)
    if problems:
        raise FormatError(f"{file}: verification failed ({len(problems)} problem(s)): "
                          f"{problems[0]}")
