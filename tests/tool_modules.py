"""Import a script of tools/ as a module, for tests of its functions."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def tool_module(name: str) -> ModuleType:
    """tools/NAME.py as the module NAME, imported the way `python tools/NAME.py` finds its
    imports (tools/ first on the path, so one tool's `import study_routing` resolves)."""
    sys.path.insert(0, str(TOOLS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(TOOLS))
