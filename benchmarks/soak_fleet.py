"""The soak harness's moving parts (:mod:`soak`): a ``kvtool serve`` process in its own
session and what is seen of it (RSS, fds, store failures, engine deaths), the clients' load,
and the prompts they send."""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

SHARED_TOKENS = (300, 520, 780, 1040, 1300)  # the shared documents' lengths
FRESH_SHARE = 0.25  # requests with a prefix of their own (new chunks: the store fills)
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
