"""Compile every Triton launch kvtool's host code makes for a GPU target, without a GPU.

The Triton interpreter (what the tests run on a machine without CUDA) accepts kernels that the
compiler rejects, and a kernel's shared memory or registers only show when it is compiled for a
real target. This runs kvtool's CUDA host code on CPU tensors (``host_stubs``: the launches are
recorded, not run) — ``CompressedCache`` prefill and decode steps of a random-init Llama per
policy and head dim, and the codecs' encode, decode and scores calls over the input and output
dtypes — then compiles each distinct launch for ``sm_XX`` the way Triton's own dispatch would
(its argument specialisation: dtypes, 16-byte alignment, integers divisible by 16 or equal to
1), with the first config the autotuner keeps for it that fits the target or, with
``--all-configs``, every one. It prints registers, spills and shared memory per launch, and
exits non-zero if any launch does not compile or no kept config fits the target's shared
memory.

    python benchmarks/triton_compile.py                     # sm_90, one config per launch
    python benchmarks/triton_compile.py --arch 80 --all-configs
    python benchmarks/triton_compile.py --quick             # what the tests run (~1 minute)
    python benchmarks/triton_compile.py --menus --dims 256  # every fit's codecs (Gemma's D)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, never interpret

from host_stubs import Launch  # noqa: E402  (benchmarks/ is the script's directory)
from triton_sass import sass_profile  # noqa: E402

#: shared memory a block may use (bytes): sm_80 (A100) and sm_90 (H100/H200)
SHARED = {80: 166912, 90: 232448}
POLICIES = ("turbo2", "turbo3", "turbo4", "quality", "balanced", "small")
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--arch", type=int, default=90, choices=sorted(SHARED), help="sm_XX target")
    p.add_argument("--all-configs", action="store_true",
                   help="compile every config the autotuner keeps (default: the first that fits)")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma list (default: all)")
    p.add_argument("--dims", default="64,128", help="head dims of the cache runs")
    p.add_argument("--quick", action="store_true",
                   help="the default preset and balanced (every kernel) at D=128, bf16 only")
    p.add_argument("--menus", action="store_true",
                   help="instead: the encode and decode calls (bf16) of the codecs of every "
                        "policy on the presets' menus (what a fit picks among) at --dims")
    p.add_argument("--json", help="write the rows here")
    return p.parse_args(argv)


def record_launches(policies: list[str], dims: list[int], quick: bool = False) -> list[Launch]:
    """The launches of ``CompressedCache`` runs (prefill, then decode steps through a flush)
    and of the codecs' device calls, on CPU tensors taking the CUDA code path (``quick``: the
    codecs' calls in bf16 at D=128, turbo3 and ``policies``' presets only)."""
    import torch
    from decode_host import _cuda_path_on_cpu
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvtool.engines.hf_runtime import CompressedCache
    from kvtool.kernels import triton_cuda as tc
    from kvtool.kernels import triton_turbomix as tt
    from kvtool.policy import CodecPolicy
    from kvtool.presets import preset_policy

    launches: list[Launch] = []
    _cuda_path_on_cpu(record=launches)
    torch.manual_seed(0)
    with torch.inference_mode():
        for dim in dims:
            config = LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=dim, intermediate_size=64,
                                 vocab_size=64, max_position_embeddings=1024)
            model = LlamaForCausalLM(config).eval()
            for label in policies:  # a prefill of 3 blocks, then steps until a block flushes
                cache = CompressedCache(CodecPolicy.from_label(label, recent_tokens=16),
                                        config=config)
                ids = torch.randint(0, 64, (1, 208))
                model(ids, past_key_values=cache)
                for t in range(64):
                    model(ids[:, t:t + 1], past_key_values=cache)
        dtypes = (torch.bfloat16,) if quick else (torch.float16, torch.bfloat16, torch.float32)
        presets = [p for p in ("quality", "balanced", "small") if p in policies or not quick]
        for dtype in dtypes:  # the codecs' calls
            for dim in (64, 128, 256) if dtype == torch.float16 else (128,):
                x = torch.randn(4, 64, dim, dtype=dtype)
                for bits in (3,) if quick else (2, 3, 4):
                    codes, norms = tc.turbo_encode(x, bits, 1)
                    tc.turbo_decode(codes, norms, dim, bits, 1, dtype)
                    if dtype == torch.float16 or quick:
                        tc.turbo_scores(x[:, :8].float(), codes, norms, bits, 1)
                for label in presets:
                    policy = preset_policy(label)
                    for codec in (policy.key, policy.value):
                        arrays = tt.encode(codec, x)
                        tt.decode(codec, arrays, tuple(x.shape),
                                  str(dtype).removeprefix("torch."))
    return launches


def record_menu_launches(dims: list[int]) -> list[Launch]:
    """The launches of the ``turbomix`` encode and decode of every preset menu policy's codecs
    (:data:`kvtool.preset_fit.MENUS`) on bf16 ``[4, 64, dim]`` inputs."""
    import torch
    from decode_host import _cuda_path_on_cpu

    from kvtool.kernels import triton_turbomix as tt
    from kvtool.policy import CodecPolicy
    from kvtool.preset_fit import MENUS

    launches: list[Launch] = []
    _cuda_path_on_cpu(record=launches)
    torch.manual_seed(0)
    labels = dict.fromkeys(label for menu in MENUS.values() for label in menu)
    codecs = {json.dumps(c.get_config(), sort_keys=True): c
              for policy in map(CodecPolicy.from_label, labels) for c in (policy.key, policy.value)}
    with torch.inference_mode():
        for dim in dims:
            x = torch.randn(4, 64, dim, dtype=torch.bfloat16)
            for codec in codecs.values():
                tt.decode(codec, tt.encode(codec, x), tuple(x.shape), "bfloat16")
    return launches


def _jit_function(kernel: Any) -> Any:
    """The JIT function of a kernel (under its autotuner, if it has one)."""
    return kernel.fn if hasattr(kernel, "configs") else kernel


def _configs(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The configs the autotuner keeps for these arguments (None: a kernel without one)."""
    if not hasattr(kernel, "configs"):
        return [None]
    named = dict(zip(kernel.arg_names, args, strict=False))
    prune = getattr(kernel, "early_config_prune", None)
    return prune(kernel.configs, named, **kwargs) if prune else list(kernel.configs)


def compile_launch(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any], config: Any,
                   arch: int) -> Any:
    """The kernel Triton's dispatch would compile for this launch on ``sm_{arch}``."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = _jit_function(kernel)
    kwargs = dict(kwargs)
    if config is not None:
        kwargs.update(config.all_kwargs())
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound,
                                                          specialization, options)
    return compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                   options=options.__dict__)


def _identity(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What sets a launch's code apart: the kernel, each argument's type and dtype, integers
    equal to 1 (Triton makes them constants), the constexprs and options. (Alignment and
    divisibility by 16 only change how wide its loads are: not told apart.)"""
    import torch

    def part(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return a.dtype
        if isinstance(a, bool) or a is None:
            return (type(a), a)
        return (type(a), a == 1 if isinstance(a, int) else None)

    return (id(kernel), tuple(part(a) for a in args),
            tuple(sorted((k, repr(v)) for k, v in kwargs.items())))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import triton

    start = time.perf_counter()
    if args.quick:
        args.policies, args.dims = "quality,balanced", "128"
    dims = [int(d) for d in args.dims.split(",")]
    launches = record_menu_launches(dims) if args.menus \
        else record_launches(args.policies.split(","), dims, args.quick)
    distinct: dict[tuple[Any, ...], Launch] = {}
    for kernel, a, kw in launches:
        distinct.setdefault(_identity(kernel, a, kw), (kernel, a, kw))
    print(f"sm_{args.arch}, Triton {triton.__version__}: {len(launches)} launches recorded "
          f"({time.perf_counter() - start:.0f} s), {len(distinct)} distinct; "
          f"{'every kept config' if args.all_configs else 'the first kept config that fits'} "
          "each")
    print(f"{'kernel':>40} | {'configs':>7} | {'regs':>4} | {'spill':>5} | {'smem KB':>7} | "
          f"{'s':>5} | constexprs")
    rows, failed = [], 0
    for kernel, a, kw in distinct.values():
        fn = _jit_function(kernel)
        name = f"{fn.module.rsplit('.', 1)[-1]}.{fn.fn.__name__}"
        shown = {k: v for k, v in kw.items() if k not in _OPTIONS and not k.endswith("_ptr")}
        configs = _configs(kernel, a, kw)
        t0, built, error = time.perf_counter(), [], None
        for config in configs:  # the first that fits, or (``--all-configs``) every one
            try:
                built.append(compile_launch(kernel, a, kw, config, args.arch))
            except Exception as e:  # noqa: BLE001 - Triton raises bare RuntimeErrors too
                error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
                break
            if not args.all_configs and built[-1].metadata.shared <= SHARED[args.arch]:
                break
        seconds = time.perf_counter() - t0
        fits = [k for k in built if k.metadata.shared <= SHARED[args.arch]]
        usage = [sass_profile(k)[:2] for k in built]  # (registers, spill bytes)
        row = {"kernel": name, "constexprs": {k: repr(v) for k, v in shown.items()},
               "configs": len(built), "seconds": round(seconds, 2), "error": error,
               "shared_bytes": max((k.metadata.shared for k in built), default=0),
               "regs": max((r for r, _ in usage), default=0),
               "spill_bytes": max((b for _, b in usage), default=0)}
        if error is None and not fits:
            row["error"] = f"no config fits sm_{args.arch}'s {SHARED[args.arch]} bytes of smem"
        rows.append(row)
        failed += row["error"] is not None
        what = ", ".join(f"{k}={v}" for k, v in shown.items())
        status = f"{row['error']}: {what}" if row["error"] else what
        print(f"{name:>40} | {len(built):>7} | {row['regs']:>4} | {row['spill_bytes']:>5} | "
              f"{row['shared_bytes'] / 1024:>7.0f} | {seconds:>5.1f} | {status}", flush=True)
    print(f"{len(rows) - failed} of {len(rows)} launches compiled "
          f"({time.perf_counter() - start:.0f} s in all)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arch": args.arch, "triton": triton.__version__, "rows": rows}, f,
                      indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
