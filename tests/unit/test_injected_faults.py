"""The fault tests' injection (megamoe.train.faults): from the environment variable only, and a
malformed value is one line naming the variable."""
from __future__ import annotations

import pytest

from megamoe.errors import ConfigError
from megamoe.train.faults import VARIABLE, InjectedFaults, injected_faults


def test_nothing_is_injected_without_the_variable(monkeypatch):
    monkeypatch.delenv(VARIABLE, raising=False)
    assert injected_faults() == InjectedFaults(nan_step=0, spike_step=0)


def test_the_variable_names_the_faults(monkeypatch):
    monkeypatch.setenv(VARIABLE, "{nan_step: 5, nan_param: decoder.layers.2, spike_step: 9}")
    assert injected_faults() == InjectedFaults(nan_step=5, nan_param="decoder.layers.2",
                                               spike_step=9)


@pytest.mark.parametrize("text, fragment", [("{nan_stp: 5}", "did you mean"),
                                            ("{nan_step: x}", "nan_step"),
                                            ("[1, 2", "not valid YAML")])
def test_a_malformed_variable_is_one_line(monkeypatch, text, fragment):
    monkeypatch.setenv(VARIABLE, text)
    with pytest.raises(ConfigError, match=VARIABLE) as raised:
        injected_faults()
    assert fragment in str(raised.value) and "\n" not in str(raised.value)
