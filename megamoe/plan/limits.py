"""The memory planner's own arguments (--device-memory, --world, --ranks, --maxvio), checked
before it builds anything; the model's sizes are checked when its config loads
(`megamoe.train.settings.sizes`)."""
from __future__ import annotations

import math
import re
from typing import Optional

from megamoe.errors import ConfigError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
MAX_WORLD = 1 << 20


def parse_memory(text: str) -> float:
    """'80GiB', '80GB', '141e9', '0.5TiB' -> bytes (G, GiB: 2^30; GB: 10^9)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS or not math.isfinite(float(match.group(1))) \
            or float(match.group(1)) <= 0:
        raise ConfigError(f"--device-memory {text!r} is not a size; write e.g. 80GiB, 141GB "
                          "or 80e9 (bytes)")
    return float(match.group(1)) * _UNITS[unit]


def check_world(world: Optional[int], flag: str) -> None:
    if world is not None and not 1 <= world <= MAX_WORLD:
        raise ConfigError(f"{flag} {world} must be a number of ranks in 1..{MAX_WORLD:,}")


def check_maxvio(maxvio: float) -> None:
    if not (math.isfinite(maxvio) and maxvio >= 0):
        raise ConfigError(f"--maxvio {maxvio} must be >= 0 (0: perfectly balanced experts)")


def check_request(world: Optional[int], ranks: Optional[int], maxvio: float,
                  measure: bool) -> None:
    """The planner's arguments besides the config (--world, --ranks, --maxvio, --measure):
    one-line ConfigError unless it can plan them."""
    check_world(world, "--world")
    check_world(ranks, "--ranks")
    check_maxvio(maxvio)
    if measure and world is not None:
        raise ConfigError("--measure runs the config's own layout; drop --world (or --measure)")
