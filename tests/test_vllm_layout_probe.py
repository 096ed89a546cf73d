"""CPU paged layouts checked against, or read off, a cache writer
(kvtool.engines.vllm.layout_probe): vLLM's own writer where installed (its ``vec``/``vec16``
ISAs and the one it picks on this machine), and reference writers of the packings vLLM's
sources define for CPUs not here (ARM's BFMMLA), or adversarial writers.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from paged_writers import (  # noqa: E402
    WRITERS,
    amx_write,
    bfmmla_write,
    vec_write,
    vllm_cpu_ops_or_skip,
    write_tokens,
)

from kvtool.engines.vllm import paged_io  # noqa: E402
from kvtool.engines.vllm.layout import PagedLayout, UnsupportedLayoutError  # noqa: E402
from kvtool.engines.vllm.layout_probe import (  # noqa: E402
    agrees,
    cpu_layout,
    probe_offsets,
    vllm_cpu_writer,
)


def _cache(dtype=torch.bfloat16, block_size: int = 32, dim: int = 64) -> torch.Tensor:
    return torch.zeros(6, 2, block_size, 2 * dim, dtype=dtype)


@pytest.mark.parametrize("isa,block_size,dtype", [
    ("vec", 32, "float32"), ("vec", 64, "bfloat16"), ("vec16", 16, "float16"),
    ("picked", 32, "bfloat16"), ("picked", 128, "bfloat16")])
def test_vllm_writer_confirms_the_known_layout_and_the_probe_reads_it_too(isa, block_size,
                                                                          dtype):
    """vLLM's writer for each ISA here agrees with the layout kvtool knows for it (no warning),
    and the permutation read off that writer places every element where the known layout
    does ("picked": the ISA vLLM picks on this machine, ``amx`` where it has AMX)."""
    vllm_cpu_ops_or_skip()
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    dt, dim = getattr(torch, dtype), 64
    if isa == "picked":
        isa = _get_attn_isa(dt, block_size, dim)
    kv = _cache(dt, block_size, dim)
    layout, warning = cpu_layout(kv, dim, isa, vllm_cpu_writer(isa))
    assert warning is None and layout.name == ("cpu_amx" if isa == "amx" else "cpu")
    probed = PagedLayout("cpu_probed", dim, probe_offsets(vllm_cpu_writer(isa), dt,
                                                          block_size, dim))
    gen = torch.Generator().manual_seed(5)
    filled = torch.randn(kv.shape, generator=gen).to(dt)
    for a, b in ((0, 3 * block_size), (5, 2 * block_size + 9)):
        assert all(torch.equal(x, y) for x, y in zip(layout.gather(filled, [4, 1, 2], a, b),
                                                     probed.gather(filled, [4, 1, 2], a, b),
                                                     strict=True))


@pytest.mark.parametrize("isa", ["vec", "vec16", "picked"])
def test_reference_writers_are_vllms_writers(isa):
    """The reference writers the other tests trust place every element as vLLM's writers do
    (those this machine has: ``vec``/``vec16`` everywhere, ``amx`` where picked)."""
    vllm_cpu_ops_or_skip()
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    block_size = 16 if isa == "vec16" else 32
    if isa == "picked":
        isa = _get_attn_isa(torch.bfloat16, block_size, 64)
    gen = torch.Generator().manual_seed(9)
    key, value = (torch.randn(2 * block_size + 3, 2, 64, generator=gen).to(torch.bfloat16)
                  for _ in range(2))
    slot_mapping = torch.randperm(6 * block_size, generator=gen)[:key.shape[0]]
    theirs, ours = _cache(block_size=block_size), _cache(block_size=block_size)
    vllm_cpu_writer(isa)(key, value, theirs, slot_mapping)
    WRITERS[isa](key, value, ours, slot_mapping)
    assert torch.equal(theirs, ours) and theirs.any()


@pytest.mark.parametrize("block_size,dim", [(32, 64), (32, 128), (128, 256), (64, 80)])
def test_arm_bfmmla_packing_is_read_off_its_writer(block_size, dim):
    """An ISA kvtool has no layout for (ARM's ``neon``, BFMMLA-packed bfloat16): the packing is
    read off the writer, with a warning naming it, and saves and loads through it are the
    writer's own placement, windows starting mid-block and crossing blocks included."""
    kv = _cache(torch.bfloat16, block_size, dim)
    layout, warning = cpu_layout(kv, dim, "neon", bfmmla_write)
    assert layout.name == "cpu_probed" and "'neon' is new to kvtool" in warning
    gen = torch.Generator().manual_seed(2)
    tokens = 2 * block_size + 5
    k, v = (torch.randn(2, tokens, dim, generator=gen).to(torch.bfloat16) for _ in range(2))
    blocks = [5, 0, 3]
    noise = torch.randn(kv.shape, generator=gen).to(torch.bfloat16)
    want, got = noise.clone(), noise.clone()
    write_tokens(bfmmla_write, want, blocks, 3, k, v)
    layout.scatter(got, blocks, 3, k, v)
    assert torch.equal(got, want)  # the tokens around the range, in the same blocks, kept
    for a, b in ((0, tokens), (block_size - 2, block_size + 1), (7, 8)):
        gk, gv = layout.gather(want, blocks, 3 + a, 3 + b)
        assert torch.equal(gk, k[:, a:b]) and torch.equal(gv, v[:, a:b])


def test_a_known_layout_the_writer_contradicts_is_replaced_by_the_writers_packing():
    """A vLLM release that repacks an ISA kvtool knows: the writer wins, with a warning."""
    kv = _cache()
    layout, warning = cpu_layout(kv, 64, "vec", amx_write)
    assert layout.name == "cpu_probed" and "'cpu' layout disagrees" in warning
    assert agrees(layout, amx_write, torch.bfloat16, 32)
    assert not agrees(PagedLayout("cpu", 64), amx_write, torch.bfloat16, 32)


def _drop_a_dim(key, value, kv, slot_mapping):
    """Writes every dim but the last (a packing that is no permutation)."""
    vec_write(key, value, kv, slot_mapping)
    n = kv.shape[2]
    kv.view(kv.shape[0], kv.shape[1], -1)[:, :, n * 63:n * 64] = 0  # key dim 63: [D, N] rows


def _values_in_key_half(key, value, kv, slot_mapping):
    vec_write(value, key, kv, slot_mapping)


def _one_token_twice(key, value, kv, slot_mapping):
    """Each block's token 0 is written to token 1's slots too (token 1 is lost)."""
    at = slot_mapping % kv.shape[2]
    first, second = at == 0, at == 1
    key, value = key.clone(), value.clone()
    key[second], value[second] = key[first][:int(second.sum())], value[first][:int(second.sum())]
    vec_write(key, value, kv, slot_mapping)


def _fails(key, value, kv, slot_mapping):
    raise RuntimeError("no kernel for this ISA")


@pytest.mark.parametrize("writer,why", [
    (_drop_a_dim, "first half"), (_values_in_key_half, "first half"),
    (_one_token_twice, "exactly once")])
def test_a_packing_that_is_no_permutation_is_refused(writer, why):
    with pytest.raises(UnsupportedLayoutError, match=why):
        cpu_layout(_cache(), 64, "vsx", writer)


def test_a_writer_that_fails_refuses_an_unknown_isa_and_leaves_a_known_one_unchecked():
    with pytest.raises(UnsupportedLayoutError, match="'rvv' failed on a probe"):
        cpu_layout(_cache(), 64, "rvv", _fails)
    layout, warning = cpu_layout(_cache(), 64, "vec", _fails)
    assert layout.name == "cpu" and "unchecked" in warning and "no kernel" in warning


def _amx_but_fails_on_one_head(key, value, kv, slot_mapping):
    """Packs as AMX (not the ``vec`` the ISA claims), and raises on the probe's one head."""
    if key.shape[1] == 1:
        raise RuntimeError("no single-head kernel")
    amx_write(key, value, kv, slot_mapping)


def test_a_known_layout_the_writer_contradicts_is_never_used_unchecked():
    """The writer disproved the known layout, then failed on the probe: refused, not the
    disproved layout "unchecked"."""
    with pytest.raises(UnsupportedLayoutError, match="'vec' failed on a probe.*single-head"):
        cpu_layout(_cache(), 64, "vec", _amx_but_fails_on_one_head)


def test_without_a_writer_the_isa_decides():
    assert cpu_layout(_cache(), 64, "amx", None) == (PagedLayout("cpu_amx", 64), None)
    with pytest.raises(UnsupportedLayoutError, match="'neon'"):
        cpu_layout(_cache(), 64, "neon", None)
    with pytest.raises(UnsupportedLayoutError, match="float8|fp8|scaled codes"):
        cpu_layout(torch.zeros(2, 2, 32, 128, dtype=torch.uint8), 64, "vec", vec_write)


def test_probed_layout_refuses_another_block_size_and_bad_offsets():
    layout = cpu_layout(_cache(block_size=32), 64, "neon", bfmmla_write)[0]
    kv = _cache(block_size=64)
    with pytest.raises(UnsupportedLayoutError, match="blocks of 32 tokens cannot place a "
                                                     "cache with blocks of 64"):
        layout.gather(kv, [0], 0, 4)
    with pytest.raises(ValueError, match="permutation"):
        PagedLayout("cpu_probed", 2, {"key": torch.tensor([0, 0]), "value": torch.arange(2)})
    with pytest.raises(ValueError, match="offsets"):
        PagedLayout("cpu", 2, {"key": torch.arange(2), "value": torch.arange(2)})


def test_layer_table_probes_once_per_kind_and_logs_the_replacement(caplog):
    """The connector's layer table: every layer of an ARM BFMMLA cache gets the probed
    layout, the writer is asked once for all of them, and the log says so once."""
    calls = []

    def writer_for(isa: str, kv_cache_dtype: str):
        calls.append(isa)
        return WRITERS[isa]

    layer = SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda: "CPU_ATTN"),
                            head_size=64, isa="neon")
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    kv_caches = {n: _cache() for n in names}
    with caplog.at_level(logging.WARNING, logger="kvtool"):
        table = paged_io.layer_table(kv_caches, dict.fromkeys(names, layer), 0,
                                     {"num_layers": 4, "head_dim": 64},
                                     lambda n: int(n.split(".")[2]), writer_for)
    assert [layout.name for _, layout, _ in table] == ["cpu_probed"] * 4
    assert calls == ["neon"]
    assert sum("'neon' is new to kvtool" in r.getMessage() for r in caplog.records) == 1
