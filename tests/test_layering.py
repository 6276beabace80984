"""The package's import graph has no cycles and respects the layers of the README's architecture section.

Every module under stepquant/ is parsed with ast (imports inside functions count too), giving an edge per
imported stepquant module and per package above it that Python imports on the way. The layers, bottom
to top:

    0  formats and primitives   stepquant (the package), codecs (with the packed layout), recurrence
    1  families                 families
    2  shipped assets           models, data, assets
    3  calibration, serving, accounting   calibrate, pool, kernels, integrations, accounting
    4  evaluation, analysis     eval, analysis, tasks
    5  commands                 stepquant/cli.py and every <package>/cli.py

A module imports only its own layer or lower ones; serving (pool, kernels, integrations) never imports
calibration; no library module imports a command module; nothing imports the studies. Modules form no
cycle, and neither do the components (a package without its cli.py, or a top-level module).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "stepquant"
LAYERS = {
    "stepquant": 0, "stepquant.codecs": 0, "stepquant.recurrence": 0,
    "stepquant.families": 1,
    "stepquant.models": 2, "stepquant.data": 2, "stepquant.assets": 2,
    "stepquant.calibrate": 3, "stepquant.pool": 3, "stepquant.kernels": 3, "stepquant.integrations": 3,
    "stepquant.accounting": 3,
    "stepquant.eval": 4, "stepquant.analysis": 4, "stepquant.tasks": 4,
}
COMMANDS = 5
SERVING = ("stepquant.pool", "stepquant.kernels", "stepquant.integrations")


def module_names() -> dict[str, Path]:
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def is_command(module: str) -> bool:
    return module == "stepquant.cli" or module.endswith(".cli")


def component(module: str) -> str:
    """A command module is its own component; other modules belong to their top-level package or module."""
    return module if is_command(module) else ".".join(module.split(".")[:2])


def layer(module: str) -> int:
    return COMMANDS if is_command(module) else LAYERS[component(module)]


def imported(module: str, path: Path, known: set[str]) -> set[str]:
    """The stepquant modules ``module`` imports, with the packages above them that are not its own."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in ("stepquant", "studies"):
                targets.add(name)
    own = {module.rsplit(".", depth)[0] for depth in range(module.count(".") + 1)}
    with_parents = set()
    for target in targets:
        parts = target.split(".")
        with_parents |= {".".join(parts[:n]) for n in range(1, len(parts) + 1)} - own
    return (with_parents | targets) - {module}


def import_graph() -> dict[str, set[str]]:
    names = module_names()
    return {module: imported(module, path, set(names)) for module, path in names.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of a directed graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in module_names() if not is_command(m) and component(m) not in LAYERS)
    assert not unplaced, f"add these modules to LAYERS (and to the README's architecture section): {unplaced}"


def test_no_import_cycle_between_modules():
    graph = {m: {t for t in targets if t.startswith("stepquant")} for m, targets in import_graph().items()}
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_no_import_cycle_between_components():
    components: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        edges = components.setdefault(component(module), set())
        edges |= {component(t) for t in targets if t.startswith("stepquant")} - {component(module)}
    cycle = find_cycle(components)
    assert cycle is None, f"components import each other: {' -> '.join(cycle)}"


@pytest.mark.parametrize("module", sorted(module_names()))
def test_imports_respect_the_layers(module):
    targets = import_graph()[module]
    assert not [t for t in targets if t.startswith("studies")], "the package must not import the studies"
    targets = {t for t in targets if t.startswith("stepquant")}
    if not is_command(module):
        assert not [t for t in targets if is_command(t)], f"{module} imports a command module"
    upward = sorted(t for t in targets if layer(t) > layer(module))
    assert not upward, f"{module} (layer {layer(module)}) imports higher layers: {upward}"
    if component(module) in SERVING:
        calibration = sorted(t for t in targets if component(t) == "stepquant.calibrate")
        assert not calibration, f"serving module {module} imports calibration: {calibration}"
