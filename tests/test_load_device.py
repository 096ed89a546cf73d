"""``load(path, device=...)``: segments bound for CUDA are moved there as codes and decoded there;
other devices get the host decode, moved. The device path runs here on CPU by adding "cpu" to
``reader.DECODE_ON_DEVICE``; it must give the tensors, and the refusals, of the host path.
The ``gpu`` cases check on CUDA that save encodes on the device and load decodes there."""

from __future__ import annotations

import numpy as np
import pytest
from kvz_mutate import parse, serialize
from kvz_util import synthetic_cache

from kvtool.codecs.abc import Encoded
from kvtool.errors import FormatError
from kvtool.formats import load, open_kvz, reader, save
from kvtool.presets import preset_policy

torch = pytest.importorskip("torch")

SAVES = {  # save() options; "preset": that preset's policy
    "quality": {"preset": "quality"},
    "turbo3+sinks": {"codec": "turbo3", "sink_tokens": 3},
    "kivi2": {"codec": "kivi2"},
    "raw": {"codec": "raw"},
}


def _save(path, cache, name: str) -> None:
    options = dict(SAVES[name])
    preset = options.pop("preset", None)
    save(cache, path, policy=preset_policy(preset) if preset else None, **options)


@pytest.fixture
def moved(monkeypatch):
    """The devices :meth:`Encoded.to_torch` moved segments to, in call order."""
    devices = []
    to_torch = Encoded.to_torch

    def spy(self, device=None):
        devices.append(device)
        return to_torch(self, device)

    monkeypatch.setattr(Encoded, "to_torch", spy)
    return devices


def _assert_same(a, b) -> None:
    assert a.num_layers == b.num_layers
    for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values), strict=True):
        assert x.device == y.device and x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.view(torch.uint8) if x.numel() else x,
                           y.view(torch.uint8) if y.numel() else y)


@pytest.mark.parametrize("name", list(SAVES))
def test_the_device_path_gives_the_host_paths_tensors(tmp_path, monkeypatch, moved, name):
    path = tmp_path / "c.kvz"
    _save(path, synthetic_cache(layers=2, heads=2, tokens=40, dim=64, dtype="bfloat16"), name)
    before = load(path, backend="torch").to_torch("cpu")  # how a caller moved a cache before
    assert moved and all(d is None for d in moved)
    moved.clear()
    host = load(path, device="cpu")  # cpu is not a decode-on-device type: decoded, then moved
    assert moved and all(d is None for d in moved)
    _assert_same(host, before)
    moved.clear()
    monkeypatch.setattr(reader, "DECODE_ON_DEVICE", ("cpu",))
    on_device = load(path, device="cpu")
    assert moved and all(d == "cpu" for d in moved)  # every segment moved first, then decoded
    _assert_same(on_device, before)
    assert on_device.token_ids.tolist() == before.token_ids.tolist()


def test_dtype_tokens_layers_and_empty_layers_on_the_device_path(tmp_path, monkeypatch):
    path = tmp_path / "c.kvz"
    save(synthetic_cache(layers=3, tokens=20, dim=64), path, codec="turbo4", sink_tokens=2)
    monkeypatch.setattr(reader, "DECODE_ON_DEVICE", ("cpu",))
    for options in ({"dtype": "float32", "tokens": 11, "layers": [2, 0]}, {"tokens": 0},
                    {"tokens": 1, "dtype": "bf16"}):
        want = load(path, backend="torch", **options)
        got = load(path, device=torch.device("cpu"), **options)
        _assert_same(got, want)
    with open_kvz(path) as f:
        k, v = f.layer(1, "float16", tokens=5, device="cpu")
        want_k, _ = f.layer(1, "float16", "torch", tokens=5)
        assert k.shape == (2, 5, 64) and torch.equal(k, want_k)


def test_numpy_on_a_device_is_refused(tmp_path):
    path = tmp_path / "c.kvz"
    save(synthetic_cache(), path, codec="turbo3")
    with pytest.raises(ValueError, match="backend='torch'"):
        load(path, backend="numpy", device="cpu")
    assert isinstance(load(path).keys[0], np.ndarray)  # the default stays numpy


def _corrupt(path, name: str, edit) -> None:
    """Rewrite ``path`` with tensor ``name``'s bytes edited (checksums recomputed)."""
    p = parse(str(path))
    dtype, shape, data = p.tensors[name]
    p.tensors[name] = (dtype, shape, bytes(edit(bytearray(data))))
    path.write_bytes(serialize(p))


def _refusal(path, monkeypatch, **options) -> str:
    with monkeypatch.context() as m:
        if options.pop("forced", False):
            m.setattr(reader, "DECODE_ON_DEVICE", ("cpu",))
        with pytest.raises(FormatError) as e:
            load(path, **options)
    return str(e.value)


def test_corrupt_files_are_refused_alike(tmp_path, monkeypatch):
    """The host checks (checksums, value ranges) run before anything moves; a codec's own
    refusal (an outlier mask naming the wrong number of channels) comes out the same."""
    spec = "turbomix:bits=3,outliers=8,candidates=2"
    cases = {
        "checksum": (None, lambda d: d),
        "rotation": ("layers.1.value.0.rotation", lambda d: bytearray(b"\x07" * len(d))),
        "outlier_mask": ("layers.0.key.0.outlier_mask", lambda d: bytearray(b"\xff" * len(d))),
    }
    for what, (name, edit) in cases.items():
        path = tmp_path / f"{what}.kvz"
        save(synthetic_cache(layers=2, tokens=16, dim=64), path, codec=spec)
        if name is None:  # a flipped byte under an unchanged checksum
            data = bytearray(path.read_bytes())
            data[-5] ^= 0xFF
            path.write_bytes(bytes(data))
        else:
            _corrupt(path, name, edit)
        messages = {_refusal(path, monkeypatch, backend="torch"),
                    _refusal(path, monkeypatch, device="cpu"),
                    _refusal(path, monkeypatch, device="cpu", forced=True)}
        assert len(messages) == 1, (what, messages)
        assert {"checksum": "checksum mismatch", "rotation": "every writer keeps",
                "outlier_mask": "outlier mask"}[what] in messages.pop()


# -- CUDA --------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_save_encodes_on_the_device_and_load_decodes_there(tmp_path, monkeypatch):
    """No K/V-sized float tensor reaches the host in save (only norms, means and the exact
    sink tokens do), load moves the codes and decodes them on the GPU, and the result is the
    numpy reference's decode within one step of fp16 and 1e-5 of the vector. ~15 s on an H100
    (one compile per turbomix kernel and key: :mod:`gpu_util`)."""
    from gpu_util import pin_first_config

    from kvtool.cache import KVCache
    from kvtool.kernels import triton_cuda, triton_turbomix

    pin_first_config(monkeypatch, triton_cuda, triton_turbomix)
    heads, tokens, dim = 4, 600, 128
    gen = torch.Generator("cuda").manual_seed(0)
    kv = [torch.randn((heads, tokens, dim), generator=gen, device="cuda").half()
          for _ in range(4)]
    cache = KVCache(kv[:2], kv[2:], token_ids=np.arange(tokens))
    to_host = []
    cpu = torch.Tensor.cpu

    def spy_cpu(self, *args, **kwargs):
        if self.is_cuda and self.is_floating_point():
            to_host.append(self.numel())
        return cpu(self, *args, **kwargs)

    policy = preset_policy("quality")
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "cpu", spy_cpu)
        save(cache, tmp_path / "c.kvz", policy=policy)
    assert to_host and max(to_host) <= heads * max(tokens, policy.sink_tokens * dim)
    decoded_on = []
    decode = triton_turbomix.decode

    def spy_decode(codec, arrays, shape, dtype):
        decoded_on.append({a.device.type for a in arrays.values()})
        return decode(codec, arrays, shape, dtype)

    monkeypatch.setattr(triton_turbomix, "decode", spy_decode)
    got = load(tmp_path / "c.kvz", device="cuda")
    assert len(decoded_on) == 4 and all(d == {"cuda"} for d in decoded_on)
    monkeypatch.setenv("KVTOOL_KERNELS", "reference")  # no numba compile on a fresh machine
    want = load(tmp_path / "c.kvz", backend="torch")
    for a, b, x in zip((*got.keys, *got.values), (*want.keys, *want.values), kv, strict=True):
        assert a.device.type == "cuda" and a.dtype == torch.float16
        a, b = a.double().cpu(), b.double()
        norm = x.double().norm(dim=-1, keepdim=True).cpu()
        step = 2.0 ** (torch.floor(torch.log2(b.abs().clamp_min(2.0 ** -14))) - 10)
        assert ((a - b).abs() <= step + 1e-5 * norm).all()
