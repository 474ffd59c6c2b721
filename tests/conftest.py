"""Test-wide settings, the two test tiers, and fixtures shared by every suite.

Tiers (docs/testing.md):
- quick (the default, `python -m pytest tests`): every test not marked `slow`. Each has a time
  budget, `QUICK_BUDGET_S` unless `@pytest.mark.quick(budget_s=N)` says otherwise; a quick-tier
  test whose setup, call and teardown together run longer fails, naming itself and its time.
- full (`python -m pytest tests --full`): every test, no budgets. Everything under
  tests/distributed, tests/e2e and tests/faults is `slow` unless marked `quick`
  (SLOW_DIRECTORIES).

Workers (pytest-xdist, `-n 2 --dist loadgroup`): the tests of one file run in one worker, and so
do all the files that read one of SHARED_FIXTURE_GROUPS' session fixtures, so each such fixture is
built once per run; the default corpus is built once for all workers (`build_once`).

Megatron's torch.compile-based jit fuser costs seconds per first call on CPU, so TorchDynamo is
off for every test.
"""
import os
import time
from pathlib import Path

import pytest

from shared_builds import build_once

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

# A test that needs an optional package that is not installed is skipped, naming it.
pytest_plugins = ("optional_deps",)

QUICK_BUDGET_S = 10.0
SHARED_FIXTURE_BUDGET_S = 60.0
SLOW_DIRECTORIES = ("distributed", "e2e", "faults")
# Session fixtures whose files share one xdist worker: {fixture: group}.
SHARED_FIXTURE_GROUPS = {"ckpt_dir": "ep-worlds", "world1": "ep-worlds", "world2": "ep-worlds",
                         "world4": "ep-worlds", "cluster": "slurm-cluster"}
_TESTS = Path(__file__).parent


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="run the full tier (every test, no time budgets); the default is the "
                          "quick tier: tests not marked slow, each within its budget")


def _in_slow_directory(item) -> bool:
    relative = Path(str(item.fspath)).relative_to(_TESTS)
    return relative.parts[0] in SLOW_DIRECTORIES


def _group_for_workers(items) -> None:
    """An `xdist_group` per test file, or the SHARED_FIXTURE_GROUPS group of any session fixture
    one of its tests reads."""
    groups: dict[str, str] = {}
    for item in items:
        path = str(item.fspath)
        shared = sorted({SHARED_FIXTURE_GROUPS[name] for name in item.fixturenames
                         if name in SHARED_FIXTURE_GROUPS})
        groups[path] = shared[0] if shared else groups.get(path, path)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[str(item.fspath)]))


@pytest.hookimpl(wrapper=True)  # before pytest-xdist's hook, which reads the groups
def pytest_collection_modifyitems(config, items):
    if getattr(config.option, "loadgroup", False):  # an xdist worker of `--dist loadgroup`
        _group_for_workers(items)
    _select_tier(config, items)
    return (yield)


def _select_tier(config, items) -> None:
    for item in items:
        if _in_slow_directory(item) and item.get_closest_marker("quick") is None:
            item.add_marker(pytest.mark.slow)
    if config.getoption("--full"):
        return
    quick, slow = [], []
    for item in items:
        (slow if item.get_closest_marker("slow") else quick).append(item)
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = quick


def pytest_report_header(config):
    if config.getoption("--full"):
        return "tier: full (every test)"
    return "tier: quick (tests not marked slow, each within its budget); --full runs every test"


def _budget_s(item) -> float:
    marker = item.get_closest_marker("quick")
    return float(marker.kwargs.get("budget_s", QUICK_BUDGET_S)) if marker else QUICK_BUDGET_S


class _Clock:
    """The current test's start, and the time its shared (class, module, session) fixtures
    took to set up: their cost is counted against SHARED_FIXTURE_BUDGET_S, not the test's."""
    test_start = 0.0
    shared_setup_s = 0.0


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _Clock.test_start, _Clock.shared_setup_s = time.monotonic(), 0.0
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    start = time.monotonic()
    value = yield
    elapsed = time.monotonic() - start
    if fixturedef.scope == "function":
        return value
    _Clock.shared_setup_s += elapsed
    if not request.config.getoption("--full") and elapsed > SHARED_FIXTURE_BUDGET_S:
        pytest.fail(f"shared fixture {fixturedef.argname!r} took {elapsed:.1f} s to set up, over "
                    f"the quick tier's {SHARED_FIXTURE_BUDGET_S:g} s for one: make it cheaper "
                    f"or leave the tests that use it to the full tier (mark them slow)",
                    pytrace=False)
    return value


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.when != "call" or not report.passed or item.config.getoption("--full"):
        return report
    elapsed = time.monotonic() - _Clock.test_start - _Clock.shared_setup_s
    budget = _budget_s(item)
    if elapsed > budget:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} took {elapsed:.1f} s, over its quick-tier budget of "
                           f"{budget:g} s: make it faster, give it "
                           f"@pytest.mark.quick(budget_s=N), or mark it slow")
    return report


@pytest.fixture(scope="session")
def corpus_cache(tmp_path_factory) -> Path:
    """The default corpus and its tokenizer, built once per test run for every suite (and every
    pytest-xdist worker)."""
    from megamoe.train.corpus import ensure_default_dataset

    return build_once(tmp_path_factory, "megamoe-corpus",
                      lambda cache: ensure_default_dataset(cache, progress=False))
