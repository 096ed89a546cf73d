"""``kvtool patch-vllm`` and the vLLM cache-write hook.

Patching is tested on a synthetic vLLM tree (small files with the real anchor shapes, so these
tests run without vLLM) and on a copy of the installed vLLM's backends; the installed vLLM itself
is never modified. One end-to-end test runs a real greedy generation in a subprocess on a patched
(symlinked) copy of the whole vLLM package with multiprocessing on.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from kvtool.cli.main import cli
from kvtool.engines.vllm import hook, patch_source
from kvtool.engines.vllm import patch as patcher
from kvtool.errors import PatchError

BACKENDS = "v1/attention/backends"

FAKE_FLASH = '''\
"""A fake attention backend with the shape of vLLM's flash_attn.py."""


class _Ops:
    calls: list = []

    def reshape_and_cache_flash(self, key, value, key_cache, value_cache, slot_mapping, *rest):
        self.calls.append(len(slot_mapping))


ops = _Ops()


class FlashAttentionImpl:
    kv_cache_dtype = "auto"

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None):
        return output

    def do_kv_cache_update(
        self,
        layer,
        key,
        value,
        kv_cache,
        slot_mapping,
    ) -> None:
        key_cache, value_cache = kv_cache
        # NOTE: key and value are padded; slot_mapping is not.
        ops.reshape_and_cache_flash(
            key,
            value,
            key_cache,
            value_cache,
            slot_mapping,
            self.kv_cache_dtype,
        )
'''
FAKE_CPU = '''\
"""A fake CPU backend: keyword arguments, like vLLM's cpu_attn.py."""


class ops:
    @staticmethod
    def cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, isa,
                                   k_scale=1.0, v_scale=1.0):
        return None


class CPUAttentionBackendImpl:
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if layer is None:
            return
        key_cache, value_cache = kv_cache
        ops.cpu_attn_reshape_and_cache(
            key, value, key_cache, value_cache, slot_mapping=slot_mapping, isa="vec",
            k_scale=1.0)
'''
FAKE_FLASHINFER = '''\
"""A fake backend whose write sits inside an if, through an attribute chain."""
import types

torch = types.SimpleNamespace(ops=types.SimpleNamespace(_C_cache_ops=types.SimpleNamespace(
    reshape_and_cache_flash=lambda *args: None)))


class FlashInferImpl:
    kv_sharing_target_layer_name = None

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        if self.kv_sharing_target_layer_name is None:
            torch.ops._C_cache_ops.reshape_and_cache_flash(
                key, value, kv_cache[0], kv_cache[1], slot_mapping, "auto"
            )
'''


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under root (the patch state dir included)."""
    return {str(p.relative_to(root)): _sha(p) for p in sorted(root.rglob("*")) if p.is_file()}


def _installed_vllm() -> Path | None:
    # find_spec instead of pytest.importorskip("vllm"): importing vLLM takes ~10 s
    spec = importlib.util.find_spec("vllm")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations and (Path(locations[0]) / BACKENDS).is_dir() else None


def make_fake_vllm(base: Path) -> Path:
    root = base / "vllm"
    (root / BACKENDS).mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "_version.py").write_text("__version__ = version = '0.0.0+fake'\n")
    for name, text in [("flash_attn.py", FAKE_FLASH), ("cpu_attn.py", FAKE_CPU),
                       ("flashinfer.py", FAKE_FLASHINFER), ("mamba_attn.py", "X = 1\n")]:
        (root / BACKENDS / name).write_text(text)
    cache = root / BACKENDS / "__pycache__"
    cache.mkdir()
    (cache / "flash_attn.cpython-311.pyc").write_bytes(b"stale")
    return root


def copy_real_backends(base: Path) -> Path:
    src = _installed_vllm()
    if src is None:
        pytest.skip("vLLM is not installed")
    root = base / "vllm"
    (root / BACKENDS).parent.mkdir(parents=True)
    shutil.copy2(src / "__init__.py", root / "__init__.py")
    if (src / "_version.py").exists():
        shutil.copy2(src / "_version.py", root / "_version.py")
    shutil.copytree(src / BACKENDS, root / BACKENDS,
                    ignore=shutil.ignore_patterns("__pycache__"))
    return root


@pytest.fixture(params=["fake", "real"])
def tree(request, tmp_path) -> Path:
    return make_fake_vllm(tmp_path) if request.param == "fake" else copy_real_backends(tmp_path)


# -- patch / status / dry-run / revert ------------------------------------------------------
def test_patch_status_dry_run_revert_round_trip(tree):
    before = _snapshot(tree)
    assert patcher.status(tree)["state"] == "not patched"

    dry = patcher.patch(tree, dry_run=True)
    assert dry["action"] == "would patch" and "+++ b/vllm/" in dry["diff"]
    assert "kvtool-hook" in dry["diff"] and _snapshot(tree) == before

    report = patcher.patch(tree)
    assert report["action"] == "patched" and report["files"]
    assert all(f["sites"] >= 1 for f in report["files"])
    st = patcher.status(tree)
    assert st["state"] == "patched" and {f["state"] for f in st["files"]} == {"patched"}
    manifest = json.loads((tree / ".kvtool_patch" / "manifest.json").read_text())
    assert manifest["kvtool_version"] and manifest["vllm_path"] == str(tree.resolve())
    for rel, entry in manifest["files"].items():
        data = (tree / rel).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256_after"]
        assert patcher.strip_blocks(data).decode() != data.decode()
        assert hashlib.sha256(patcher.strip_blocks(data)).hexdigest() == entry["sha256_before"]
        compile(data, rel, "exec")
        assert not list((tree / rel).parent.glob(f"__pycache__/{Path(rel).stem}.*.pyc"))

    rdry = patcher.revert(tree, dry_run=True)
    assert rdry["action"] == "would revert" and "-        # >>> kvtool-hook" in rdry["diff"]
    assert patcher.status(tree)["state"] == "patched"

    assert patcher.revert(tree)["action"] == "reverted"
    after = _snapshot(tree)
    stale = {k for k in before if "__pycache__" in k}
    assert {k: v for k, v in before.items() if k not in stale} == after  # byte-identical
    assert not (tree / ".kvtool_patch").exists()
    assert patcher.status(tree)["state"] == "not patched"
    assert patcher.revert(tree)["action"] == "not patched"


def test_repatch_is_a_no_op(tree):
    patcher.patch(tree)
    snap = _snapshot(tree)
    mtimes = {p: p.stat().st_mtime_ns for p in tree.rglob("*.py")}
    assert patcher.patch(tree)["action"] == "already patched"
    assert _snapshot(tree) == snap
    assert {p: p.stat().st_mtime_ns for p in tree.rglob("*.py")} == mtimes


def test_missing_anchor_refuses_and_modifies_nothing(tree):
    target = tree / BACKENDS / ("flash_attn.py" if (tree / BACKENDS / "flash_attn.py").exists()
                                else "cpu_attn.py")
    text = target.read_text()
    for name in patch_source.ANCHOR_CALLS:
        text = text.replace(f"{name}(", f"renamed_{name}(")
    target.write_text(text)
    before = _snapshot(tree)
    with pytest.raises(PatchError, match="no KV-cache write.*nothing was modified"):
        patcher.patch(tree)
    assert _snapshot(tree) == before and not (tree / ".kvtool_patch").exists()


def test_file_changed_after_patch_refuses_without_force(tree):
    patcher.patch(tree)
    rel = sorted(json.loads((tree / ".kvtool_patch/manifest.json").read_text())["files"])[0]
    edited = (tree / rel).read_text() + "# an upgrade or a hand edit\n"
    (tree / rel).write_text(edited)
    before = _snapshot(tree)
    st = patcher.status(tree)
    assert st["state"] == "modified"
    assert {f["file"]: f["state"] for f in st["files"]}[rel] == "modified"
    with pytest.raises(PatchError, match="changed since kvtool patched it"):
        patcher.revert(tree)
    with pytest.raises(PatchError, match="changed since kvtool patched it"):
        patcher.patch(tree)
    assert _snapshot(tree) == before

    report = patcher.revert(tree, force=True)  # keeps the edit, drops kvtool's blocks only
    assert {f["file"]: f["result"] for f in report["files"]}[rel] == "blocks removed"
    assert "kvtool-hook" not in (tree / rel).read_text()
    assert (tree / rel).read_text().endswith("# an upgrade or a hand edit\n")
    assert not (tree / ".kvtool_patch").exists()


def test_vllm_upgrade_then_force_and_kvtool_upgrade(tmp_path, monkeypatch):
    root = make_fake_vllm(tmp_path)
    patcher.patch(root)
    upgraded = FAKE_FLASH.replace("FlashAttentionImpl", "FlashAttentionImplV2")
    (root / BACKENDS / "flash_attn.py").write_text(upgraded)  # pip replaced the file
    with pytest.raises(PatchError, match="flash_attn.py changed since kvtool patched it"):
        patcher.patch(root)
    dry = patcher.patch(root, dry_run=True, force=True)
    assert dry["action"] == "would re-patch" and "FlashAttentionImplV2" not in dry["diff"]
    assert patcher.patch(root, force=True)["action"] == "patched"
    assert patcher.status(root)["state"] == "patched"
    assert "kvtool-hook" in (root / BACKENDS / "flash_attn.py").read_text()

    monkeypatch.setattr(patcher, "__version__", "9.9.9")  # a newer kvtool re-patches itself
    report = patcher.patch(root)
    assert report["action"] == "patched" and report["repatched_from"] != "9.9.9"
    assert "# >>> kvtool-hook 9.9.9" in (root / BACKENDS / "cpu_attn.py").read_text()
    assert patcher.patch(root)["action"] == "already patched"
    patcher.revert(root)
    assert (root / BACKENDS / "flash_attn.py").read_text() == upgraded
    assert (root / BACKENDS / "cpu_attn.py").read_text() == FAKE_CPU


def test_compile_failure_rolls_back_every_file(tree, monkeypatch):
    before = _snapshot(tree)
    compiled = []

    def failing_compile(path: Path) -> None:
        compiled.append(path)
        if len(compiled) == 2:
            raise SyntaxError("simulated compile failure")

    monkeypatch.setattr(patcher, "_compile_file", failing_compile)
    with pytest.raises(PatchError, match="rolled back"):
        patcher.patch(tree)
    assert len(compiled) == 2
    after = _snapshot(tree)
    assert set(after) <= set(before)
    assert {k: v for k, v in before.items() if k in after} == after
    assert not (tree / ".kvtool_patch").exists()


def test_a_patch_that_does_not_compile_is_refused_up_front(tmp_path, monkeypatch):
    root = make_fake_vllm(tmp_path)
    before = _snapshot(root)
    monkeypatch.setattr(patch_source, "SITE_BLOCK",
                        patch_source.SITE_BLOCK.replace("if ", "if if "))
    with pytest.raises(PatchError, match="does not compile"):
        patcher.patch(root)
    assert _snapshot(root) == before


def test_stray_blocks_without_manifest(tmp_path):
    root = make_fake_vllm(tmp_path)
    patcher.patch(root)
    shutil.rmtree(root / ".kvtool_patch")
    assert patcher.status(root)["state"] == "modified"
    with pytest.raises(PatchError, match="no manifest"):
        patcher.revert(root)
    with pytest.raises(PatchError, match="not recorded in a manifest"):
        patcher.patch(root)
    patcher.revert(root, force=True)
    assert patcher.status(root)["state"] == "not patched"
    assert (root / BACKENDS / "flash_attn.py").read_text() == FAKE_FLASH


def _entry_damage(edit):
    def damage(manifest: dict) -> bytes:
        edit(manifest["files"], f"{BACKENDS}/flash_attn.py")
        return json.dumps(manifest).encode()
    return damage


@pytest.mark.parametrize("damage", [
    b"garbage", b"{}", b"[1, 2]",
    # a file entry no patch writes: a KeyError or TypeError once (exit 1, no way back); a
    # path outside vLLM's tree would have been written by the revert
    _entry_damage(lambda files, rel: files[rel].pop("sha256_after")),
    _entry_damage(lambda files, rel: files.__setitem__(rel, "x")),
    _entry_damage(lambda files, rel: files[rel].__setitem__("backup", "../../../etc/passwd")),
    _entry_damage(lambda files, rel: files.__setitem__("../../outside.py", files.pop(rel))),
])
def test_a_damaged_manifest_is_reverted_with_force(tmp_path, damage):
    """A manifest that cannot be read is no record to restore from: --revert says so, and
    --revert --force removes kvtool's blocks and the record (it once refused either way)."""
    root = make_fake_vllm(tmp_path)
    patcher.patch(root)
    path = root / ".kvtool_patch" / "manifest.json"
    path.write_bytes(damage(json.loads(path.read_text())) if callable(damage) else damage)
    with pytest.raises(PatchError, match="--revert --force"):
        patcher.revert(root)
    with pytest.raises(PatchError, match="not a kvtool manifest"):
        patcher.patch(root)
    assert patcher.revert(root, force=True, dry_run=True)["action"] == "would revert"
    assert patcher.revert(root, force=True)["action"] == "reverted"
    assert patcher.status(root)["state"] == "not patched"
    assert not (root / ".kvtool_patch").exists()
    assert (root / BACKENDS / "flash_attn.py").read_text() == FAKE_FLASH
    patcher.patch(root)  # and it patches again
    assert patcher.status(root)["state"] == "patched"


@pytest.mark.parametrize("loss", ["missing", "altered"])
def test_a_lost_backup_reverts_by_removing_the_blocks_when_that_verifies(tmp_path, loss):
    root = make_fake_vllm(tmp_path)
    patcher.patch(root)
    backup = root / ".kvtool_patch" / "backup" / BACKENDS / "flash_attn.py.orig"
    backup.unlink() if loss == "missing" else backup.write_text("something else\n")
    assert patcher.status(root)["state"] == "patched"
    report = patcher.revert(root)
    assert report["action"] == "reverted"
    assert {f["result"] for f in report["files"]} == {"restored"}
    assert (root / BACKENDS / "flash_attn.py").read_text() == FAKE_FLASH
    assert patcher.status(root)["state"] == "not patched"


def test_a_kvtool_upgrade_repatches_a_file_without_a_last_newline(tmp_path, monkeypatch):
    """The helper appended at a file's end gives its last line a newline that removing the
    blocks keeps: a re-patch planned from the stripped text met the backup's bytes and gave
    up ("changed while patching"), after removing the old patch."""
    root = make_fake_vllm(tmp_path)
    (root / BACKENDS / "cpu_attn.py").write_text(FAKE_CPU.rstrip("\n"))
    patcher.patch(root)
    monkeypatch.setattr(patcher, "__version__", "9.9.9")
    assert patcher.patch(root)["action"] == "patched"
    assert "# >>> kvtool-hook 9.9.9" in (root / BACKENDS / "cpu_attn.py").read_text()
    patcher.revert(root)
    assert (root / BACKENDS / "cpu_attn.py").read_text() == FAKE_CPU.rstrip("\n")


def test_locate_errors(tmp_path):
    with pytest.raises(PatchError, match="not a vLLM package"):
        patcher.locate_vllm(tmp_path)
    root = make_fake_vllm(tmp_path)
    assert patcher.locate_vllm(tmp_path) == root.resolve()  # the parent works too
    for name in ("flash_attn.py", "cpu_attn.py", "flashinfer.py"):
        (root / BACKENDS / name).unlink()
    with pytest.raises(PatchError, match="none of the known attention backends"):
        patcher.patch(root)


# -- the CLI -------------------------------------------------------------------------------
def test_cli(tmp_path):
    root = make_fake_vllm(tmp_path)
    run = CliRunner().invoke
    res = run(cli, ["patch-vllm", "--status", "--json", "--vllm-path", str(root)])
    assert res.exit_code == 0 and json.loads(res.output)["state"] == "not patched"
    res = run(cli, ["patch-vllm", "--dry-run", "--vllm-path", str(root)])
    assert res.exit_code == 0 and res.output.startswith("--- a/vllm/")
    assert not (root / ".kvtool_patch").exists()
    res = run(cli, ["patch-vllm", "--vllm-path", str(root)])
    assert res.exit_code == 0 and "patched vLLM 0.0.0+fake" in res.output
    res = run(cli, ["patch-vllm", "--vllm-path", str(root)])
    assert "already patched" in res.output
    res = run(cli, ["patch-vllm", "--status", "--vllm-path", str(root)])
    assert ": patched" in res.output.splitlines()[0]
    (root / BACKENDS / "cpu_attn.py").write_text("# replaced by an upgrade\n")
    res = run(cli, ["patch-vllm", "--revert", "--vllm-path", str(root)])
    assert res.exit_code == 7 and res.output.count("\n") == 1 and "--force" in res.output
    edited = root / BACKENDS / "flashinfer.py"  # edited after patching, blocks kept
    edited.write_text(edited.read_text() + "# a local edit\n")
    res = run(cli, ["patch-vllm", "--revert", "--force", "--vllm-path", str(root)])
    assert res.exit_code == 0 and "reverted" in res.output
    assert ("1 files restored (sha256 verified), kvtool's blocks removed from 1 (not verified"
            in res.output), res.output
    assert edited.read_text() == FAKE_FLASHINFER + "# a local edit\n"
    assert (root / BACKENDS / "flash_attn.py").read_text() == FAKE_FLASH
    res = run(cli, ["patch-vllm", "--status", "--revert", "--vllm-path", str(root)])
    assert res.exit_code == 2


# -- the inserted code and the hook --------------------------------------------------------
def _import_backend(root: Path, name: str):
    spec = importlib.util.spec_from_file_location(f"fake_{name}", root / BACKENDS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Layer:
    layer_name = "model.layers.0.self_attn.attn"


def test_inserted_block_calls_the_hook_only_when_enabled(tmp_path, monkeypatch, capsys):
    root = make_fake_vllm(tmp_path)
    patcher.patch(root)
    calls = []
    monkeypatch.setattr(hook, "on_cache_write",
                        lambda *args, **kw: calls.append((args, kw)))
    monkeypatch.delenv(hook.ENV_MODE, raising=False)
    flash, cpu, fi = (_import_backend(root, n) for n in ("flash_attn", "cpu_attn", "flashinfer"))
    kv = ("K", "V")
    flash.FlashAttentionImpl().do_kv_cache_update(_Layer(), "k", "v", kv, [0, 1])
    assert calls == [] and flash.ops.calls == [2]

    monkeypatch.setenv(hook.ENV_MODE, "stats")
    flash.FlashAttentionImpl().do_kv_cache_update(_Layer(), "k", "v", kv, [0, 1])
    cpu.CPUAttentionBackendImpl().do_kv_cache_update(_Layer(), "k", "v", kv, [0])
    fi.FlashInferImpl().do_kv_cache_update(None, "k", "v", kv, [0])
    assert [c[0] for c in calls] == [
        ("model.layers.0.self_attn.attn", "k", "v", kv, [0, 1]),
        ("model.layers.0.self_attn.attn", "k", "v", kv, [0]),
        (None, "k", "v", kv, [0])]
    assert [c[1] for c in calls] == [{"backend": "flash_attn"}, {"backend": "cpu_attn"},
                                     {"backend": "flashinfer"}]

    def broken(*args, **kw):
        raise RuntimeError("boom")

    monkeypatch.setattr(hook, "on_cache_write", broken)
    for _ in range(3):  # never raises into vLLM, reports once
        flash.FlashAttentionImpl().do_kv_cache_update(_Layer(), "k", "v", kv, [0])
    err = capsys.readouterr().err
    assert err.count("kvtool: vLLM cache-write hook off after RuntimeError: boom") == 1
    assert flash.ops.calls == [2, 2, 1, 1, 1]


def test_stats_recorder_counts_tokens_bytes_and_ratio(tmp_path, monkeypatch):
    import ml_dtypes

    from kvtool.codecs import get_codec

    monkeypatch.setattr(hook, "_recorder", None)
    monkeypatch.setattr(hook, "_disabled_pid", None)
    monkeypatch.setenv(hook.ENV_MODE, "stats")
    monkeypatch.setenv(hook.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(hook.ENV_BATCH, "8")
    rng = np.random.default_rng(0)
    steps = [5, 1, 1, 1, 1, 1, 1, 1]
    for n in steps:  # one prefill, then decode steps; keys padded by 3 rows, one -1 slot
        k = rng.standard_normal((n + 3, 3, 64)).astype(ml_dtypes.bfloat16)
        slots = np.concatenate([np.arange(n), [-1]])
        for layer in ("l0", "l1"):
            hook.on_cache_write(layer, k, k, None, slots, backend="fake")
    path = hook.flush()
    assert path == hook.stats_path(directory=str(tmp_path)) and os.path.exists(path)
    [doc] = hook.read_stats(str(tmp_path))
    assert doc["format"] == hook.STATS_FORMAT and doc["pid"] == os.getpid()
    assert doc["codec"]["id"] == "turbo3" and doc["backend"] == "fake"
    expected_ratio = 16 / get_codec("turbo3").bits_per_element(64)
    for name in ("l0", "l1"):
        s = doc["layers"][name]
        assert s["tokens"] == sum(steps) and s["writes"] == len(steps)
        assert s["original_bytes"] == sum(steps) * 3 * 64 * 2 * 2
        assert s["ratio"] == pytest.approx(expected_ratio, rel=1e-3)
        assert s["encode_seconds"] > 0
    assert doc["totals"]["tokens"] == 2 * sum(steps)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    hook._recorder.close()


def test_stats_are_flushed_periodically_and_a_fork_starts_afresh(tmp_path, monkeypatch):
    monkeypatch.setattr(hook, "_recorder", None)
    monkeypatch.setattr(hook, "_disabled_pid", None)
    monkeypatch.setenv(hook.ENV_MODE, "stats")
    monkeypatch.setenv(hook.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(hook.ENV_FLUSH, "0")  # flush at every write
    x = np.ones((2, 1, 8), np.float32)
    hook.on_cache_write("l", x, x, None, np.arange(2))
    [doc] = hook.read_stats(str(tmp_path))
    assert doc["layers"]["l"]["tokens"] == 2 and doc["totals"]["hook_seconds"] > 0
    first = hook._recorder
    monkeypatch.setattr(first, "pid", -1)  # as seen from a forked child
    assert hook.get_recorder() is not first and hook.flush() is not None
    first.pid = os.getpid()
    first.close()
    hook._recorder.close()


def test_unknown_mode_and_bad_codec_disable_quietly(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(hook, "_recorder", None)
    monkeypatch.setattr(hook, "_disabled_pid", None)
    monkeypatch.setenv(hook.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(hook.ENV_MODE, "stats")
    monkeypatch.setenv(hook.ENV_CODEC, "nope")
    x = np.zeros((1, 1, 8), np.float32)
    for _ in range(2):
        hook.on_cache_write("l", x, x, None, np.zeros(1, np.int64))
    assert capsys.readouterr().err.count("hook disabled") == 1
    assert os.listdir(tmp_path) == []


def test_hook_module_imports_cheaply():
    code = ("import sys, kvtool.engines.vllm.hook; "
            "print(sorted(m for m in ('torch', 'numpy', 'vllm', 'kvtool.codecs') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- end to end on a real vLLM ---------------------------------------------------------------
GENERATE = textwrap.dedent('''
    import json, os, sys

    def main():
        import vllm
        from vllm import LLM, SamplingParams
        llm = LLM(model=sys.argv[1], dtype="bfloat16", max_model_len=256,
                  kv_cache_memory_bytes=32 << 20, enforce_eager=True,
                  enable_prefix_caching=False)
        out = llm.generate(["The capital of France is"],
                           SamplingParams(temperature=0.0, max_tokens=int(sys.argv[2])))[0]
        print("RESULT " + json.dumps({"vllm_file": vllm.__file__, "pid": os.getpid(),
                                      "prompt": len(out.prompt_token_ids),
                                      "generated": len(out.outputs[0].token_ids)}))

    if __name__ == "__main__":
        main()
''')


@pytest.mark.slow
def test_end_to_end_stats_in_vllm_worker_process(tmp_path):
    src = _installed_vllm()
    if src is None:
        pytest.skip("vLLM is not installed")
    from kvtool.codecs import get_codec
    from kvtool.errors import ModelNotFoundError
    from kvtool.models import resolve_model

    try:
        _, model_dir = resolve_model("default")
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    site = tmp_path / "site"  # a copy of vLLM made of symlinks; patching replaces only links
    shutil.copytree(src, site / "vllm", copy_function=os.symlink,
                    ignore=shutil.ignore_patterns(".kvtool_patch"))
    originals = {rel: _sha(src / rel) for rel in patcher.TARGETS if (src / rel).exists()}
    res = CliRunner().invoke(cli, ["patch-vllm", "--vllm-path", str(site), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["action"] == "patched"
    assert "kvtool-hook" in (site / "vllm" / BACKENDS / "cpu_attn.py").read_text()
    assert {rel: _sha(src / rel) for rel in originals} == originals  # the real one untouched

    (tmp_path / "gen.py").write_text(GENERATE)
    stats = tmp_path / "stats"
    kvtool_root = str(Path(patcher.__file__).resolve().parents[3])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), kvtool_root]),
           hook.ENV_MODE: "stats", hook.ENV_DIR: str(stats), hook.ENV_CODEC: "turbo3",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(tmp_path / "gen.py"), str(model_dir), "12"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])
    assert result["vllm_file"].startswith(str(site))
    docs = hook.read_stats(str(stats))
    assert len(docs) == 1, docs
    doc = docs[0]
    assert doc["pid"] != result["pid"]  # written by vLLM's worker process, not the caller
    assert doc["vllm_version"] and doc["backend"] == "cpu_attn" and doc["codec"]["id"] == "turbo3"
    assert len(doc["layers"]) == 30  # SmolLM2-135M
    # every token that enters the cache: the prompt, then each generated token but the last
    written = result["prompt"] + result["generated"] - 1
    ratio = 16 / get_codec("turbo3").bits_per_element(64)
    for name, s in doc["layers"].items():
        assert name.startswith("model.layers.")
        assert s["tokens"] == written and s["head_dim"] == 64 and s["kv_heads"] == 3
        assert s["ratio"] == pytest.approx(ratio, rel=1e-3)

    res = CliRunner().invoke(cli, ["patch-vllm", "--revert", "--vllm-path", str(site)])
    assert res.exit_code == 0, res.output
    assert {rel: _sha(site / "vllm" / rel) for rel in originals} == originals
