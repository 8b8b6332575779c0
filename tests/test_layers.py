"""The layering of docs/architecture.md holds: an import only ever points down the list (or sideways),
with no exception."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "onnxpipe"

DOC = PACKAGE.parent / "docs" / "architecture.md"


def read_layers() -> tuple[tuple[str, ...], ...]:
    """The module prefixes of each layer in docs/architecture.md's layer table, lowest first."""
    text = DOC.read_text().split("## Layers", 1)[1]
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| ") and "`" in line]
    return tuple(tuple(re.findall(r"`([\w.]+)`", row[2])) for row in reversed(rows))


#: Lowest first. A module's layer is the one of its longest matching prefix.
LAYERS = read_layers()


def layer_of(module: str) -> int:
    best = None
    for level, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > len(best[1]):
                    best = (level, prefix)
    assert best is not None, module
    return best[0]


def imports_of(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("onnxpipe"):
            if node.module != "onnxpipe":
                found.add(node.module)
                continue
            for alias in node.names:  # `from onnxpipe import schedule` reaches a submodule, not the API
                submodule = (PACKAGE / f"{alias.name}.py").exists() or (PACKAGE / alias.name).is_dir()
                found.add(f"onnxpipe.{alias.name}" if submodule else "onnxpipe")
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("onnxpipe"))
    return found


def test_every_import_points_down_the_layers() -> None:
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        level = layer_of(module)
        for target in imports_of(path):
            target_level = layer_of(target)
            if target_level > level:
                wrong.append(f"{module} (layer {level}) imports {target} (layer {target_level})")
    assert not wrong, "\n".join(wrong)


def test_the_table_names_every_module() -> None:
    known = {prefix for layer in LAYERS for prefix in layer}
    assert {"onnxpipe", "onnxpipe.pricing", "onnxpipe.simulate", "onnxpipe.plan", "onnxpipe.schedule"} <= known
    for path in sorted(PACKAGE.glob("*.py")):
        module = "onnxpipe" if path.stem == "__init__" else f"onnxpipe.{path.stem}"
        assert module in known, f"{module} is not in the layer table of docs/architecture.md"


def test_the_import_graph_has_no_cycle() -> None:
    """Sideways imports inside a layer are allowed, a cycle is not (function-local imports count too)."""
    import networkx as nx

    graph = nx.DiGraph()
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        graph.add_edges_from((module, target) for target in imports_of(path) if target != module)
    cycles = sorted(sorted(c) for c in nx.simple_cycles(graph))
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)
