"""Test-wide settings, the two test tiers, and fixtures shared by every suite.

Tiers (docs/testing.md):
- quick (the default, `python -m pytest tests`): every test not marked `slow`. Each has a time
  budget, `QUICK_BUDGET_S` unless `@pytest.mark.quick(budget_s=N)` says otherwise; a quick-tier
  test whose setup, call and teardown together run longer fails, naming itself and its time.
- full (`python -m pytest tests --full`): every test, no budgets. Everything under
  tests/distributed, tests/e2e and tests/faults is `slow` unless marked `quick`
  (SLOW_DIRECTORIES).

Megatron's torch.compile-based jit fuser costs seconds per first call on CPU, so TorchDynamo is
off for every test.
"""
import os
import time
from pathlib import Path

import pytest

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

# A test that needs an optional package that is not installed is skipped, naming it.
pytest_plugins = ("optional_deps",)

QUICK_BUDGET_S = 10.0
SHARED_FIXTURE_BUDGET_S = 60.0
SLOW_DIRECTORIES = ("distributed", "e2e", "faults")
_TESTS = Path(__file__).parent


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="run the full tier (every test, no time budgets); the default is the "
                          "quick tier: tests not marked slow, each within its budget")


def _in_slow_directory(item) -> bool:
    relative = Path(str(item.fspath)).relative_to(_TESTS)
    return relative.parts[0] in SLOW_DIRECTORIES


def pytest_collection_modifyitems(config, items):
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
    """The default corpus and its tokenizer, built once per test session for every suite."""
    from megamoe.train.corpus import ensure_default_dataset

    cache = tmp_path_factory.getbasetemp() / "megamoe-corpus"
    ensure_default_dataset(cache, progress=False)
    return cache
