"""The package's layers (docs/structure.md): every module imports on its own, no module imports a higher
layer, and no modules import each other in a circle. Imports are read from the source (``ast``), function-local
and ``TYPE_CHECKING`` ones included: a circle that only a lazy import hides is still a circle."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import omnistage

ROOT = Path(omnistage.__file__).parent
STRUCTURE = ROOT.parent / "docs" / "structure.md"


def _module_files() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _module_files()


def _imports(name: str, path: Path) -> set[str]:
    """The omnistage modules ``name`` imports (a package named by ``from package import module`` resolves to the
    module when it is one)."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    resolved = set()
    for target in found:
        while target and target not in MODULES:  # `import a.b.c` where c is an attribute, not a module
            target = target.rpartition(".")[0]
        if target.startswith("omnistage") and target != name:
            resolved.add(target)
    return resolved


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layers() -> list[set[str]]:
    """The numbered layer list under "Layering" in docs/structure.md, lowest first: each entry's backticked
    names are top-level subpackages or modules of omnistage (`omnistage` itself is the package's __init__)."""
    text = STRUCTURE.read_text()
    section = text[text.index("Layering"):text.index("## ", text.index("Layering"))]
    layers = []
    for line in section.splitlines():
        m = re.match(r"\d+\. (.*)", line)
        if m:
            head = m[1].split(" — ")[0]
            layers.append(set(re.findall(r"`([a-z_0-9]+)`", head)))
    return layers


LAYERS = _layers()


def _layer_of(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "omnistage"
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module}: its top level {top!r} is in no layer of docs/structure.md")


def test_structure_lists_layers():
    assert len(LAYERS) >= 5 and set().union(*LAYERS) >= {"core", "models", "pipeline", "entrypoints", "testing"}
    for module in MODULES:
        _layer_of(module)


def test_no_module_imports_a_higher_layer():
    bad = [f"{m} (layer {_layer_of(m) + 1}) imports {t} (layer {_layer_of(t) + 1})"
           for m, targets in GRAPH.items() for t in sorted(targets) if _layer_of(t) > _layer_of(m)]
    assert not bad, "\n".join(bad)


def test_only_tests_import_testing():
    testing = LAYERS[-1]
    assert testing == {"testing"}
    bad = [f"{m} imports {t}" for m, targets in GRAPH.items() if m.split(".")[1:2] != ["testing"]
           for t in targets if t.split(".")[1:2] == ["testing"]]
    assert not bad, "\n".join(bad)


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_circle_finder_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert _circles(graph) == [["a", "b", "c"]]


def test_no_import_circles():
    # A package's __init__ re-exporting its modules is not a circle with them: a module that imports its own
    # package only runs the __init__ (which Python has already started), so only module-to-module edges count.
    graph = {m: {t for t in targets if not m.startswith(f"{t}.")} for m, targets in GRAPH.items()}
    circles = _circles(graph)
    assert not circles, "\n".join(" <-> ".join(c) for c in circles)


def test_every_module_imports_on_its_own():
    # One fresh interpreter per module would cost a minute; a fresh interpreter per batch, each module imported
    # after a reset of everything omnistage loaded, keeps each import on its own.
    script = (
        "import importlib, sys, traceback\n"
        "failed = []\n"
        "for name in sys.argv[1:]:\n"
        "    for loaded in [m for m in sys.modules if m == 'omnistage' or m.startswith('omnistage.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception:\n"
        "        failed.append(name + ':\\n' + traceback.format_exc())\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n"
    )
    names = sorted(MODULES)
    result = subprocess.run([sys.executable, "-c", script, *names], capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        pytest.fail(result.stdout + result.stderr)


def test_structure_has_a_line_per_module():
    text = STRUCTURE.read_text()
    missing = [str(path.relative_to(ROOT)) for path in MODULES.values() if path.name != "__init__.py"
               and f"`{path.relative_to(ROOT)}`" not in text]
    assert not missing, f"docs/structure.md has no line for: {missing}"
