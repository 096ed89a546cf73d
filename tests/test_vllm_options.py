"""The connector's options as a user passing ``--kv-transfer-config`` to vLLM writes them: every
value of the wrong type is refused by name, before the connector reads it (no vLLM needed)."""

from __future__ import annotations

import pytest

from kvtool.engines.vllm.options import check_extra
from kvtool.engines.vllm.store_backend import open_backend
from kvtool.errors import KvtoolError


@pytest.mark.parametrize("extra, message", [
    # a string read as a list: "/srv" would allow "/" and let a request open any file
    ({"kvz_dirs": "/srv/kvz"}, "kvz_dirs must be a list of directories"),
    ({"kvz_files": "/srv/a.kvz"}, "kvz_files must be a list of paths"),
    ({"kvz_dirs": [5]}, "kvz_dirs must be a list of directories"),
    # "false" read as bool() is true
    ({"save": "false"}, "save must be true or false"),
    ({"load": 0}, "load must be true or false"),
    ({"entropy": "false"}, "entropy must be true or false"),
    ({"capture_all": "false"}, "capture_all must be true or false"),
    # misspelt choices fell back to the default
    ({"on_load_error": "Recompute"}, 'on_load_error must be "recompute" or "fail"'),
    ({"save_mode": "SYNC"}, 'save_mode must be "async" or "sync"'),
    # accepted at start, then every save failed
    ({"zstd": "false"}, "zstd must be true, false or a level in 1..22"),
    ({"zstd": 99}, "zstd must be true, false or a level in 1..22"),
    ({"zstd": 0.5}, "zstd must be true, false or a level in 1..22"),
    # never a whole chunk, or silently rounded
    ({"chunk_tokens": True}, "chunk_tokens must be a whole number of tokens"),
    ({"chunk_tokens": 1.9}, "chunk_tokens must be a whole number of tokens"),
    ({"chunk_tokens": -16}, "chunk_tokens must be a whole number of tokens"),
    ({"chunk_tokens": 10**10}, "chunk_tokens must be a whole number of tokens"),
    ({"chunk_tokens": "abc"}, "chunk_tokens must be a whole number of tokens"),
    # tracebacks later
    ({"capture_dir": 5}, "capture_dir must be a directory"),
    ({"store_path": 5}, "store_path must be a directory or an s3:// URL"),
    ({"codec": 5}, "codec must be a codec"),
    ({"codec": ["raw"]}, "codec must be a codec"),
    ({"sink_tokens": "x"}, "sink_tokens must be an integer from 0 to 2147483647"),
    ({"protect_layers": -1}, "protect_layers must be an integer from 0"),
    ({"stats_interval": "abc"}, "stats_interval must be seconds"),
    ({"stats_interval": float("inf")}, "stats_interval must be seconds"),
    ({"stats_interval": float("nan")}, "stats_interval must be seconds"),
    ({"storage_options": "x"}, "storage_options must be a JSON object"),
    # a URL of another scheme named a local directory ./gs:/...
    ({"store_path": "gs://bucket/x"}, "gs:// is not supported"),
    ({"store_path": "S3://bucket/x"}, "S3:// is not supported .lowercase: s3://."),
    ({"store_path": "https://host/x"}, "https:// is not supported"),
])
def test_a_value_of_the_wrong_kind_is_refused_by_name(extra, message):
    with pytest.raises(KvtoolError, match=message):
        check_extra(extra)


def test_what_kvtool_serve_writes_passes_and_nulls_are_left_out():
    extra = {"model_name": "m", "store_path": "/x", "preset": "quality", "zstd": 3,
             "chunk_tokens": 256, "save_mode": "sync", "on_load_error": "fail", "load": False,
             "kvz_files": ["/a.kvz"], "kvz_dirs": [], "stats_interval": 0, "max_bytes": "2GB",
             "store_timeout": 0.5, "codec": {"id": "turbo3"}, "sink_tokens": 0,
             "capture_dir": None}
    checked = check_extra(extra)
    assert "capture_dir" not in checked and checked["load"] is False
    assert {k: v for k, v in extra.items() if v is not None} == checked
    with pytest.raises(KvtoolError, match="must be a JSON object"):
        check_extra(["store_path"])


def test_open_backend_refuses_other_url_schemes(tmp_path):
    with pytest.raises(KvtoolError, match="gs:// is not supported"):
        open_backend("gs://bucket/prefix")
    assert open_backend(str(tmp_path)).location == str(tmp_path)
