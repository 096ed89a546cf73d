"""CPU tensors on the CUDA code path, for measuring the host's side of it without a GPU
(``decode_host.py``, ``attend_host.py``): the Triton modules' host code runs as on CUDA, their
kernels do not.

- attention launches stop at their key (:class:`KeyedLaunch`): what a repeat launch works out
  before it calls the compiled kernel;
- the encode, decode and norm kernels zero their float outputs (:class:`Stub`): the model and
  the encodes' checks read them.

Both can also keep what each launch passed (``record``): ``triton_compile.py`` compiles those
launches for a GPU.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

#: a recorded launch: (the kernel — JIT function or autotuner —, its positional arguments,
#: its keyword arguments: constexprs and compile options)
Launch = tuple[Any, tuple[Any, ...], dict[str, Any]]


class KeyedLaunch:
    """Stands in for a :class:`~kvtool.kernels.triton_launch.Launcher`: each launch computes
    the key a real one would look its compiled kernel up by (``Launcher.key``), and looks it
    up; nothing runs. ``keys`` counts the distinct keys seen; ``record`` (a list) gets each
    launch."""

    def __init__(self, launcher: Any, record: list[Launch] | None = None):
        self.launcher, self.record = launcher, record
        self.keys: dict[Hashable, int] = {}

    def __call__(self, grid: Sequence[int], args: Sequence[Any], constants: dict[str, Any],
                 tuned: Hashable = (), fixed: Hashable = None) -> None:
        key = self.launcher.key(0, args, constants, tuned, fixed)
        self.keys[key] = self.keys.get(key, 0) + 1
        if self.record is not None:
            self.record.append((self.launcher.kernel, tuple(args), dict(constants)))


class Stub:
    """A Triton kernel whose launches do nothing but zero its float outputs:
    ``kernel[grid](*args)`` as the host code calls it (``record``: as :class:`KeyedLaunch`)."""

    def __init__(self, kernel: Any, outputs: tuple[str, ...],
                 record: list[Launch] | None = None):
        self.names, self.outputs = list(kernel.arg_names), outputs  # JIT or autotuner
        self.kernel, self.record = kernel, record

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            if self.record is not None:
                self.record.append((self.kernel, args, kwargs))
            for name, arg in zip(self.names, args, strict=False):
                if name in self.outputs:
                    arg.zero_()

        return launch


def stub_kernels(record: list[Launch] | None = None) -> None:
    """Attention launches become :class:`KeyedLaunch`es (an H100's 132 SMs for the split
    heuristic); the turbo (encode, decode, scores), ``turbomix`` and uint8-norm kernels become
    :class:`Stub`s; ``record`` gets every launch of them all."""
    from kvtool.kernels import triton_attention as ta
    from kvtool.kernels import triton_attention_parts as tap
    from kvtool.kernels import triton_cuda as tc
    from kvtool.kernels import triton_turbomix as tt
    from kvtool.kernels import triton_turbomix_norms as tn

    for module in (ta, tap):
        if not isinstance(module._LAUNCH, KeyedLaunch):
            module._LAUNCH = KeyedLaunch(module._LAUNCH, record)
    ta._sm_count = lambda device: 132
    for module, name, outputs in (
            (tc, "_encode_kernel", ("norms_ptr",)), (tc, "_decode_kernel", ("out_ptr",)),
            (tc, "_rotate_kernel", ("out_ptr",)), (tc, "_scores_kernel", ("out_ptr",)),
            (tt, "_stats_kernel", ("mean_ptr", "energy_ptr")),
            (tt, "_encode_kernel", ("norms_ptr", "err_ptr")),
            (tt, "_decode_kernel", ("out_ptr",)), (tn, "_norm_codes_kernel", ("range_ptr",)),
            (tn, "_norm_values_kernel", ("out_ptr",))):
        kernel = getattr(module, name)
        if not isinstance(kernel, Stub):
            setattr(module, name, Stub(kernel, outputs, record))
