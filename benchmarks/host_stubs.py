"""CPU tensors on the CUDA code path, for measuring the host's side of it without a GPU
(``decode_host.py``, ``attend_host.py``): the Triton modules' host code runs as on CUDA, their
kernels do not.

Launches stop at their key (:class:`KeyedLaunch`): what a repeat launch works out before it
calls the compiled kernel; the encode, decode, selection, norm and scores kernels also fill
their outputs (zeros, and "ok" flags: the model and the encodes' checks read them). Each can
also keep what it was passed (``record``): ``triton_compile.py`` compiles those launches for a
GPU.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from torch.utils._python_dispatch import _disable_current_modes

#: a recorded launch: (the kernel — JIT function or autotuner —, its positional arguments,
#: its keyword arguments: constexprs and compile options)
Launch = tuple[Any, tuple[Any, ...], dict[str, Any]]


class KeyedLaunch:
    """Stands in for a :class:`~kvtool.kernels.triton_launch.Launcher`: each launch computes
    the key a real one would look its compiled kernel up by (``Launcher.key``), and looks it
    up; nothing runs. ``keys`` counts the distinct keys seen; ``record`` (a list) gets each
    launch."""

    def __init__(self, launcher: Any, record: list[Launch] | None = None,
                 outputs: dict[str, Any] | None = None):
        self.launcher, self.record = launcher, record
        self.outputs = {launcher.names.index(name): value
                        for name, value in (outputs or {}).items()}
        self.keys: dict[Hashable, int] = {}

    def __call__(self, grid: Any, args: Sequence[Any], constants: dict[str, Any],
                 tuned: Hashable = (), fixed: Hashable = None) -> None:
        key = self.launcher.key(0, args, constants, tuned, fixed)
        self.keys[key] = self.keys.get(key, 0) + 1
        if self.record is not None:
            self.record.append((self.launcher.kernel, tuple(args), dict(constants)))
        if not self.outputs:
            return
        with _disable_current_modes():  # a GPU launch dispatches no torch op: count none
            for at, value in self.outputs.items():  # in order: an output may alias another
                if callable(value):
                    value(args[at], constants)
                else:
                    args[at].fill_(value)


def _first_outliers(mask: Any, constants: dict[str, Any]) -> None:
    """A stubbed outlier selection's mask: the first ``N_HI`` channels (a valid mask)."""
    import torch

    bits = torch.zeros(mask.shape[-1] * 8, dtype=torch.int32)
    bits[:constants["N_HI"]] = 1
    mask.copy_((bits.view(-1, 8) << torch.arange(8)).sum(1).to(torch.uint8).expand_as(mask))


def _other_channels(lo: Any, constants: dict[str, Any]) -> None:
    lo.copy_(lo.new_tensor(range(constants["N_HI"], constants["D"])).expand_as(lo))


def _outlier_channels(hi: Any, constants: dict[str, Any]) -> None:
    hi.copy_(hi.new_tensor(range(constants["N_HI"])).expand_as(hi))


def stub_kernels(record: list[Launch] | None = None) -> None:
    """Attention launches and the launches through :func:`kvtool.kernels.triton_support.launch`
    (the turbo, ``turbomix`` and uint8-norm kernels) become :class:`KeyedLaunch`es (an H100's
    132 SMs for the split heuristic); ``record`` gets every launch of them all."""
    from kvtool.kernels import triton_attention as ta
    from kvtool.kernels import triton_attention_parts as tap
    from kvtool.kernels import triton_cuda as tc
    from kvtool.kernels import triton_support as support
    from kvtool.kernels import triton_turbomix as tt
    from kvtool.kernels import triton_turbomix_norms as tn
    from kvtool.kernels import triton_turbomix_select as ts
    from kvtool.kernels.triton_launch import Launcher

    for module in (ta, tap):
        if not isinstance(module._LAUNCH, KeyedLaunch):
            module._LAUNCH = KeyedLaunch(module._LAUNCH, record)
    ta._sm_count = lambda device: 132
    zero = dict.fromkeys
    for module, name, outputs in (
            (tc, "_encode_kernel", zero(["norms_ptr"], 0)),
            (tc, "_decode_kernel", zero(["out_ptr"], 0)),
            (tc, "_rotate_kernel", zero(["out_ptr"], 0)),
            (tc, "_scores_kernel", zero(["out_ptr"], 0)),
            (tt, "_stats_kernel", zero(["mean_ptr", "energy_ptr"], 0)),
            (tt, "_encode_kernel", zero(["norms_ptr", "err_ptr"], 0)),
            (tt, "_decode_kernel", zero(["out_ptr"], 0)),
            (ts, "_outliers_kernel", {"mask_ptr": _first_outliers, "lo_ptr": _other_channels,
                                      "hi_ptr": _outlier_channels}),
            (ts, "_rotation_kernel", zero(["rot_ptr"], 0)),
            (ts, "_choose_kernel", {**zero(["out_ptr", "out2_ptr", "n16_ptr", "n16b_ptr",
                                            "n8_ptr", "n8b_ptr", "range_ptr", "range2_ptr",
                                            "rot_ptr"], 0), "ok_ptr": 1}),
            (tn, "_norm_codes_kernel", zero(["range_ptr"], 0)),
            (tn, "_norm_values_kernel", zero(["out_ptr"], 0))):
        kernel = getattr(module, name)
        if not isinstance(support._LAUNCHERS.get(kernel), KeyedLaunch):
            support._LAUNCHERS[kernel] = KeyedLaunch(Launcher(kernel), record, outputs)
