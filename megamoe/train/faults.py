"""Faults the fault tests (tests/faults) inject into a real training run, from the environment
rather than the user's config: `MEGAMOE_TEST_FAULTS`, a YAML mapping of `InjectedFaults` fields,
e.g.

    MEGAMOE_TEST_FAULTS='{nan_step: 5, spike_step: 10}' python -m megamoe.train --config ...

For tests only: a run without the variable injects nothing, and no config key reaches this.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from megamoe.bounded import parse_yaml
from megamoe.errors import ConfigError
from megamoe.settings import build

VARIABLE = "MEGAMOE_TEST_FAULTS"


@dataclass
class InjectedFaults:
    """What to break, and when (0: never)."""

    nan_step: int = 0
    """Just before step N, set element 0 of the first parameter whose name starts with
    `nan_param` to NaN (the non-finite guard must stop step N before its update)."""
    nan_param: str = "decoder.layers.1.mlp.experts"
    """The parameter `nan_step` poisons (a name prefix)."""
    spike_step: int = 0
    """Labels 0 for the batch at the data position of step N of an uninterrupted run (its loss
    jumps: the spike guard must act)."""


def injected_faults() -> InjectedFaults:
    """The faults `MEGAMOE_TEST_FAULTS` asks for (none when it is unset); a malformed value is a
    one-line ConfigError naming the variable."""
    text = os.environ.get(VARIABLE, "").strip()
    if not text:
        return InjectedFaults()
    raw = parse_yaml(text, ConfigError, f"the environment variable {VARIABLE}")
    return build(InjectedFaults, raw, VARIABLE, "in the environment")

