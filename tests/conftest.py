"""Shared fixtures: tiny random targets (built once per session) and the real SmolLM2 target."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MATPLOTLIBRC", os.path.join(os.path.dirname(__file__), "matplotlibrc"))  # fewer pixels per plot
if os.environ.get("DFLASHKIT_ISA"):  # `make test ISA=v3`: the suite at a level, as the CLI would run it (torch too)
    from dflashkit import levels

    for key, value in levels.torch_environment(levels.choose(os.environ["DFLASHKIT_ISA"])).items():
        os.environ.setdefault(key, value)
from dflashkit.cli import use_environment  # noqa: E402 (light: no torch)

use_environment()  # a test process is an entry point too: $DFLASHKIT_HOME and the rest as the CLI reads them
if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs one worker per core: one torch thread each
    import torch

    torch.set_num_threads(1)
# torch is imported in the fixtures, not here: xdist's controller loads this file too, and 2.5 s of importing torch
# there delays both workers' start (measured on a 2-core machine).


@pytest.fixture(autouse=True)
def float32_by_default(monkeypatch, request):
    """dtype "auto" means bf16 on CPUs with native bf16 dot products: tests pin the float32 answer so that they
    check the same numbers on every CPU; bf16 tests ask for bfloat16 explicitly."""
    from dflashkit.targets import model

    monkeypatch.setattr(model, "cpu_has_bf16_matmul", lambda: False)


@pytest.fixture(autouse=True)
def auto_engine_is_hf(monkeypatch):
    """`--engine auto` (the CLI's default) times both backends once per machine, compiling the static step: tests
    get hf from it unless they test the probe itself (tests/test_engine.py calls the real one). The machine is
    quiet to every measurement (probe.measured_load): no /proc/stat counters, a load average of 0."""
    from dflashkit.measure import probe

    monkeypatch.setattr(probe, "cpu_times", lambda cpus: (0, 0))
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    real = probe.probe
    monkeypatch.setattr(probe, "probe", lambda session, **kw: {"plain": "hf", "speculative": "hf"})
    monkeypatch.setattr(probe, "real_probe", real, raising=False)


@pytest.fixture
def machine_env(monkeypatch):
    """machine_env(DFLASHKIT_HOME=path, ...): set (None: unset) environment variables as a user does for the
    `dflashkit` command and hand them to library code as its entry point does (`dflashkit.cli.use_environment`);
    both are restored after the test."""
    from dflashkit import machine
    from dflashkit.cli import use_environment

    def setenv(**env):
        for name, value in env.items():
            monkeypatch.setenv(name, str(value)) if value is not None else monkeypatch.delenv(name, raising=False)
        use_environment()

    outer = machine.current()
    yield setenv
    machine.use(outer)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory, worker_id):
    """kind -> folder of a tiny random target (llama, qwen3, qwen3_5), written once per run: pytest-xdist's
    workers share this run's folder (behind a lock), as the targets are the same."""
    from filelock import FileLock

    from tiny_targets import KINDS, make_tiny_target

    if worker_id == "master":
        root = tmp_path_factory.mktemp("targets")
    else:
        root = tmp_path_factory.getbasetemp().parent / "targets"
    with FileLock(f"{root}.lock"):
        return {k: make_tiny_target(k, root / k) for k in KINDS}


@pytest.fixture(scope="session")
def tiny_targets(tiny_dirs):
    from dflashkit.targets.model import load_target

    return {k: load_target(p, device="cpu", dtype="float32") for k, p in tiny_dirs.items()}


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded default, prepared once per machine (about 20 s the first time)."""
    import torch

    from dflashkit.targets.model import load_target

    torch.manual_seed(0)
    return load_target("smollm2-135m", device="cpu", dtype="float32")


@pytest.fixture
def native_kernels():
    """Our C++ kernels (decode/native.py) loaded from their build under the real home, once per process: a test that
    then points DFLASHKIT_HOME at a folder of its own would otherwise build them again there (11 s on 2 cores)."""
    from dflashkit.decode import native

    native.load()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine spinning threads make
    the tests 10-50x slower; modules opt in with pytestmark and the setting is restored afterwards."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Every test of the real SmolLM2 target is end to end (`make test-e2e`) and runs on one xdist worker (`--dist
    loadgroup`): loaded once, not twice.
    xdist deals out the groups first (most tests first), then single tests in collection order: the tests marked
    slow (up to 15 s each) go first, so that none starts last and leaves the other worker idle until it ends."""
    for item in items:
        if "smollm2" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group(name="smollm2"))
        if "smollm2" in item.fixturenames or item.name.startswith("test_smollm2"):  # the real target: `make test-e2e`
            item.add_marker(pytest.mark.e2e)
    # then the tests of the other levels' builds last, which the background build makes while the rest run
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None, other_build(item)))  # stable otherwise


def other_build(item) -> bool:
    """Whether a test runs kernels of a level other than the chosen one (or v3 with Zen's tuning planted)."""
    values = str(getattr(getattr(item, "callspec", None), "params", {}))
    return any(name in values for name in ("'portable'", "'v4'", "'znver3'"))


# Every ISA level's kernels (and v3 with Zen's tuning planted, tests/test_static_decoder.py) built once, one after
# another, by one process beside the workers: without it both workers met the same missing library at once, and
# one built it while the other waited (7 s a level on 2 cores). A library already built is only checked.
BUILD_LEVELS = """
import os, sys
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
from dflashkit import levels
from dflashkit.cli import use_environment
use_environment()  # into $DFLASHKIT_HOME, where the workers look
levels.choose(os.environ.get("DFLASHKIT_ISA") or None)
from dflashkit.decode import native
from helpers import exercised_levels
for level in sorted(exercised_levels(), key=lambda lv: lv != levels.chosen()):  # the chosen level first
    native.ensure_built(level)
if "v3" in exercised_levels():
    native.ensure_built("v3", "znver3")
"""


def pytest_configure(config):
    import subprocess
    import sys

    if os.environ.get("PYTEST_XDIST_WORKER") or not getattr(config.option, "numprocesses", None):
        return
    config._dflashkit_builds = subprocess.Popen([sys.executable, "-c", BUILD_LEVELS], cwd=str(config.rootpath))


def pytest_unconfigure(config):
    builds = getattr(config, "_dflashkit_builds", None)
    if builds is not None:
        builds.wait()
