"""The vLLM connector's CUDA path (kvtool.engines.vllm.device_io) on CPU tensors: chunks encoded
where the paged cache lives, codes copied out and written, files decoded back into the blocks.

On CPU the path runs the same numba kernels as the host path, so every file it writes must be
the host path's byte for byte, and every load must write exactly what the host path's load
writes, for every paged layout vLLM hands the connector. ``gpu`` cases run the same on CUDA
tensors (the Triton kernels: codes within float rounding of the host's); the Triton kernels also
run through this path under the interpreter (``tests/vllm_device_io_cases.py``, in a fresh
process). The connector itself is driven through both paths on vLLM's CPU build when installed.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from paged_writers import WRITERS, fp8_writer  # noqa: E402

from kvtool.codecs import Encoded, get_codec  # noqa: E402
from kvtool.engines.vllm import connector_worker, device_io  # noqa: E402
from kvtool.engines.vllm.common import flush, policy_from_extra, stats  # noqa: E402
from kvtool.engines.vllm.fp8_cache import Fp8Cache  # noqa: E402
from kvtool.engines.vllm.layout import LAYOUTS, detect_layout  # noqa: E402
from kvtool.engines.vllm.layout_probe import cpu_layout  # noqa: E402
from kvtool.engines.vllm.store import PrefixStore  # noqa: E402
from kvtool.engines.vllm.store_backend import QUARANTINE_DIR  # noqa: E402
from kvtool.errors import FormatError, KvtoolError  # noqa: E402
from kvtool.formats import load  # noqa: E402

L, H, D, BS, NB, CHUNK = 3, 2, 64, 4, 20, 16
MODEL = {"fingerprint": "d" * 64, "name": "tiny"}
IDS = list(range(500, 500 + 2 * CHUNK))
SAVE_BLOCKS = random.Random(1).sample(range(NB), 2 * CHUNK // BS)  # shuffled, not contiguous
LOAD_BLOCKS = random.Random(2).sample(range(NB), 2 * CHUNK // BS)
SENTINEL = -80.0  # what the slots a load must not touch hold (exact in every float and fp8)
FP8 = Fp8Cache("e4m3", 0.5, 0.5, "bfloat16")  # the "fp8" dtype (SENTINEL / 0.5: a code)
CUDA = torch.cuda.is_available()
ON_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]

PACKED_BS = 16  # the AMX and BFMMLA packings take blocks of 16 tokens at least (vLLM: 32 up)
#: every paged tensor vLLM hands the connector: (attention backend name, shape maker, the
#: permutation viewing it, the CPU ISA that wrote it)
PAGED = {
    "cpu": ("CPU_ATTN", lambda: (NB, H, BS, 2 * D), None, "vec"),
    "cpu-amx": ("CPU_ATTN", lambda: (NB, H, PACKED_BS, 2 * D), None, "amx"),
    # ARM's BFMMLA packing, which kvtool reads off the writer (tests/paged_writers.py)
    "cpu-probed": ("CPU_ATTN", lambda: (NB, H, PACKED_BS, 2 * D), None, "neon"),
    "split": ("FLASH_ATTN", lambda: (NB, BS, H, 2 * D), (0, 2, 1, 3), None),  # NHD memory
    "split-hnd": ("FLASHINFER", lambda: (NB, H, BS, 2 * D), None, None),
    "flash": ("FLASH_ATTN", lambda: (2, NB, BS, H, D), None, None),
}
#: (kind, dtype) pairs a vLLM engine makes: the AMX packing is of 16-bit caches only, ARM's
#: BFMMLA of bfloat16 only; "fp8": ``--kv-cache-dtype fp8`` (codes of bfloat16 K/V)
KIND_DTYPES = [(kind, dtype) for kind in PAGED
               for dtype in ("bfloat16", "float16", "float32", "fp8")
               if not (kind == "cpu-amx" and dtype == "float32")
               and not (kind == "cpu-probed" and dtype != "bfloat16")]


@pytest.fixture(autouse=True)
def reference_cpu_writers(monkeypatch):
    """The connector asks these writers, not vLLM's, to check its CPU layouts: vLLM's runs
    the ISA of this machine whatever the test's layer claims."""
    monkeypatch.setattr(connector_worker, "vllm_cpu_writer", writer_of)


def writer_of(isa: str, kv_cache_dtype: str = "auto"):
    return WRITERS[isa] if kv_cache_dtype == "auto" else fp8_writer(WRITERS[isa], FP8.code_dtype)


def paged(kind: str, dtype: str, seed: int | None = 0, device: str = "cpu"):
    """(paged tensor, its detected layout): random values, or :data:`SENTINEL` (seed None)."""
    backend, shape, perm, isa = PAGED[kind]
    if seed is None:
        base = torch.full(shape(), SENTINEL)
    else:
        base = torch.randn(shape(), generator=torch.Generator().manual_seed(seed)) + 0.2
    fp8 = FP8 if dtype == "fp8" else None
    kv = (fp8.encode(base, "key") if fp8 else base.to(getattr(torch, dtype))).to(device)
    kv = kv.permute(perm) if perm else kv
    if isa is not None:  # a CPU cache: its layout checked against the writer, as the connector
        return kv, cpu_layout(kv, D, isa, writer_of(isa, dtype if fp8 else "auto"), fp8)[0]
    return kv, detect_layout(kv, D, backend, isa, fp8)


def untouched(kv: torch.Tensor, layout) -> torch.Tensor:
    """Where ``kv`` still holds :data:`SENTINEL` (an fp8 cache: its code)."""
    return (layout.fp8.decode(kv, "key") if layout.fp8 else kv) == SENTINEL


def caches(kind: str, dtype: str, fill: bool = True, device: str = "cpu") -> list:
    return [paged(kind, dtype, i if fill else None, device) for i in range(L)]


def gather(layers: list, chunk) -> tuple[list, list]:
    pairs = [layout.gather(kv, SAVE_BLOCKS, chunk.start, chunk.stop) for kv, layout in layers]
    return [k for k, _ in pairs], [v for _, v in pairs]


def stores(tmp_path, extra: dict | None = None, **kwargs) -> tuple[PrefixStore, PrefixStore]:
    """(host path's store, device path's store): one policy, zstd on as the connector's."""
    policy = policy_from_extra(extra or {})
    return tuple(PrefixStore(tmp_path / name, MODEL, CHUNK, policy, zstd=True, **kwargs)
                 for name in ("host", "device"))


def file_of(store: PrefixStore, chunk) -> Path:
    return Path(store.root) / store._name(chunk)


def save_device(store: PrefixStore, layers: list, chunk) -> device_io.EncodedChunk:
    keys, values = gather(layers, chunk)
    encoded = device_io.to_host(device_io.encode_chunk(keys, values, store.chunk_policy(chunk)))
    assert store.write_encoded(chunk, encoded, IDS) > 0
    return encoded


def load_device(store: PrefixStore, layers: list, chunk, a: int, b: int) -> None:
    """The connector's device load of tokens ``[a, b)`` from ``chunk`` into LOAD_BLOCKS."""
    targets = [(kv, layout, LOAD_BLOCKS) for kv, layout in layers]
    tokens = b - chunk.start
    store.read_into(chunk, tokens, None, lambda f: device_io.load_file(
        f, targets, chunk.start, a - chunk.start, tokens))


def load_host(store: PrefixStore, layers: list, chunk, a: int, b: int) -> None:
    """The connector's host load (PrefixStore.read, then PagedLayout.scatter)."""
    cache = store.read(chunk, b - chunk.start)
    for i, (kv, layout) in enumerate(layers):
        k, v = cache.layer(i)
        layout.scatter(kv, LOAD_BLOCKS, a, k[:, a - chunk.start:], v[:, a - chunk.start:])


def test_every_known_layout_is_covered():
    assert {paged(kind, "bfloat16")[1].name for kind in PAGED} == set(LAYOUTS)


# -- save ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,dtype", KIND_DTYPES)
def test_the_device_path_writes_the_host_paths_files(tmp_path, kind, dtype):
    host, dev = stores(tmp_path)
    layers = caches(kind, dtype)
    for chunk in host.chunks(IDS):  # the first keeps 4 sink tokens raw, the second does not
        keys, values = gather(layers, chunk)
        assert host.write(chunk, keys, values, IDS) > 0
        encoded = save_device(dev, layers, chunk)
        assert encoded.ready is None  # CPU: no copy in flight
        assert file_of(dev, chunk).read_bytes() == file_of(host, chunk).read_bytes()
    assert dev.write_encoded(chunk, encoded, IDS) == 0  # an existing chunk is kept


def test_the_device_path_of_a_lossless_server_replaces_a_lossy_chunk(tmp_path):
    """As :meth:`PrefixStore.write` does: a chunk a lossy server stored at the key is one a
    lossless server never loads, so its codes made on the GPU replace it."""
    kind, dtype = KIND_DTYPES[0]
    layers = caches(kind, dtype)
    lossy = PrefixStore(tmp_path / "s", MODEL, CHUNK, policy_from_extra({"codec": "turbo3"}))
    chunk = lossy.chunks(IDS)[0]
    assert lossy.write(chunk, *gather(layers, chunk), IDS) > 0
    lossless = PrefixStore(tmp_path / "s", MODEL, CHUNK, policy_from_extra({"codec": "raw"}))
    assert lossless.lookup(IDS) == []
    save_device(lossless, layers, chunk)  # written (> 0), not kept
    assert [c.key for c in lossless.lookup(IDS)] == [chunk.key]


@pytest.mark.parametrize("extra,options", [
    ({"codec": "raw"}, {}), ({"preset": "balanced"}, {}), ({}, {"entropy": True}),
    ({"codec": "turbo3", "protect_layers": 1}, {}),
    ({"key_codec": "int8", "value_codec": "kivi2"}, {})],
    ids=["raw", "balanced", "quality-rans", "turbo3-protected", "int8-kivi2"])
def test_every_policy_writes_the_host_paths_files(tmp_path, extra, options):
    host, dev = stores(tmp_path, extra, **options)
    layers = caches("split", "bfloat16")
    for chunk in host.chunks(IDS):
        host.write(chunk, *gather(layers, chunk), IDS)
        save_device(dev, layers, chunk)
        assert file_of(dev, chunk).read_bytes() == file_of(host, chunk).read_bytes()


def test_a_device_file_is_a_kvz_file_of_the_chunk(tmp_path, runner):
    from kvtool.cli.main import cli

    _, dev = stores(tmp_path)
    layers = caches("flash", "bfloat16")
    chunk = dev.chunks(IDS)[0]
    save_device(dev, layers, chunk)
    path = file_of(dev, chunk)
    result = runner.invoke(cli, ["inspect", str(path), "--verify"])
    assert result.exit_code == 0, result.output
    assert "turbomix" in result.output
    got = load(path, backend="torch")
    keys, values = gather(layers, chunk)
    assert list(got.token_ids) == IDS[:CHUNK] and got.dtype == "bfloat16"
    for x, y in zip(got.keys + got.values, keys + values, strict=True):
        assert torch.equal(x[:, :4], y[:, :4])  # the sink tokens: exact
        err = ((x[:, 4:].float() - y[:, 4:].float()) ** 2).sum() / (y[:, 4:].float() ** 2).sum()
        assert float(err) < 0.05


def test_a_chunk_encoded_with_another_policy_is_refused(tmp_path):
    host, dev = stores(tmp_path)
    chunk = dev.chunks(IDS)[1]
    keys, values = gather(caches("cpu", "bfloat16"), chunk)
    other = device_io.encode_chunk(keys, values, policy_from_extra({"codec": "turbo4"}))
    with pytest.raises(ValueError, match="another policy"):
        dev.write_encoded(chunk, device_io.to_host(other), IDS)
    assert not dev.exists(chunk)


def test_packed_copies_keep_every_array():
    arrays = {"a": torch.arange(7, dtype=torch.uint8), "b": torch.randn(3, 5).half(),
              "c": torch.randn(2, 1, 3).bfloat16(), "d": torch.arange(6, dtype=torch.int32)
              .reshape(2, 3).t(), "e": torch.zeros(0, 4, dtype=torch.float32)}
    chunk = device_io.EncodedChunk([device_io.Part(0, "key", 0, 2, get_codec("raw"),
                                                   Encoded(arrays, (1, 2, 3), "float16"))], 1)
    for out in (device_io.to_host(chunk).parts[0].encoded,
                device_io.upload([Encoded({k: v.numpy() if v.dtype != torch.bfloat16 else v
                                           for k, v in arrays.items()}, (1, 2, 3), "float16")],
                                 torch.device("cpu"))[0]):
        assert out.arrays.keys() == arrays.keys()
        for name, want in arrays.items():
            got = out.arrays[name]
            assert got.dtype == want.dtype and torch.equal(got, want), name
            assert got.data_ptr() % 16 == 0 or got.numel() == 0
        assert out.shape == (1, 2, 3) and out.dtype == "float16"


# -- load ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,dtype", KIND_DTYPES)
def test_a_device_load_writes_exactly_what_the_host_load_writes(tmp_path, kind, dtype):
    """Tokens 5..27 of two chunks (a partial start, a partial last chunk) into other shuffled
    blocks: the same values in the same slots, in the cache's dtype, nothing else touched."""
    _, dev = stores(tmp_path)
    saved = caches(kind, dtype)
    chunks = dev.chunks(IDS)
    for chunk in chunks:
        save_device(dev, saved, chunk)
    mine, want = caches(kind, dtype, fill=False), caches(kind, dtype, fill=False)
    for chunk, (a, b) in zip(chunks, [(5, 16), (16, 27)], strict=True):
        load_device(dev, mine, chunk, a, b)
        load_host(dev, want, chunk, a, b)
    for (kv, layout), (ref, _) in zip(mine, want, strict=True):
        assert kv.dtype == (torch.uint8 if dtype == "fp8" else getattr(torch, dtype))
        assert torch.equal(kv, ref)
        assert int((~untouched(kv, layout)).sum()) == (27 - 5) * H * 2 * D
        k, v = layout.gather(kv, LOAD_BLOCKS, 0, 5)  # already computed: untouched
        assert bool((k == SENTINEL).all() and (v == SENTINEL).all())


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "another model"])
@pytest.mark.parametrize("writable", [True, False], ids=["writer", "read-only"])
def test_a_damaged_file_is_refused_as_the_host_path_refuses_it(tmp_path, damage, writable):
    host, dev = stores(tmp_path)
    layers = caches("split", "bfloat16")
    chunk = dev.chunks(IDS)[0]
    host.write(chunk, *gather(layers, chunk), IDS)
    save_device(dev, layers, chunk)
    if damage == "another model":
        other = PrefixStore(tmp_path / "other", {"fingerprint": "e" * 64}, CHUNK, dev.policy)
        other.write(chunk, *gather(layers, chunk), IDS)
        data = (Path(other.root) / other._name(chunk)).read_bytes()
    else:
        data = bytearray(file_of(dev, chunk).read_bytes())
        if damage == "truncated":
            data = data[:len(data) // 2]
        else:
            data[-5] ^= 0xFF  # in the last tensor's bytes: its checksum no longer matches
    for store in (host, dev):
        file_of(store, chunk).write_bytes(bytes(data))
    host, dev = (PrefixStore(s.root, MODEL, CHUNK, s.policy, writable=writable)
                 for s in (host, dev))
    before = stats()
    with pytest.raises(Exception) as host_error:
        host.read(chunk)
    target = caches("split", "bfloat16", fill=False)
    with pytest.raises(Exception) as dev_error:
        load_device(dev, target, chunk, 0, CHUNK)
    assert type(dev_error.value) is type(host_error.value)
    assert isinstance(dev_error.value, (FormatError, ValueError))
    assert all(bool((kv == SENTINEL).all()) for kv, _ in target)  # refused before writing
    for store in (host, dev):
        quarantined = os.listdir(Path(store.root) / QUARANTINE_DIR) \
            if (Path(store.root) / QUARANTINE_DIR).exists() else []
        assert len(quarantined) == (1 if writable else 0)
        assert store.exists(chunk) != writable  # a read-only store leaves it in place
    assert stats()["invalid_files"] == before["invalid_files"] + 2


@pytest.mark.parametrize("extra", [{}, {"codec": "raw"}], ids=["default", "raw"])
@pytest.mark.parametrize("path", ["host", "device"])
def test_a_wider_chunk_past_fp16s_range_is_refused_by_an_fp16_cache_and_kept(tmp_path, path,
                                                                              extra):
    """A bf16 server's chunk with a value float16 cannot hold, loaded by an fp16 server: not
    attended as inf (host) or a silently clipped 65504 (device), but refused before any slot
    is written, and left in the store for the servers that can use it."""
    _, store = stores(tmp_path, extra)
    saved = caches("split", "bfloat16")
    saved[0][0][SAVE_BLOCKS[0], 1, 1, 7] = 1e5  # layer 0, head 1, token 1 (a sink: raw): a key
    chunk = store.chunks(IDS)[0]
    save_device(store, saved, chunk)
    before = stats()
    target = caches("split", "float16", fill=False)
    with pytest.raises(KvtoolError, match="past float16's 65504"):
        (load_device if path == "device" else load_host)(store, target, chunk, 0, CHUNK)
    assert all(bool((kv == SENTINEL).all()) for kv, _ in target)
    assert store.exists(chunk) and stats()["invalid_files"] == before["invalid_files"]
    wide = caches("split", "float32", fill=False)
    (load_device if path == "device" else load_host)(store, wide, chunk, 0, CHUNK)
    assert float(wide[0][0].abs().max()) > 9e4  # the value, where a float32 cache has room


def test_a_code_no_writer_stores_is_a_format_error_and_writes_nothing():
    codec = get_codec("turbomix:candidates=4")
    encoded = codec.encode(torch.randn(H, 8, D))
    encoded.arrays["rotation"] = torch.full_like(encoded.arrays["rotation"], 9)
    kv, layout = paged("cpu", "float32", None)
    part = device_io.Part(0, "value", 0, 8, codec, encoded)
    with pytest.raises(FormatError, match="could not decode tokens 0..8"):
        device_io.decode_into(kv, layout, LOAD_BLOCKS, 0, part, encoded, 0, 8, "x.kvz")
    assert bool((kv == SENTINEL).all())


# -- the Triton kernels, and CUDA ---------------------------------------------------------------
def test_triton_kernels_through_the_device_path_under_the_interpreter():
    pytest.importorskip("triton")
    cases = Path(__file__).with_name("vllm_device_io_cases.py")
    run = subprocess.run([sys.executable, "-m", "pytest", str(cases), "-q", "-p",
                          "no:cacheprovider"], env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, cwd=cases.parent.parent, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1].startswith("1 passed")


def _step_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within one step of bf16 (decodes of the same codes by two backends)."""
    got, want = got.float().cpu(), want.float().cpu()
    step = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
    assert bool(((got - want).abs() <= step + 1e-6).all())


@pytest.mark.parametrize("kind", ["split", "flash"])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=ON_CUDA)])
def test_cuda_codes_reach_pinned_memory_and_a_file_the_host_reads(tmp_path, kind, device):
    host, dev = stores(tmp_path)
    layers = caches(kind, "bfloat16", device=device)
    chunk = dev.chunks(IDS)[0]
    keys, values = gather(layers, chunk)
    assert keys[0].is_cuda
    encoded = device_io.encode_chunk(keys, values, dev.chunk_policy(chunk))
    assert all(a.is_cuda for p in encoded.parts for a in p.encoded.arrays.values())
    copied = device_io.to_host(encoded)
    assert isinstance(copied.ready, torch.cuda.Event)
    assert all(a.device.type == "cpu" and a.is_pinned()
               for p in copied.parts for a in p.encoded.arrays.values())
    assert dev.write_encoded(chunk, copied, IDS) > 0
    host.write(chunk, [k.cpu() for k in keys], [v.cpu() for v in values], IDS)
    mine, want = load(file_of(dev, chunk), backend="torch"), load(file_of(host, chunk),
                                                                   backend="torch")
    for x, y in zip(mine.keys + mine.values, want.keys + want.values, strict=True):
        assert torch.equal(x[:, :4], y[:, :4])  # raw sinks
        err = ((x.float() - y.float()) ** 2).sum() / (y.float() ** 2).sum()
        assert float(err) < 5e-3  # the same codes but within float rounding of a decision


@pytest.mark.parametrize("kind", ["split", "flash"])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=ON_CUDA)])
def test_cuda_load_decodes_into_the_blocks(tmp_path, kind, device):
    host, _ = stores(tmp_path)
    saved = caches(kind, "bfloat16")
    chunks = host.chunks(IDS)
    for chunk in chunks:
        host.write(chunk, *gather(saved, chunk), IDS)
    mine = caches(kind, "bfloat16", fill=False, device=device)
    want = caches(kind, "bfloat16", fill=False)
    for chunk, (a, b) in zip(chunks, [(5, 16), (16, 27)], strict=True):
        load_device(host, mine, chunk, a, b)
        load_host(host, want, chunk, a, b)
    for (kv, _), (ref, _) in zip(mine, want, strict=True):
        assert kv.is_cuda and kv.dtype == torch.bfloat16
        kv = kv.cpu()
        assert torch.equal(kv == SENTINEL, ref == SENTINEL)  # the same slots written
        _step_close(kv, ref)


# -- the connector ------------------------------------------------------------------------------
def connector(store: Path, kind: str, role: str = "worker", **parallel: int):
    """A KvtoolConnector (``role``: worker or scheduler side) of an L-layer model whose paged
    caches are ``kind`` (``parallel``: vLLM's parallel config, e.g. tensor_parallel_size)."""
    pytest.importorskip("vllm")
    from transformers import LlamaConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtool.engines.vllm.connector import KvtoolConnector

    hf = LlamaConfig(num_hidden_layers=L, num_attention_heads=2 * H, num_key_value_heads=H,
                     hidden_size=2 * H * D, head_dim=D, intermediate_size=64, vocab_size=1000)
    layer = SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda: PAGED[kind][0]),
                            head_size=D, isa=PAGED[kind][3])
    names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    extra = {"store_path": str(store), "chunk_tokens": CHUNK, "model_name": "tiny",
             "tokenizer_fingerprint": "tok", "stats_interval": 0}
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra, kv_role="kv_both",
                                           kv_load_failure_policy="fail"),
        cache_config=SimpleNamespace(block_size=block_size(kind)),
        model_config=SimpleNamespace(model=str(store), dtype=torch.bfloat16, hf_config=hf),
        compilation_config=SimpleNamespace(static_forward_context=dict.fromkeys(names, layer)),
        parallel_config=SimpleNamespace(**parallel))
    return KvtoolConnector(config, getattr(KVConnectorRole, role.upper())), names


def block_size(kind: str) -> int:
    return PACKED_BS if kind in ("cpu-amx", "cpu-probed") else BS


def connector_load(conn, names: list[str], kind: str, chunks: list) -> tuple[list, set]:
    """Tokens 4..31 of ``chunks`` through ``start_load_kv`` into fresh caches: (the caches,
    the blocks reported failed)."""
    from kvtool.engines.vllm.common import LoadSpec, Source
    from kvtool.engines.vllm.connector import KvtoolMetadata

    fresh = [kv for kv, _ in caches(kind, "bfloat16", fill=False)]
    conn.register_kv_caches(dict(zip(names, fresh, strict=True)))
    sources = [Source(c.path, c.start, c.stop, c) for c in chunks]
    conn.bind_connector_metadata(KvtoolMetadata(loads=[
        LoadSpec("r2", LOAD_BLOCKS, 4, 2 * CHUNK - 1, sources)]))
    conn.start_load_kv(None)
    return fresh, conn.get_block_ids_with_load_errors()


@pytest.mark.parametrize("kind", ["cpu", "cpu-amx", "cpu-probed", "split", "flash"])
def test_the_connector_takes_either_path_with_the_same_results(tmp_path, kind, monkeypatch):
    """Saves and loads through KvtoolConnector's own hooks: on CPU caches the host path (the
    device path's functions never called), forced onto the device path the same files and
    the same cache contents; a damaged chunk fails the same blocks on both."""
    from kvtool.engines.vllm.common import SaveSpec
    from kvtool.engines.vllm.connector import KvtoolMetadata

    results, calls = {}, []
    for fn in ("encode_chunk", "load_file"):
        monkeypatch.setattr(device_io, fn, lambda *a, _real=getattr(device_io, fn), _fn=fn,
                            **k: (calls.append(_fn), _real(*a, **k))[1])
    for forced in (False, True):
        monkeypatch.setattr(device_io, "FORCE_ON_CPU", forced)
        calls.clear()
        conn, names = connector(tmp_path / f"store-{forced}", kind)
        conn.register_kv_caches({n: kv for n, (kv, _) in zip(names, caches(kind, "bfloat16"),
                                                             strict=True)})
        chunks = conn.store.chunks(IDS)
        conn.bind_connector_metadata(KvtoolMetadata(saves=[SaveSpec("r1", SAVE_BLOCKS, IDS,
                                                                    chunks)]))
        conn.wait_for_save()
        assert flush(60)
        files = [file_of(conn.store, c).read_bytes() for c in chunks]

        loaded, failed = connector_load(conn, names, kind, chunks)
        assert not failed
        path = file_of(conn.store, chunks[1])
        path.write_bytes(path.read_bytes()[:100])
        _, failed_after_damage = connector_load(conn, names, kind, chunks)
        conn.shutdown()
        results[forced] = files, loaded, failed_after_damage, list(calls)
    (host_files, host_loaded, host_failed, host_calls), \
        (dev_files, dev_loaded, dev_failed, dev_calls) = results[False], results[True]
    assert host_calls == [] and dev_calls.count("encode_chunk") == 2 \
        and dev_calls.count("load_file") >= 2
    assert dev_files == host_files
    for x, y in zip(dev_loaded, host_loaded, strict=True):
        assert torch.equal(x, y) and int((x != SENTINEL).sum()) == (2 * CHUNK - 5) * H * 2 * D
    bs = block_size(kind)  # the blocks of the damaged second chunk's tokens
    assert dev_failed == host_failed == set(LOAD_BLOCKS[CHUNK // bs:2 * CHUNK // bs])


def test_saves_planned_before_the_scheduler_hears_of_a_failed_load_are_withheld(tmp_path):
    """Under async scheduling vLLM plans step N+1 before it hears that step N's load failed,
    and N+1 computes more of the prompt on the failed blocks; another request may read them
    through vLLM's prefix cache. Those chunks are wrong and must not reach the store under
    their (right) keys: the worker withholds the saves of the failing request, and of any
    holding a failed block, until a step's metadata says the scheduler heard of the failure
    (``heard_failed``; from then on the scheduler plans knowing of it)."""
    from kvtool.engines.vllm.common import SaveSpec
    from kvtool.engines.vllm.connector import KvtoolMetadata

    conn, names = connector(tmp_path / "store", "cpu")
    conn.register_kv_caches({n: kv for n, (kv, _) in zip(names, caches("cpu", "bfloat16"),
                                                         strict=True)})
    chunks = conn.store.chunks(IDS)
    conn.bind_connector_metadata(KvtoolMetadata(saves=[SaveSpec("r1", SAVE_BLOCKS, IDS,
                                                                chunks[:1])]))
    conn.wait_for_save()
    assert flush(60) and file_of(conn.store, chunks[0]).exists()
    file_of(conn.store, chunks[0]).write_bytes(b"damaged")
    _, failed = connector_load(conn, names, "cpu", chunks[:1])  # request r2's load fails
    assert failed and set(failed) <= set(LOAD_BLOCKS)
    told = conn.build_connector_worker_meta()  # the step the failure came from, for vLLM
    assert told.failed_steps == {0} and conn.build_connector_worker_meta() is None
    other = [b for b in range(NB) if b not in LOAD_BLOCKS][:len(SAVE_BLOCKS)]

    def step(req: str, blocks: list[int] = LOAD_BLOCKS, heard: tuple = ()) -> bool:
        """The next step: ``req``'s second chunk is computed; whether it was stored."""
        path = file_of(conn.store, chunks[1])
        path.unlink(missing_ok=True)
        conn.bind_connector_metadata(KvtoolMetadata(
            saves=[SaveSpec(req, blocks, IDS, chunks[1:])], heard_failed=list(heard)))
        conn.start_load_kv(None)
        conn.wait_for_save()
        assert flush(60)
        return path.exists()

    assert not step("r2")  # computed on the failed blocks: not saved
    assert not step("r2", heard=sorted(failed)[:1])  # nor while the scheduler heard of part
    assert not step("r3")  # another request reading them: not saved either
    assert not step("r3", other)  # it read them: withheld while the scheduler does not know
    assert step("r4", other)  # a request elsewhere in the cache is saved
    assert step("r2", heard=sorted(failed))  # planned knowing of the failure: saved
    assert step("r3", other) and not conn._withheld
    conn.shutdown()


def test_the_scheduler_half_plans_no_save_over_a_failed_load(tmp_path):
    """Through the connector's scheduler hooks (async scheduling: step 2 is planned before
    vLLM reports step 1's failed block): the request vLLM rolled back plans its chunks again
    from the failed block and gets its capture; one that went on past it, one that hits
    blocks computed over it (also of a request that finished before the report) store
    nothing; a clean prefix hit stores; a failed block written again from its first token
    (p's, preempted and freed) is clean."""
    from kvtool.engines.vllm.common import ReqState
    from kvtool.engines.vllm.connector import KvtoolWorkerMetadata
    from kvtool.engines.vllm.load_failures import PoisonedBlocks

    conn, _ = connector(tmp_path / "store", "cpu", role="scheduler")
    conn.capture_dir = str(tmp_path)
    prompt = list(range(1000, 1064))  # 4 chunks of 16 tokens, 16 blocks of 4

    def new(req_id, blocks, computed):
        return SimpleNamespace(req_id=req_id, prompt_token_ids=prompt, block_ids=(blocks,),
                               num_computed_tokens=computed)

    def step(scheduled, new_reqs=(), cached=(), preempted=()):
        """cached: (id, computed, new blocks); the step's saves: {id: ([chunk starts], capture)}"""
        out = SimpleNamespace(
            num_scheduled_tokens=scheduled, scheduled_new_reqs=list(new_reqs),
            preempted_req_ids=set(preempted),
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[c[0] for c in cached], num_computed_tokens=[c[1] for c in cached],
                new_block_ids=[(c[2],) if c[2] else None for c in cached],
                resumed_req_ids=set()))
        meta = conn.build_connector_meta(out)
        return meta, {s.req_id: ([c.start for c in s.chunks], s.capture_path is not None)
                      for s in meta.saves}

    a_blocks = list(range(16))
    conn._reqs["z"] = ReqState(prompt, block_ids=[2, 70], planned=8)  # gone before step 1
    conn.request_finished(SimpleNamespace(request_id="z"), [])
    conn._reqs["a"] = ReqState(prompt, capture=True)
    _, saves = step({"a": 64, "b": 16, "c": 4, "p": 8},
                    [new("a", a_blocks, 0), new("b", [0, 1, 2, 3, *range(20, 28)], 16),
                     new("c", [0, 1, 2, 3, 30, 31], 16), new("p", [40, 41], 0)])
    assert saves["a"] == ([0, 16, 32, 48], True) and saves["b"] == ([0, 16], False)
    _, saves = step({"a": 1, "b": 16}, cached=[("a", 64, []), ("b", 32, [])],
                    preempted=["p"])
    assert conn._reqs["p"].block_ids == []
    conn.request_finished(SimpleNamespace(request_id="c"), [])  # before the report
    conn.update_connector_output(SimpleNamespace(
        invalid_block_ids={2, 41}, kv_connector_worker_meta=KvtoolWorkerMetadata({1})))
    meta, saves = step({"a": 16, "b": 4}, cached=[("a", 8, []), ("b", 48, [])])
    assert sorted(meta.heard_failed) == [2, 41]
    assert saves["a"] == ([0], False)  # recomputed from token 8: its chunks planned again
    assert "b" not in saves  # not rolled back: it went on over the failed block
    assert conn._reqs["b"].tainted and not conn._reqs["b"].save
    poisoned: PoisonedBlocks = conn._poisoned
    assert 30 in poisoned.blocks  # c's block after the failed one (c finished since step 1)
    assert 70 not in poisoned.blocks  # z's: z had finished, block 2 was a's in step 1
    assert not {2, 3, 4, 5} & poisoned.blocks and 6 in poisoned.blocks  # a rewrote 8..24
    assert 41 in poisoned.blocks
    _, saves = step({"a": 40, "d": 4, "e": 4, "f": 8},
                    [new("d", [0, 1, 2, 3, 30, 50], 20), new("e", [*a_blocks[:4], 60], 16),
                     new("f", [40, 41], 0)], cached=[("a", 24, [])])
    assert saves["a"] == ([16, 32, 48], True)  # and its capture, once the prompt is done
    assert conn._reqs["d"].tainted and "d" not in saves  # it read c's block 30
    assert not conn._reqs["e"].tainted  # a clean prefix hit
    assert not conn._reqs["f"].tainted and 41 not in poisoned.blocks  # written from token 0


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2},
                                      {"pipeline_parallel_size": 4},
                                      {"prefill_context_parallel_size": 2, "world_size": 2},
                                      {"world_size": 4}])
def test_tensor_and_pipeline_parallel_engines_are_refused(tmp_path, parallel):
    """Each worker of a TP or PP engine holds some heads or layers of a chunk and computes
    over the others' loads: the connector refuses to start rather than store half chunks."""
    for role in ("worker", "scheduler"):
        with pytest.raises(ValueError, match="one worker per engine.*(parallel|world) size [24]"):
            connector(tmp_path / "store", "cpu", role, **parallel)
    connector(tmp_path / "store", "cpu", tensor_parallel_size=1, pipeline_parallel_size=1)
