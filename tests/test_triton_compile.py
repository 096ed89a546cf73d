"""Every Triton launch of the CUDA paths users run compiles for a GPU, on a machine without one
(``benchmarks/triton_compile.py``): the interpreter, which the other Triton tests use here,
accepts kernels the compiler rejects."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
if not PTXAS.exists():  # a Triton without its NVIDIA backend's assembler
    pytest.skip("this Triton ships no ptxas", allow_module_level=True)

#: the kernels the default preset (``quality``), ``balanced`` and the turbo codec launch
KERNELS = {"triton_cuda._encode_kernel", "triton_cuda._decode_kernel",
           "triton_cuda._rotate_kernel", "triton_cuda._scores_kernel",
           "triton_turbomix._stats_kernel", "triton_turbomix._encode_kernel",
           "triton_turbomix._decode_kernel", "triton_turbomix_norms._norm_values_kernel",
           "triton_turbomix_select._outliers_kernel", "triton_turbomix_select._choose_kernel",
           "triton_attention._attend_kernel",
           "triton_attention_parts._parts_kernel"}


def test_every_launch_of_the_default_and_balanced_paths_compiles_for_hopper(tmp_path):
    out = tmp_path / "compiled.json"
    run = subprocess.run([sys.executable, str(BENCH / "triton_compile.py"), "--quick",
                          "--json", str(out)], capture_output=True, text=True, timeout=1200,
                         env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["kernel"] for r in rows} == KERNELS
    assert all(r["error"] is None and r["configs"] >= 1 for r in rows), rows
    # the trellis encode at D=128 (balanced), once ~13 s a config to compile, and the
    # attention kernels are among them
    assert any(r["kernel"] == "triton_turbomix._encode_kernel"
               and r["constexprs"].get("QUANT") == "2" for r in rows)


WIDE = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from triton_compile import SHARED, _configs, compile_launch, record_menu_launches
from kvtool.kernels import triton_turbomix as tt
rows = []
for kernel, args, kw in record_menu_launches([256]):
    if kernel is tt._encode_kernel and kw["QUANT"] != tt.TRELLIS and kw["NP"] == 256:
        key = (kw["N"], kw["QUANT"], kw["CODES"], kw["RP"])
        if key not in [r[0] for r in rows]:
            built = compile_launch(kernel, args, kw, _configs(kernel, args, kw)[0], 90)
            rows.append((key, kw["KR"], built.metadata.shared <= SHARED[90]))
print(json.dumps(rows))
"""


def test_wide_scalar_and_pair_encodes_fit_hoppers_shared_memory():
    """The scalar and pair encodes of the 192- and 256-wide parts the presets' menus run at
    D=256 (Gemma's fitted ``quality`` keys, ``small``'s probe and its ``vq=2`` alternative)
    compile for sm_90 within its shared memory: a whole 3-piece rotation per dot took 432 KB
    and no config fit."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", WIDE, str(BENCH)], capture_output=True,
                         text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    assert {(n, quant, pieces) for (n, quant, _, pieces), _, _ in rows} >= {
        (192, 0, 3), (192, 1, 3), (256, 0, 1)}  # scalar and pair at 192, scalar at 256
    assert any(not codes for (_, _, codes, _), _, _ in rows)  # small's probe
    assert all(fits for _, _, fits in rows), rows
    assert all(kr == (32 if pieces == 3 else 256) for (_, _, _, pieces), kr, _ in rows), rows


def test_the_sass_profile_of_a_presets_kernels_compiles_every_pass():
    """``benchmarks/triton_sass.py --preset`` builds each launch's signature by hand: a kernel
    argument it does not know fails the compile (it broke twice, unnoticed). ``small``'s encode
    shows both of ``select=scalar``'s passes (the probe writes no codes)."""
    run = subprocess.run([sys.executable, str(BENCH / "triton_sass.py"), "--preset", "small",
                          "--dims", "64"], capture_output=True, text=True, timeout=600,
                         env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [[c.strip() for c in line.split("|")] for line in run.stdout.splitlines()
            if line.lstrip().startswith(("encode", "decode"))]
    assert {(r[0], r[2]) for r in rows} == {
        ("encode", "key probe"), ("encode", "key"), ("encode", "value probe"),
        ("encode", "value"), ("decode", "key"), ("decode", "value")}
    probes = [r for r in rows if r[2].endswith("probe")]
    assert probes and all(int(r[-1]) <= 2 for r in probes)  # the norms and errors alone
    assert all(int(r[6]) > 0 for r in rows)  # registers of a compiled kernel


@triton.jit
def _fits(x_ptr, N: triton.language.constexpr):
    i = triton.language.arange(0, N)
    triton.language.store(x_ptr + i, triton.language.load(x_ptr + i) * 2)


@triton.jit
def _does_not_compile(x_ptr, N: triton.language.constexpr):
    i = triton.language.arange(0, N)  # N = 48 is no power of two: Triton refuses the range
    triton.language.store(x_ptr + i, triton.language.load(x_ptr + i) * 2)


def test_a_launch_that_does_not_compile_fails_the_run(monkeypatch, capsys):
    sys.path.insert(0, str(BENCH))
    try:
        import triton_compile
    finally:
        sys.path.remove(str(BENCH))
    x = torch.zeros(64)
    monkeypatch.setattr(triton_compile, "record_launches",
                        lambda *a: [(_fits, (x,), {"N": 64})])
    assert triton_compile.main(["--quick"]) == 0
    monkeypatch.setattr(triton_compile, "record_launches",
                        lambda *a: [(_fits, (x,), {"N": 64}),
                                    (_does_not_compile, (x,), {"N": 48})])
    assert triton_compile.main(["--quick"]) == 1
    printed = capsys.readouterr().out
    assert "1 of 2 launches compiled" in printed and "_does_not_compile" in printed
