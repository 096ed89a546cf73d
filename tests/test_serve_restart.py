"""``kvtool serve`` restarted on its store with the ``balanced`` preset (trellis-coded
turbomix keys and values) over an fp8 paged cache (``--kv-cache-dtype fp8``: saved dequantized,
loaded quantized): the prefix stored by the first server is served by the second, and the second
keeps serving. The case starts two real servers (~30-50 s each on 2 cores).

The other policies' restarts, without two more servers each: the store default's (``quality``,
with its metrics) is tests/test_serve.py's server pair; ``small``, ``turbo3`` and ``raw``
(token-identical after the restart) chunks load in a fresh vLLM process in
tests/test_vllm_connector.py::test_save_then_load_in_fresh_process."""

from __future__ import annotations

import time

import pytest
from serve_util import Server


def chunks(store) -> list:
    return [p for p in store.rglob("*.kvz") if "quarantine" not in p.parts]


PROMPT = " ".join(f"restart{i}" for i in range(160)) + " What comes next?"  # two chunks


@pytest.mark.parametrize("policy,engine", [
    # one pair of servers for both (each pair costs ~2 min of the suite on 2 cores)
    (("--preset", "balanced"), ("--kv-cache-dtype", "fp8")),
], ids=["balanced-fp8-cache"])
def test_restart_serves_the_stored_prefix_and_keeps_serving(tmp_path, policy, engine):
    pytest.importorskip("vllm")
    pytest.importorskip("openai")
    first = Server(tmp_path / "store", tmp_path / "a.log", policy, engine).start()
    try:
        first.complete(PROMPT)
        for _ in range(120):  # written in the background (trellis presets take seconds)
            if len(chunks(tmp_path / "store")) >= 2:
                break
            time.sleep(1)
        assert len(chunks(tmp_path / "store")) >= 2, first.log.read_text()[-3000:]
    finally:
        first.stop()
    second = Server(tmp_path / "store", tmp_path / "b.log", policy, engine).start()
    try:
        second.complete(PROMPT)  # lossy: its text may differ from the cold run's
        assert second.wait_metric("kvtool_store_loaded_tokens_total", 512) >= 512, \
            second.log.read_text()[-3000:]
        assert second.metric("kvtool_store_failures_total") == 0
        for i in range(3):  # the engine survived the load: later requests succeed
            assert second.complete(f"{PROMPT} Follow-up {i}.").strip()
        time.sleep(1)
        assert second.alive(), second.log.read_text()[-3000:]
        assert "Check failed" not in second.log.read_text()
        for log in (first.log, second.log):  # no save or load refused its paged cache
            assert "kvtool: cannot" not in log.read_text(), log.read_text()[-3000:]
    finally:
        second.stop()
