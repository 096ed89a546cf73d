"""``kvtool serve --engine mlx --store``: damaged, foreign and crafted store entries (a hostile
sweep found a restarted server serving a flipped byte's K/V, or a flipped token id's entry for
another prompt, and crashing or hanging on a symlink, a FIFO or a bad entry)."""

from __future__ import annotations

import json
import os
import re

import pytest

mx = pytest.importorskip("mlx.core")

import numpy as np  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from kvtool.cli.main import cli  # noqa: E402
from kvtool.engines.mlx_cache import KvtoolMLXCache  # noqa: E402
from kvtool.engines.mlx_store import (  # noqa: E402
    QUARANTINE,
    STORE_KEY,
    SUM_KEY,
    entry_name,
    lock_store,
    prompt_cache_class,
)
from kvtool.errors import KvtoolError  # noqa: E402
from kvtool.policy import CodecPolicy  # noqa: E402

POLICY = CodecPolicy.from_options("turbo3")
IDENTITY = {"fingerprint": "fp", "dtype": "float32", "path": "/models/served", "num_layers": 2}
MODEL = ("/models/served", None, None)


def _layers(seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    out = [KvtoolMLXCache.for_layer(POLICY, i, 2, block_size=4) for i in range(2)]
    for c in out:
        x = mx.array(rng.standard_normal((1, 2, 6, 16)).astype(np.float32))
        c.update_and_fetch(x, x)
    return out


def _store(path, tokens_list):
    """The files of entries ``tokens_list`` written by a server, in that order."""
    cache = prompt_cache_class(POLICY, IDENTITY, str(path))()
    for i, tokens in enumerate(tokens_list):
        cache.insert_cache(MODEL, tokens, _layers(i))
    by_tokens = {}
    for file in path.glob("*.safetensors"):
        entry = json.loads(mx.load(str(file), return_metadata=True)[1][f"0.{STORE_KEY}"])
        by_tokens[tuple(entry["tokens"])] = file
    return [by_tokens[tuple(t)] for t in tokens_list]


def _rewrite(path, edit_arrays=None, edit_entry=None):
    """``path`` written again with its arrays or entry changed (mlx-lm's layout kept)."""
    arrays, meta = mx.load(str(path), return_metadata=True)
    arrays = {k: np.array(v) for k, v in arrays.items()}
    if edit_arrays:
        edit_arrays(arrays)
    if edit_entry:
        entry = json.loads(meta[f"0.{STORE_KEY}"])
        edit_entry(entry)
        meta[f"0.{STORE_KEY}"] = json.dumps(entry, sort_keys=True)
    os.unlink(path)
    mx.save_safetensors(str(path), {k: mx.array(v) for k, v in arrays.items()}, meta)


def test_a_flipped_byte_or_token_id_is_quarantined_not_served(tmp_path):
    store = tmp_path / "store"
    files = _store(store, [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18]])
    assert len(files) == 3
    meta = mx.load(str(files[0]), return_metadata=True)[1]
    assert f"0.{SUM_KEY}" in meta and files[0].name == entry_name(
        json.loads(meta[f"0.{STORE_KEY}"]))

    def flip(arrays):
        name = next(k for k in sorted(arrays) if k.endswith("norms"))
        arrays[name].view(np.uint8).reshape(-1)[1] ^= 0x40

    def other_token(entry):
        entry["tokens"][2] += 1

    _rewrite(files[0], edit_arrays=flip)
    _rewrite(files[1], edit_entry=other_token)
    again = prompt_cache_class(POLICY, IDENTITY, str(store))()
    assert len(again) == 1  # the intact third entry
    assert sorted(p.name for p in (store / QUARANTINE).iterdir()) == sorted(
        p.name for p in files[:2])
    assert again.fetch_nearest_cache(MODEL, [7, 8, 10, 10, 11, 12, 1])[0] is None


@pytest.mark.parametrize("kind", ["dangling link", "fifo", "null entry", "no tokens",
                                  "not ours", "directory", "cache type", "model key"])
def test_a_bad_entry_is_skipped_and_the_store_still_loads(tmp_path, kind):
    store = tmp_path / "store"
    good, victim = _store(store, [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])
    bad = store / ("b" * 32 + ".safetensors")
    if kind == "dangling link":
        bad.symlink_to(tmp_path / "nowhere")
    elif kind == "fifo":
        os.mkfifo(bad)  # opening it would block the start
    elif kind == "directory":
        bad.mkdir()
    else:
        edit = {"null entry": lambda e: e.clear(), "no tokens": lambda e: e.pop("tokens"),
                "not ours": lambda e: e.update(fingerprint="other"),
                # each failed the server's start (a KeyError, an unhashable list)
                "cache type": lambda e: e.update(cache_type="tool"),
                "model key": lambda e: e.update(model_key=["/models/served", None, ["x"]])}[kind]
        _rewrite(victim, edit_entry=edit)
        if kind in ("not ours", "cache type", "model key"):  # named after its entry
            entry = json.loads(mx.load(str(victim), return_metadata=True)[1][
                f"0.{STORE_KEY}"])
            victim = victim.rename(store / entry_name(entry))
        if kind == "null entry":
            arrays, meta = mx.load(str(victim), return_metadata=True)
            meta[f"0.{STORE_KEY}"] = "null"
            os.unlink(victim)
            mx.save_safetensors(str(victim), arrays, meta)
    again = prompt_cache_class(POLICY, IDENTITY, str(store))()
    assert len(again) == (2 if kind in ("dangling link", "fifo", "directory") else 1)
    if kind == "not ours":  # another model's entry is left alone, not quarantined
        assert victim.exists() and not (store / QUARANTINE).exists()
    if kind in ("cache type", "model key"):
        assert [p.name for p in (store / QUARANTINE).iterdir()] == [victim.name]


def test_a_save_replaces_a_link_in_its_place_and_never_writes_through(tmp_path):
    store = tmp_path / "store"
    name = _store(store, [[1, 2, 3, 4, 5, 6]])[0].name
    os.unlink(store / name)
    victim = tmp_path / "precious.txt"
    victim.write_text("precious data")
    (store / name).symlink_to(victim)
    cache = prompt_cache_class(POLICY, IDENTITY, str(store))()
    cache.insert_cache(MODEL, [1, 2, 3, 4, 5, 6], _layers(0))
    assert victim.read_text() == "precious data"
    assert not (store / name).is_symlink() and len(
        prompt_cache_class(POLICY, IDENTITY, str(store))()) == 1


def test_a_copy_of_an_entry_is_loaded_once_and_removed(tmp_path):
    store = tmp_path / "store"
    first = _store(store, [[1, 2, 3, 4, 5, 6]])[0]
    other_path = ("/elsewhere/served", None, None)  # the same model moved: another file name
    cache = prompt_cache_class(POLICY, dict(IDENTITY, path=other_path[0]), str(store))()
    cache.insert_cache(other_path, [1, 2, 3, 4, 5, 6], _layers(0))
    assert len(list(store.glob("*.safetensors"))) == 2
    os.utime(first, (1e9, 1e9))  # older for sure (a timestamp's tick may hold both writes)
    again = prompt_cache_class(POLICY, IDENTITY, str(store))()
    assert len(again) == 1 and len(list(store.glob("*.safetensors"))) == 1
    assert not first.exists()  # the older copy went


def test_a_failed_save_is_warned_and_evictions_still_leave_the_store(tmp_path, caplog,
                                                                     monkeypatch):
    import kvtool.engines.mlx_store as mlx_store

    store = tmp_path / "store"
    cache = prompt_cache_class(POLICY, IDENTITY, str(store))(max_size=1)
    cache.insert_cache(MODEL, [1, 2, 3, 4, 5, 6], _layers(0))
    monkeypatch.setattr(mlx_store, "arrays_sum", lambda *args: 1 / 0)
    cache.insert_cache(MODEL, [7, 8, 9, 10, 11, 12], _layers(1))
    assert "could not store a prompt cache" in caplog.text and "ZeroDivisionError" in caplog.text
    assert not list(store.glob("*.safetensors"))  # the evicted entry's file went all the same


def test_one_server_owns_a_store(tmp_path):
    store = str(tmp_path / "store")
    held = lock_store(store)
    try:
        with pytest.raises(KvtoolError, match=rf"another kvtool serve --engine mlx \(pid "
                                              rf"{os.getpid()}\) uses this store"):
            lock_store(store)
    finally:
        held.close()
    lock_store(store).close()  # released: the next server takes it
    other = tmp_path / "other"
    other.mkdir()
    victim = tmp_path / "precious.txt"
    victim.write_text("precious data")
    (other / ".lock").symlink_to(victim)  # never written through
    with pytest.raises(KvtoolError, match="cannot create the store or its .lock"):
        lock_store(str(other))
    assert victim.read_text() == "precious data"


def test_other_servers_files_are_left_alone_even_when_this_one_cannot_read_them(tmp_path):
    """A newer kvtool's layer config (or a plug-in codec not installed here) made an entry of
    another model unreadable, and it went to quarantine: the entry is judged first."""
    store = tmp_path / "store"
    path = _store(store, [[1, 2, 3, 4, 5, 6]])[0]

    def newer(arrays):
        name = next(k for k in arrays if k.endswith("kvtool"))
        config = json.loads(arrays[name].tobytes().decode())
        arrays[name] = np.frombuffer(json.dumps(dict(config, version=99)).encode(), np.uint8)

    def another_model(entry):
        entry["fingerprint"] = "another"

    _rewrite(path, edit_arrays=newer, edit_entry=another_model)
    arrays, meta = mx.load(str(path), return_metadata=True)
    named = path.rename(store / entry_name(json.loads(meta[f"0.{STORE_KEY}"])))
    assert len(prompt_cache_class(POLICY, IDENTITY, str(store))()) == 0
    assert named.exists() and not (store / QUARANTINE).exists()


def test_a_file_without_the_checksum_its_entry_requires_is_quarantined(tmp_path):
    store = tmp_path / "store"
    path = _store(store, [[1, 2, 3, 4, 5, 6]])[0]
    arrays, meta = mx.load(str(path), return_metadata=True)
    del meta[f"0.{SUM_KEY}"]
    os.unlink(path)
    mx.save_safetensors(str(path), arrays, meta)
    assert len(prompt_cache_class(POLICY, IDENTITY, str(store))()) == 0
    assert (store / QUARANTINE / path.name).exists()


def test_a_draft_models_layers_after_the_models_own_load(tmp_path):
    """mlx-lm appends a draft model's cache layers (``--draft-model``): more layers than the
    model has, which the layer count check must not take for damage. The entry names the
    draft model's files (as an adapter's): one stored before the draft model was replaced is
    removed, not served to fail every request that reuses it."""
    store, draft = tmp_path / "store", tmp_path / "draft"
    draft.mkdir()
    (draft / "model.safetensors").write_bytes(b"x" * 10)
    key = ("/models/served", None, str(draft))
    cache = prompt_cache_class(POLICY, IDENTITY, str(store))()
    cache.insert_cache(key, [1, 2, 3, 4, 5, 6], _layers(0) + _layers(1))
    again = prompt_cache_class(POLICY, IDENTITY, str(store))()
    assert len(again) == 1 and not (store / QUARANTINE).exists()
    cache.insert_cache(MODEL, [7, 8, 9, 10, 11, 12], _layers(0) + _layers(1))  # no draft
    assert len(prompt_cache_class(POLICY, IDENTITY, str(store))()) == 1
    assert len(list((store / QUARANTINE).iterdir())) == 1
    (draft / "model.safetensors").write_bytes(b"y" * 12)  # another draft model
    assert len(prompt_cache_class(POLICY, IDENTITY, str(store))()) == 0
    assert not list(store.glob("*.safetensors"))


def test_entries_whose_layers_do_not_hold_their_ids_are_not_stored(tmp_path):
    """An image's patches (mlx-lm keys them as negative ids) and a speculative answer's last
    token (mlx-lm never feeds it to the model: its layers hold one token fewer) were stored,
    then quarantined as damaged at the next start."""
    store = tmp_path / "store"
    cache = prompt_cache_class(POLICY, IDENTITY, str(store))()
    cache.insert_cache(MODEL, [1, 2, -3, -3, 5, 6], _layers(0))
    cache.insert_cache(MODEL, [1, 2, 3, 4, 5, 6, 7], _layers(1))  # layers hold 6
    assert len(cache) == 2 and not list(store.glob("*.safetensors"))
    assert store.stat().st_mode & 0o077 == 0  # the conversations' ids: its owner's only
    cache.insert_cache(MODEL, [1, 2, 3, 4, 5, 6], _layers(2))
    assert len(list(store.glob("*.safetensors"))) == 1


def test_a_store_path_that_cannot_be_one_is_refused_before_the_start(tmp_path):
    runner = CliRunner()
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    (tmp_path / "file").write_text("x")
    for store, message in ((model_dir, "holds files that are not stored prompt caches "
                                       "\\(config.json\\)"),
                           (tmp_path / "file" / "x", "cannot be created or written here"),
                           (tmp_path / "file", "not a directory")):
        out = runner.invoke(cli, ["serve", "--engine", "mlx", "--dry-run", "--store", str(store)])
        assert out.exit_code != 0 and len(out.output.strip().splitlines()) == 1, out.output
        assert re.search(message, out.output), out.output
    ok = tmp_path / "new" / "store"
    out = runner.invoke(cli, ["serve", "--engine", "mlx", "--dry-run", "--store", str(ok)])
    assert out.exit_code == 0, out.output
    assert not ok.exists()  # a dry run creates nothing


def test_an_entry_of_a_lora_adapter_trained_again_is_not_served(tmp_path):
    """mlx-lm keys prompts by the adapter's path: an adapter trained again at that path gives
    other K/V, and its old entries were served after a restart."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapters.safetensors").write_bytes(b"first")
    store = tmp_path / "store"
    key = ("/models/served", str(adapter), None)
    cache = prompt_cache_class(POLICY, IDENTITY, str(store))()
    cache.insert_cache(key, [1, 2, 3, 4, 5, 6], _layers(0))
    assert len(prompt_cache_class(POLICY, IDENTITY, str(store))()) == 1
    (adapter / "adapters.safetensors").write_bytes(b"second, retrained")
    assert len(prompt_cache_class(POLICY, IDENTITY, str(store))()) == 0
    assert not list(store.glob("*.safetensors"))  # removed: it never fits again


def test_an_entry_whose_adapter_is_not_here_is_left_alone(tmp_path, monkeypatch):
    """mlx-lm keys a prompt by the adapter path as given: a relative one, from a server
    started in another directory, is not there; its entries were deleted as stale."""
    (tmp_path / "a" / "adapter").mkdir(parents=True)
    (tmp_path / "a" / "adapter" / "adapters.safetensors").write_bytes(b"weights")
    (tmp_path / "b").mkdir()
    store = tmp_path / "store"
    key = ("/models/served", "adapter", None)
    monkeypatch.chdir(tmp_path / "a")
    prompt_cache_class(POLICY, IDENTITY, str(store))().insert_cache(key, [1, 2, 3, 4, 5, 6],
                                                                     _layers(0))
    monkeypatch.chdir(tmp_path / "b")
    assert len(prompt_cache_class(POLICY, IDENTITY, str(store))()) == 0
    assert len(list(store.glob("*.safetensors"))) == 1 and not (store / QUARANTINE).exists()
    monkeypatch.chdir(tmp_path / "a")  # where its adapter is: served again
    assert len(prompt_cache_class(POLICY, IDENTITY, str(store))()) == 1


def test_a_relabelled_layer_class_is_quarantined_not_a_crash_at_every_start(tmp_path):
    """mlx-lm rebuilds each layer by the class name in the file's metadata: ``KVCache`` in
    place of ``KvtoolMLXCache`` loaded, then crashed the start with a traceback."""
    store = tmp_path / "store"
    path = _store(store, [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])[0]
    arrays, meta = mx.load(str(path), return_metadata=True)
    meta["1.0"] = "KVCache"
    os.unlink(path)
    mx.save_safetensors(str(path), arrays, meta)
    assert len(prompt_cache_class(POLICY, IDENTITY, str(store))()) == 1
    assert (store / QUARANTINE / path.name).exists()


def test_quarantine_is_never_a_link_out_of_the_store(tmp_path, caplog):
    store = tmp_path / "store"
    path = _store(store, [[1, 2, 3, 4, 5, 6]])[0]
    path.write_bytes(b"damaged")
    outside = tmp_path / "outside"
    outside.mkdir()
    (store / QUARANTINE).symlink_to(outside)
    assert len(prompt_cache_class(POLICY, IDENTITY, str(store))()) == 0
    assert path.exists() and not list(outside.iterdir())
    assert "cannot quarantine it" in caplog.text and "is a symbolic link" in caplog.text


def test_a_start_among_many_bad_files_warns_of_twenty_then_counts(tmp_path, caplog):
    from kvtool.engines.mlx_store import MAX_FILE_WARNINGS

    store = tmp_path / "store"
    store.mkdir()
    for i in range(MAX_FILE_WARNINGS + 5):
        (store / f"{i:032x}.safetensors").write_bytes(b"junk")
    prompt_cache_class(POLICY, IDENTITY, str(store))()
    warned = [r for r in caplog.records if "moved to quarantine" in r.getMessage()]
    assert len(warned) == MAX_FILE_WARNINGS and "and 5 more files" in caplog.text
