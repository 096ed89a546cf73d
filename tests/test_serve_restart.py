"""``kvtool serve`` restarted on its store with every policy: the prefix stored by the first
server is served by the second, and the second keeps serving (the default policy's restart,
with its metrics: tests/test_serve.py). Each case starts two real servers (~20-40 s each)."""

from __future__ import annotations

import time

import pytest
from serve_util import Server


def chunks(store) -> list:
    return [p for p in store.rglob("*.kvz") if "quarantine" not in p.parts]


PROMPT = " ".join(f"restart{i}" for i in range(160)) + " What comes next?"  # two chunks


@pytest.mark.parametrize("policy", [("--preset", "balanced"), ("--preset", "small"),
                                    ("--codec", "turbo3"), ("--codec", "raw")],
                         ids=lambda p: p[1])
def test_restart_serves_the_stored_prefix_and_keeps_serving(tmp_path, policy):
    pytest.importorskip("vllm")
    pytest.importorskip("openai")
    first = Server(tmp_path / "store", tmp_path / "a.log", policy).start()
    try:
        cold = first.complete(PROMPT)
        for _ in range(120):  # written in the background (trellis presets take seconds)
            if len(chunks(tmp_path / "store")) >= 2:
                break
            time.sleep(1)
        assert len(chunks(tmp_path / "store")) >= 2, first.log.read_text()[-3000:]
    finally:
        first.stop()
    second = Server(tmp_path / "store", tmp_path / "b.log", policy).start()
    try:
        warm = second.complete(PROMPT)
        assert second.wait_metric("kvtool_store_loaded_tokens_total", 512) >= 512, \
            second.log.read_text()[-3000:]
        assert second.metric("kvtool_store_failures_total") == 0
        if policy == ("--codec", "raw"):
            assert warm == cold  # exact K/V: the same greedy text as the cold run
        for i in range(3):  # the engine survived the load: later requests succeed
            assert second.complete(f"{PROMPT} Follow-up {i}.").strip()
        time.sleep(1)
        assert second.alive(), second.log.read_text()[-3000:]
        assert "Check failed" not in second.log.read_text()
    finally:
        second.stop()
