"""Shared fixtures and helpers for the test suite."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import tempfile

import numpy as np
import pytest

# presets fitted on this machine (kvtool calibrate --preset) would change what --preset means
# for the bundled models: tests (and the processes they start) read an empty folder instead
os.environ["KVTOOL_PRESET_FITS_DIR"] = tempfile.mkdtemp(prefix="kvtool-preset-fits-")

# -- pytest-xdist: scripts/test.sh runs the suite on two workers (--dist loadgroup) -------------
# A module that builds a module-scoped fixture (a server, a model, a benchmark run: found in its
# source) goes to one worker as a whole, so that the fixture is built once. Every other test is a
# work unit itself. A test of ALONE_MODULES runs alone (the other worker waits): each drives a
# real server under load for minutes against targets that CPU contention breaks (its saves were
# dropped, so the restarted server had no hits, with another heavy test beside it).
ALONE_MODULES = {"test_soak.py"}
# handed out first, in this order: the modules with the longest work (a minute or more on 2
# cores: servers, fresh processes, the Triton interpreter), so that none of them starts last
# while the other worker has nothing left to do; ALONE_MODULES go last (when they start, the
# other worker waits only for a short test to end). Not test_vllm_connector.py: it stays after
# every other module that starts vLLM in its own process (test_cross_engine.py,
# test_identity.py), as in a serial run: after its tests, a new in-process vLLM engine fails
# ("tensor model parallel group is not initialized")
FIRST = ("test_triton_turbomix.py", "test_triton_attention.py", "test_gpu_benchmark.py",
         "test_serve_restart.py", "test_serve.py", "test_quality_benchmark.py",
         "test_patch_vllm.py", "test_readme_commands.py", "test_store_s3.py", "test_gemma.py",
         "test_triton_compile.py", "test_cross_engine.py", "test_vllm_sliding.py")
_MODULE_FIXTURE = re.compile(r"""scope\s*=\s*["'](?:module|class|package)["']""")


def _worker(config) -> bool:
    """Whether this process is an xdist worker (not a pytest it started: PYTEST_XDIST_WORKER is
    inherited)."""
    return hasattr(config, "workerinput")


def pytest_configure(config):
    if _worker(config):
        try:  # two workers share two cores: one torch thread each (tests that need more
            import torch  # set them themselves)
        except ImportError:
            pass
        else:
            torch.set_num_threads(1)


_turns: dict[str, object] = {}


def _turn_locks(config):
    """The gate and run lock files of this xdist run (None: not under xdist, or not POSIX)."""
    if not _worker(config) or importlib.util.find_spec("fcntl") is None:
        return None
    if not _turns:
        run = config.workerinput["testrunuid"]
        folder = os.path.join(tempfile.gettempdir(), f"kvtool-xdist-{run}")
        os.makedirs(folder, exist_ok=True)
        _turns.update(folder=folder, alone=False, gate=open(os.path.join(folder, "gate"), "a"),
                      run=open(os.path.join(folder, "run"), "a"))
    return _turns


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under xdist, each test (its setup, call and teardown, module fixtures included) runs in
    its turn: beside the other worker's test, or alone for ALONE_MODULES, from the first test of
    such a module to its last. Two ``flock``s in a folder of this run: a test takes the gate,
    then the run lock (exclusive when alone, else shared), then lets the gate go, so that a
    test waiting to run alone holds the gate and no new test starts before it."""
    turns = _turn_locks(item.config)
    if turns is None:
        return (yield)
    import fcntl

    alone = item.path.name in ALONE_MODULES
    if not turns["alone"]:
        fcntl.flock(turns["gate"], fcntl.LOCK_EX)
        try:
            fcntl.flock(turns["run"], fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turns["gate"], fcntl.LOCK_UN)
        turns["alone"] = alone
    try:
        return (yield)
    finally:  # an alone module's next test keeps the turn
        if not (alone and nextitem is not None and nextitem.path == item.path):
            fcntl.flock(turns["run"], fcntl.LOCK_UN)
            turns["alone"] = False


def pytest_unconfigure(config):
    if _turns:
        _turns["gate"].close()
        _turns["run"].close()
        shutil.rmtree(_turns["folder"], ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """Under xdist, the modules of FIRST first and ALONE_MODULES last (xdist hands work out in
    collection order: ``--no-loadscope-reorder``); each module's tests stay together, in their
    order."""
    if _worker(config):
        rank = {name: i for i, name in enumerate(FIRST)} | dict.fromkeys(ALONE_MODULES, 1 << 20)
        items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))


@pytest.hookimpl(optionalhook=True)  # a hook of xdist's: unknown without it
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` with a module-scoped fixture's module as a group. (xdist's own
    loadgroup reads ``xdist_group`` marks from a suffix it writes into each test's nodeid,
    which pytest 9.2 no longer lets it write: there, every test would be its own group.) A plain
    ``-n N`` (xdist's ``load``) gets the same: split over two workers, a module's server fixture
    would start twice and its tests would count each other's requests on neither."""
    if config.getvalue("dist") not in ("load", "loadgroup"):
        return None
    from xdist.scheduler import LoadGroupScheduling

    grouped: dict[str, bool] = {}

    def module_is_a_unit(module: str) -> bool:
        if module not in grouped:
            path = config.rootpath / module
            grouped[module] = path.name in ALONE_MODULES or (
                path.suffix == ".py" and path.is_file()
                and _MODULE_FIXTURE.search(path.read_text()) is not None)
        return grouped[module]

    class ModuleGroups(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)  # an xdist_group mark's group, where read
            if scope != nodeid:
                return scope
            module = nodeid.split("::", 1)[0]
            return module if module_is_a_unit(module) else nodeid

    return ModuleGroups(config, log)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def relative_mse(x, x_hat) -> float:
    """‖x − x̂‖² / ‖x‖² over the whole array (float64)."""
    x = np.asarray(x, dtype=np.float64)
    x_hat = np.asarray(x_hat, dtype=np.float64)
    return float(((x - x_hat) ** 2).sum() / (x**2).sum())


def assert_codes_agree(mine: dict, ref: dict, *, codes: float = 2e-3,
                       fp16_norms: float = 0.01) -> None:
    """Two encodings' arrays (name: numpy array) agree: the same names, shapes and dtypes;
    codes and uint8 norms differ only where a value sits within float rounding of a decision
    (at most a ``codes`` share), fp16 norms (summed in another order) by one step (at most a
    ``fp16_norms`` share); everything else is equal."""
    assert mine.keys() == ref.keys()
    for name, a in ref.items():
        a, b = np.asarray(a), np.asarray(mine[name])
        assert a.shape == b.shape and a.dtype == b.dtype, name
        wrong = float(np.mean(a != b))
        if name.startswith("norms") and a.dtype == np.float16:
            assert wrong <= fp16_norms, (name, wrong)
            np.testing.assert_array_less(np.abs(a.astype(np.float32) - b.astype(np.float32)),
                                         1.01 * np.spacing(np.maximum(a, b)).astype(np.float32)
                                         + 1e-30)
            continue
        assert wrong <= (codes if name.startswith(("codes", "norms")) else 0.0), (name, wrong)


@pytest.fixture(scope="session")
def loaded():
    """The default model (SmolLM2-135M-Instruct, float32), loaded once for the whole session."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kvtool.models import load_model

    torch.set_num_threads(1)  # small model: 1 thread is fastest on a shared 2-core box
    return load_model("default", dtype="float32")


@pytest.fixture
def runner():
    """A click test runner for ``kvtool`` commands."""
    from click.testing import CliRunner

    return CliRunner()


@pytest.fixture(autouse=True)
def _fresh_cast_notes(monkeypatch):
    """The dtype-cast note is logged once per process; each test sees its own first time."""
    import kvtool.identity

    monkeypatch.setattr(kvtool.identity, "_NOTED", set())
