"""launch/local_cluster.py loaded as a module, and the path of the SLURM launch script."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRETRAIN_SCRIPT = REPO / "launch" / "pretrain_moe.sh"


def _load_local_cluster():
    """Import launch/local_cluster.py (launch/ is a folder of scripts, not a package)."""
    path = REPO / "launch" / "local_cluster.py"
    spec = importlib.util.spec_from_file_location("local_cluster", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


local_cluster = _load_local_cluster()
