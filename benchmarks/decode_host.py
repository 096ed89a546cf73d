"""Host time a ``CompressedCache`` adds to each layer of a decode step, on the CUDA code path,
without a GPU.

A CUDA decode step of a small model is bound by the host: on an H200 a 16-layer random-init
Llama decoded ~100 tokens/s with ``DynamicCache`` (~600 µs of host time per layer) and
``CompressedCache`` ran at 0.72–0.76× that. This measures the Python and torch work of the
cache's side of a layer — ``update`` (window, flushes, the codes view) and the attention hook
up to the kernel launch — against ``DynamicCache``'s ``update`` and sdpa call, on CPU tensors
routed through the Triton path (``hf_attention.DEVICE_ATTENTION_ON_CPU``) with the kernel
launch replaced by its launch key (as ``benchmarks/attend_host.py``; the launch itself, ~10 µs
on an H200, and CUDA's allocator are left out). The model is a random-init Llama with a tiny
hidden size and one KV head of 64 dims, so the tensors are small and what is timed is the
host's work, not the CPU copying or computing what a GPU would; ``DynamicCache`` holds only
``--dynamic-tokens`` (its sdpa computes over them on the CPU, unlike on a GPU).

Columns: µs per layer and step spent in the cache's ``update`` and in attention (the hook's
checks and kernel call; ``DynamicCache``: the sdpa function), the best of ``--rounds`` rounds
of ``--steps`` steps with the caches interleaved, their sum against ``DynamicCache``'s, and
aten ops per layer (a ``TorchDispatchMode`` count: an ordinary step, and the most of 64 steps:
the one that flushes a block, whose every layer encodes it). "prefill" is the host's µs per
layer in the cache's ``update`` during a ``--context``-token prefill (every cache, DynamicCache
too, prefills the whole context: the compressed ones encode it there), best of ``--rounds``,
with the aten ops a layer of that prefill adds to DynamicCache's. "host reads" counts, in the
prefill, in those 64 steps and in a next turn (a forward of 40 new tokens, which attends
through the store decoded), the device values the host read (``.item()``, ``bool()``,
``nonzero``, ``.tolist()``, ``.cpu()``, ...): on CUDA each waits for the device to catch up,
so the host stops running ahead of it. The tables built on the host from numpy and the
queued checks' flags (pinned host memory on CUDA, :mod:`kvtool.kernels.device_checks`) are
host data there too, and not counted.

    python benchmarks/decode_host.py                    # turbo3 and the presets, 16 layers
    python benchmarks/decode_host.py --policy balanced --rounds 9
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from contextlib import nullcontext
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)

from host_stubs import stub_kernels  # noqa: E402  (benchmarks/ is the script's directory)

POLICIES = ("turbo3", "quality", "balanced", "small")
TURN = 40  # tokens of the next turn (a forward of them attends through decoded K/V)
#: aten ops that read a tensor's values on the host (on CUDA: wait for the device; ``item``
#: is what ``int()``/``.item()`` dispatch under ``torch.inference_mode``)
READ_OPS = frozenset({"_local_scalar_dense", "item", "is_nonzero", "nonzero", "equal",
                      "masked_select", "unique", "_unique2", "unique_dim",
                      "unique_consecutive"})
#: Tensor methods that read values on the host without an aten op on a CPU tensor
READ_METHODS = ("tolist", "numpy", "cpu")
#: (file, function) whose tensors are host memory on CUDA too: tables built from numpy, and
#: the queued checks' pinned flags
HOST_FRAMES = frozenset({("triton_cuda.py", "_rotation"), ("triton_turbomix_tables.py",
                                                           "_rotations"),
                         ("triton_turbomix_tables.py", "_tables"),
                         ("device_checks.py", "poll")})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 3)[3])
    p.add_argument("--policy", default=",".join(POLICIES), help="comma list (default: all)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--context", type=int, default=1024, help="tokens prefilled (default 1024)")
    p.add_argument("--dynamic-tokens", type=int, default=8,
                   help="tokens DynamicCache holds (default 8: its CPU sdpa stays cheap)")
    p.add_argument("--steps", type=int, default=64, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=5, help="best of this many (default 5)")
    p.add_argument("--json", help="write the rows here")
    return p.parse_args(argv)


class _Timer:
    """Wraps functions to add their wall time (seconds) to ``spent[name]``."""

    def __init__(self) -> None:
        self.spent: Counter[str] = Counter()

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[name] += time.perf_counter() - start

        setattr(owner, attr, timed)


def _cuda_path_on_cpu(record: list[Any] | None = None) -> None:
    """CPU tensors take the CUDA code path: attention and encodes through the Triton modules'
    host code, their kernels stubbed (:func:`host_stubs.stub_kernels`, which gets ``record``),
    encode checks queued as on CUDA."""
    import torch

    from kvtool.codecs.turbo import TurboCodec
    from kvtool.codecs.turbomix import TurboMixCodec
    from kvtool.engines import hf_attention
    from kvtool.kernels import device_checks
    from kvtool.kernels import triton_attention as ta
    from kvtool.kernels import triton_attention_parts as tap
    from kvtool.kernels import triton_cuda as tc
    from kvtool.kernels import triton_turbomix as tt

    stub_kernels(record)
    for module, name in ((ta, "attend_store"), (tap, "attend")):  # what the hook calls
        attend = getattr(module, name)
        setattr(module, name, lambda *a, _attend=attend, **k: _attend(*a, **k).zero_())
    tc._rows_launch = lambda rows, sub=False: {"grid": (1,), "meta": {}}
    TurboCodec._kernels = lambda self, like, dim: tc if tc.supported(dim, self.bits) else None
    TurboMixCodec._fused = lambda self, like: None
    TurboMixCodec._cuda = lambda self, like: tt
    device_checks.deferrable = lambda ok: isinstance(ok, torch.Tensor)
    hf_attention.DEVICE_ATTENTION_ON_CPU = True
    hf_attention._DEVICE_KERNELS[:] = [ta]


class HostReads:
    """Counts the host's reads of tensor values (:data:`READ_OPS`, :data:`READ_METHODS`)
    made by kvtool outside :data:`HOST_FRAMES`, while entered; ``where`` keeps their call
    sites (``file:line``)."""

    def __init__(self) -> None:
        import kvtool

        self.where: Counter[str] = Counter()
        self._package = os.path.dirname(os.path.abspath(kvtool.__file__)) + os.sep

    def _seen(self) -> None:
        import traceback

        package = self._package
        frames = [f for f in traceback.extract_stack()[:-2] if f.filename.startswith(package)]
        if not frames or any((os.path.basename(f.filename), f.name) in HOST_FRAMES
                             for f in frames):
            return
        self.where[f"{frames[-1].filename[len(package):]}:{frames[-1].lineno}"] += 1

    def __enter__(self) -> HostReads:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        reads = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, a=(), kw=None):
                if func.overloadpacket.__name__ in READ_OPS:
                    reads._seen()
                return func(*a, **(kw or {}))

        self._saved = {m: getattr(torch.Tensor, m) for m in READ_METHODS}
        for method, fn in self._saved.items():
            def read(t: Any, *a: Any, _fn: Any = fn, **k: Any) -> Any:
                reads._seen()
                return _fn(t, *a, **k)

            setattr(torch.Tensor, method, read)
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch

        self._mode.__exit__(*exc)
        for method, fn in self._saved.items():
            setattr(torch.Tensor, method, fn)

    @property
    def count(self) -> int:
        return sum(self.where.values())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from kvtool.engines import hf_attention
    from kvtool.engines.hf_runtime import CompressedCache
    from kvtool.policy import CodecPolicy

    _cuda_path_on_cpu()
    torch.set_num_threads(1)
    config = LlamaConfig(num_hidden_layers=args.layers, hidden_size=64, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=64, intermediate_size=128,
                         vocab_size=256, max_position_embeddings=args.context + 4096)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 256, (1, args.context))
    timer = _Timer()
    timer.wrap(CompressedCache, "update", "update")
    timer.wrap(DynamicCache, "update", "update")
    hf_attention.install()  # what a CompressedCache does; untagged calls go to _delegate
    for attr in ("_plan", "_attend", "_delegate"):  # kvtool's checks and call; sdpa
        timer.wrap(hf_attention, attr, "attention")
    makers = {"DynamicCache": (lambda: DynamicCache(config=config), args.dynamic_tokens)}
    for label in args.policy.split(","):
        policy = CodecPolicy.from_label(label, recent_tokens=128)
        makers[label] = (lambda p=policy: CompressedCache(p, config=config), args.context)
    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, a=(), kw=None):
            Count.n += 1
            return func(*a, **(kw or {}))

    caches, tokens, reads = {}, {}, {}
    prefill: dict[str, float] = {}  # host µs per layer in the caches' updates of a prefill
    prefill_ops: dict[str, float] = {}  # aten ops per layer of a prefill
    with torch.inference_mode():
        for round_ in range(args.rounds + 1):  # every cache prefills the whole context
            for name, (make, _) in makers.items():
                timer.spent.clear()
                Count.n = 0
                with Count() if round_ == args.rounds else nullcontext():
                    model(ids, past_key_values=make(), logits_to_keep=1)
                if round_ == args.rounds:
                    prefill_ops[name] = Count.n / args.layers
                else:
                    prefill[name] = min(prefill.get(name, float("inf")),
                                        timer.spent["update"] / args.layers * 1e6)
        for name, (make, n) in makers.items():
            caches[name] = make()
            with HostReads() as prefill_reads:
                logits = model(ids[:, :n], past_key_values=caches[name],
                               logits_to_keep=1).logits
            tokens[name] = logits[:, -1:].argmax(-1)
            reads[name] = {"prefill": prefill_reads}
        best: dict[str, dict[str, float]] = {}
        for _ in range(args.rounds):
            for name, cache in caches.items():
                timer.spent.clear()
                for _ in range(args.steps):
                    model(tokens[name], past_key_values=cache, logits_to_keep=1)
                per = {k: v / args.steps / args.layers * 1e6 for k, v in timer.spent.items()}
                per["total"] = per.get("update", 0.0) + per.get("attention", 0.0)
                if name not in best or per["total"] < best[name]["total"]:
                    best[name] = per

        ops: dict[str, tuple[float, float]] = {}  # (an ordinary step, the flushing one)
        for name, cache in caches.items():
            counts = []
            with HostReads() as step_reads:
                for _ in range(64):  # a block of 64 tokens: one step flushes it
                    Count.n = 0
                    with Count():
                        model(tokens[name], past_key_values=cache, logits_to_keep=1)
                    counts.append(Count.n / args.layers)
            ops[name] = (min(counts), max(counts))
            reads[name]["steps"] = step_reads
            with HostReads() as turn_reads:  # a next turn: many new tokens over the store,
                model(ids[:, :TURN], past_key_values=cache, logits_to_keep=1)  # decoded
            reads[name]["turn"] = turn_reads
    base = best["DynamicCache"]
    print(f"host µs per layer and decode step, best of {args.rounds} rounds of {args.steps} "
          f"steps ({args.layers} layers; compressed caches hold {args.context} tokens, "
          f"DynamicCache {args.dynamic_tokens}; kernel launches replaced by their launch keys)")
    print(f"{'cache':>13} | {'update':>7} | {'attention':>9} | {'sum':>6} | {'vs Dynamic':>10} | "
          f"{'aten ops':>8} | {'flush step':>10} | {'prefill':>7} | {'prefill ops':>11} | "
          "host reads")
    dyn, dyn_prefill = ops["DynamicCache"][0], prefill_ops["DynamicCache"]
    for name, per in best.items():
        plain, flush = ops[name]
        own = name == "DynamicCache"
        print(f"{name:>13} | {per.get('update', 0):>7.1f} | {per.get('attention', 0):>9.1f} | "
              f"{per['total']:>6.1f} | {per['total'] - base['total']:>+10.1f} | "
              f"{plain if own else plain - dyn:>8.1f} | "
              f"{flush if own else flush - dyn:>10.1f} | {prefill[name]:>7.1f} | "
              f"{prefill_ops[name] if own else prefill_ops[name] - dyn_prefill:>11.1f} | "
              f"{reads[name]['prefill'].count} / {reads[name]['steps'].count} / "
              f"{reads[name]['turn'].count}", flush=True)
    print(f"(aten ops per layer: DynamicCache's own, then what each cache adds in an ordinary "
          f"step and in the step that flushes a block; prefill: host µs per layer in the "
          f"cache's update of a {args.context}-token prefill (its encodes) and the aten ops a "
          f"layer of it adds; host reads: in the prefill / in the 64 steps / in a "
          f"{TURN}-token next turn, all layers)")
    for name, both in reads.items():
        for phase, seen in both.items():
            if seen.count:
                print(f"  {name} {phase} reads at: " + ", ".join(
                    f"{where} ×{n}" for where, n in seen.where.most_common()))
    if args.json:
        rows = [{"cache": name, "update_us": per.get("update", 0.0),
                 "attention_us": per.get("attention", 0.0), "total_us": per["total"],
                 "over_dynamic_us": per["total"] - base["total"], "aten_ops": ops[name][0],
                 "flush_aten_ops": ops[name][1], "prefill_update_us": prefill[name],
                 "prefill_aten_ops": prefill_ops[name],
                 "prefill_host_reads": reads[name]["prefill"].count,
                 "step_host_reads": reads[name]["steps"].count,
                 "turn_host_reads": reads[name]["turn"].count} for name, per in best.items()]
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
