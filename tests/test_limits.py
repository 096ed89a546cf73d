"""Resource limits: decode bombs, aliasing, oversized headers are refused from the header alone,
and ``inspect --verify`` decodes everything and names the tensor at fault."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from kvz_mutate import model_identity, parse, serialize
from kvz_util import synthetic_cache

from kvtool.cache import KVCache
from kvtool.cli.main import cli
from kvtool.errors import FormatError, KvtoolError
from kvtool.formats import constants as C
from kvtool.formats import load, open_kvz, save


def test_aliasing_bomb_is_refused(tmp_path):
    """Every layer and role pointing at one stored tensor: the 5 KB → 4 GiB file of the review."""
    src = tmp_path / "small.kvz"
    save(synthetic_cache(layers=4, tokens=8, dim=16), src, codec="raw")
    p = parse(str(src))
    for layer in p.header[C.H_LAYERS]:
        for role in C.ROLES:
            layer[role]["segments"][0]["tensors"]["data"] = "layers.0.key.0.data"
    (tmp_path / "bomb.kvz").write_bytes(serialize(p))
    with pytest.raises(FormatError, match="is not named|backs both"):
        open_kvz(tmp_path / "bomb.kvz")


def test_token_count_bomb_is_refused_before_allocation(tmp_path):
    src = tmp_path / "small.kvz"
    save(synthetic_cache(layers=2, tokens=8, dim=16), src, codec="turbo3")
    p = parse(str(src))
    big = 1 << 26
    p.header[C.H_NUM_TOKENS] = big
    for layer in p.header[C.H_LAYERS]:
        for role in C.ROLES:
            info = layer[role]
            info["shape"][1] = info["segments"][0]["shape"][1] = info["segments"][0]["stop"] = big
    (tmp_path / "bomb.kvz").write_bytes(serialize(p))
    with pytest.raises(FormatError, match="too large for its .* stored bytes|over the limit"):
        open_kvz(tmp_path / "bomb.kvz")


def test_legitimate_giant_cache_loads_with_the_override(tmp_path, monkeypatch):
    """An all-zero raw cache with zstd is tiny on disk and 80 MB decoded: over the default
    limit, loadable with KVTOOL_MAX_DECODED_BYTES or max_decoded_bytes=."""
    zeros = np.zeros((4, 5000, 128), np.float32)
    cache = KVCache([zeros] * 10, [zeros] * 10, model=model_identity(10, 4, 128))
    path = tmp_path / "zeros.kvz"
    save(cache, path, codec="raw", zstd=True)
    assert path.stat().st_size * C.MAX_DECODED_RATIO < 80_000_000
    with pytest.raises(FormatError, match="over the limit"):
        open_kvz(path)
    assert load(path, layers=[0], max_decoded_bytes=10**9).keys[0].shape == (4, 5000, 128)
    monkeypatch.setenv(C.ENV_MAX_DECODED, "1e9")
    with open_kvz(path) as f:
        assert f.num_tokens == 5000
    for bad in ("lots", "inf", "-1", "0"):  # the environment's error, not the file's
        monkeypatch.setenv(C.ENV_MAX_DECODED, bad)
        with pytest.raises(KvtoolError, match=f"KVTOOL_MAX_DECODED_BYTES='{bad}' is not a "
                           "positive") as e:
            open_kvz(path)
        assert not isinstance(e.value, FormatError)


def test_oversized_header_is_refused_without_reading_it(tmp_path):
    path = tmp_path / "h.kvz"
    n = C.MAX_HEADER_BYTES + 8
    with open(path, "wb") as f:
        f.write(n.to_bytes(8, "little"))
        f.seek(8 + n)
        f.write(b"\0")  # a sparse file: the claimed header really is there
    with pytest.raises(FormatError, match="exceeds the .*-byte limit"):
        open_kvz(path)


def test_header_of_many_tensors_is_refused(tmp_path):
    """A header just under the size cap, full of entries: refused (it took 32 s at 58 MB)."""
    entries = {f"t{i}": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
               for i in range(150_000)}
    entries["__metadata__"] = {"kvz.format": "kvz", "kvz.format_version": "1",
                               "kvz.header": "{}"}
    raw = json.dumps(entries).encode()
    raw += b" " * (-len(raw) % 8)
    assert len(raw) < C.MAX_HEADER_BYTES
    path = tmp_path / "many.kvz"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw)
    with pytest.raises(FormatError):
        open_kvz(path)


def _negative_norm_file(tmp_path) -> tuple[str, str]:
    src = tmp_path / "t.kvz"
    save(synthetic_cache(layers=2, tokens=8, dim=16), src, codec="turbo3")
    p = parse(str(src))
    name = "layers.1.value.0.norms"
    dtype, shape, data = p.tensors[name]
    arr = np.frombuffer(data, np.float16).copy()
    arr[0] = np.nan
    p.tensors[name] = (dtype, shape, arr.tobytes())
    (tmp_path / "nan.kvz").write_bytes(serialize(p))
    return str(tmp_path / "nan.kvz"), name


def test_inspect_verify_decodes_every_layer_and_names_the_tensor(tmp_path):
    path, name = _negative_norm_file(tmp_path)
    runner = CliRunner()
    plain = runner.invoke(cli, ["inspect", path])
    assert plain.exit_code == 0, plain.output  # checksums are valid: only decoding shows it
    result = runner.invoke(cli, ["inspect", path, "--verify"])
    assert result.exit_code == 4
    assert name in result.stderr and "NaN" in result.stderr
    result = runner.invoke(cli, ["inspect", path, "--verify", "--json"])
    assert result.exit_code == 4
    assert json.loads(result.stdout)["verify"]["ok"] is False


def test_torch_backend_refuses_with_format_error(tmp_path):
    path, name = _negative_norm_file(tmp_path)
    with pytest.raises(FormatError, match=name):
        load(path, backend="torch")
