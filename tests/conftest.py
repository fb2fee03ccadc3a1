"""Shared test fixtures (paths to the repository's example files) and the test tiers.

Tiers (markers registered in pytest.ini): a test marked ``distributed`` starts processes or a process group, one
marked ``slow`` is long but in-process; every other test is ``unit`` and runs in this process only, which an
autouse guard enforces (a unit test that starts a subprocess, a multiprocessing child or a process group fails,
saying which marker it needs). ``python -m pytest -m unit`` is the quick tier.
"""
import gc
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
CLUSTERS = os.path.join(EXAMPLES, "clusters")

if REPO not in sys.path:  # tests import helpers (tests/helpers_*.py) as modules
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Torch's JIT-built extensions (DeepSpeed ops) go to a folder of this environment, inherited by every subprocess:
# the default ~/.cache/torch_extensions is shared by all of a user's venvs, which then rebuild in turn.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

TIERS = ("unit", "distributed", "slow")

def pytest_collection_modifyitems(config, items):
    for item in items:
        if not any(item.get_closest_marker(t) for t in TIERS[1:]):
            item.add_marker(pytest.mark.unit)


VIOLATIONS = pytest.StashKey[list]()


def _refuse(item, what: str):
    def refuse(*args, **kwargs):
        message = (f"a unit test may not start {what}: mark {item.name} @pytest.mark.distributed "
                   f"(tiers: tests/conftest.py)")
        item.stash[VIOLATIONS].append(message)  # reported even if the code under test swallows the error
        raise RuntimeError(message)

    return refuse


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A unit test runs in this process, fixtures of every scope included: no subprocess, no multiprocessing child
    (a process pool), no process group."""
    if item.get_closest_marker("unit") is None:
        yield
        return
    import multiprocessing.process
    import subprocess

    item.stash[VIOLATIONS] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "__init__", _refuse(item, "a subprocess"))
        mp.setattr(multiprocessing.process.BaseProcess, "start", _refuse(item, "a process (a pool or a rank)"))
        dist = sys.modules.get("torch.distributed")
        if dist is not None:
            mp.setattr(dist, "init_process_group", _refuse(item, "a process group"))
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    violations = item.stash.get(VIOLATIONS, [])
    if violations and report.passed and call.when == "call":  # during setup too: the list outlives the phase
        report.outcome = "failed"
        report.longrepr = "\n".join(violations)


@pytest.fixture
def cluster_path():
    def get(name: str) -> str:
        return os.path.join(CLUSTERS, f"{name}.yaml")

    return get


def pytest_collectreport(report):
    """While collecting, what each module built (torch, the test module, its tables) is frozen (gc.freeze): the
    cyclic collector's full passes during collection otherwise rescan every module imported so far."""
    gc.freeze()


def pytest_collection_finish(session):
    """The tests run with the collector as a user's process has it, nothing frozen: the planner's gc_pause moves a
    search's objects to the oldest generation only then (a frozen heap made the planner tests slower)."""
    gc.unfreeze()


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long runs (e.g. the long fuzz run of test_bad_inputs.py)")
