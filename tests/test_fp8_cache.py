"""fp8 paged caches (vLLM's ``--kv-cache-dtype fp8``): the values (kvtool.engines.vllm.fp8_cache)
and every paged layout reading and writing them (a save dequantizes, a load quantizes), checked
against vLLM's own CPU cache writer where installed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from paged_writers import WRITERS, fp8_writer, vllm_cpu_ops_or_skip  # noqa: E402

from kvtool.engines.vllm import paged_io  # noqa: E402
from kvtool.engines.vllm.fp8_cache import (  # noqa: E402
    Fp8Cache,
    checkpoint_kv_cache_dtype,
    fp8_format,
    layer_fp8,
)
from kvtool.engines.vllm.layout import PagedLayout, UnsupportedLayoutError  # noqa: E402
from kvtool.engines.vllm.layout_probe import (  # noqa: E402
    cpu_layout,
    probe_offsets,
    vllm_cpu_writer,
)
from kvtool.errors import KvtoolError  # noqa: E402

H, D, N, NB = 2, 32, 16, 6


def test_formats_of_vllms_kv_cache_dtypes():
    assert [fp8_format(x) for x in ("fp8", "FP8_E4M3", "fp8_e5m2", "auto", None, "bfloat16")] \
        == ["e4m3", "e4m3", "e5m2", None, None, None]
    for unknown in ("fp8_inc", "nvfp4", "int8"):
        with pytest.raises(KvtoolError, match="kvtool reads fp8"):
            fp8_format(unknown)
    layer = SimpleNamespace(kv_cache_dtype="fp8_e5m2", _k_scale_float=0.5, _v_scale_float=2.0)
    assert layer_fp8(layer, "float16") == Fp8Cache("e5m2", 0.5, 2.0, "float16")
    assert layer_fp8(SimpleNamespace(kv_cache_dtype="auto"), "bfloat16") is None
    only_tensors = SimpleNamespace(kv_cache_dtype="fp8", _k_scale=torch.tensor(0.25),
                                   _v_scale=torch.tensor(4.0))
    assert layer_fp8(only_tensors, "bfloat16") == Fp8Cache("e4m3", 0.25, 4.0)
    with pytest.raises(KvtoolError, match="without its v_scale"):
        layer_fp8(SimpleNamespace(kv_cache_dtype="fp8", _k_scale_float=1.0), "bfloat16")
    for scale in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(KvtoolError, match="positive number"):
            Fp8Cache("e4m3", scale)


def test_a_checkpoint_that_quantizes_its_kv_cache_makes_it_fp8():
    """vLLM turns ``--kv-cache-dtype auto`` into fp8 for such a checkpoint: kvtool serve
    must see that before vLLM starts (a lossless policy is refused with it)."""
    pytest.importorskip("vllm")
    scheme = {"num_bits": 8, "type": "float", "dynamic": False, "strategy": "tensor"}
    for quant, want in (({"kv_cache_scheme": scheme}, "fp8"),
                        ({"quant_method": "modelopt", "kv_cache_quant_algo": "FP8"}, "fp8_e4m3"),
                        ({"quant_method": "fp8"}, None), (None, None)):
        assert checkpoint_kv_cache_dtype(SimpleNamespace(quantization_config=quant)) == want
    assert checkpoint_kv_cache_dtype(SimpleNamespace()) is None


@pytest.mark.parametrize("fmt,top", [("e4m3", 448.0), ("e5m2", 57344.0)])
def test_values_round_to_nearest_even_and_saturate(fmt, top):
    """A load's quantization: x / scale rounded to the nearest code (ties to even), anything
    past the largest finite value saturated, never inf or NaN; a save's: code × scale."""
    fp8 = Fp8Cache(fmt, k_scale=0.5, v_scale=4.0, dtype="float32")
    x = torch.tensor([1.0, -3.0, 1e9, -1e9, 0.0, 7.3, 1e-12])
    for role, scale in (("key", 0.5), ("value", 4.0)):
        codes = fp8.encode(x, role)
        assert codes.dtype == torch.uint8
        want = (x / scale).clamp(-top, top).to(fp8.code_dtype)
        assert torch.equal(codes, want.view(torch.uint8))
        back = fp8.decode(codes, role)
        assert torch.isfinite(back).all() and back[2] == top * scale and back[3] == -top * scale
        assert torch.equal(back, want.float() * scale)
        assert back[0] == 1.0 and back[1] == -3.0  # exact codes come back exact


def _fp8_layouts():
    """Every layout, as an fp8 cache (scales 0.5 / 2.0, read out in bfloat16)."""
    fp8 = Fp8Cache("e4m3", 0.5, 2.0, "bfloat16")
    probed = probe_offsets(WRITERS["amx"], torch.bfloat16, N, D)
    return {"cpu": (PagedLayout("cpu", D, fp8=fp8), (NB, H, N, 2 * D)),
            "cpu_amx": (PagedLayout("cpu_amx", D, fp8=fp8), (NB, H, N, 2 * D)),
            "cpu_probed": (PagedLayout("cpu_probed", D, probed, fp8), (NB, H, N, 2 * D)),
            "split": (PagedLayout("split", D, fp8=fp8), (NB, H, N, 2 * D)),
            "flash": (PagedLayout("flash", D, fp8=fp8), (2, NB, N, H, D))}


@pytest.mark.parametrize("name", ["cpu", "cpu_amx", "cpu_probed", "split", "flash"])
def test_every_layout_writes_codes_and_gathers_real_values(name):
    """Codes land where the layout puts 16-bit values, the tokens around the range keep
    their bytes, and a gather gives back K/V: exact for values an fp8 code holds, within
    rounding for the rest."""
    layout, shape = _fp8_layouts()[name]
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 256, (2, H, 2 * N + 3, D), generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
    k, v = layout.fp8.decode(codes[0], "key"), layout.fp8.decode(codes[1], "value")
    noise = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    kv8 = noise.clone()
    blocks = [4, 1, 3, 0]
    layout.write(kv8, blocks, 5, "key", k)
    layout.write(kv8, blocks, 5, "value", v)
    # the bytes as numbers in a bfloat16 cache (0..255 are exact), placed as 16-bit values
    want = noise.to(torch.bfloat16)
    PagedLayout(layout.name, D, layout.offsets).scatter(
        want, blocks, 5, codes[0].to(torch.bfloat16), codes[1].to(torch.bfloat16))
    assert torch.equal(kv8.to(torch.bfloat16), want)
    gk, gv = layout.gather(kv8, blocks, 5, 5 + k.shape[1])
    assert gk.dtype == torch.bfloat16 and torch.equal(gk, k) and torch.equal(gv, v)
    x = torch.randn(H, 7, D, generator=gen) * 3
    layout.write(kv8, blocks, 9, "key", x)
    got = layout.gather(kv8, blocks, 9, 16)[0].float()
    assert torch.allclose(got, x, rtol=2 ** -4, atol=2 ** -9)  # e4m3: 3 mantissa bits


def test_an_fp8_layout_refuses_a_float_cache_and_a_float_layout_refuses_codes():
    fp8 = Fp8Cache("e4m3")
    with pytest.raises(UnsupportedLayoutError, match="does not hold fp8 e4m3 codes"):
        PagedLayout("cpu", D, fp8=fp8).gather(torch.zeros(NB, H, N, 2 * D), [0], 0, 1)
    with pytest.raises(UnsupportedLayoutError, match="named no fp8 format"):
        PagedLayout("cpu", D).gather(torch.zeros(NB, H, N, 2 * D, dtype=torch.uint8), [0], 0, 1)
    codes = torch.zeros(NB, H, N, 2 * D, dtype=torch.float8_e4m3fn)  # codes as fp8 values
    PagedLayout("cpu", D, fp8=fp8).write(codes, [2], 3, "key", torch.full((H, 1, D), 1.5))
    assert (codes[2].float() == 1.5).sum() == H * D and codes.float().abs().sum() == 1.5 * H * D


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("isa", ["vec", "picked"])
def test_vllm_writes_what_the_fp8_layout_reads(kv_cache_dtype, isa):
    """vLLM's CPU writer (its ISA here and the one it picks: ``amx`` on AMX CPUs) at scales
    0.5 / 2: the layout kvtool knows agrees with it; a gather reads the writer's codes × the
    scales, and values an fp8 code holds go back in as the writer's own bytes."""
    vllm_cpu_ops_or_skip()
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    block_size, dim = 32, 64
    if isa == "picked":
        isa = _get_attn_isa(torch.bfloat16, block_size, dim)
    fp8 = Fp8Cache(fp8_format(kv_cache_dtype), 0.5, 2.0, "bfloat16")
    kv = torch.zeros(4, 2, block_size, 2 * dim, dtype=torch.uint8)
    layout, warning = cpu_layout(kv, dim, isa, vllm_cpu_writer(isa, kv_cache_dtype), fp8)
    assert warning is None and layout.name == ("cpu_amx" if isa == "amx" else "cpu")
    gen = torch.Generator().manual_seed(1)
    tokens = block_size + 9
    key, value = (torch.randn(tokens, 2, dim, generator=gen).bfloat16() for _ in range(2))
    blocks = [3, 0]
    slot_mapping = torch.tensor([blocks[p // block_size] * block_size + p % block_size
                                 for p in range(tokens)])
    key_cache, value_cache = kv.view(4, 2, 2 * block_size, dim).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa, 0.5,
                                   2.0, kv_cache_dtype)
    gk, gv = layout.gather(kv, blocks, 0, tokens)
    assert torch.allclose(gk.float(), key.transpose(0, 1).float(), rtol=0.25, atol=2 ** -6)
    assert torch.allclose(gv.float(), value.transpose(0, 1).float(), rtol=0.25, atol=2 ** -6)
    again = torch.zeros_like(kv)
    layout.scatter(again, blocks, 0, gk, gv)
    assert torch.equal(again, kv)


def test_layer_table_gives_each_layer_its_scales_and_probes_once():
    calls = []

    def writer_for(isa: str, kv_cache_dtype: str):
        calls.append((isa, kv_cache_dtype))
        return fp8_writer(WRITERS[isa], torch.float8_e4m3fn)

    names = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
    layers = {n: SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda: "CPU_ATTN"),
                                 head_size=D, isa="vec", kv_cache_dtype="fp8",
                                 _k_scale_float=0.25 * (i + 1), _v_scale_float=1.0)
              for i, n in enumerate(names)}
    caches = {n: torch.zeros(NB, H, N, 2 * D, dtype=torch.uint8) for n in names}
    table = paged_io.layer_table(caches, layers, 0, {"num_layers": 3, "head_dim": D,
                                                     "dtype": "float16"},
                                 lambda n: int(n.split(".")[2]), writer_for)
    assert [layout.fp8 for _, layout, _ in table] == [
        Fp8Cache("e4m3", 0.25 * (i + 1), 1.0, "float16") for i in range(3)]
    assert calls == [("vec", "fp8")]
    kv, layout, _ = table[2]
    layout.write(kv, [1], 0, "key", torch.full((H, 1, D), 0.75))
    assert (kv.view(torch.float8_e4m3fn).float() == 1.0).sum() == H * D  # 0.75 / 0.75


@pytest.mark.parametrize("codec,refused", [("raw", True), ("turbo3", False)])
def test_the_connector_refuses_a_lossless_policy_on_an_fp8_cache(codec, refused):
    """Raw chunks of rounded K/V would pass as exact for float servers of the model: the
    worker's layer table (every save and load goes through it) refuses them."""
    pytest.importorskip("vllm")
    from kvtool.engines.vllm import connector_worker
    from kvtool.policy import CodecPolicy

    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    layer = SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda: "FLASH_ATTN"),
                            head_size=D, kv_cache_dtype="fp8_e5m2", _k_scale_float=1.0,
                            _v_scale_float=1.0)
    worker = SimpleNamespace(
        _layers=None, _kv_caches={n: torch.zeros(NB, H, N, 2 * D, dtype=torch.uint8)
                                  for n in names},
        _vllm_config=SimpleNamespace(compilation_config=SimpleNamespace(
            static_forward_context=dict.fromkeys(names, layer))),
        _kv_cache_config=SimpleNamespace(num_blocks=NB), policy=CodecPolicy.from_options(codec),
        model_info={"num_layers": 2, "head_dim": D, "dtype": "bfloat16"},
        store=SimpleNamespace(lossy_sources=[]))
    if refused:
        for _ in range(2):  # the second save or load: the same reason, the table not remade
            with pytest.raises(KvtoolError, match="lossless store policy"):
                connector_worker.WorkerHalf._layer_table(worker)
            worker._kv_caches = None  # a remade table would fail otherwise
        assert worker._layers is None
    else:
        table = connector_worker.WorkerHalf._layer_table(worker)
        assert [layout.fp8.format for _, layout, _ in table] == ["e5m2", "e5m2"]
        assert worker.store.lossy_sources == ["fp8_e5m2"]  # its chunks say so
