"""The connector's on-disk prefix store (kvtool.engines.vllm.store) without vLLM: hash-chain keys,
longest-prefix lookup, header validation, and a write/read round trip with the default policy
(the shared-store rules: tests/test_vllm_store_rules.py)."""

from __future__ import annotations

import logging
import os

import pytest

torch = pytest.importorskip("torch")

from kvtool.cache import KVCache  # noqa: E402
from kvtool.engines.vllm.common import policy_from_extra, stats  # noqa: E402
from kvtool.engines.vllm.store import PrefixStore  # noqa: E402
from kvtool.engines.vllm.store_backend import QUARANTINE_DIR  # noqa: E402
from kvtool.formats import save  # noqa: E402

MODEL = {"fingerprint": "f" * 64, "name": "tiny"}
CHUNK = 16


def kv(tokens: int, seed: int = 0) -> tuple[list, list]:
    gen = torch.Generator().manual_seed(seed)
    return ([torch.randn(2, tokens, 32, generator=gen) for _ in range(3)],
            [torch.randn(2, tokens, 32, generator=gen) for _ in range(3)])


@pytest.fixture
def store(tmp_path) -> PrefixStore:
    return PrefixStore(tmp_path, MODEL, CHUNK, policy_from_extra({"codec": "raw"}))


def test_chain_keys(store, tmp_path):
    a, b = list(range(50)), list(range(40)) + [999] * 10
    ka, kb = store.chunks(a), store.chunks(b)
    assert [(c.start, c.stop) for c in ka] == [(0, 16), (16, 32), (32, 48)]
    assert [c.key for c in ka[:2]] == [c.key for c in kb[:2]]  # shared prefix, shared keys
    assert ka[2].key != kb[2].key
    assert len(store.chunks(a, limit=47)) == 2
    other = PrefixStore(tmp_path, {"fingerprint": "0" * 64}, CHUNK, store.policy)
    assert other.chunks(a)[0].key != ka[0].key  # the model is part of every key
    bigger = PrefixStore(tmp_path, MODEL, 2 * CHUNK, store.policy)
    assert bigger.chunks(a)[0].key != ka[0].key


def test_longest_prefix_and_roundtrip(store):
    ids = list(range(100, 160))
    chunks = store.chunks(ids)
    keys, values = kv(64)
    for c in chunks[:2]:
        ks = [k[:, c.start:c.stop] for k in keys]
        vs = [v[:, c.start:c.stop] for v in values]
        assert store.write(c, ks, vs, ids) > 0
    assert store.write(chunks[0], keys, values, ids) == 0  # existing chunks are kept
    found = store.lookup(ids)
    assert [c.key for c in found] == [c.key for c in chunks[:2]]
    assert store.lookup(ids[:20] + [1] * 40) == found[:1]
    got = store.read(found[1])
    assert list(got.token_ids) == ids[16:32]
    assert torch.equal(got.keys[2], keys[2][:, 16:32])
    assert store.size_bytes() > 0


def test_invalid_files_are_ignored(store, caplog):
    ids = list(range(64))
    c0, c1, c2 = store.chunks(ids)[:3]
    keys, values = kv(16)
    store.write(c0, keys, values, ids)
    save(KVCache(keys, values, token_ids=ids[16:32], model={"fingerprint": "other"}),
         _mk(c1.path))
    save(KVCache(keys, values, token_ids=[7] * 16, model=MODEL), _mk(c2.path))
    before = stats()["invalid_files"]
    with caplog.at_level(logging.WARNING, logger="kvtool.vllm"):
        assert store.lookup(ids) == [c0]
        assert not store.is_valid(c2, ids)
    assert "another model" in caplog.text and "other token ids" in caplog.text
    assert stats()["invalid_files"] == before + 2
    assert not store.exists(c1) and not store.exists(c2)  # quarantined (writable store)
    assert len(os.listdir(os.path.join(store.root, QUARANTINE_DIR))) == 2
    open(c0.path, "wb").write(b"garbage")
    assert store.lookup(ids) == []
    assert not store.exists(c0)  # moved, never deleted
    assert len(os.listdir(os.path.join(store.root, QUARANTINE_DIR))) == 3


def test_a_chunk_copied_under_another_prefix_key_is_refused(store, caplog):
    """Chunk 1 of two prompts that differ only in chunk 0 holds the same ids, not the same
    K/V (they attend to other tokens): a file copied from one key to the other is refused,
    by its recorded key, although its ids match."""
    a = list(range(32))
    b = [999] * 16 + a[16:]
    (a0, a1), (_, b1) = store.chunks(a), store.chunks(b)
    keys, values = kv(32)
    store.write(a0, [k[:, :16] for k in keys], [v[:, :16] for v in values], a)
    store.write(a1, [k[:, 16:] for k in keys], [v[:, 16:] for v in values], a)
    with store.pin(a1) as (path, _):
        from kvtool.formats import open_kvz
        with open_kvz(path) as f:
            assert f.store_chunk == {"key": a1.key, "start": 16}
    os.makedirs(os.path.dirname(b1.path), exist_ok=True)
    os.link(a1.path, b1.path)
    with caplog.at_level(logging.WARNING, logger="kvtool.vllm"):
        assert store.is_valid(a1, a)
        assert not store.is_valid(b1, b)
    assert "another prefix" in caplog.text
    assert not store.exists(b1) and store.exists(a1)  # the misfiled copy is quarantined


def test_chunks_of_older_writers_without_a_recorded_place_still_serve(store):
    ids = list(range(16))
    (c0,) = store.chunks(ids)
    keys, values = kv(16)
    save(KVCache(keys, values, token_ids=ids, model=MODEL), _mk(c0.path))
    assert store.lookup(ids) == [c0]


def _mk(path: str) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return path


def test_default_policy_roundtrip(tmp_path):
    from kvtool.policy import CodecPolicy

    policy = policy_from_extra({})
    assert policy == CodecPolicy.from_label("quality")  # the preset names the store default
    s = PrefixStore(tmp_path, MODEL, 128, policy, zstd=True)
    keys, values = kv(128, seed=3)
    keys = [k.to(torch.bfloat16) for k in keys]
    values = [v.to(torch.bfloat16) for v in values]
    ids = list(range(128))
    c = s.chunks(ids)[0]
    size = s.write(c, keys, values, ids)
    # < 6 bits/element with the header and 4 raw sink tokens of a tiny chunk (bf16: 16)
    assert size < 0.75 * sum(k.numel() for k in keys + values)
    got = s.read(c)
    assert got.keys[0].dtype == torch.bfloat16
    for a, b in zip(got.keys + got.values, keys + values, strict=True):
        a, b = a.float(), b.float()
        assert ((a - b) ** 2).sum() / (b**2).sum() < 0.05
    assert policy_from_extra({"codec": "turbo4"}).value.codec_id == "turbo4"
    assert policy_from_extra({"value_codec": "int8"}).key == policy.key  # the rest: the preset


def test_entropy_option_stores_rans_coded_chunks_that_read_back_the_same(tmp_path):
    from kvtool.engines.vllm.options import check_extra
    from kvtool.formats import constants as C
    from kvtool.formats import open_kvz

    check_extra({"entropy": True})  # a connector option
    policy = policy_from_extra({"codec": "turbo3"})
    keys, values = kv(256, seed=5)
    ids = list(range(256))
    got, sizes = [], []
    for name, entropy in (("fixed", False), ("rans", True)):
        s = PrefixStore(tmp_path / name, MODEL, 256, policy, entropy=entropy)
        c = s.chunks(ids)[0]
        sizes.append(s.write(c, keys, values, ids))
        got.append(s.read(c))
        with open_kvz(c.path) as f:
            table = f.header[C.H_TENSORS]
            assert (table["layers.0.key.0.codes"]["compression"] == C.COMPRESSION_RANS) \
                == entropy
    assert sizes[1] < 0.98 * sizes[0]  # Gaussian K/V: turbo3 codes carry ~2.83 of 3 bits
    for a, b in zip(got[0].keys + got[0].values, got[1].keys + got[1].values, strict=True):
        assert torch.equal(a, b)
