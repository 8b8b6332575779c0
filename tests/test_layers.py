"""The layering of ARCHITECTURE.md holds: an import only ever points down the list (or sideways).

The plan JSON's dataclasses (`onnxpipe.plan.result`) are a contract like the manifest: plain data
that the simulator reads, so the sim layer may import that one module from the plan layer."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "onnxpipe"

#: Lowest first. A module's layer is the first prefix that matches.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("onnxpipe.errors", "onnxpipe.units", "onnxpipe.safepath", "onnxpipe.protostream", "onnxpipe.ortutil", "onnxpipe.fileio"),
    ("onnxpipe.graph", "onnxpipe.initializers", "onnxpipe.cost", "onnxpipe.cost_formulas", "onnxpipe.cost_profile", "onnxpipe.target"),
    ("onnxpipe.schedule",),
    ("onnxpipe.pricing",),
    ("onnxpipe.simulate",),
    ("onnxpipe.plan",),
    ("onnxpipe.split", "onnxpipe.manifest", "onnxpipe.chain", "onnxpipe.verify", "onnxpipe.report"),
    ("onnxpipe.train",),
    ("onnxpipe",),
    ("onnxpipe.cli", "onnxpipe.__main__"),
)
CONTRACTS = {"onnxpipe.plan.result": 4}


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
            allowed = CONTRACTS.get(target)
            target_level = allowed if allowed is not None else layer_of(target)
            if target_level > level:
                wrong.append(f"{module} (layer {level}) imports {target} (layer {target_level})")
    assert not wrong, "\n".join(wrong)
