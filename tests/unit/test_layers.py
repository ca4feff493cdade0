"""The package's layers, as docs/architecture.md#layout declares them: no import circle inside
distzo, and no module importing from a layer above its own. Read from the source with `ast`, so
every import counts for the layers: at module level, inside functions (lazy imports) and under
TYPE_CHECKING. An import under TYPE_CHECKING never runs, so it cannot close a circle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "distzo"


def declared_layers() -> list[list[str]]:
    """The layer table of docs/architecture.md, lowest first: each row's first cell lists the
    top-level modules and packages of that layer (`distzo/x/` or `distzo/x.py`)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("<!-- layers -->")[1].split("<!-- /layers -->")[0]
    layers = []
    for line in section.splitlines():
        if line.startswith("| ") and "distzo/" in line.split("|")[1]:
            layers.append(re.findall(r"distzo/(\w+)", line.split("|")[1]))
    return layers


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:`."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def imports_of(name: str, running_only: bool = False) -> set[str]:
    """The distzo modules `name` imports (a `from package import submodule` counts as the submodule);
    running_only: not those under TYPE_CHECKING."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    tree = ast.parse(path.read_text())
    skip = type_checking_nodes(tree) if running_only else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                full = f"{target}.{alias.name}"
                out.add(full if full in MODULES else target)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in MODULES and m != name}


GRAPH = {name: imports_of(name) for name in MODULES}
RUNNING = {name: imports_of(name, running_only=True) for name in MODULES}


def top(name: str) -> str:
    """The top-level part of a module: distzo.engine.staged -> engine; distzo -> __init__."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_part_of_the_package_has_a_declared_layer():
    layers = declared_layers()
    declared = [t for layer in layers for t in layer]
    assert len(declared) == len(set(declared)), "a part is declared in two layers"
    parts = {top(m) for m in MODULES}
    assert parts == set(declared), (f"undeclared: {sorted(parts - set(declared))}; declared but missing: "
                                    f"{sorted(set(declared) - parts)}")


def test_no_module_imports_from_a_layer_above_its_own():
    level = {part: i for i, layer in enumerate(declared_layers()) for part in layer}
    upward = sorted(f"{m} -> {t}" for m, targets in GRAPH.items() for t in targets
                    if level[top(t)] > level[top(m)])
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_parts_of_one_layer_do_not_import_each_other():
    level = {part: i for i, layer in enumerate(declared_layers()) for part in layer}
    sideways = sorted(f"{m} -> {t}" for m, targets in GRAPH.items() for t in targets
                      if top(t) != top(m) and level[top(t)] == level[top(m)])
    assert not sideways, "imports between parts of one layer:\n" + "\n".join(sideways)


def test_there_is_no_import_circle():
    """Depth-first search for a cycle through the module graph (package __init__ files included)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted(RUNNING[m]):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state:
                found = visit(t)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(RUNNING):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_check_sees_lazy_imports():
    """Function-level imports count: the CLI reaches the run layer only lazily, and it is seen."""
    assert any(top(t) == "run" for t in GRAPH["distzo.cli.main"])
