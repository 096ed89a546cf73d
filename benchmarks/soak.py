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
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from kvtool.engines.vllm.engine import server_env

SHARED_TOKENS = (300, 520, 780, 1040, 1300)  # the shared documents' lengths
FRESH_SHARE = 0.25  # requests with a prefix of their own (new chunks: the store fills)
LOOKUP_LINE = re.compile(r"kvtool store: (?:hit|miss): request (\S+?):? .* in (\d+) ms")
LOAD_LINE = re.compile(r"kvtool store: loaded \d+ tokens \(\d+ bytes\) for request (\S+) "
                       r"in (\d+) ms")
ENGINE_DEATH = re.compile(r"EngineDeadError|EngineCore encountered an issue|Check failed|"
                          r"EngineCore failed|Segmentation fault|core dumped")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_pids(sid: int) -> list[int]:
    """Every process of the session ``sid`` (the server, its engine core and workers)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":  # zombies: already gone
                pids.append(int(entry))
    return pids


RSS_KINDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")


def rss_and_fds(sid: int) -> tuple[int, int, dict[str, int]]:
    """The session's RSS, open fds, and RSS by kind (``RSS_KINDS``, summed over processes)."""
    fds = 0
    kinds = dict.fromkeys(RSS_KINDS, 0)
    for pid in session_pids(sid):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                name, _, value = line.partition(":")
                if name in kinds:
                    kinds[name] += int(value.split()[0]) * 1024
            fds += len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue
    return kinds["VmRSS"], fds, kinds


class Server:
    """One ``kvtool serve`` process (its own session) and what was seen of it."""

    def __init__(self, args: argparse.Namespace, store: str, env: dict, log: Path,
                 started: list[Server]):
        """Start it, registered in ``started`` at once (stopped there however the run ends),
        and wait until it answers."""
        self.log, self.port, self.began = log, free_port(), time.monotonic()
        cmd = [sys.executable, "-m", "kvtool.cli.main", "serve", "--store", store,
               "--max-store-bytes", str(args.max_bytes), "--port", str(self.port),
               "--max-model-len", "2048", "--", "--max-num-seqs", str(args.clients)]
        with open(log, "w") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        started.append(self)
        self.samples: list[tuple[float, int, int, dict[str, int]]] = []  # time, rss, fds, kinds
        self.failures: dict[str, float] = {}
        self.stopping = False
        self.log_at_stop: int | None = None  # the log's length when it was told to stop
        deadline = time.monotonic() + 600
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server did not start; see {log}")
            time.sleep(1)
        self.up = time.monotonic()

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models",
                                        timeout=5) as r:
                self.model = json.loads(r.read())["data"][0]["id"]
            return True
        except Exception:
            return False

    def sample(self) -> None:
        if self.proc.poll() is None:
            self.samples.append((time.monotonic(), *rss_and_fds(self.proc.pid)))

    def scrape(self) -> None:
        """The store's failure counters, by kind (kept: a killed server has no last word)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
                text = r.read().decode()
        except Exception:
            return
        kinds: dict[str, float] = {}
        for m in re.finditer(r'^kvtool_store_failures_total\{[^}]*kind="([^"]+)"[^}]*\} (\S+)',
                             text, re.M):
            kinds[m.group(1)] = kinds.get(m.group(1), 0) + float(m.group(2))
        self.failures = kinds

    def stop(self, sig: int) -> None:
        self.stopping = True
        self.log_at_stop = self.log.stat().st_size
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig) if sig == signal.SIGKILL else \
                self.proc.send_signal(sig)
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        for _ in range(60):  # the engine core and workers follow their parent
            if not session_pids(self.proc.pid):
                break
            time.sleep(0.5)
        else:
            os.killpg(self.proc.pid, signal.SIGKILL)

    def died(self) -> bool:
        """Exited unasked, or an engine error in its log before it was told to stop (vLLM's
        API server logs EngineDeadError while it shuts its engine down)."""
        unexpected = self.proc.poll() is not None and not self.stopping
        text = self.log.read_bytes()[:self.log_at_stop].decode(errors="replace")
        return unexpected or bool(ENGINE_DEATH.search(text))

    def growth(self, warm_up: float) -> tuple[float, float] | None:
        """(RSS, fds) growth from just after warm-up to the end; None if it ran less than a
        minute after warm-up."""
        after = [s for s in self.samples if s[0] - self.up >= warm_up]
        if len(after) < 10 or after[-1][0] - after[0][0] < 60:
            return None  # too short a life after warm-up to tell growth from start-up
        head, tail = after[:5], after[-5:]

        def med(xs: list[int]) -> float:
            return sorted(xs)[len(xs) // 2]

        return tuple(med([s[i] for s in tail]) / max(1, med([s[i] for s in head])) - 1
                     for i in (1, 2))  # type: ignore[return-value]


class Load:
    """``clients`` threads sending completions while ``gate`` is open."""

    def __init__(self, args: argparse.Namespace, prompts: list[list[int]],
                 fresh: callable):
        self.args, self.prompts, self.fresh = args, prompts, fresh
        self.gate, self.stop = threading.Event(), threading.Event()
        self.server: Server | None = None
        self.lock = threading.Lock()
        self.inflight: dict[int, float] = {}
        self.results: list[dict] = []
        self.excused: set[int] = set()  # in flight at a SIGKILL
        self.at_term: set[int] = set()
        self._next = 0
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                        for i in range(args.clients)]

    def _client(self, i: int) -> None:
        import openai

        rng = random.Random(1000 + i)
        while not self.stop.is_set():
            if not self.gate.wait(0.5):
                continue
            prompt = (self.fresh(rng) if rng.random() < FRESH_SHARE
                      else self.prompts[rng.randrange(len(self.prompts))]
                      + [rng.randrange(1000, 30000) for _ in range(rng.randrange(4, 40))])
            with self.lock:  # admitted only while the gate is open (pause() closes it here)
                if not self.gate.is_set():
                    continue
                server = self.server
                rid, self._next = self._next, self._next + 1
                self.inflight[rid] = time.monotonic()
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1",
                                   api_key="-", timeout=300, max_retries=0)
            began, error = time.monotonic(), None
            try:
                client.completions.create(model=server.model, prompt=prompt, max_tokens=4,
                                          temperature=0)
            except Exception as e:
                error = f"{type(e).__name__}: {str(e)[:160]}"
            with self.lock:
                self.inflight.pop(rid, None)
                self.results.append({"id": rid, "seconds": time.monotonic() - began,
                                     "error": error, "tokens": len(prompt)})

    def pause(self) -> set[int]:
        """Close the gate; the ids in flight now."""
        with self.lock:
            self.gate.clear()
            return set(self.inflight)

    def wait_idle(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while self.inflight and time.monotonic() < deadline:
            time.sleep(0.2)


def prompt_set(tokenizer_dir: Path) -> tuple[list[list[int]], callable]:
    """The shared documents (token ids of the bundled eval text at several lengths and
    offsets) and a maker of fresh prompts (random ids: chunks no one shares)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    text = (Path(__file__).parents[1] / "kvtool" / "data" / "eval_text.md").read_text()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    while len(ids) < 4000:
        ids += ids
    docs = [ids[37 * i: 37 * i + n] for i, n in enumerate(SHARED_TOKENS)]

    def fresh(rng: random.Random) -> list[int]:
        return [rng.randrange(1000, 30000) for _ in range(rng.randrange(300, 900))]

    return docs, fresh


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
        """Bytes the budget answers for: chunks, quarantine, temp files (not stats/)."""
        if self.moto is not None:
            total = 0
            for page in self.client.get_paginator("list_objects_v2").paginate(
                    Bucket="soak", Prefix="store/"):
                total += sum(o["Size"] for o in page.get("Contents", ())
                             if not o["Key"].startswith(("store/stats/", "store/hits/")))
            return total
        seen: dict[int, int] = {}  # by inode: a chunk being published is briefly two links
        for root, dirs, files in os.walk(self.location):
            if root == self.location and "stats" in dirs:
                dirs.remove("stats")
            for name in files:
                try:
                    st = os.lstat(os.path.join(root, name))
                except OSError:
                    continue
                seen[st.st_ino] = st.st_size
        return sum(seen.values())

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
