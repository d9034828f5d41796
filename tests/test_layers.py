"""The package's modules import each other in one direction: no circle, lazy imports included, and each layer
imports only the layers below it (docs/internals/design.md, "Layers"). Read from the source (ast), nothing is
imported."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

# bottom first; a module may import its own layer's modules and those of the layers before it
LAYERS = [
    {"ebrl.errors", "ebrl.classes", "ebrl.telemetry", "ebrl.recipes", "ebrl.install"},
    {"ebrl.node"},
    {"ebrl.envs"},
    {"ebrl.config", "ebrl.checks", "ebrl.shape"},
    {"ebrl.policies"},
    {"ebrl.rl", "ebrl.alloc"},
    {"ebrl.runtime", "ebrl.demos"},
    {"ebrl.forecast"},
    {"ebrl.runs"},
    {"ebrl.bench", "ebrl.export"},
]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Each ebrl module -> the ebrl modules it imports anywhere (top level or inside a function)."""
    files = {module_name(p): p for p in (REPO / "ebrl").rglob("*.py")}
    out: dict[str, set[str]] = {}
    for name, path in files.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ebrl"):
                # `from ebrl.policies import layers` names a module; `from ebrl.rl.ppo import X` a name in one
                found |= {
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module for a in node.names
                }
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("ebrl")}
        out[name] = {m for m in found if m in files and m != name}
    return out


def layer_of(module: str) -> int:
    for i, layer in enumerate(LAYERS):
        if any(module == top or module.startswith(top + ".") for top in layer):
            return i
    return len(LAYERS)  # (ebrl itself)


def test_no_module_imports_a_layer_above_its_own():
    upward = [f"{a} imports {b}" for a, deps in imports().items() for b in deps if layer_of(b) > layer_of(a)]
    assert upward == []


def test_no_import_circle():
    graph = imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                circles.append(path[path.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert circles == []


MOST_ATTRIBUTES = 15  # a class that holds more does more than one thing (the models' layers and data records aside)


def attributes(cls: ast.ClassDef) -> set[str]:
    """The names a class assigns on `self` anywhere in its body."""
    out = set()
    for node in ast.walk(cls):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, (ast.AnnAssign, ast.AugAssign))
            else []
        )
        for target in targets:
            out |= {
                e.attr
                for e in ast.walk(target)
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self"
            }
    return out


def test_no_class_outside_the_models_holds_more_than_a_few_attributes():
    """Dataclasses (schemas, records) and the policies' modules (layers) are data; every other class is behaviour,
    and one that holds more than MOST_ATTRIBUTES things is a god object in the making."""
    big = []
    for path in (REPO / "ebrl").rglob("*.py"):
        if path.parent.name == "policies":
            continue
        for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
            decorators = {ast.unparse(d).split("(")[0] for d in cls.decorator_list}
            held = attributes(cls)
            if "dataclass" not in decorators and len(held) > MOST_ATTRIBUTES:
                big.append(f"{module_name(path)}.{cls.name}: {len(held)}")
    assert big == []
