"""A ``kvtool serve`` subprocess on 127.0.0.1 for the serving tests (tests/test_serve.py,
tests/test_serve_restart.py)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvtool.engines.vllm.engine import server_env


@dataclass
class Server:
    """A ``kvtool serve`` subprocess on 127.0.0.1."""

    store: Path
    log: Path
    policy: tuple[str, ...] = ()  # policy options (``--preset small``); none: the default
    engine: tuple[str, ...] = ()  # vLLM's own options (``--kv-cache-dtype fp8``)
    port: int = 0
    proc: subprocess.Popen | None = None
    notes: dict = field(default_factory=dict)

    def start(self) -> Server:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        kvtool = shutil.which("kvtool", path=os.path.dirname(sys.executable))
        env = server_env()  # not what an in-process engine in this worker quietened
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [kvtool, "serve", "--store", str(self.store), "--port", str(self.port),
                 *self.policy, "--max-model-len", "1024", "--", "--max-num-seqs", "8",
                 *self.engine],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 300
        while True:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                self.model = self.client().models.list().data[0].id
                return self
            except Exception:
                assert time.time() < deadline, "server did not start"
                time.sleep(2)

    def client(self, cls=None):
        import openai

        return (cls or openai.OpenAI)(base_url=f"http://127.0.0.1:{self.port}/v1",
                                      api_key="none", timeout=300, max_retries=0)

    def complete(self, prompt: str, max_tokens: int = 8) -> str:
        out = self.client().completions.create(model=self.model, prompt=prompt,
                                               max_tokens=max_tokens, temperature=0)
        return out.choices[0].text

    def metric(self, name: str, **labels: str) -> float:
        """The sum of a metric's samples on /metrics whose labels include ``labels``."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as r:
            text = r.read().decode()
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == name and labels.items() <= s.labels.items())

    def wait_metric(self, name: str, at_least: float, **labels: str) -> float:
        """Counters arrive with the engine step after the work (async saves: the next one)."""
        for _ in range(30):
            value = self.metric(name, **labels)
            if value >= at_least:
                return value
            time.sleep(1)
        return value

    def alive(self) -> bool:
        """Whether the server (and so its engine: vLLM's API server exits when its engine
        dies) still runs."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM to the API server, which shuts its engine down (connectors included);
        anything of its process group left after 60 s is killed."""
        if self.proc is None or self.proc.returncode is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        for _ in range(30):  # the engine-core and worker processes follow their parent
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(1)
        else:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)


