"""``kill -9`` in the middle of a 200 MB save: the old file stays intact and loadable, and the next
write into the directory removes the dead writer's temp file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from kvz_util import synthetic_cache

from kvtool import fileio
from kvtool.formats import load, save

BIG_SAVE = """
import sys
import numpy as np
from kvtool.cache import KVCache
from kvtool.formats import save

layers, heads, tokens, dim = 16, 8, 3072, 64  # 2 x 16 x 8 x 3072 x 64 float32 = 201 MB
block = np.random.default_rng(0).standard_normal((heads, tokens, dim), dtype=np.float32)
cache = KVCache([block + i for i in range(layers)], [block - i for i in range(layers)],
                model={"name": "big"}, tokenizer_fingerprint="t")
save(cache, sys.argv[1], codec="raw")
"""


def start_big_save(path: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BIG_SAVE, path],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def kill_while_writing(proc: subprocess.Popen, directory: str, min_bytes: int = 1 << 20,
                       timeout: float = 60.0) -> str | None:
    """SIGKILL ``proc`` once its temp file in ``directory`` holds ``min_bytes``; the temp's name
    (None if the save finished or failed first)."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        for name in os.listdir(directory):
            if name.endswith(fileio.TEMP_SUFFIX):
                try:
                    size = os.stat(os.path.join(directory, name)).st_size
                except FileNotFoundError:
                    continue
                if size >= min_bytes:
                    proc.kill()
                    proc.wait()
                    return name
        time.sleep(0.002)
    proc.kill()
    proc.wait()
    return None


@pytest.mark.slow
def test_kill_9_during_a_200mb_save(tmp_path):
    path = tmp_path / "doc.kvz"
    save(synthetic_cache(layers=2, tokens=8), path)
    before = path.read_bytes()
    proc = start_big_save(str(path))
    temp = kill_while_writing(proc, str(tmp_path))
    assert temp is not None, proc.stderr.read().decode()
    assert proc.returncode == -signal.SIGKILL
    assert path.read_bytes() == before  # never half-replaced
    assert load(path).num_layers == 2
    assert fileio.is_stale_temp(str(tmp_path / temp))  # still there, and collectable
    save(synthetic_cache(layers=1, tokens=4), tmp_path / "next.kvz")  # the next write ...
    assert sorted(os.listdir(tmp_path)) == ["doc.kvz", "next.kvz"]  # ... collects the litter
