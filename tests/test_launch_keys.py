"""Launches keyed by their plan (:class:`kvtool.kernels.triton_launch.Launcher`'s ``fixed``
keys): a repeat launch reuses the kernel compiled for its key, so a plan's key must stand for
exactly one specialisation — the one Triton's own dispatch would pick (the full key). Checked
on the host code of both attention modules over calls that differ in every way Triton
specialises on (no kernel runs: the launch is recorded)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kvtool.codecs import get_codec  # noqa: E402
from kvtool.kernels import triton_attention as ta  # noqa: E402
from kvtool.kernels import triton_attention_parts as tap  # noqa: E402
from kvtool.kernels.triton_launch import Launcher, launch_key  # noqa: E402


class Recorder:
    """Stands in for a module's launcher: each launch's key against its full key."""

    def __init__(self, launcher: Launcher):
        self.launcher, self.full_of, self.planned = launcher, {}, 0

    def __call__(self, grid, args, constants, tuned=(), fixed=None):
        assert fixed is not None  # both modules key their launches by plan
        key = self.launcher.key("dev", args, constants, tuned, fixed)
        full = ("dev", tuned, tuple(constants.values()), launch_key(args))
        self.planned += key != full
        self.last = key
        assert self.full_of.setdefault(key, full) == full, "one plan key, two specialisations"


def _planned(recorder: Recorder) -> set:
    """The plan keys a recorder saw (not full keys)."""
    return {key for key, full in recorder.full_of.items() if key != full}


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    buf = torch.empty(t.numel() * t.element_size() + 1, dtype=torch.uint8)
    return buf[1:].view(t.dtype).view(t.shape) if t.element_size() == 1 else \
        buf[:-1].view(t.dtype).view(t.shape)


def _codes(heads: int, n: int, dim: int, bits: int, gen: torch.Generator):
    return (torch.randint(0, 256, (heads, n, dim * bits // 8), dtype=torch.uint8, generator=gen),
            torch.rand(heads, n, generator=gen).half())


def test_a_plan_key_holds_while_every_tensor_is_aligned():
    launcher = Launcher(ta._attend_kernel)
    buf = torch.zeros(64, dtype=torch.uint8)
    args, constants = (buf, 3, buf[16:], 0.5), {"D": 32}
    planned = launcher.key("dev", args, constants, (), fixed=("plan", 1))
    assert planned == launcher.key("dev", (buf[32:], 3, buf, 0.1), constants, (), ("plan", 1))
    # another plan that specialises alike shares the kernel; one that does not, does not
    assert planned == launcher.key("dev", (buf, 35, buf, 0.5), constants, (), ("plan", 2))
    assert planned != launcher.key("dev", (buf, 32, buf, 0.5), constants, (), ("plan", 4))
    assert planned != launcher.key("dev", args, {"D": 64}, (), ("plan", 5))
    odd = launcher.key("dev", (buf, 3, buf[1:], 0.5), constants, (), ("plan", 1))
    assert odd == ("dev", (), (32,), launch_key((buf, 3, buf[1:], 0.5)))  # the full key
    assert launcher.key("dev", (buf, "a"), constants, (), ("plan", 3)) is None


def test_turbo_attention_plan_keys_stand_for_one_specialisation(monkeypatch):
    recorder = Recorder(ta._LAUNCH)
    monkeypatch.setattr(ta, "_LAUNCH", recorder)
    gen = torch.Generator().manual_seed(0)
    for batch, hkv, group, nq, n, dim, bits, cands, x, extra in (
            (1, 2, 2, 1, 64, 32, (3, 3), 1, 5, ()), (2, 2, 2, 1, 64, 32, (3, 3), 1, 5, ()),
            (1, 2, 4, 2, 64, 64, (4, 2), 1, 9, ("bias", "causal")),
            (1, 2, 2, 1, 64, 32, (3, 3), 1, 0, ()), (1, 2, 2, 1, 64, 32, (3, 3), 1, 5, ("odd",)),
            (1, 2, 2, 1, 64, 32, (3, 3), 1, 5, ("strided",)),
            (1, 2, 2, 1, 64, 32, (4, 3), 2, 5, ("means",)),
            (1, 2, 2, 1, 128, 32, (4, 3), 2, 5, ("means", "split"))):
        heads = batch * hkv
        for _ in range(2):  # fresh tensors, other addresses: the same keys
            (kc, kn), (vc, vn) = (_codes(heads, n, dim, b, gen) for b in bits)
            if "odd" in extra:
                kc = _misaligned(kc).copy_(kc)
            q = torch.randn(batch, group * hkv, nq, dim + 1, generator=gen)  # rows of 33:
            q = q[..., :dim] if "strided" in extra else q[..., 1:].contiguous()  # not by 16
            ke = ve = torch.randn(batch, hkv, x, dim, generator=gen) if x else None
            blocked = dict(block=16, k_rotations=torch.randint(0, cands, (heads, n // 16),
                                                               dtype=torch.uint8),
                           v_rotations=torch.zeros(heads, n // 16, dtype=torch.uint8),
                           key_means=torch.randn(heads, n // 16, dim).half()) \
                if "means" in extra else {}
            ta.attend(q, kc, kn, vc, vn, ke, ve, dim=dim, k_bits=bits[0], v_bits=bits[1],
                      k_seeds=tuple(range(1, cands + 1)), v_seeds=tuple(range(5, cands + 5)),
                      scale=0.1, causal="causal" in extra, split_k=3 if "split" in extra else None,
                      bias=torch.zeros(1, nq, x) if "bias" in extra else None, **blocked)
    # all but the calls with misaligned codes take plan keys, fresh tensors the same ones; 7
    # plans, 6 specialisations (batch 1 and 2 differ only in the grid)
    assert recorder.planned == 14 and len(_planned(recorder)) == 6


def test_parts_attention_plan_keys_stand_for_one_specialisation(monkeypatch):
    recorder = Recorder(tap._LAUNCH)
    monkeypatch.setattr(tap, "_LAUNCH", recorder)
    rng = np.random.default_rng(0)
    for kspec, vspec, n, dim, x, strided in (
            ("turbomix:outliers=8,center=true,candidates=2", "turbo3", 32, 32, 3, False),
            ("turbomix:outliers=8,center=true,candidates=2", "turbo3", 32, 32, 3, True),
            ("turbomix:vq=2,candidates=2", "turbomix:bits=2,outliers=4", 48, 32, 0, False)):
        roles = []
        for spec in (kspec, vspec):
            codec = get_codec(spec)
            enc = codec.encode(rng.standard_normal((1, 2, n // 16, 16, dim), np.float32))
            arrays = {k: torch.from_numpy(np.ascontiguousarray(a)) for k, a in enc.arrays.items()}
            roles.append(tap.role_tensors(codec, arrays, 2, n, 16, dim))
        for _ in range(2):
            q = torch.randn(1, 4, 1, dim + 1)[..., :dim] if strided else torch.randn(1, 4, 1, dim)
            ke = ve = torch.randn(1, 2, x, dim) if x else None
            tap.attend(q, *roles, ke, ve, scale=0.1)
    assert recorder.planned == 6 and len(_planned(recorder)) == 3
    flat = torch.randn(1, 2, 32)  # exact tokens without their [B, Hkv, X, D] axes
    with pytest.raises(ValueError, match="exact keys/values"):
        tap.attend(torch.randn(1, 4, 1, 32), *roles, flat, flat, scale=0.1)


def test_a_store_grown_by_a_block_launches_the_same_kernel(monkeypatch):
    """Each store change makes a new plan (the store's size is in its key); where the new
    size specialises alike (a multiple of 16), the launch key is the same, so the first call
    over the grown store is no first launch through Triton's dispatch."""
    recorder = Recorder(ta._LAUNCH)
    monkeypatch.setattr(ta, "_LAUNCH", recorder)
    gen = torch.Generator().manual_seed(2)
    q, keys = torch.randn(1, 4, 1, 32, generator=gen), []
    for n in (64, 128, 192, 200):
        (kc, kn), (vc, vn) = (_codes(2, n, 32, 3, gen) for _ in range(2))
        store = ta.prepare(kc, kn, vc, vn, dim=32, k_bits=3, v_bits=3, k_seeds=(1,),
                           v_seeds=(2,))
        ta.attend_store(q, store, scale=0.1, split_k=1)
        keys.append(recorder.last)
    assert keys[0] == keys[1] == keys[2] != keys[3], keys  # 200 tokens: not by 16


@pytest.mark.parametrize("module", ["turbo", "parts"])
def test_a_growing_window_keeps_its_plan(monkeypatch, module):
    """A decode step adds an exact token per step: the plan holds while the tokens' parts of
    128 and their specialisation (a multiple of 16 or not) do, so a step is not a first
    launch."""
    from kvtool.kernels.triton_launch import Plans

    mod = ta if module == "turbo" else tap
    recorder, plans = Recorder(mod._LAUNCH), Plans()
    monkeypatch.setattr(mod, "_LAUNCH", recorder)
    monkeypatch.setattr(mod, "_PLANS", plans)
    gen = torch.Generator().manual_seed(1)
    if module == "turbo":
        (kc, kn), (vc, vn) = (_codes(2, 64, 32, 3, gen) for _ in range(2))
        store = ta.prepare(kc, kn, vc, vn, dim=32, k_bits=3, v_bits=3, k_seeds=(1,),
                           v_seeds=(2,))
    else:
        codec = get_codec("turbomix:outliers=8,candidates=2")
        enc = codec.encode(np.random.default_rng(0).standard_normal((1, 2, 4, 16, 32),
                                                                    np.float32))
        arrays = {k: torch.from_numpy(np.ascontiguousarray(a)) for k, a in enc.arrays.items()}
        roles = [tap.role_tensors(codec, arrays, 2, 64, 16, 32)] * 2
    window = torch.randn(1, 2, 140, 32, generator=gen)
    q = torch.randn(1, 4, 1, 32, generator=gen)
    for x in range(100, 140):
        ke = window[..., :x, :].contiguous()
        if module == "turbo":
            ta.attend_store(q, store, ke, ke, scale=0.1)
        else:
            tap.attend(q, *roles, ke, ke, scale=0.1)
    # x ≤ 128 and not by 16, x ∈ {112, 128}, x > 128: three plans for 40 steps
    assert len(plans) == 3 and len(_planned(recorder)) == 3 and recorder.planned == 40


def test_direct_launches_use_the_chosen_configs_grid(monkeypatch):
    """The direct path with a fake compiled kernel: a grid that is a function of the
    meta-parameters goes to Triton as given on a key's first launch; repeats work it out
    from the chosen config's values and pass the constexprs after the arguments; an
    autotuner whose search was changed (a test pinning a config) goes through Triton again."""
    from types import SimpleNamespace

    from kvtool.kernels import triton_launch

    runs, firsts = [], []

    class Compiled:
        function = packed_metadata = None

        def run(self, *a):
            runs.append(a)

    class Tuner:  # what Launcher reads of an autotuner
        arg_names = ["x_ptr", "n", "D", "BM"]
        configs = [SimpleNamespace(kwargs={"BM": 32})]
        best_config = configs[0]

        def __getitem__(self, grid):
            firsts.append(grid({"BM": self.best_config.kwargs["BM"]}))
            return lambda *a, **k: Compiled()

    driver = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda d: 7)
    monkeypatch.setattr(triton_launch, "triton", SimpleNamespace(
        runtime=SimpleNamespace(driver=SimpleNamespace(active=driver))))
    monkeypatch.setattr(triton_launch, "_hooks_set", lambda: False)
    tuner = Tuner()
    launcher = Launcher(tuner)
    launcher.direct = True
    x = torch.zeros(16)
    grid = lambda meta: (-(-100 // meta["BM"]),)  # noqa: E731
    for _ in range(2):
        launcher(grid, (x, 100), {"D": 64})
    assert firsts == [(4,)] and launcher.fast == 1
    assert runs[0][:4] == (4, 1, 1, 7) and runs[0][-4:] == (x, 100, 64, 32)
    tuner.configs = [SimpleNamespace(kwargs={"BM": 64})]  # pinned: Triton chooses again
    tuner.best_config = tuner.configs[0]
    launcher(grid, (x, 100), {"D": 64})
    launcher(grid, (x, 100), {"D": 64})
    assert firsts == [(4,), (2,)] and launcher.fast == 2
    assert runs[-1][:3] == (2, 1, 1) and runs[-1][-1] == 64


def test_a_launch_runs_on_its_tensors_device(monkeypatch):
    """A tensor on another GPU than the current one (a model spread over devices) launches
    under that device, so Triton uses its stream; a tensor on the current one, or on the CPU,
    launches as is."""
    import contextlib

    class OnGpu(torch.Tensor):  # what Launcher reads of a CUDA tensor, on a CPU build
        device_index = 1

        @property
        def is_cuda(self):
            return True

        def get_device(self):
            return self.device_index

    active, launched = [], []

    @contextlib.contextmanager
    def device(index):
        active.append(index)
        yield
        active.pop()

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", device)

    class Kernel:
        arg_names = ["x_ptr", "n"]

        def __getitem__(self, grid):
            return lambda *a, **k: launched.append(list(active))

    launcher = Launcher(Kernel())
    launcher.direct = False
    x = torch.zeros(4)
    on_one = torch.Tensor._make_subclass(OnGpu, x)
    launcher((1,), (3, on_one, x), {})
    launcher((1,), (x, on_one), {})  # the first tensor decides: this one is on the CPU
    OnGpu.device_index = 0
    launcher((1,), (on_one,), {})
    assert launched == [[1], [], []] and not active
