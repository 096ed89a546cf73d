"""``kvtool patch-vllm``: insert (or revert) kvtool's cache-write hook in an installed vLLM."""

from __future__ import annotations

from typing import Any

import click

from kvtool.cli._common import echo_json, handle_errors

HOOK_HINT = ("enable it per process with KVTOOL_VLLM_HOOK=stats "
             "(KVTOOL_VLLM_HOOK_CODEC, KVTOOL_VLLM_HOOK_DIR)")


@click.command("patch-vllm")
@click.option("--status", "show_status", is_flag=True,
              help="Only report: patched / not patched / modified, per file.")
@click.option("--dry-run", is_flag=True, help="Print the unified diff; modify nothing.")
@click.option("--revert", is_flag=True,
              help="Restore the original files byte for byte (sha256-checked).")
@click.option("--vllm-path", type=click.Path(exists=True, file_okay=False),
              help="The vllm package directory (or its parent) to patch instead of the "
                   "installed one.")
@click.option("--force", is_flag=True,
              help="Go on when files changed since patching (e.g. vLLM was upgraded): drop the "
                   "old patch record and only remove kvtool's own marked blocks.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@handle_errors
def patch_vllm_command(show_status: bool, dry_run: bool, revert: bool, vllm_path: str | None,
                       force: bool, as_json: bool) -> None:
    """Insert kvtool's cache-write hook into every attention backend of the installed vLLM.

    The hook costs one environment look-up while KVTOOL_VLLM_HOOK is unset; with
    KVTOOL_VLLM_HOOK=stats every vLLM process (EngineCore and workers included) shadow-compresses
    the keys and values it writes and records per-layer statistics. Backups and a manifest live
    in <vllm>/.kvtool_patch/; re-patching is a no-op. A failure (a file that cannot be written,
    a failed compile check) rolls every file back and exits with code 7; every run first removes
    what an interrupted run left (temp files, orphan backups).
    """
    from kvtool.engines.vllm import patch as patcher

    if show_status and (dry_run or revert):
        raise click.UsageError("--status cannot be combined with --dry-run or --revert")
    if show_status:
        report = patcher.status(vllm_path)
    elif revert:
        report = patcher.revert(vllm_path, dry_run=dry_run, force=force)
    else:
        report = patcher.patch(vllm_path, dry_run=dry_run, force=force)
    if as_json:
        echo_json(report)
        return
    if show_status:
        _print_status(report)
    else:
        _print_action(report)
    if report.get("cleaned"):
        n = len(report["cleaned"])
        click.echo(f"  removed {n} leftover file{'s' if n != 1 else ''} of an interrupted run")


def _where(r: dict[str, Any]) -> str:
    return f"vLLM {r.get('vllm_version') or '(unknown version)'} at {r['vllm_path']}"


def _print_status(r: dict[str, Any]) -> None:
    by = f" (by kvtool {r['patched_by']})" if r.get("patched_by") else ""
    click.echo(f"{_where(r)}: {r['state']}{by}")
    for f in r["files"]:
        sites = f" ({f['sites']} site{'s' if f['sites'] != 1 else ''})" if f["sites"] else ""
        click.echo(f"  {f['state']:<12} {f['file']}{sites}")
    if r["state"] != "modified":
        return
    if any(f["state"] in ("modified", "missing") for f in r["files"]):
        click.echo("  files changed since patching: 'kvtool patch-vllm --revert' (add --force "
                   "if it refuses), then patch again")
    else:  # recorded files with their original bytes: an interrupted or incomplete run
        click.echo("  only partly patched (an interrupted run, or a file that could not be "
                   "written): 'kvtool patch-vllm' or 'kvtool patch-vllm --revert' finishes it")


def _print_action(r: dict[str, Any]) -> None:
    action = r["action"]
    if r.get("dry_run"):
        if r.get("diff"):
            click.echo(r["diff"], nl=False)
        else:
            click.echo(f"{_where(r)}: nothing to {'revert' if 'revert' in action else 'patch'}")
        return
    if action == "already patched":
        click.echo(f"{_where(r)} is already patched (kvtool {r['kvtool_version']}); "
                   "nothing to do")
    elif action == "not patched":
        click.echo(f"{_where(r)} is not patched; nothing to revert")
    elif action == "patched":
        sites = sum(f["sites"] for f in r["files"])
        again = f" (replacing kvtool {r['repatched_from']}'s)" if r.get("repatched_from") else ""
        click.echo(f"patched {_where(r)}{again}: {len(r['files'])} files, {sites} hook sites; "
                   f"{HOOK_HINT}")
        for f in r["files"]:
            click.echo(f"  patched      {f['file']}")
    elif action == "reverted":
        stripped = sum(f["result"] == "blocks removed" for f in r["files"])
        click.echo(f"reverted {_where(r)}: {len(r['files']) - stripped} files restored (sha256 "
                   "verified)" + (f", kvtool's blocks removed from {stripped} (not verified: "
                                  "they changed since patching)" if stripped else ""))
        for f in r["files"]:
            click.echo(f"  {f['result']:<12} {f['file']}")
