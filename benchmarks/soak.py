"""Soak and fault harness for ``kvtool serve``: a real server with the default preset, its
store bounded close to the size of its disk, under concurrent clients sending mixed shared
prefixes, with ``kvtool store prune`` running beside it, SIGTERM and SIGKILL restarts, and
(``--s3``) an S3 endpoint frozen mid-run. Prints one table of the targets and exits 1 if one
is missed.

    python benchmarks/soak.py                            # directory store on a tmpfs, 10 min
    python benchmarks/soak.py --s3                       # moto S3 store, frozen 30 s mid-run
    python benchmarks/soak.py --minutes 2 --settle 5     # the short form (tests/test_soak.py)

What is measured:

* requests: every client request's outcome; a failure counts unless the request was in flight
  when the server was SIGKILLed. As behind a load balancer, clients send nothing while the
  server restarts, and a SIGTERM comes once the requests in flight have finished (in a first
  run, requests still running when vLLM 0.32 got the signal failed with connection errors);
  the run is extended by the time spent restarting, so that the load runs ``--minutes``;
* engine deaths: a server that exits unless stopped, or an engine error in its log;
* store hits after every restart (from each server's log);
* each request's wait on the store: its lookup plus its load, from the connector's log lines;
* server RSS and open fds (every process of the server's session), per server: growth from
  after its warm-up to its end;
* store size (chunks, quarantine and temp files; on S3 the bucket's objects) against
  ``max_bytes`` at every sample, and temp files (store and the S3 writer's local temp dirs)
  ``--settle`` seconds after the run.

The disk is a tmpfs of ``--disk-mb`` mounted for the run (root only; else a plain directory,
and the table says so). The S3 store is a moto server on 127.0.0.1. Nothing leaves this
machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from kvtool.engines.vllm.engine import server_env

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when loaded by its path
from soak_fleet import RSS_KINDS, Load, Server, free_port, prompt_set, session_pids  # noqa: E402

LOOKUP_LINE = re.compile(r"kvtool store: (?:hit|miss): request (\S+?):? .* in (\d+) ms")
LOAD_LINE = re.compile(r"kvtool store: loaded \d+ tokens \(\d+ bytes\) for request (\S+) "
                       r"in (\d+) ms")


class Storage:
    """The store's location and environment: a tmpfs-backed directory, or a moto bucket."""

    def __init__(self, args: argparse.Namespace, work: Path):
        # the servers' logs are read (store hits and waits): not an in-process engine's quiet
        self.args, self.work, self.env = args, work, server_env()
        self.mounted, self.moto = False, None
        self.env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        if args.s3:
            self._start_moto()
            self.location = "s3://soak/store"
        else:
            disk = work / "disk"
            disk.mkdir()
            if not args.no_tmpfs and os.geteuid() == 0:
                self.mounted = subprocess.run(
                    ["mount", "-t", "tmpfs", "-o", f"size={args.disk_mb}m", "tmpfs", str(disk)],
                    capture_output=True).returncode == 0
            self.location = str(disk / "store")

    def _start_moto(self) -> None:
        import boto3

        port = free_port()
        self.env.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="soak",
                        AWS_SECRET_ACCESS_KEY="soak", AWS_DEFAULT_REGION="us-east-1",
                        AWS_EC2_METADATA_DISABLED="true", AWS_CONFIG_FILE=os.devnull,
                        AWS_SHARED_CREDENTIALS_FILE=os.devnull)
        self.moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                      "-p", str(port)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        os.environ.update({k: v for k, v in self.env.items() if k.startswith("AWS_")})
        self.client = boto3.client("s3")
        for _ in range(300):
            try:
                self.client.create_bucket(Bucket="soak")
                return
            except Exception:
                time.sleep(0.1)
        raise SystemExit("moto did not start")

    def size(self) -> int:
        """Bytes the budget answers for (chunks, quarantine, temp files; not stats/) at one
        instant, counted low rather than high: a file counts only when two listings, one
        after the other, both see it (so it existed between them), at its smaller size. One
        listing alone adds the files deleted while it runs to those written while it runs
        (a CI run once read 1.14x max_bytes on a 24 MB tmpfs that cannot hold that much)."""
        first, second = self._files(), self._files()
        return sum(min(n, second[f]) for f, n in first.items() if f in second)

    def _files(self) -> dict:
        """One listing of the store's counted files: {identity: size} (the inode on a
        directory: a chunk being published is briefly two links; the key on S3)."""
        if self.moto is not None:
            found = {}
            for page in self.client.get_paginator("list_objects_v2").paginate(
                    Bucket="soak", Prefix="store/"):
                found.update((o["Key"], o["Size"]) for o in page.get("Contents", ())
                             if not o["Key"].startswith(("store/stats/", "store/hits/")))
            return found
        seen: dict[int, int] = {}
        for root, dirs, files in os.walk(self.location):
            if root == self.location and "stats" in dirs:
                dirs.remove("stats")
            for name in files:
                try:
                    st = os.lstat(os.path.join(root, name))
                except OSError:
                    continue
                seen[st.st_ino] = st.st_size
        return seen

    def list_to(self, path: Path, now: float) -> None:
        """Every file of a directory store (size, age, name) written to ``path``."""
        if self.moto is not None:
            return
        lines, wall = [f"at {now:.1f} s"], time.time()
        for root, _, files in os.walk(self.location):
            for name in files:
                with contextlib.suppress(OSError):
                    st = os.lstat(os.path.join(root, name))
                    lines.append(f"{st.st_size:>10} {wall - st.st_mtime:8.2f}s "
                                 f"{st.st_ino} {os.path.join(root, name)}")
        path.write_text("\n".join(lines) + "\n")

    def temps(self) -> int:
        """Temp files in the store, and the S3 writer's local temp dirs."""
        found = sum(name.endswith(".kvtmp") for _, _, files in os.walk(self.location)
                    for name in files) if self.moto is None else 0
        local = [p for p in Path(tempfile.gettempdir()).glob("kvtool-s3-*")]
        return found + len(local)

    def freeze(self, seconds: float) -> None:
        self.moto.send_signal(signal.SIGSTOP)
        time.sleep(seconds)
        self.moto.send_signal(signal.SIGCONT)

    def close(self) -> None:
        if self.moto is not None:
            self.moto.send_signal(signal.SIGCONT)
            self.moto.terminate()
            self.moto.wait(30)
        if self.mounted:
            subprocess.run(["umount", "-l", str(Path(self.location).parent)])


def prune_loop(storage: Storage, args: argparse.Namespace, stop: threading.Event,
               runs: list[int]) -> None:
    """``kvtool store prune`` every ``--prune-every`` seconds, as an operator's cron would."""
    while not stop.wait(args.prune_every):
        runs.append(run_prune(storage, args))


def run_prune(storage: Storage, args: argparse.Namespace) -> int:
    if storage.moto is None and not os.path.isdir(storage.location):
        return 0
    out = subprocess.run([sys.executable, "-m", "kvtool.cli.main", "store", "prune",
                          storage.location, "--max-bytes", str(int(args.max_bytes * 0.85))],
                         env=storage.env, capture_output=True, text=True, timeout=300)
    return out.returncode


def store_waits(logs: list[Path]) -> list[float]:
    """Seconds each request waited on the store (lookup + load), from the servers' logs."""
    waits: dict[str, float] = {}
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            m = LOOKUP_LINE.search(line) or LOAD_LINE.search(line)
            if m:
                waits[m.group(1)] = waits.get(m.group(1), 0.0) + int(m.group(2)) / 1e3
    return list(waits.values())


def run(args: argparse.Namespace) -> dict:
    from kvtool.models import resolve_model

    work = Path(tempfile.mkdtemp(prefix="kvtool-soak-"))
    storage = Storage(args, work)
    docs, fresh = prompt_set(resolve_model("default")[1])
    load = Load(args, docs, fresh)
    servers: list[Server] = []
    stop_all, prunes = threading.Event(), []
    events = sorted((float(at) * args.minutes * 60, kind) for kind, at in
                    (e.split("@") for e in args.events.split(",") if e))
    if args.s3 and args.freeze:
        events.append((args.freeze_at * args.minutes * 60, "freeze"))
        events.sort()
    t0 = time.monotonic()
    log = lambda msg: print(f"[{time.monotonic() - t0:6.0f} s] {msg}", file=sys.stderr)  # noqa: E731
    try:
        Server(args, storage.location, storage.env, work / "server-0.log", servers)
        log(f"server up; store {storage.location} (tmpfs: {storage.mounted})")
        load.server = servers[-1]
        for t in load.threads:
            t.start()
        load.gate.set()
        t0 = time.monotonic()
        pruner = threading.Thread(target=prune_loop, args=(storage, args, stop_all, prunes),
                                  daemon=True)
        pruner.start()
        sizes: list[int] = []
        freezer: threading.Thread | None = None
        end = args.minutes * 60
        next_scrape = 0.0
        while time.monotonic() - t0 < end:
            now = time.monotonic() - t0
            if events and now >= events[0][0]:
                _, kind = events.pop(0)
                if kind == "freeze":
                    log(f"freezing the S3 endpoint for {args.freeze} s")
                    freezer = threading.Thread(target=storage.freeze, args=(args.freeze,))
                    freezer.start()
                else:
                    log(f"restart: {kind}")
                    server = servers[-1]
                    server.scrape()
                    down = time.monotonic()
                    inflight = load.pause()
                    if kind == "kill":
                        load.excused |= inflight
                        server.stop(signal.SIGKILL)
                    else:  # drained first, as behind a load balancer
                        load.at_term |= inflight
                        load.wait_idle(120)
                        server.stop(signal.SIGTERM)
                    load.wait_idle(30)
                    Server(args, storage.location, storage.env,
                           work / f"server-{len(servers)}.log", servers)
                    load.server = servers[-1]
                    load.gate.set()
                    end += time.monotonic() - down  # the load runs its full time
                    events = [(at + time.monotonic() - down, k) for at, k in events]
                    log("server up again")
            servers[-1].sample()
            sizes.append(storage.size())
            if sizes[-1] > args.max_bytes:  # what was there, for the logs
                storage.list_to(work / f"over-budget-{len(sizes)}.txt", now)
            if now >= next_scrape:
                servers[-1].scrape()
                next_scrape = now + 10
            time.sleep(args.sample_every)
        load.pause()
        load.stop.set()
        load.wait_idle(120)
        servers[-1].scrape()
        servers[-1].stop(signal.SIGTERM)
        stop_all.set()
        if freezer is not None:
            freezer.join()
        prunes.append(run_prune(storage, args))
        time.sleep(args.settle)
        sizes.append(storage.size())
        temps = storage.temps()
    finally:
        load.stop.set()
        stop_all.set()
        for s in servers:
            if session_pids(s.proc.pid):
                s.stop(signal.SIGKILL)
        storage.close()
    return report(args, storage, servers, load, sizes, prunes, temps, work)


def report(args: argparse.Namespace, storage: Storage, servers: list[Server], load: Load,
           sizes: list[int], prunes: list[int], temps: int, work: Path) -> dict:
    failed = [r for r in load.results if r["error"] and r["id"] not in load.excused]
    hits = [len(re.findall(r"kvtool store: hit:", s.log.read_text(errors="replace")))
            for s in servers[1:]]
    waits = store_waits([s.log for s in servers])
    growth = [g for s in servers if (g := s.growth(args.warm_up)) is not None]
    kinds: dict[str, float] = {}
    for s in servers:
        for k, v in s.failures.items():
            kinds[k] = kinds.get(k, 0) + v
    out = {
        "store": storage.location, "tmpfs": storage.mounted, "disk_mb": args.disk_mb,
        "max_bytes": args.max_bytes, "minutes": args.minutes, "clients": args.clients,
        "requests": len(load.results),
        "failed": len(failed), "failed_examples": [r["error"] for r in failed[:5]],
        "excused_at_sigkill": sum(1 for r in load.results
                                  if r["error"] and r["id"] in load.excused),
        "in_flight_at_sigterm": len(load.at_term),
        "engine_deaths": sum(s.died() for s in servers),
        "restarts": len(servers) - 1, "hits_after_restart": hits,
        "max_store_wait_s": max(waits, default=0.0),
        "store_waits_over_2s": sum(w > 2.0 for w in waits),
        "rss_growth": max((g[0] for g in growth), default=None),
        "fd_growth": max((g[1] for g in growth), default=None),
        "max_store_bytes_seen": max(sizes, default=0),
        "samples": len(sizes), "samples_over_budget": sum(s > args.max_bytes for s in sizes),
        "temps_after": temps, "prune_runs": len(prunes),
        "prune_failures": sum(rc != 0 for rc in prunes),
        "failures_by_kind": kinds, "logs": str(work),
        "growth_by_server": [s.growth(args.warm_up) for s in servers],
        "rss_mb_by_server": [[round(x[1] / 2**20) for x in s.samples] for s in servers],
        "rss_kinds_mb_by_server": [[[round(x[0] - s.up)]
                                    + [round(x[3][k] / 2**20) for k in RSS_KINDS]
                                    for x in s.samples] for s in servers],
    }
    checks = {
        "failed": out["failed"] == 0,
        "engine_deaths": out["engine_deaths"] == 0,
        "hits_after_restart": all(h > 0 for h in hits),
        "store_waits_over_2s": out["store_waits_over_2s"] == 0,
        "rss_growth": out["rss_growth"] is None or out["rss_growth"] <= 0.10,
        "fd_growth": out["fd_growth"] is None or out["fd_growth"] <= 0.10,
        "samples_over_budget": out["samples_over_budget"] == 0,
        "temps_after": out["temps_after"] == 0,
    }
    out["checks"] = checks
    out["ok"] = all(checks.values())
    return out


def print_table(r: dict) -> None:
    def pct(x: float | None) -> str:
        return "n/a (too short)" if x is None else f"{100 * x:+.1f}%"

    mark = {k: "✓" if v else "✗" for k, v in r["checks"].items()}
    kinds = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["failures_by_kind"].items())) or "none"
    disk = f"tmpfs {r['disk_mb']} MB" if r["tmpfs"] else "no tmpfs"
    print(f"\nsoak: {r['store']} ({disk}), max_bytes {r['max_bytes'] / 1e6:.1f} MB, "
          f"{r['minutes']:g} min, {r['clients']} clients\n")
    rows = [
        ("requests (failed at a SIGKILL, excused)", f"{r['requests']} ({r['excused_at_sigkill']})",
         "", ""),
        ("failed requests", r["failed"], "0", mark["failed"]),
        ("in flight at a SIGTERM (drained)", r["in_flight_at_sigterm"], "", ""),
        ("engine deaths", r["engine_deaths"], "0", mark["engine_deaths"]),
        ("store hits after each restart", ", ".join(map(str, r["hits_after_restart"])),
         "> 0 each", mark["hits_after_restart"]),
        ("max wait on the store (lookup + load)", f"{r['max_store_wait_s']:.2f} s", "≤ 2 s",
         mark["store_waits_over_2s"]),
        ("server RSS growth after warm-up", pct(r["rss_growth"]), "≤ 10%", mark["rss_growth"]),
        ("open fds growth after warm-up", pct(r["fd_growth"]), "≤ 10%", mark["fd_growth"]),
        ("largest store size / max_bytes",
         f"{r['max_store_bytes_seen'] / r['max_bytes']:.3f} ({r['samples']} samples, "
         f"{r['samples_over_budget']} over)", "≤ 1", mark["samples_over_budget"]),
        ("temp files after the run", r["temps_after"], "0", mark["temps_after"]),
        ("store prune runs (failed)", f"{r['prune_runs']} ({r['prune_failures']})", "", ""),
        ("store failures by kind", kinds, "", ""),
    ]
    print("| measure | value | target | |\n|---|---|---|---|")
    for name, value, target, ok in rows:
        print(f"| {name} | {value} | {target} | {ok} |")
    if r["failed_examples"]:
        print("\nfailed:", *r["failed_examples"], sep="\n  ")
    print(f"\nlogs: {r['logs']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--s3", action="store_true", help="a moto S3 store instead of a directory")
    ap.add_argument("--disk-mb", type=int, default=64, help="the tmpfs under the store")
    ap.add_argument("--max-bytes", type=int, help="the store's max_bytes (default: 90%% of "
                    "the disk; on S3 the same number)")
    ap.add_argument("--events", default="term@0.3,kill@0.55,term@0.8",
                    help="restarts: KIND@FRACTION of the run, KIND term or kill")
    ap.add_argument("--freeze", type=float, default=30.0, help="S3: seconds frozen (0: none)")
    ap.add_argument("--freeze-at", type=float, default=0.4, help="S3: when, as a fraction")
    ap.add_argument("--prune-every", type=float, default=20.0)
    ap.add_argument("--sample-every", type=float, default=2.0)
    ap.add_argument("--warm-up", type=float, default=45.0, help="seconds after each start "
                    "before RSS/fds are a baseline")
    ap.add_argument("--settle", type=float, default=60.0, help="seconds after the run before "
                    "temp files are counted")
    ap.add_argument("--no-tmpfs", action="store_true")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    args.max_bytes = args.max_bytes or int(args.disk_mb * 0.9 * 2**20)
    result = run(args)
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
