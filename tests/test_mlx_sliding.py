"""Sliding-window models (Gemma 3) on the mlx engine, on a tiny random-init Gemma 3 (window 16;
no weights): mlx-lm keeps the local layers in a ``RotatingKVCache``. A file captured by HF or
mlx-lm, past the window and not, continues in the other as that engine's own recompute; the
compressed mlx cache keeps those layers exact and compresses the global ones; mlx-lm prompt-cache
files carry the rings both ways; ``kvtool serve --engine mlx --store`` keeps them across a
restart and refuses a ring crafted to attend to the wrong tokens. mlx-lm ignores the window of
Mistral-7B-v0.1's layout (every layer attends to every token): kvtool's mlx engine runs such a
model only within its window, where that is the same."""

from __future__ import annotations

import copy
import json
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

import numpy as np  # noqa: E402
from gemma_util import write_tiny_gemma, write_tiny_mistral  # noqa: E402
from mlx_lm.models import cache as mlx_cache  # noqa: E402
from mlx_util import alone, batched  # noqa: E402

import kvtool  # noqa: E402
from kvtool.engines import hf  # noqa: E402
from kvtool.engines import mlx as E  # noqa: E402
from kvtool.engines.mlx_cache import make_kvtool_cache, ring_problem, ring_tokens  # noqa: E402
from kvtool.engines.mlx_store import (  # noqa: E402
    QUARANTINE,
    STORE_KEY,
    SUM_KEY,
    arrays_sum,
    prompt_cache_class,
)
from kvtool.errors import FormatError  # noqa: E402
from kvtool.policy import CodecPolicy  # noqa: E402

WINDOW = 16
IDS = list(range(100, 160))
CUTS = (50, WINDOW - 1, 10)  # slid, just full, not yet


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """The tiny Gemma 3 loaded by mlx-lm and by transformers, and both engines' greedy tokens
    for ``IDS``. mlx-lm's gemma3_text puts a global layer every ``sliding_window_pattern``
    (6) layers: layers 0-4 slide, layer 5 is global."""
    from kvtool.models import load_model

    path = write_tiny_gemma(tmp_path_factory.mktemp("gemma") / "gemma", WINDOW)
    lm, loaded = E.load_mlx(str(path), dtype="float32"), load_model(str(path), dtype="float32")
    return {"path": path, "lm": lm, "hf": loaded,
            "mlx_base": E.recompute_generation(lm, input_ids=IDS, max_new_tokens=6)
            .new_token_ids,
            "hf_base": hf.recompute_generation(loaded, input_ids=IDS, max_new_tokens=6)
            .new_token_ids}


def _hf_capture(gemma, cut):
    loaded = gemma["hf"]
    return hf.capture(loaded.model, loaded.tokenizer, token_ids=IDS[:cut], model_info=loaded.info)


def test_a_file_past_the_window_moves_between_hf_and_mlx(gemma, tmp_path):
    lm = gemma["lm"]
    for cut in CUTS:
        kvtool.save(_hf_capture(gemma, cut), tmp_path / "hf.kvz")
        from_hf = kvtool.load(tmp_path / "hf.kvz")
        assert E.continue_generation(lm, from_hf, input_ids=IDS,
                                     max_new_tokens=6).new_token_ids == gemma["mlx_base"]
        from_mlx = E.capture(lm, token_ids=IDS[:cut])
        assert [k.shape for k in from_mlx.keys] == [k.shape for k in from_hf.keys]
        assert from_mlx.layer_info == from_hf.layer_info
        assert hf.continue_generation(gemma["hf"], from_mlx, input_ids=IDS,
                                      max_new_tokens=6).new_token_ids == gemma["hf_base"]


def test_the_compressed_cache_keeps_the_rings_exact_and_encodes_the_global_layer(gemma):
    """``--runtime-codec`` and ``kvtool serve --engine mlx`` on Gemma 3: the local layers are
    mlx-lm's own rings, bit-identical to a plain prefill's; the global layer holds codes."""
    lm = gemma["lm"]
    policy = CodecPolicy.from_options("turbo3")
    plain, ours = mlx_cache.make_prompt_cache(lm.model), make_kvtool_cache(lm.model, policy,
                                                                          block_size=4)
    assert [type(c).__name__ for c in ours] == ["RotatingKVCache"] * 5 + ["KvtoolMLXCache"]
    for cache in (plain, ours):
        lm.model(mx.array([IDS]), cache=cache)
    for a, b in zip(plain[:5], ours[:5], strict=True):
        assert all(np.array_equal(np.array(x), np.array(y))
                   for x, y in zip(ring_tokens(a), ring_tokens(b), strict=True))
    assert ours[5].nbytes < plain[5].nbytes / 3  # codes, not float32 K/V
    # every token kept exact (the recent window holds the prompt): mlx-lm's own tokens, from a
    # fresh cache and from a restored file
    exact = CodecPolicy.from_options("turbo3", recent_tokens=256)
    fresh = make_kvtool_cache(lm.model, exact)
    assert E.recompute_generation(lm, input_ids=IDS, max_new_tokens=6,
                                  prompt_cache=fresh).new_token_ids == gemma["mlx_base"]
    for cut in CUTS:
        restored = E.continue_generation(lm, _hf_capture(gemma, cut), input_ids=IDS,
                                         max_new_tokens=6, policy=exact)
        assert restored.new_token_ids == gemma["mlx_base"]
    lossy = E.continue_generation(lm, _hf_capture(gemma, 50), input_ids=IDS, max_new_tokens=6,
                                  policy=CodecPolicy.from_options("turbo4", recent_tokens=0))
    assert len(lossy.new_token_ids) == 6


@pytest.mark.parametrize("codec", [None, "turbo3"])
def test_an_mlx_lm_prompt_cache_file_carries_the_rings_both_ways(gemma, tmp_path, codec):
    """``decompress --to mlx`` / ``compress --from mlx`` of a Gemma 3 cache: stock mlx-lm
    loads the exported file and continues as its own recompute; the import gives back the
    same layers and windows."""
    from mlx_lm.generate import generate_step

    policy = CodecPolicy.from_options(codec, recent_tokens=256) if codec else None
    for cut in CUTS:
        cache = _hf_capture(gemma, cut)
        path = tmp_path / f"{cut}.safetensors"
        E.export_prompt_cache(cache, path, policy=policy)
        layers = mlx_cache.load_prompt_cache(str(path))
        assert [type(c).__name__ for c in layers][:5] == ["RotatingKVCache"] * 5
        tokens = [int(t) for t, _ in generate_step(mx.array(IDS[cut:]), gemma["lm"].model,
                                                   max_tokens=6, prompt_cache=layers)]
        assert tokens == gemma["mlx_base"]
        back = E.import_prompt_cache(path)
        assert back.layer_info == cache.layer_info and back.num_tokens == cache.num_tokens
        for a, b in zip(back.keys + back.values, cache.keys + cache.values, strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b))


def _stock_file(path, layers):
    """``layers`` saved as stock mlx-lm saves a prompt cache (no kvtool metadata)."""
    mx.eval([c.state for c in layers])
    mlx_cache.save_prompt_cache(str(path), layers, {"model": "some/model"})
    return path


def _rewritten(path, edit):
    arrays, meta = mx.load(str(path), return_metadata=True)
    edit(arrays, meta)
    os.unlink(path)
    mx.save_safetensors(str(path), arrays, meta)


def test_batched_requests_slide_as_each_would_alone(gemma):
    """``kvtool serve --engine mlx`` batches concurrent requests: on Gemma 3 the rings batch as
    mlx-lm's own and the global layer as kvtool's compressed rows. Prompts past the window and
    not, one continuing a cache that slid: each request's greedy tokens are its own alone, and
    its cache comes back as rings plus codes."""
    lm = gemma["lm"]
    policy = CodecPolicy.from_options("turbo3", recent_tokens=8)

    def make(model):
        return make_kvtool_cache(model, policy, block_size=4)

    slid = make(lm.model)
    lm.model(mx.array([IDS[:40]]), cache=slid)
    requests = [(IDS[:50], None, 6), (IDS[:10], None, 9), (IDS[40:45], slid, 7)]
    want = [alone(lm.model, p, copy.deepcopy(c) if c is not None else make(lm.model), n)
            for p, c, n in requests]
    got, caches = batched(lm.model, [requests], make)
    assert got == want
    for cache, (prompt, given, n) in zip(caches, requests, strict=True):
        assert [type(c).__name__ for c in cache] == ["RotatingKVCache"] * 5 + ["KvtoolMLXCache"]
        total = len(prompt) + n + (40 if given is not None else 0)
        assert cache[5].offset == total
        assert all(ring_problem(c, WINDOW, total) is None for c in cache[:5])


def test_an_import_refuses_rings_mlx_lm_never_writes(gemma, tmp_path):
    """Each would continue from other tokens than the file's (or fail at its next step)."""
    def prefilled():  # one forward of 50 tokens: every ring holds them all, in order
        layers = mlx_cache.make_prompt_cache(gemma["lm"].model)
        gemma["lm"].model(mx.array([IDS[:50]]), cache=layers)
        return layers

    def rotated(arrays, meta):
        for j in (0, 1):
            x = arrays[f"0.{j}"]
            arrays[f"0.{j}"] = mx.concatenate([x[:, :, 10:], x[:, :, :10]], axis=2)
        arrays["0.5"] = mx.array(40)

    def few(arrays, meta):
        for j in (0, 1):
            arrays[f"0.{j}"] = arrays[f"0.{j}"][:, :, :4]

    def float_offset(arrays, meta):
        arrays["1.2"] = mx.array(50.0)

    for edit, message in ((rotated, "layer 0: a sliding-window layer with ring index 40 of 50"),
                          (few, "layer 0: a sliding-window layer with ring index 50 of 4"),
                          (float_offset, "not one count")):
        path = _stock_file(tmp_path / "c.safetensors", prefilled())
        assert E.import_prompt_cache(path).num_tokens == 50  # as mlx-lm wrote it
        _rewritten(path, edit)
        with pytest.raises(FormatError, match=message):
            E.import_prompt_cache(path)
    # every layer a ring past its window and no token ids: where its tokens sit is lost
    rings = [mlx_cache.RotatingKVCache(max_size=WINDOW) for _ in range(2)]
    x = mx.array(np.random.default_rng(0).standard_normal((1, 1, 40, 32)).astype(np.float32))
    for ring in rings:
        ring.update_and_fetch(x, x)
    with pytest.raises(FormatError, match="slid past its window and no token ids"):
        E.import_prompt_cache(_stock_file(tmp_path / "all.safetensors", rings))


# -- kvtool serve --engine mlx --store ------------------------------------------------------
POLICY = CodecPolicy.from_options("turbo3")
MODEL = ("/models/gemma", None, None)


def _identity(layout):
    return {"fingerprint": "fp", "dtype": "float32", "path": MODEL[0], "num_layers": 6, **layout}


def _served(gemma, ids, prefill=None):
    """A served cache of ``ids``: one prefill forward (a ring past its window holds them all,
    in order), or ``prefill`` tokens then one token a step (a ring wrapped in place)."""
    cache = make_kvtool_cache(gemma["lm"].model, POLICY, block_size=4)
    prefill = prefill or len(ids)
    gemma["lm"].model(mx.array([ids[:prefill]]), cache=cache)
    for token in ids[prefill:]:
        gemma["lm"].model(mx.array([[token]]), cache=cache)
    return cache


def _craft(path, edit):
    """``path`` written again with its arrays edited and a checksum that matches them (a
    hostile file, not a damaged one)."""
    arrays, meta = mx.load(str(path), return_metadata=True)
    edit(arrays, meta)
    classes = [meta[f"1.{i}"] for i in range(6)]
    meta[f"0.{SUM_KEY}"] = arrays_sum(arrays, classes)
    os.unlink(path)
    mx.save_safetensors(str(path), arrays, meta)


def _ring_edit(layer, keys=None, index=None):
    """An edit of layer ``layer``'s ring: ``keys(a)`` applied to its keys and values, its ring
    index set to ``index``."""
    def edit(arrays, meta):
        if keys is not None:
            for j in (0, 1):
                arrays[f"{layer}.{j}"] = keys(arrays[f"{layer}.{j}"])
        if index is not None:
            arrays[f"{layer}.5"] = mx.array(index)
    return edit


CRAFTED = {  # tokens of the entry: (edit, why mlx-lm could never have saved it)
    48: (lambda a, m: a.update({"0.4": mx.array(WINDOW * 2)}), "another window"),
    40: (_ring_edit(1, index=999), "a ring index past its slots"),
    30: (_ring_edit(2, keys=lambda x: x[:, :, :3]), "3 of the window's 15 tokens"),
    35: (_ring_edit(2, keys=lambda x: x[:, :, -(WINDOW - 1):], index=WINDOW - 1),
         "15 slots at offset 35: the next step fails"),
    45: (_ring_edit(3, keys=lambda x: mx.concatenate([x, x[:, :, :4]], axis=2), index=10),
         "a ring longer than its window, its index not at its end: other tokens"),
    25: (_ring_edit(4, keys=lambda x: mx.concatenate([x, x], axis=1)), "2 KV heads, not 1"),
    22: (_ring_edit(4, keys=lambda x: x.astype(mx.float16)), "float16 in a float32 model"),
    20: (lambda a, m: m.update({"2.1.1": "string"}), "a ring integer relabelled a string"),
    18: (lambda a, m: _two_heads(a, 5), "the global layer's codes of 2 KV heads, not 1"),
}


def _two_heads(arrays, layer):
    """Layer ``layer`` (a KvtoolMLXCache) as a sound state of twice the model's KV heads."""
    name = f"{layer}.kvtool"
    config = json.loads(np.array(arrays[name]).astype(np.uint8).tobytes())
    for stream in config["streams"]:
        for chunk in stream["chunks"]:
            chunk["shape"][2] *= 2  # [keys and values, batch, heads, blocks, block, dim]
    arrays[name] = mx.array(np.frombuffer(json.dumps(config, sort_keys=True).encode(), np.uint8))
    for key in [k for k in arrays if k.startswith(f"{layer}.s0.")]:
        arrays[key] = mx.concatenate([arrays[key], arrays[key]], axis=2)


def test_the_store_keeps_rings_across_a_restart_and_refuses_crafted_ones(gemma, tmp_path):
    from kvtool.engines.mlx_serve import cache_layout

    layout = cache_layout(str(gemma["path"]))  # what the server checks stored layers against
    assert layout == {"windows": [WINDOW] * 5 + [None], "kv_shape": (1, 32)}
    store = tmp_path / "store"
    server = prompt_cache_class(POLICY, _identity(layout), str(store))(max_size=20)
    entries = {50: _served(gemma, IDS[:50]), 33: _served(gemma, IDS[:33], prefill=30)}
    entries |= {n: _served(gemma, IDS[:n]) for n in CRAFTED}
    for n, layers in entries.items():
        server.insert_cache(MODEL, IDS[:n], layers)
    files = {len(json.loads(mx.load(str(f), return_metadata=True)[1][f"0.{STORE_KEY}"])[
        "tokens"]): f for f in store.glob("*.safetensors")}
    assert sorted(files) == sorted(entries)
    again = prompt_cache_class(POLICY, _identity(layout), str(store))(max_size=20)
    assert len(again) == len(entries)
    from mlx_lm.generate import generate_step

    for n in (50, 33):  # a prefill's ring (all 50 tokens) and one wrapped in place (16 slots)
        layers, rest = again.fetch_nearest_cache(MODEL, IDS[:n] + [7])
        assert rest == [7]
        for a, b in zip(layers[:5], entries[n][:5], strict=True):
            assert (a.max_size, a.offset, a._idx, a.keys.shape[2]) == (
                WINDOW, n, b._idx, 50 if n == 50 else WINDOW)
            assert all(np.array_equal(np.array(x), np.array(y))
                       for x, y in zip(ring_tokens(a), ring_tokens(b), strict=True))

        def continued(cache):
            return [int(t) for t, _ in generate_step(mx.array([7, 8, 9]), gemma["lm"].model,
                                                     max_tokens=4, prompt_cache=cache)]

        assert continued(layers) == continued(entries[n])

    for n, (edit, _) in CRAFTED.items():
        _craft(files[n], edit)
    assert len(prompt_cache_class(POLICY, _identity(layout), str(store))(max_size=20)) == 2
    assert sorted(p.name for p in (store / QUARANTINE).iterdir()) == sorted(
        files[n].name for n in CRAFTED)
    # a model whose layer 0 is global: the stored rings are not its layers
    full = prompt_cache_class(POLICY, _identity({**layout, "windows": [None] + [WINDOW] * 4
                                                 + [None]}), str(store))()
    assert len(full) == 0


def test_generate_with_a_runtime_codec_on_the_command_line(gemma):
    """``kvtool generate --engine mlx --runtime-codec``: the report counts only the
    compressed layers' codes (the rings hold none)."""
    from click.testing import CliRunner

    from kvtool.cli.main import cli

    result = CliRunner().invoke(cli, [
        "generate", "--engine", "mlx", "--model", str(gemma["path"]), "--dtype", "fp32",
        "--prompt", " ".join(f"word{i}" for i in range(80)), "--runtime-codec", "turbo4",
        "--max-new-tokens", "3", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["runtime_codec"]["tokens"] > WINDOW
    assert report["runtime_codec"]["encoded_tokens"] > 0


def test_a_window_mlx_lm_ignores_bounds_the_mlx_engine(tmp_path):
    """mlx-lm's mistral attends to every token where the model slides: past the window its K/V
    and tokens are not the model's, and an mlx capture (naming no window) continued in HF as
    if they were. Within the window they are: an HF file that names the window continues in
    mlx-lm as HF recomputes (it was refused: "the model full attention"); past it capture and
    generation are refused in one line, and ``kvtool serve --engine mlx`` says so."""
    from click.testing import CliRunner

    from kvtool.cli.main import cli
    from kvtool.errors import KvtoolError
    from kvtool.models import load_model

    window = 32
    path = write_tiny_mistral(tmp_path / "mistral", window, positions=256)
    lm, loaded = E.load_mlx(str(path), dtype="float32"), load_model(str(path), dtype="float32")
    ids = list(range(1000, 1000 + window + 8))
    with pytest.raises(KvtoolError, match=f"the prompt: {window + 8} tokens, past the sliding "
                                          f"window of {window} tokens"):
        E.capture(lm, token_ids=ids)
    with pytest.raises(KvtoolError, match="mlx-lm ignores"):
        E.recompute_generation(lm, input_ids=ids[:20], max_new_tokens=window)
    assert E.capture(lm, token_ids=ids[:window]).num_tokens == window
    prompt = ids[:20]
    cache = hf.capture(loaded.model, loaded.tokenizer, token_ids=prompt, model_info=loaded.info)
    assert cache.layer_info == [{"sliding_window": window}] * 2
    kvtool.save(cache, tmp_path / "hf.kvz", codec="raw")
    more = prompt + [5, 6]
    want = hf.recompute_generation(loaded, input_ids=more, max_new_tokens=6).new_token_ids
    got = E.continue_generation(lm, kvtool.load(tmp_path / "hf.kvz"), input_ids=more,
                                max_new_tokens=6).new_token_ids
    assert got == want == E.recompute_generation(lm, input_ids=more,
                                                 max_new_tokens=6).new_token_ids
    with pytest.raises(KvtoolError, match="past the sliding window"):
        E.continue_generation(lm, kvtool.load(tmp_path / "hf.kvz"), input_ids=more,
                              max_new_tokens=window)
    out = CliRunner().invoke(cli, ["serve", "--engine", "mlx", "--dry-run", "--model", str(path)])
    assert out.exit_code == 0 and f"ignores this model's sliding window of {window}" in out.output
