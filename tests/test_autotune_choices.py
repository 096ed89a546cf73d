"""Autotune choices on disk: ``KVTOOL_AUTOTUNE_CACHE=0`` keeps a process's choices off disk,
``benchmarks/gpu.py``'s parallel warm-up processes run with it (their timings would otherwise
be what the measured run loads), and ``benchmarks/autotune_table.py`` reads back every config
Triton timed, named by kvtool's autotune keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import autotune_table  # noqa: E402  (benchmarks/autotune_table.py)
import gpu  # noqa: E402
import ncu_turbo  # noqa: E402

TUNED = ("triton_cuda._encode_kernel", "triton_cuda._decode_kernel",
         "triton_attention._attend_kernel", "triton_attention_parts._parts_kernel",
         "triton_turbomix._encode_kernel", "triton_turbomix._decode_kernel")
PROBE = ("import importlib; print(sorted(int(getattr(importlib.import_module("
         "'kvtool.kernels.' + name.split('.')[0]), name.split('.')[1]).cache_results) "
         f"for name in {TUNED!r}))")


@pytest.mark.parametrize("knob, kept", [("", 1), ("0", 0)])
def test_autotuners_keep_their_choices_unless_the_knob_says_not(knob, kept):
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "KVTOOL_AUTOTUNE_CACHE")}
    if knob:
        env["KVTOOL_AUTOTUNE_CACHE"] = knob
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert json.loads(out) == [kept] * len(TUNED)


def test_warm_processes_keep_no_autotune_choice(monkeypatch):
    """They share the GPU and run small sizes under the measured run's autotune keys."""
    envs = []

    class Finished:
        returncode = 0

        def poll(self) -> int:
            return 0

    def popen(argv, env, stdout, stderr):
        envs.append(env)
        return Finished()

    monkeypatch.setattr(gpu.subprocess, "Popen", popen)
    monkeypatch.setattr(gpu.time, "sleep", lambda seconds: None)
    args = gpu.parse_args(["--all", "--warm-workers", "3"])
    result = gpu.warm(args, None)
    assert result["failed"] == [] and len(envs) == len(gpu.warm_tasks(args)) > 10
    assert all(env["KVTOOL_AUTOTUNE_CACHE"] == "0" for env in envs)


def _write(cache: Path, name: str, key: tuple, timings: dict) -> None:
    """An autotune result file as Triton's ``Autotuner.check_disk_cache`` writes it."""
    folder = cache / f"{len(list(cache.iterdir())):064x}"
    folder.mkdir()
    (folder / f"{name}.autotune.json").write_text(json.dumps({
        "key": key, "configs_timings": [(c.__dict__, t) for c, t in timings.items()]}))


def test_autotune_table_lists_every_config_by_its_named_key(tmp_path, capsys):
    from kvtool.kernels import triton_cuda as tc
    from kvtool.kernels import triton_turbomix as tt

    a, b, c = tc._encode_kernel.configs[:3]
    _write(tmp_path, "_encode_kernel",
           (128, 3, 1, 1, "torch.float16", "torch.float16", "torch.float32", "torch.uint8"),
           {a: [0.5, 0.4, 0.6], b: [0.25, 0.2, 0.3], c: [float("inf")] * 3})
    m = tt._encode_kernel.configs[0]
    _write(tmp_path, "_encode_kernel", (128, 128, 4, 0, 1, 64, False, True, "torch.bfloat16"),
           {m: 1.5})
    out = tmp_path / "table.json"
    assert autotune_table.main(["--cache", str(tmp_path), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    entries = json.loads(out.read_text(), parse_constant=lambda bad: pytest.fail(bad))
    assert len(entries) == 2 and "2 kernel keys" in printed
    turbo, mix = sorted(entries, key=lambda e: e["key"])
    assert turbo["key"] == "D=128 BITS=3 PIECES=1 size_class=1 dtypes=float16,float32,uint8"
    assert [r["ms"] for r in turbo["configs"]] == [0.25, 0.5, None]  # fastest first
    assert [r["ratio"] for r in turbo["configs"]] == [1.0, 2.0, None]
    assert turbo["configs"][0]["config"] == autotune_table.describe(b.__dict__)
    assert f"BLOCK_M={b.kwargs['BLOCK_M']} w{b.num_warps} s{b.num_stages}" \
        in printed and "failed" in printed
    assert mix["key"] == ("N=128 NP=128 BITS=4 QUANT=0 RP=1 tok_class=64 HAS_CHOICE=False "
                          "CODES=True dtypes=bfloat16")
    assert mix["configs"] == [{"config": autotune_table.describe(m.__dict__), "ms": 1.5,
                               "ratio": 1.0}]


def test_attention_key_tells_grids_apart():
    """The attention autotuner's ``size_class`` holds the grid's fill as well as the parts'
    length: a split-K sweep that forces another grid over the same tokens per part must not
    reuse the choice made for the first (on CPU tensors ``_sm_count`` is 4)."""
    from kvtool.kernels import triton_attention

    cpu = __import__("torch").device("cpu")
    classes = {(programs, per_part): triton_attention._size_class(cpu, programs, per_part)
               for programs in (2, 4, 11, 12, 400) for per_part in (256, 1024, 8192)}
    assert len(set(classes.values())) == 9
    assert classes[(2, 256)] == 0 and classes[(400, 8192)] == 8
    assert classes[(4, 256)] == classes[(11, 256)] != classes[(12, 256)] == classes[(400, 256)]


SEARCH = """
import json
from kvtool.kernels import triton_attention as ta, triton_cuda as tc, triton_turbomix as tt
def unspecialised(kernel):
    return sorted(p.name for p in kernel.fn.params if p.do_not_specialize)
def kept(kernel, **named):
    return [(c.kwargs["BLOCK_M"], c.num_warps)
            for c in kernel.early_config_prune(kernel.configs, named)]
print(json.dumps({
    "unspecialised": [unspecialised(k) for k in (tc._encode_kernel, tc._decode_kernel,
                      ta._attend_kernel, tt._encode_kernel, tt._decode_kernel)],
    "encode": [[c.kwargs["BLOCK_M"], c.num_warps, c.num_stages] for c in tc._encode_kernel.configs],
    "decode": [[c.kwargs["BLOCK_M"], c.kwargs["SUB"], c.num_warps, c.num_stages]
               for c in tc._decode_kernel.configs],
    "bulk_128": kept(tc._decode_kernel, D=128, size_class=1),
    "bulk_256_decode": kept(tc._decode_kernel, D=256, size_class=1),
    "bulk_256": kept(tc._encode_kernel, D=256, size_class=1),
    "small": kept(tc._decode_kernel, D=128, size_class=0),
}))
"""


def test_class_arguments_share_compiles_and_small_calls_get_one_config():
    """The autotuners' class arguments are tuned on but not specialised on (a config compiles
    once for every class: the H100's first load recompiled each decode config for the other
    class); the turbo searches hold the H100's winners (the decode's beside blocks in
    sub-tiles); small calls get one config (no search).
    Compiled-path autotuners exist without a GPU when the interpreter is off."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "KVTOOL_AUTOTUNE_CACHE")}
    out = json.loads(subprocess.run([sys.executable, "-c", SEARCH], env=env,
                                    capture_output=True, text=True, check=True).stdout)
    assert out["unspecialised"] == [["size_class"]] * 3 + [["tok_class"]] * 2
    assert out["encode"] == [[64, 4, 1], [128, 4, 1], [128, 8, 1], [256, 8, 1]]
    # decode: the H100's winners in one tile, then R kept over 64-row sub-tiles, the next
    # one's codes loaded ahead
    assert out["decode"] == [[64, 64, 4, 1], [128, 128, 4, 1], [256, 64, 4, 2], [512, 64, 4, 2]]
    assert out["bulk_128"] == [[64, 4], [128, 4], [256, 4], [512, 4]]
    assert out["bulk_256"] == [[64, 4], [128, 8]]  # [BLOCK_M, 256] tiles within registers
    assert out["bulk_256_decode"] == [[64, 4]]  # R in chunks: no pipelined sub-tiles
    assert out["small"] == [[64, 4]]
    pins = ncu_turbo.parse_args([])  # what gpu_session.sh profiles: configs of these searches
    assert list(pins.encode) + [1] in out["encode"]
    assert [pins.decode[0], 64, pins.decode[1], 2] in out["decode"]
