"""K/V that went through a lossy codec or a narrowing cast never pass for exact again: the
``lossy_sources`` a file records and carries through every re-write, and the stored width
``exact_dtype`` checks; and layer subsets that could not restore in place."""

from __future__ import annotations

import json

import numpy as np
import pytest
from kvz_util import rewrite_header, synthetic_cache

from kvtool.cli.main import cli
from kvtool.errors import FormatError, KvtoolError
from kvtool.formats import load, open_kvz, save, transcode
from kvtool.formats.transcode import refuse_requantizing
from kvtool.policy import CodecPolicy

MODEL32 = {"name": "synthetic", "architecture": "LlamaForCausalLM", "fingerprint": "f" * 16,
           "dtype": "float32"}


def _exact_dtype(path) -> str | None:
    from kvtool.engines.vllm.chunk_checks import exact_dtype

    with open_kvz(path) as f:
        return exact_dtype(f)


@pytest.fixture
def raw32(tmp_path):
    path = tmp_path / "raw32.kvz"
    save(synthetic_cache(dtype="float32", tokens=40, model=MODEL32), path)
    return path


@pytest.fixture
def t3(tmp_path, raw32):
    path = tmp_path / "t3.kvz"
    transcode(raw32, path, "turbo3")
    return path


def test_a_lossy_file_decoded_to_raw_says_so_through_every_rewrite(tmp_path, raw32, t3):
    """``decompress``, ``compress --codec raw`` and ``load`` + ``save`` once wrote a file
    labelled raw everywhere, which then passed for exact: re-quantized without --force."""
    assert _exact_dtype(raw32) == "float32" and open_kvz(raw32).lossy_sources() == []
    dec, again, saved = tmp_path / "dec.kvz", tmp_path / "again.kvz", tmp_path / "saved.kvz"
    transcode(t3, dec, "raw")
    transcode(dec, again, CodecPolicy.from_options(codec="raw", sink_tokens=4))
    cache = load(again)
    assert cache.lossy_sources == ["turbo3"]
    save(cache.prefix(20), saved)
    for path in (dec, again, saved):
        with open_kvz(path) as f:
            assert f.header["lossy_sources"] == ["turbo3"] and f.lossy_sources() == ["turbo3"]
            assert f.info()["lossy_sources"] == ["turbo3"]
        assert _exact_dtype(path) is None
        with pytest.raises(KvtoolError, match=r"already lossy \(turbo3\)"):
            refuse_requantizing(path, CodecPolicy.from_options(codec="turbo4"), "compressing")
    refuse_requantizing(dec, CodecPolicy.from_options(codec="raw"), "compressing")  # lossless
    for cast in ("raw:dtype=float32", "raw:dtype=float16"):  # a cast quantizes nothing
        refuse_requantizing(dec, CodecPolicy.from_options(codec=cast), "compressing")


def test_exact_sinks_rewritten_wider_from_a_lossy_file_are_not_exact(tmp_path, raw32):
    """``compress q.kvz --force --sink-tokens 8`` of a file with 2 raw sinks labelled tokens
    0-8 raw, though 2-7 were decoded from codes."""
    q, wider = tmp_path / "q.kvz", tmp_path / "wider.kvz"
    transcode(raw32, q, CodecPolicy.from_options(codec="turbo3", sink_tokens=2))
    transcode(q, wider, CodecPolicy.from_options(codec="turbo4", sink_tokens=8))
    with open_kvz(wider) as f:
        assert f.header["layers"][0]["key"]["segments"][0]["codec"]["id"] == "raw"
        assert f.header["lossy_sources"] == ["turbo3"]
        assert f.lossy_sources() == ["turbo3", "turbo4"]


def test_cli_refuses_requantizing_and_inspect_shows_a_decoded_lossy_file(runner, tmp_path, t3):
    dec, out = tmp_path / "dec.kvz", tmp_path / "t4.kvz"
    assert runner.invoke(cli, ["decompress", str(t3), "-o", str(dec)]).exit_code == 0
    res = runner.invoke(cli, ["compress", str(dec), "--codec", "turbo4", "-o", str(out)])
    assert res.exit_code == 1 and "already lossy (turbo3)" in res.output and not out.exists()
    text = runner.invoke(cli, ["inspect", str(dec)]).output
    assert "decoded from lossy K/V: turbo3" in text and "raw*" in text, text
    info = json.loads(runner.invoke(cli, ["inspect", str(dec), "--json"]).output)
    assert info["lossy_sources"] == info["decoded_from_lossy"] == ["turbo3"]
    plain = runner.invoke(cli, ["inspect", str(t3)]).output
    assert "raw*" not in plain and "decoded from" not in plain


def test_the_store_never_serves_a_decoded_lossy_file_as_exact(tmp_path, t3):
    from kvtool.engines.vllm.common import policy_from_extra
    from kvtool.engines.vllm.store import PrefixStore
    from kvtool.engines.vllm.store_pins import pin_file

    dec = tmp_path / "dec.kvz"
    transcode(t3, dec, "raw")
    with pytest.raises(KvtoolError, match="is stored lossy"):
        pin_file(tmp_path / "s1", str(dec), chunk_tokens=16,
                 policy_options={"codec": "raw"})
    # chunks a server writes from decoded lossy K/V record it, even when all raw (sinks)
    cache = load(dec)
    model = {**cache.model}
    lossless = PrefixStore(tmp_path / "s2", model, 16, policy_from_extra({"codec": "raw"}))
    ids = [int(t) for t in cache.token_ids]
    chunk = lossless.chunks(ids)[0]
    lossless.write(chunk, [k[:, :16] for k in cache.keys], [v[:, :16] for v in cache.values],
                   ids, lossy_sources=cache.lossy_sources)
    assert _exact_dtype(chunk.path) is None and not lossless.is_valid(chunk, ids)


@pytest.mark.parametrize("sources", [[], ["turbo3", "turbo3"], ["turbo4", "turbo3"], [""],
                                     [3], "turbo3", None, {"turbo3": 1}, ["x" * 129]])
def test_lossy_sources_no_writer_records_are_refused(t3, tmp_path, sources):
    """Optional: absent, or a sorted list of distinct short strings; anything else is a
    FormatError (and a well-formed one loads)."""
    bad, good = tmp_path / "bad.kvz", tmp_path / "good.kvz"
    rewrite_header(t3, bad, lambda h: h.update(lossy_sources=sources))
    with pytest.raises(FormatError, match="lossy_sources must be"):
        load(bad)
    rewrite_header(t3, good, lambda h: h.update(lossy_sources=["float32->bfloat16", "kivi4"]))
    assert load(good).lossy_sources == ["float32->bfloat16", "kivi4", "turbo3"]


def test_a_narrowed_file_is_not_exact_in_the_model_dtype(tmp_path, raw32):
    """``decompress --dtype bf16`` of a float32 capture (or ``load(dtype=)`` + ``save``) kept
    ``exact_dtype`` float32, so a float32 lossless server loaded bf16-rounded K/V; widening
    back does not make it exact, and bf16 -> fp16 is lossy too."""
    bf, back, loaded = tmp_path / "bf.kvz", tmp_path / "back.kvz", tmp_path / "loaded.kvz"
    transcode(raw32, bf, "raw", dtype="bf16")
    transcode(bf, back, "raw", dtype="float32")
    save(load(raw32, dtype="bfloat16").astype("float32"), loaded)
    for path in (bf, back, loaded):
        assert _exact_dtype(path) is None
        assert open_kvz(path).lossy_sources() == ["float32->bfloat16"]
        refuse_requantizing(path, CodecPolicy.from_options(codec="turbo3"), "x")  # no codec
    # a file narrowed by a writer before lossy_sources existed: its roles say it
    plain = tmp_path / "plain.kvz"
    save(synthetic_cache(dtype="bfloat16", tokens=40, model=MODEL32), plain)
    assert "lossy_sources" not in open_kvz(plain).header and _exact_dtype(plain) is None
    bf16 = {**MODEL32, "dtype": "bfloat16"}
    src, fp16, wide = tmp_path / "b.kvz", tmp_path / "h.kvz", tmp_path / "w.kvz"
    save(synthetic_cache(dtype="bfloat16", tokens=40, model=bf16), src)
    transcode(src, fp16, "raw", dtype="float16")
    transcode(src, wide, "raw", dtype="float32")
    assert _exact_dtype(src) == "bfloat16" and _exact_dtype(wide) == "bfloat16"
    assert _exact_dtype(fp16) is None and open_kvz(fp16).lossy_sources() == [
        "bfloat16->float16"]
    # raw:dtype=float32 segments over bf16 K/V: what an older fp8 server's chunks look like
    # (fp8-rounded values, nothing recorded); a store never serves them as exact
    widened = tmp_path / "widened.kvz"
    save(synthetic_cache(dtype="bfloat16", tokens=40, model=bf16), widened,
         codec="raw:dtype=float32")
    assert open_kvz(widened).lossy_sources() == [] and _exact_dtype(widened) is None


@pytest.mark.parametrize("layers", [[1, 0, 2], [0, 0, 0], [2, 1, 0]])
def test_every_layer_out_of_order_or_repeated_is_refused(raw32, layers):
    """``load(layers=[29..0])`` or ``[0]*30`` then ``save`` wrote a full cache whose layers
    restore into each other's places (a subset, in any order, saves as no model's cache)."""
    with pytest.raises(ValueError, match="not each once in order"):
        load(raw32, layers=layers)
    assert load(raw32, layers=[0, 1, 2]).num_layers == 3
    assert np.array_equal(load(raw32, layers=[2, 0]).keys[0], load(raw32).keys[2])
