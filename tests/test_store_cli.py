"""``kvtool store ls|stats|verify|prune`` on a store at rest, and the last-hit mark that LRU
pruning uses (kvtool.engines.vllm.store_admin; no vLLM needed)."""

from __future__ import annotations

import json
import os
import time

import pytest

torch = pytest.importorskip("torch")

from kvtool.cli.main import cli  # noqa: E402
from kvtool.engines.vllm import store_admin, store_pins  # noqa: E402
from kvtool.engines.vllm.common import policy_from_extra  # noqa: E402
from kvtool.engines.vllm.store import PrefixStore  # noqa: E402
from kvtool.engines.vllm.store_budget import StoreBudget  # noqa: E402
from kvtool.errors import KvtoolError  # noqa: E402

CHUNK = 16
MODELS = [{"fingerprint": "a" * 64, "name": "m1"}, {"fingerprint": "b" * 64, "name": "m2"}]


def fill(root, model, n_chunks: int, seed: int = 0) -> tuple[PrefixStore, list]:
    store = PrefixStore(root, model, CHUNK, policy_from_extra({"codec": "raw"}))
    gen = torch.Generator().manual_seed(seed)
    ids = [seed * 1000 + i for i in range(n_chunks * CHUNK)]
    chunks = store.chunks(ids)
    for c in chunks:
        ks = [torch.randn(2, CHUNK, 32, generator=gen) for _ in range(2)]
        vs = [torch.randn(2, CHUNK, 32, generator=gen) for _ in range(2)]
        store.write(c, ks, vs, ids)
    return store, chunks


@pytest.fixture
def root(tmp_path):
    fill(tmp_path, MODELS[0], 3, seed=1)
    fill(tmp_path, MODELS[1], 2, seed=2)
    return tmp_path


def set_hit(path: str, when: float) -> None:
    """Pretend the chunk was written and last hit at ``when``."""
    os.utime(path, ns=(int(when * 1e9), int(when * 1e9)))


def test_stats_counts_every_model_quarantine_and_temp_files(root, runner):
    (root / "quarantine").mkdir()
    (root / "quarantine" / "x.kvz").write_bytes(b"12345")
    shard = next(p for p in (root / ("a" * 16)).iterdir())
    (shard / f".tmp.host.1.chunk{store_admin.TEMP_SUFFIX}").write_bytes(b"123")
    os.symlink("/etc/passwd", shard / ("c" * 64 + ".kvz"))  # never counted, never followed
    out = runner.invoke(cli, ["store", "stats", str(root), "--json"])
    assert out.exit_code == 0, out.output
    info = json.loads(out.output)
    assert info["chunks"] == 5
    assert [m["chunks"] for m in info["models"]] == [3, 2]
    assert info["bytes"] == sum(m["bytes"] for m in info["models"]) > 0
    assert (info["quarantined_files"], info["quarantined_bytes"]) == (1, 5)
    assert (info["temp_files"], info["temp_bytes"]) == (1, 3)
    assert info["ignored_entries"] == 1
    human = runner.invoke(cli, ["store", "stats", str(root)])
    assert human.exit_code == 0 and "5 (" in human.output and "aaaaaaaaaaaaaaaa" in human.output


def test_ls_lists_most_recent_hit_first(root, runner):
    found = store_admin.scan(root)
    for i, c in enumerate(sorted(found.chunks, key=lambda c: c.path)):
        set_hit(c.path, 1_000_000 + i)
    out = runner.invoke(cli, ["store", "ls", str(root), "--json"])
    rows = json.loads(out.output)
    assert len(rows) == 5
    assert [r["last_hit"] for r in rows] == sorted((r["last_hit"] for r in rows), reverse=True)


def test_a_served_load_marks_the_hit_and_keeps_mtime(tmp_path):
    store, chunks = fill(tmp_path, MODELS[0], 2)
    set_hit(chunks[1].path, 1_000_000)
    before = os.stat(chunks[1].path)
    store.read(chunks[1])
    after = os.stat(chunks[1].path)
    assert after.st_atime > 1_000_000 + 1e6  # now, not the old mark
    assert after.st_mtime_ns == before.st_mtime_ns  # the verdict cache's stamp is unchanged


def test_prune_lru_to_max_bytes_and_by_age(root, runner):
    found = store_admin.scan(root)
    order = sorted(found.chunks, key=lambda c: c.path)
    now = 2_000_000_000
    for i, c in enumerate(order):
        set_hit(c.path, now - 86400 * (10 - i))  # order[0] is the least recently hit
    found = store_admin.scan(root)  # as marked
    size = order[0].bytes
    assert all(c.bytes == size for c in order)
    plan = store_admin.prune_plan(found, max_bytes=3 * size, now=now)
    assert [c.path for c in plan] == [c.path for c in order[:2]]
    plan = store_admin.prune_plan(found, older_than=8.5 * 86400, now=now)
    assert [c.path for c in plan] == [c.path for c in order[:2]]  # 10 and 9 days old
    dry = runner.invoke(cli, ["store", "prune", str(root), "--max-bytes", str(3 * size),
                              "--dry-run", "--json"])
    assert json.loads(dry.output)["removed_files"] == 2
    assert len(store_admin.scan(root).chunks) == 5  # dry run removed nothing
    out = runner.invoke(cli, ["store", "prune", str(root), "--max-bytes", str(3 * size),
                              "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["removed_files"] == 2
    left = {c.path for c in store_admin.scan(root).chunks}
    assert left == {c.path for c in order[2:]}


def test_pruned_chunks_are_misses_not_errors(tmp_path):
    store, chunks = fill(tmp_path, MODELS[0], 3)
    ids = [i for i in range(3 * CHUNK)]
    store_admin.remove([store_admin.scan(tmp_path).chunks[0]], tmp_path)
    assert len(store.lookup(ids)) < 3  # the store serves what is left and recomputes the rest


def test_verify_finds_damage_and_foreign_files(root, runner):
    assert runner.invoke(cli, ["store", "verify", str(root)]).exit_code == 0
    found = sorted(store_admin.scan(root).chunks, key=lambda c: c.path)
    data = bytearray(open(found[0].path, "rb").read())
    data[-10] ^= 0xFF  # a flipped payload byte
    open(found[0].path, "wb").write(bytes(data))
    other = next(c for c in found if c.model != found[0].model)
    moved = os.path.join(os.path.dirname(found[1].path) if found[1].model != other.model
                         else os.path.dirname(found[-1].path), os.path.basename(other.path))
    os.rename(other.path, moved)  # a chunk of model b under model a's directory
    out = runner.invoke(cli, ["store", "verify", str(root), "--json"])
    assert out.exit_code == 4
    damaged = {d["path"]: d["problem"] for d in json.loads(out.output)["damaged"]}
    assert found[0].path in damaged
    assert any("belongs to model" in why for why in damaged.values())


def test_verify_finds_a_chunk_copied_under_another_key(root, runner):
    mine = MODELS[0]["fingerprint"][:16]
    a, b = sorted((c for c in store_admin.scan(root).chunks if c.model == mine),
                  key=lambda c: c.path)[:2]
    shown = runner.invoke(cli, ["inspect", a.path])
    assert f"prefix-store chunk {a.key[:16]}, tokens from " in shown.output
    os.replace(a.path, b.path)  # a valid chunk file, in the place of another key
    out = runner.invoke(cli, ["store", "verify", str(root), "--json"])
    assert out.exit_code == 4
    damaged = {d["path"]: d["problem"] for d in json.loads(out.output)["damaged"]}
    assert list(damaged) == [b.path] and "another prefix" in damaged[b.path]


def test_verify_finds_a_chunk_the_server_never_reads(root, runner):
    """A chunk in another two-letter directory (or none) is a miss for every server: verify
    names where it belongs."""
    c = store_admin.scan(root).chunks[0]
    wrong = "00" if c.key[:2] != "00" else "01"
    os.makedirs(os.path.join(root, c.model, wrong), exist_ok=True)
    os.replace(c.path, os.path.join(root, c.model, wrong, os.path.basename(c.path)))
    out = runner.invoke(cli, ["store", "verify", str(root), "--json"])
    assert out.exit_code == 4
    (problem,) = [d["problem"] for d in json.loads(out.output)["damaged"]]
    assert problem == (f"it is never read here: a server looks for it at "
                       f"{c.model}/{c.key[:2]}/{c.key}.kvz")


@pytest.mark.parametrize("args, message", [
    (["prune", "{root}", "--max-bytes", "lots"], "Invalid value for '--max-bytes': 'lots' is "
     "not a size"),
    (["prune", "{root}", "--older-than", "soon"], "Invalid value for '--older-than': 'soon' "
     "is not a duration"),
    (["stats", "{root}/missing"], "does not exist"),
])
def test_bad_options_and_paths_are_one_line_errors(root, runner, args, message):
    out = runner.invoke(cli, ["store", *[a.format(root=root) for a in args]])
    assert out.exit_code != 0
    assert message in out.output
    assert "Traceback" not in out.output


def test_a_directory_of_other_files_is_not_an_empty_store(tmp_path, runner):
    """A mistyped path (files, none a store's) is refused by every command, one line; an empty
    directory is an empty store, and one with only a server's stats/ is a store."""
    junk = tmp_path / "home"
    (junk / "photos").mkdir(parents=True)
    (junk / "notes.txt").write_text("x")
    pin = tmp_path / "p.kvz"
    pin.write_bytes(b"x")
    for command, *extra in (["ls"], ["ls", "--json"], ["stats"], ["stats", "--json"],
                            ["verify"], ["prune", "--max-bytes", "1"], ["pin", str(pin)]):
        out = runner.invoke(cli, ["store", command, str(junk), *extra])
        assert out.exit_code != 0, (command, out.output)
        assert "holds no kvtool store" in out.output and "notes.txt, photos" in out.output
        assert len(out.output.strip().splitlines()) == 1, out.output
    assert sorted(os.listdir(junk)) == ["notes.txt", "photos"]  # nothing written there
    mlx = tmp_path / "mlx"  # kvtool serve --engine mlx's prompt caches
    mlx.mkdir()
    (mlx / f"{'ab' * 16}.safetensors").write_bytes(b"x")
    out = runner.invoke(cli, ["store", "stats", str(mlx)])
    assert out.exit_code != 0 and "mlx-lm prompt-cache store" in out.output, out.output
    (mlx / "quarantine").mkdir()  # named like a vLLM store's: still the mlx server's store
    (mlx / ".lock").write_text("1")
    out = runner.invoke(cli, ["store", "stats", str(mlx)])
    assert out.exit_code != 0 and "mlx-lm prompt-cache store" in out.output, out.output
    (mlx / f"{'ab' * 16}.safetensors").unlink()  # its one entry quarantined: still the mlx's
    out = runner.invoke(cli, ["store", "prune", str(mlx), "--max-bytes", "1"])
    assert out.exit_code != 0 and "mlx-lm prompt-cache store" in out.output, out.output
    assert store_admin.scan(junk, missing_ok=True).chunks == []  # a server's own budget scan
    (tmp_path / "empty" / "lost+found").mkdir(parents=True)  # a volume's mount point
    (tmp_path / "empty" / ".snapshot").write_text("x")
    assert store_admin.scan(tmp_path / "empty").chunks == []
    (junk / "stats").mkdir()
    assert store_admin.scan(junk).chunks == []


def test_prune_with_no_option_removes_no_chunk(root, runner):
    out = runner.invoke(cli, ["store", "prune", str(root)])
    assert out.exit_code == 0, out.output
    assert "removed 0 chunks" in out.output and len(store_admin.scan(root).chunks) == 5


def test_sizes_and_durations_parse():
    assert store_admin.parse_size("500MB") == 500_000_000
    assert store_admin.parse_size("2GiB") == 2 * 1024**3
    assert store_admin.parse_size("1000") == 1000
    assert store_admin.parse_duration("30d") == 30 * 86400
    assert store_admin.parse_duration("90m") == 5400
    for unclear in ("30", "30M", "1D", "٣d", "d"):  # seconds? months? a non-ASCII digit
        with pytest.raises(ValueError, match="is not a duration .a number and a unit"):
            store_admin.parse_duration(unclear)
    with pytest.raises(ValueError, match="is not a size"):
        store_admin.parse_size("٣GB")


def test_the_connector_budget_evicts_lru_down_to_low_water(tmp_path):
    store, chunks = fill(tmp_path, MODELS[0], 4)
    size = os.path.getsize(chunks[0].path)
    for i, c in enumerate(chunks):
        set_hit(c.path, 1_000_000 + i)  # chunks[0] least recently hit
    budget = StoreBudget(tmp_path, max_bytes=int(3.2 * size))
    assert budget.added(0) == (2, 2 * size)  # 4 chunks > 3.2: down to 0.9 * 3.2 = 2.88 → 2 left
    assert {c.path for c in store_admin.scan(tmp_path).chunks} == {c.path for c in chunks[2:]}
    assert budget.added(size) == (0, 0)  # under budget: no scan, nothing evicted
    with pytest.raises(ValueError):
        StoreBudget(tmp_path, 0)


def test_a_bound_below_one_chunk_drops_saves_instead_of_evicting_everything(tmp_path):
    """``--max-store-bytes`` under one chunk file made every save evict the store, then the
    chunk it had just written: encoding and disk work for nothing, and never a hit."""
    from kvtool.engines.vllm.store_budget import NoRoom

    store, chunks = fill(tmp_path, MODELS[0], 2)
    size = os.path.getsize(chunks[0].path)
    budget = StoreBudget(tmp_path, max_bytes=size // 2)
    budget.added(size)  # a file of this size was written
    with pytest.raises(NoRoom, match=f"a chunk file takes ~{size} bytes, more than max_bytes"):
        budget.reserve(size)
    assert {c.path for c in store_admin.scan(tmp_path).chunks} <= {c.path for c in chunks}


def test_pin_stores_a_prefix_as_server_chunks_that_prune_keeps(tmp_path, runner):
    import numpy as np

    from kvtool.cache import KVCache
    from kvtool.formats import save

    rng = np.random.default_rng(0)
    ids = list(range(500, 540))  # 2 full chunks of 16, 8 tokens left over
    cache = KVCache([rng.standard_normal((2, 40, 32)).astype(np.float32) for _ in range(2)],
                    [rng.standard_normal((2, 40, 32)).astype(np.float32) for _ in range(2)],
                    token_ids=np.array(ids), model=MODELS[0])
    kvz = tmp_path / "system.kvz"
    save(cache, kvz)
    root = tmp_path / "store"
    fill(root, MODELS[0], 2, seed=3)  # two unpinned chunks
    out = runner.invoke(cli, ["store", "pin", str(root), str(kvz), "--chunk-tokens",
                              str(CHUNK), "--codec", "raw"])
    assert out.exit_code == 0, out.output
    assert "pinned 2 chunks" in out.output
    server = PrefixStore(root, MODELS[0], CHUNK, policy_from_extra({"codec": "raw"}))
    found = server.lookup(ids)
    assert len(found) == 2  # the connector finds the pinned prefix under its own keys
    np.testing.assert_array_equal(server.read(found[1]).layer(1)[0], cache.layer(1)[0][:, 16:32])
    prune = runner.invoke(cli, ["store", "prune", str(root), "--max-bytes", "0", "--json"])
    assert json.loads(prune.output)["removed_files"] == 2  # only the unpinned ones
    assert {c.path for c in store_admin.scan(root).chunks} == {c.path for c in found}
    assert json.loads(runner.invoke(cli, ["store", "stats", str(root), "--json"])
                      .output)["pinned_chunks"] == 2
    assert "unpinned 2 chunks" in runner.invoke(cli, ["store", "unpin", str(root),
                                                      str(kvz)]).output
    again = runner.invoke(cli, ["store", "unpin", str(root), str(kvz)])  # nothing pinned now
    assert again.exit_code != 0 and "no chunks pinned from" in again.output, again.output
    runner.invoke(cli, ["store", "prune", str(root), "--max-bytes", "0"])
    assert store_admin.scan(root).chunks == []


def _pin_source(tmp_path, codec: str = "raw"):
    import numpy as np

    from kvtool.cache import KVCache
    from kvtool.formats import save

    rng = np.random.default_rng(0)
    cache = KVCache([rng.standard_normal((2, 32, 32)).astype(np.float32) for _ in range(2)],
                    [rng.standard_normal((2, 32, 32)).astype(np.float32) for _ in range(2)],
                    token_ids=np.arange(600, 632), model=MODELS[0])
    kvz = tmp_path / f"{codec}.kvz"
    save(cache, kvz, codec=codec)
    return kvz


def _chunk_policies(root) -> set[str]:
    from kvtool.formats import open_kvz
    from kvtool.policy import CodecPolicy

    policies = set()
    for chunk in store_admin.scan(root).chunks:
        with open_kvz(chunk.path) as f:
            policies.add(CodecPolicy.from_json(f.info()["policy"]).describe())
    return policies


@pytest.mark.parametrize("options, expected", [
    (["--preset", "lossless"], {"raw"}),
    (["--preset", "quality", "--sink-tokens", "8"], None),
])
def test_pin_encodes_as_the_server_would_with_the_same_options(tmp_path, runner, options,
                                                               expected):
    """`store pin` with a preset (or only token counts) once ignored them unless a codec was
    given too, and pinned with the connector's lossy default."""
    root = tmp_path / "store"
    out = runner.invoke(cli, ["store", "pin", str(root), str(_pin_source(tmp_path)),
                              "--chunk-tokens", str(CHUNK), *options])
    assert out.exit_code == 0, out.output
    served = policy_from_extra({"preset": options[1], "sink_tokens": 8}
                               if expected is None else {"preset": options[1]},
                               MODELS[0]["fingerprint"]).describe()
    policies = _chunk_policies(root)
    if expected is not None:
        assert policies == expected == {served}
    else:  # the first chunk holds the sinks; the second, the same codecs
        codecs = served.removesuffix(" sink=8")
        assert "sink=8" in served and policies == {served, codecs}, (policies, served)


def test_an_exact_pin_replaces_chunks_stored_lossy_and_keeps_exact_ones(tmp_path, runner):
    """A chunk a lossy server stored at a prefix's key is never loaded by a lossless server,
    and was kept by a lossless `store pin` of the exact capture (first writer wins): the pin
    said it pinned the prefix while every lossless server still computed it."""
    root, source = tmp_path / "store", str(_pin_source(tmp_path))
    pin = ["store", "pin", str(root), source, "--chunk-tokens", str(CHUNK)]
    lossy = runner.invoke(cli, pin)  # the connector's default, lossy policy
    assert lossy.exit_code == 0 and "(2 written, 0 already stored)" in lossy.output, lossy.output
    server = PrefixStore(root, MODELS[0], CHUNK, policy_from_extra({"preset": "lossless"}))
    ids = list(range(600, 632))
    assert server.lookup(ids) == []  # stored lossy: a lossless server misses
    exact = runner.invoke(cli, [*pin, "--preset", "lossless"])
    assert exact.exit_code == 0, exact.output
    assert "(2 written, 2 of them replacing chunks stored lossy or damaged, 0 already stored)" \
        in exact.output, exact.output
    assert _chunk_policies(root) == {"raw"} and len(server.lookup(ids)) == 2
    again = runner.invoke(cli, pin)  # a lossy pin never replaces exact chunks
    assert again.exit_code == 0 and "(0 written, 2 already stored)" in again.output, again.output
    assert _chunk_policies(root) == {"raw"}


def test_pin_refuses_to_quantize_a_lossy_file_again_unless_forced(tmp_path, runner):
    root = tmp_path / "store"
    lossy = str(_pin_source(tmp_path, "turbo3"))
    out = runner.invoke(cli, ["store", "pin", str(root), lossy, "--chunk-tokens", str(CHUNK)])
    assert out.exit_code != 0 and "already lossy (turbo3)" in out.output, out.output
    assert not os.path.exists(root / "pins.json")
    odd = runner.invoke(cli, ["store", "pin", str(root), lossy, "--chunk-tokens", "100"])
    assert odd.exit_code == 2 and "not a multiple of 16" in odd.output, odd.output
    for forced in ([], ["--force"]):  # raw chunks of decoded codes would pass for exact
        lossless = runner.invoke(cli, ["store", "pin", str(root), lossy, "--chunk-tokens",
                                       str(CHUNK), "--preset", "lossless", *forced])
        assert lossless.exit_code != 0 and "is stored lossy" in lossless.output, lossless.output
        assert not os.path.exists(root / "pins.json")
    forced = runner.invoke(cli, ["store", "pin", str(tmp_path / "s2"), lossy, "--chunk-tokens",
                                 str(CHUNK), "--force"])
    assert forced.exit_code == 0 and "pinned 2 chunks" in forced.output, forced.output


@pytest.mark.parametrize("damage", [b'{"trunc', b'["a list"]', b'{"k": {"model": "x"}}', b"\xff",
                                    b'{"k": {"file": "a"}, "k": {"file": "b"}}'])
def test_a_damaged_pins_file_stops_every_removal_and_is_never_overwritten(root, runner, damage):
    """Read as "no pins", a damaged pins.json made prune delete the pinned chunks and a new
    pin overwrite the others: it is refused in one line, and nothing is removed or written.
    Reading the store goes on, with a warning: it is how one finds out what is wrong."""
    (root / "pins.json").write_bytes(damage)
    files = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    for args in (["prune", str(root), "--max-bytes", "0"],
                 ["unpin", str(root), str(root / "x.kvz")]):
        out = runner.invoke(cli, ["store", *args])
        assert out.exit_code != 0 and "pins.json is damaged" in out.output, out.output
        assert len(out.output.strip().splitlines()) == 1, out.output
    for args in (["stats", str(root)], ["ls", str(root)], ["verify", str(root)]):
        out = runner.invoke(cli, ["store", *args])
        assert out.exit_code == 0 and "warning: " in out.output, out.output
        assert "pins.json is damaged" in out.output and "chunks" in out.output, out.output
    with pytest.raises(KvtoolError, match="pins.json is damaged"):  # the server's eviction
        store_admin.eviction_order(store_admin.scan(root))
    with pytest.raises(KvtoolError, match="pins.json is damaged"):
        store_pins.pin_file(root, str(root / "x.kvz"))
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == files


@pytest.mark.parametrize("kind", ["symlink", "directory"])
def test_a_pins_file_that_is_not_a_regular_file_is_never_read_as_no_pins(root, runner, tmp_path,
                                                                         kind):
    """A pins.json that is a symlink (to a valid pins file) or a directory was read as "no
    pins", and prune removed the pinned chunks."""
    real = tmp_path / "pins.real"
    real.write_text(json.dumps({"a" * 64: {"file": "x.kvz", "model": "m"}}))
    if kind == "symlink":
        os.symlink(real, root / "pins.json")
    else:
        (root / "pins.json").mkdir()
    out = runner.invoke(cli, ["store", "prune", str(root), "--older-than", "0s"])
    assert out.exit_code != 0 and "pins.json cannot be read" in out.output, out.output
    assert len(out.output.strip().splitlines()) == 1, out.output
    assert len(list(root.rglob("*.kvz"))) == 5  # nothing removed


def test_unpin_needs_a_store(tmp_path, runner):
    out = runner.invoke(cli, ["store", "unpin", str(tmp_path / "nostore"), str(tmp_path / "x")])
    assert out.exit_code != 0 and "no store at" in out.output, out.output
    assert not (tmp_path / "nostore").exists()


# -- the stats files of ended servers ---------------------------------------------------------
class _Store:
    """What a stats writer needs of a PrefixStore."""

    def __init__(self, root):
        self.root, self.policy = root, policy_from_extra({"codec": "raw"})


def _activity(runner, root) -> dict:
    out = runner.invoke(cli, ["store", "stats", "--json", str(root)])
    assert out.exit_code == 0, out.output
    return json.loads(out.output)["activity"]


def _stats_names(root) -> list[str]:
    return sorted(os.listdir(root / "stats"))


def test_prune_folds_ended_servers_stats_and_keeps_the_totals(root, runner):
    from kvtool.engines.vllm import activity
    from kvtool.engines.vllm.stats_files import STALE, StatsWriter

    writers = [StatsWriter(_Store(root), "raw", False, interval=0) for _ in range(4)]
    activity.record("requests_hit", 5)
    activity.observe("load", 0.5)
    for w in writers:
        assert w.write()
    writers[0].close()  # ended
    writers[1].close()
    stale = json.loads((root / "stats" / writers[2].name).read_text())  # killed 2 hours ago
    stale["updated"] -= 2 * STALE
    (root / "stats" / writers[2].name).write_text(json.dumps(stale))
    legacy = {k: v for k, v in stale.items() if k != "heartbeat"}  # an old server's: kept
    (root / "stats" / "old-1-abc.json").write_text(json.dumps(legacy))  # for 30 days
    before = _activity(runner, root)
    assert before["processes"] == 5 and before["folded"] == 0
    dry = json.loads(runner.invoke(cli, ["store", "prune", "--dry-run", "--json", str(root)])
                     .output)
    assert dry["folded_stats_files"] == 3 and len(_stats_names(root)) == 5
    out = runner.invoke(cli, ["store", "prune", str(root)])
    assert out.exit_code == 0 and "folded the stats files of 3 ended server processes" \
        in out.output, out.output
    assert _stats_names(root) == sorted(["folded.json", writers[3].name, "old-1-abc.json"])
    after = _activity(runner, root)
    assert after["counters"] == before["counters"] and after["policies"] == {"raw": False}
    assert after["processes"] == 5 and after["folded"] == 3 and after["unreadable"] == 0
    assert after["counters"]["requests_hit"] == 25 and after["counters"]["load_count"] == 5
    assert json.loads(runner.invoke(cli, ["store", "prune", "--json", str(root)]).output)[
        "folded_stats_files"] == 0
    assert _activity(runner, root) == after


def test_a_fold_cut_short_counts_nothing_twice(root, runner):
    from kvtool.engines.vllm import activity
    from kvtool.engines.vllm.stats_files import StatsWriter, fold_ended

    writer = StatsWriter(_Store(root), "raw", False, interval=0)
    activity.record("bytes_loaded", 700)
    writer.close()
    kept = (root / "stats" / writer.name).read_bytes()
    before = _activity(runner, root)
    assert fold_ended(store_admin.backend_of(str(root))) == (1, len(kept))
    (root / "stats" / writer.name).write_bytes(kept)  # as if the fold died before removing it
    assert _activity(runner, root)["counters"] == before["counters"]
    assert fold_ended(store_admin.backend_of(str(root))) == (1, len(kept))
    assert _stats_names(root) == ["folded.json"]
    assert _activity(runner, root)["counters"] == before["counters"]


def test_a_live_writer_whose_file_was_folded_goes_on_in_a_new_one(root, runner):
    from kvtool.engines.vllm import activity
    from kvtool.engines.vllm.stats_files import HEARTBEAT, STALE, StatsWriter, fold_ended

    writer = StatsWriter(_Store(root), "raw", False, interval=0)
    activity.record("chunks_evicted", 2)
    assert writer.write()
    first = writer.name
    writer._written_at -= HEARTBEAT  # unchanged counters: a heartbeat rewrites the file
    updated = json.loads((root / "stats" / first).read_text())["updated"]
    assert writer.write() and json.loads((root / "stats" / first).read_text())["updated"] > \
        updated
    # its heartbeats failed for two hours (a full disk): prune took it for a dead server's
    assert fold_ended(store_admin.backend_of(str(root)), now=time.time() + 2 * STALE)[0] == 1
    writer._written_at -= STALE
    activity.record("chunks_evicted", 3)
    assert writer.write() and writer.name != first
    got = _activity(runner, root)
    assert got["counters"]["chunks_evicted"] == 5 and got["processes"] == 2


def test_a_damaged_folded_file_is_never_overwritten(root, runner):
    from kvtool.engines.vllm.stats_files import StatsWriter

    writer = StatsWriter(_Store(root), "raw", False, interval=0)
    writer.close()
    (root / "stats" / "folded.json").write_text('{"kind": "kvtool-folded-stats", "counters"')
    out = runner.invoke(cli, ["store", "prune", "--max-bytes", "0", str(root)])
    assert out.exit_code == 1 and "folded.json" in out.output and "damaged" in out.output
    assert "Traceback" not in out.output and "removed 5 chunks" in out.output
    assert (root / "stats" / "folded.json").read_text().endswith('"counters"')
    assert (root / "stats" / writer.name).exists()
    assert _activity(runner, root)["unreadable"] == 1
