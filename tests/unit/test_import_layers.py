"""The package's layers and the one direction they import in (docs/architecture.md).

Read from the source with `ast`, so imports inside functions and under TYPE_CHECKING count too:
- every megamoe module belongs to one layer, and imports only its own layer or those below;
- the MoE core (and the base utilities under it) imports no Megatron, no Transformer Engine, no
  apex, DeepSpeed or transformers;
- no cycles, between modules or between packages;
- no test machinery in the package or in launch/, and neither the package nor the tools import
  the tests' helpers.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "megamoe"

# Lowest first. A module belongs to the layer of its longest matching prefix.
LAYERS = {
    "base": ["megamoe.errors", "megamoe.atomic", "megamoe.bounded", "megamoe.paths",
             "megamoe.ownership", "megamoe.children", "megamoe.settings"],
    "core": ["megamoe", "megamoe.registry", "megamoe.config", "megamoe.routing",
             "megamoe.balancing", "megamoe.dispatch", "megamoe.experts", "megamoe.parallel",
             "megamoe.layer", "megamoe.optim"],
    "megatron": ["megamoe.megatron"],
    "checkpointing": ["megamoe.checkpointing"],
    "train": ["megamoe.train"],
    "apps": ["megamoe.upcycle", "megamoe.interop", "megamoe.instruct", "megamoe.simoe",
             "megamoe.plan"],
}
RANK = {layer: rank for rank, layer in enumerate(LAYERS)}
HOST_FRAMEWORKS = {"megatron", "transformer_engine", "apex", "deepspeed", "transformers"}
TEST_HELPERS = {path.stem for path in (REPO / "tests").rglob("*.py")} - {"conftest"}


def _modules() -> dict[str, tuple[Path, bool]]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """Every module `name` imports (absolute names; `from X import Y` counts X.Y if a module)."""
    path, is_package = MODULES[name]
    here = name.split(".") if is_package else name.split(".")[:-1]
    return imports_in(path.read_text(), here)


def imports_in(source: str, here: list[str]) -> set[str]:
    """The imports anywhere in `source` (a module of package `here`)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names
                         if f"{base}.{alias.name}" in MODULES)
    return found


def _own(target: str) -> str | None:
    """The megamoe module an imported name lies in, or None outside megamoe."""
    while target not in MODULES:
        if "." not in target:
            return None
        target = target.rsplit(".", 1)[0]
    return target


GRAPH = {name: {own for target in _imports(name) if (own := _own(target)) and own != name}
         for name in MODULES}


def layer_of(name: str) -> str:
    best = max(((prefix, layer) for layer, prefixes in LAYERS.items() for prefix in prefixes
                if name == prefix or name.startswith(prefix + ".")), key=lambda p: len(p[0]))
    return best[1]


def package_of(name: str) -> str:
    """`megamoe.X` for a module of subpackage or top-level module X."""
    return ".".join(name.split(".")[:2])


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph`, or None (depth-first search)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_every_module_has_a_layer():
    for name in MODULES:
        assert layer_of(name) in LAYERS, name


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_down(name):
    upward = [target for target in GRAPH[name] if RANK[layer_of(target)] > RANK[layer_of(name)]]
    assert not upward, f"{name} ({layer_of(name)}) imports {upward} from a layer above"


def test_core_imports_no_host_framework():
    offenders = {name: sorted({t.split(".")[0] for t in _imports(name)} & HOST_FRAMEWORKS)
                 for name in MODULES if RANK[layer_of(name)] <= RANK["core"]}
    assert not {k: v for k, v in offenders.items() if v}


def test_no_cycle_between_modules():
    assert _cycle(GRAPH) is None


def test_no_cycle_between_packages():
    packages: dict[str, set[str]] = {}
    for name, targets in GRAPH.items():
        packages.setdefault(package_of(name), set()).update(
            package_of(t) for t in targets if package_of(t) != package_of(name))
    assert _cycle(packages) is None


def test_test_machinery_stays_with_the_tests():
    for path in [*PACKAGE.rglob("*.py"), *(REPO / "launch").rglob("*.py"),
                 *(REPO / "tools").glob("*.py")]:
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
        assert not imported & (TEST_HELPERS | {"tests"}), f"{path} imports test helpers"
    assert not list((REPO / "launch").glob("*.py")), "launch/ holds the production launch only"


def test_the_graph_reader_sees_every_kind_of_import():
    """The checks above would be blind without these: imports in functions, under
    TYPE_CHECKING and relative ones are read; a cycle is found."""
    source = """
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from megatron.core import parallel_state
def build():
    import megamoe.train.loop
    from ..checkpointing import layout
    from . import sibling
"""
    found = imports_in(source, ["megamoe", "routing"])
    assert {"megatron.core", "megamoe.train.loop", "megamoe.checkpointing.layout",
            "megamoe.routing"} <= found
    assert layer_of("megamoe.train.loop") == "train" and layer_of("megamoe.routing.topk") == "core"
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
