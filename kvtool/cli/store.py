"""``kvtool store``: a prefix store at rest — list, measure, verify and prune it (in the style of
``hf cache``). Every command takes a store directory (a symlink to one is fine) or an
``s3://bucket/prefix`` URL, and is safe while servers use the store: a chunk pruned or
quarantined during ``verify`` is reported as gone, not damaged; ``prune`` exits 1, naming the
file, when it cannot remove what it chose. Sizes and durations are refused by their option's
name (:data:`SIZE`, :data:`DURATION`)."""

from __future__ import annotations

import time
from typing import Any

import click

from kvtool.cli._common import (
    codec_policy_options,
    connector_options,
    echo_json,
    handle_errors,
)
from kvtool.errors import KvtoolError


class SizeType(click.ParamType):
    """A byte count: ``500MB``, ``2GiB``, ``10G``, ``1000``."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None
                ) -> int:
        from kvtool.engines.vllm.store_admin import parse_size

        if isinstance(value, int):
            return value
        try:
            return parse_size(str(value))
        except ValueError as e:
            self.fail(str(e), param, ctx)


class DurationType(click.ParamType):
    """Seconds: ``30d``, ``12h``, ``90m``, ``2w`` (``never``: None, where allowed)."""

    name = "duration"

    def __init__(self, never: bool = False):
        self.never = never

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None
                ) -> float | None:
        from kvtool.engines.vllm.store_admin import parse_duration

        if value is None or isinstance(value, float):
            return value
        if self.never and str(value).strip().lower() == "never":
            return None
        try:
            return parse_duration(str(value))
        except ValueError as e:
            self.fail(str(e).replace(")", ", or never)") if self.never else str(e), param, ctx)


SIZE = SizeType()
DURATION = DurationType()


def _when(ts: float) -> str:
    age = max(0.0, time.time() - ts)
    for unit, seconds in (("d", 86400), ("h", 3600), ("m", 60)):
        if age >= seconds:
            return f"{age / seconds:.0f}{unit} ago"
    return "just now"


def _scan(root: str, *, removing: bool = False):
    """The store's scan; a damaged pins file is warned of to read it, refused to remove from
    it (a pinned chunk would read as unpinned)."""
    from kvtool.engines.vllm import store_admin

    found = store_admin.scan(root)
    if found.pins_problem and removing:
        raise KvtoolError(found.pins_problem)
    if found.pins_problem:
        click.echo(f"warning: {found.pins_problem}", err=True)
    return found


@click.group("store")
def store_group() -> None:
    """Inspect and manage a kvtool prefix store (the vLLM connector's --store: a directory or
    an s3://bucket/prefix URL, reached through the standard AWS environment)."""


@store_group.command("ls")
@click.argument("root", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print JSON (one object per chunk).")
@handle_errors
def ls_command(root: str, as_json: bool) -> None:
    """List the chunk files of every model in the store, most recently hit first."""
    from kvtool.cli.inspect import human_bytes

    chunks = sorted(_scan(root).chunks, key=lambda c: -c.last_hit)
    if as_json:
        echo_json([{"path": c.path, "model": c.model, "bytes": c.bytes, "written": c.written,
                    "last_hit": c.last_hit, "pinned": c.pinned} for c in chunks])
        return
    click.echo(f"{'model':<16}  {'size':>9}  {'last hit':>10}  chunk")
    for c in chunks:
        click.echo(f"{c.model:<16}  {human_bytes(c.bytes):>9}  {_when(c.last_hit):>10}  "
                   f"{c.path.rsplit('/', 1)[-1][:16]}{'  (pinned)' if c.pinned else ''}")
    click.echo(f"{len(chunks)} chunks")


def print_stats(info: dict[str, Any]) -> None:
    from kvtool.cli.inspect import human_bytes

    click.echo(f"store      {info['root']}")
    click.echo(f"chunks     {info['chunks']} ({human_bytes(info['bytes'])}) "
               f"for {len(info['models'])} model(s); {info['pinned_chunks']} pinned")
    for m in info["models"]:
        click.echo(f"  {m['model']}  {m['chunks']} chunks, {human_bytes(m['bytes'])}, "
                   f"hits from {_when(m['oldest_hit'])} to {_when(m['newest_hit'])}")
    click.echo(f"quarantine {info['quarantined_files']} files "
               f"({human_bytes(info['quarantined_bytes'])})")
    click.echo(f"temp files {info['temp_files']} ({human_bytes(info['temp_bytes'])}: writes in "
               "progress or crash leftovers)")
    if info["ignored_entries"]:
        click.echo(f"ignored    {info['ignored_entries']} entries (symlinks, special files, "
                   "foreign names)")


def print_activity(a: dict[str, Any]) -> None:
    """What servers did with the store (:func:`kvtool.engines.vllm.stats_files.store_activity`)."""
    from kvtool.cli.inspect import human_bytes

    c = a["counters"]

    def avg(op: str) -> str:
        return f"avg {1e3 * c[op + '_seconds'] / c[op + '_count']:.0f} ms" if c[op + "_count"] \
            else "none"

    policies = ", ".join(f"{p} ({'lossy' if lossy else 'lossless'})"
                         for p, lossy in a["policies"].items()) or "none recorded"
    last = _when(a["last_update"]) if a["last_update"] else "never"
    click.echo(f"activity   {a['processes']} server process(es), last update {last}; "
               f"policy {policies}")
    seen = c["requests_hit"] + c["requests_missed"]
    click.echo(f"  lookups  {seen} requests: {c['requests_hit']} hit, {c['requests_missed']} "
               f"missed; {c['prompt_tokens_hit']} of "
               f"{c['prompt_tokens_hit'] + c['prompt_tokens_missed']} prompt tokens stored")
    click.echo(f"  loaded   {c['tokens_loaded']} tokens from {c['files_loaded']} files "
               f"({human_bytes(c['bytes_loaded'])}); {c['load_count']} loads, {avg('load')}")
    click.echo(f"  saved    {c['tokens_saved']} tokens in {c['chunks_saved']} chunks "
               f"({human_bytes(c['bytes_saved'])}); {c['save_count']} writes, {avg('save')}")
    click.echo(f"  evicted  {c['chunks_evicted']} chunks ({human_bytes(c['bytes_evicted'])})")
    click.echo(f"  failures {c['load_failures']} load, {c['save_failures']} save, "
               f"{c['invalid_files']} bad files ({c['quarantined_files']} quarantined)")
    click.echo(f"  outages  {c['lookup_timeouts']} lookup and {c['load_timeouts']} load "
               f"timeouts, {c['store_unavailable']} skipped while the store recovered, "
               f"{c['saves_dropped']} saves dropped, {c['disk_full']} full-disk retries")


@store_group.command("stats")
@click.argument("root", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@handle_errors
def stats_command(root: str, as_json: bool) -> None:
    """Totals of a store at rest: chunks and bytes per model, quarantine, temp files, and
    what servers did with it (hits, loads, saves, latencies, failures)."""
    from kvtool.engines.vllm import store_admin
    from kvtool.engines.vllm.stats_files import store_activity

    info = store_admin.stats(_scan(root))
    info["activity"] = store_activity(root)
    if as_json:
        echo_json(info)
    else:
        print_stats(info)
        print_activity(info["activity"])


@store_group.command("verify")
@click.argument("root", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@handle_errors
def verify_command(root: str, as_json: bool) -> None:
    """Check every chunk's checksums and layers (reads every byte; changes nothing).
    Exit code 4 if any chunk is damaged; a chunk pruned or quarantined while the scan runs is
    reported as gone (exit code 0)."""
    from tqdm import tqdm

    from kvtool.engines.vllm import store_admin

    found = _scan(root)
    report = store_admin.verify(found, lambda chunks: tqdm(chunks, desc="verifying",
                                                           unit="chunk", leave=False,
                                                           disable=None))
    bad, gone = report.damaged, report.gone
    if as_json:
        echo_json({"chunks": len(found.chunks), "gone": gone, "ignored": found.ignored,
                   "damaged": [{"path": p, "problem": why} for p, why in bad]})
    else:
        for path in gone:
            click.echo(f"GONE {path} (removed during the scan)")
        for path, why in bad:
            click.echo(f"DAMAGED {path}: {why}")
        checked = len(found.chunks) - len(gone)
        click.echo(f"{checked - len(bad)} of {checked} chunks ok"
                   + (f"; {len(gone)} removed during the scan" if gone else "")
                   + (f"; {found.ignored} other entries ignored (symlinks, directories or "
                      "special files in chunks' places, names not of the store's layout)"
                      if found.ignored else ""))
    if bad:
        raise SystemExit(4)


@store_group.command("prune")
@click.argument("root", type=click.Path(file_okay=False))
@click.option("--max-bytes", type=SIZE, help="Remove least recently hit chunks until the whole "
              "store (chunks, quarantine, temp files) fits (e.g. 500MB, 2GiB).")
@click.option("--older-than", type=DURATION, help="Remove chunks not hit for this long "
              "(a number and a unit: s, m (minutes), h, d, w; e.g. 30d, 12h).")
@click.option("--quarantine-older-than", type=DurationType(never=True), default="7d",
              show_default=True, help="Remove quarantined (damaged) files moved aside longer "
              "ago than this; 'never' keeps them.")
@click.option("--dry-run", is_flag=True, help="Say what would be removed; remove nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@handle_errors
def prune_command(root: str, max_bytes: int | None, older_than: float | None,
                  quarantine_older_than: float | None, dry_run: bool, as_json: bool) -> None:
    """Remove stale temp files of dead writers, quarantined files older than
    --quarantine-older-than, and chunks by last hit (LRU: --max-bytes, --older-than); safe while
    servers use the store. With no option, only the temp files and the aged quarantine go.
    The stats files of ended server processes are folded into one (their totals stay).
    Pinned chunks are never removed. Exit code 1, naming the file, if something chosen cannot
    be removed (read-only filesystem, permissions)."""
    from kvtool.cli.inspect import human_bytes
    from kvtool.engines.vllm import store_admin
    from kvtool.engines.vllm.stats_files import FOLDED, STATS_DIR, fold_ended

    found = _scan(root, removing=True)
    now = time.time()
    aged = store_admin.quarantine_plan(found, older_than=quarantine_older_than, now=now)
    failures: list[store_admin.RemoveError] = []
    fold_error: KvtoolError | None = None

    def run(step: Any, *args: Any) -> tuple[int, int]:
        try:
            return step(*args)
        except store_admin.RemoveError as e:
            failures.append(e)
            return e.removed

    try:
        stats = fold_ended(found.backend, now=now, dry_run=dry_run)
    except KvtoolError as e:  # the chunks are pruned all the same
        stats, fold_error = (0, 0), e
    if dry_run:
        stale = store_admin.stale_temps(found)
        temps = len(stale), sum(t.size for t in stale)
        quarantined = len(aged), sum(e.size for e in aged)
    else:
        temps = run(store_admin.collect_temps, found)
        quarantined = run(store_admin.remove, aged, found.backend)
    doomed = []
    if max_bytes is not None or older_than is not None:
        other = found.quarantined_bytes - quarantined[1] + max(0, found.temp_bytes - temps[1])
        doomed = store_admin.prune_plan(found, max_bytes=max_bytes, older_than=older_than,
                                        now=now, other_bytes=other)
    chunks = ((len(doomed), sum(c.bytes for c in doomed)) if dry_run
              else run(store_admin.remove, doomed, found.backend))
    left = max(0, found.total_bytes - temps[1] - quarantined[1] - chunks[1])
    if as_json:
        echo_json({"removed_files": chunks[0], "removed_bytes": chunks[1],
                   "removed_temp_files": temps[0], "removed_temp_bytes": temps[1],
                   "removed_quarantined_files": quarantined[0],
                   "removed_quarantined_bytes": quarantined[1],
                   "folded_stats_files": stats[0], "dry_run": dry_run,
                   "bytes_left": left})
    else:
        verb = "would remove" if dry_run else "removed"
        click.echo(f"{verb} {chunks[0]} chunks ({human_bytes(chunks[1])}); "
                   f"{human_bytes(left)} left in the store")
        click.echo(f"{verb} {temps[0]} stale temp files ({human_bytes(temps[1])})")
        click.echo(f"{verb} {quarantined[0]} quarantined files ({human_bytes(quarantined[1])})")
        if stats[0]:
            click.echo(f"{'would fold' if dry_run else 'folded'} the stats files of {stats[0]} "
                       f"ended server processes into {STATS_DIR}/{FOLDED}")
    if failures:
        raise failures[0]
    if fold_error is not None:
        raise fold_error


#: every vLLM KV block size is a multiple of this
PIN_BLOCK_MULTIPLE = 16


@store_group.command("pin")
@click.argument("root", type=click.Path(file_okay=False))
@click.argument("file", type=click.Path(dir_okay=False, exists=True))
@click.option("--chunk-tokens", default=256, show_default=True, type=click.IntRange(1),
              help="The server's chunk size (the connector's chunk_tokens, a whole number "
                   "of its KV blocks: a multiple of 16).")
@codec_policy_options
@click.option("--force", is_flag=True,
              help="Encode an already lossy FILE with a lossy policy (errors add up).")
@click.option("--model", "model", default=None, metavar="MODEL",
              help="The model the server runs (a directory, a Hub id or 'default'): its "
                   "checkpoint keys the chunks. Needed for a FILE that names none.")
@click.option("--quantization", default=None, metavar="METHOD",
              help="The server's vLLM --quantization (e.g. fp8), with --model: a checkpoint "
                   "quantized as it loads computes other K/V, so its chunks have other keys.")
@click.option("--quantization-config", default=None, metavar="JSON",
              help="The server's vLLM --quantization-config (JSON), with --model.")
@handle_errors
def pin_command(root: str, file: str, chunk_tokens: int, force: bool, model: str | None,
                quantization: str | None, quantization_config: str | None,
                **codec_opts: Any) -> None:
    """Store FILE.kvz's prefix as the server's chunks and keep them: prune and max_bytes never
    remove pinned chunks. Encoded as ``kvtool serve`` with the same codec options would
    (without any: its default policy). An exact FILE pinned with --preset lossless replaces
    chunks of its prefix that a lossy server stored (a lossless server never loads those)."""
    from kvtool.engines.vllm import store_pins

    if chunk_tokens % PIN_BLOCK_MULTIPLE:  # a server rounds it up to whole blocks: never hit
        raise click.BadParameter(f"{chunk_tokens} is not a multiple of {PIN_BLOCK_MULTIPLE}; "
                                 "a server rounds chunk_tokens up to whole KV blocks, so these "
                                 "chunks would be keyed by a size no server uses",
                                 param_hint="'--chunk-tokens'")
    pinned, written, replaced = store_pins.pin_file(root, file, chunk_tokens=chunk_tokens,
                                          policy_options=connector_options(codec_opts),
                                          force=force, model=model,
                                          quantization=quantization,
                                          quantization_config=quantization_config)
    lossy = f", {replaced} of them replacing chunks stored lossy or damaged" if replaced \
        else ""
    click.echo(f"pinned {pinned} chunks of {file} ({written} written{lossy}, "
               f"{pinned - written} already stored)")


@store_group.command("unpin")
@click.argument("root", type=click.Path(file_okay=False))
@click.argument("file", type=click.Path(dir_okay=False))
@handle_errors
def unpin_command(root: str, file: str) -> None:
    """Unpin the chunks pinned from FILE.kvz (they stay stored, and become prunable)."""
    from kvtool.engines.vllm import store_pins

    click.echo(f"unpinned {store_pins.unpin_file(root, file)} chunks")
