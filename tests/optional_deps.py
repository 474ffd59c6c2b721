"""Optional packages (pyproject's `train` and `interop` extras): a test that needs one that is
not installed is skipped, naming it, never an error.

One place for the whole suite (a pytest plugin, loaded by tests/conftest.py): a test module
whose import fails for want of one (directly, through a helper such as tests/hf_models.py, or
through a megamoe module that imports it) is skipped as a whole at collection, and a test
whose fixture or body raises that ModuleNotFoundError is skipped. An optional package that is
installed but fails to import (a broken install, a missing submodule) stays an error.
"""
from __future__ import annotations

import importlib.util
import re
from typing import Optional

import pytest

OPTIONAL = ("transformers", "tokenizers", "sentencepiece", "safetensors", "deepspeed")
_NOT_FOUND = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")


def _absent(name: str) -> Optional[str]:
    """The optional package `name` (a module name) lies in, if it is not installed."""
    root = name.split(".")[0]
    if root not in OPTIONAL:
        return None
    try:
        return root if importlib.util.find_spec(root) is None else None
    except ImportError:
        return root


def _reason(package: str) -> str:
    return f"Skipped: needs {package}, which is not installed (pip install -e .[test])"


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    if report.failed and isinstance(collector, pytest.Module):
        names = _NOT_FOUND.findall(str(report.longrepr))
        package = names and _absent(names[-1])
        if package:
            report.outcome = "skipped"
            report.longrepr = (str(collector.path), None, _reason(package))
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    error = call.excinfo.value if call.excinfo is not None else None
    if report.failed and isinstance(error, ModuleNotFoundError) and error.name:
        package = _absent(error.name)
        if package:
            report.outcome = "skipped"
            report.longrepr = (str(item.path), None, _reason(package))
    return report
