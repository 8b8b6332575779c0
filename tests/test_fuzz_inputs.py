"""Fuzzing the files a user may be handed: a manifest, a plan and an .npz of inputs, each broken at a
random place by hypothesis. Every case must end in exit code 2 with one line on stderr, and no file
outside the directory under test may be opened (a `secret` beside it is watched through Python's audit
hook on every open).

The CLI runs in-process (typer's runner) so that hundreds of cases take seconds, not minutes.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from onnxpipe import models
from onnxpipe.cli import app
from onnxpipe.manifest import Manifest, SharedInitializer, Stage, StageInput, StageOutput
from onnxpipe.plan.result import Candidate, Memory, Plan, SolveInfo, StagePlan

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

#: Paths every open() during a command is recorded into (None: not recording).
_opened: list[str] | None = None


def _record_opens(event: str, args: tuple[Any, ...]) -> None:
    if event == "open" and _opened is not None and isinstance(args[0], (str, bytes, Path)):
        _opened.append(str(Path(args[0].decode() if isinstance(args[0], bytes) else args[0]).resolve()))


sys.addaudithook(_record_opens)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from onnxpipe.plan import plan_model
    from onnxpipe.split import split

    root = tmp_path_factory.mktemp("fuzz-base")
    onnx.save(models.build("mlp"), str(root / "mlp.onnx"))
    graph, _, _, plan = plan_model(root / "mlp.onnx", "fpga4", stages=2, time_limit=5)
    split(graph, plan, root / "stages")
    np.savez(root / "good.npz", x=np.zeros((8, 16), np.float32))
    return root


def run(argv: list[str], secret: Path) -> tuple[int, str]:
    """Exit code and stderr of one command; fails when it opened anything in `secret`'s folder."""
    global _opened
    _opened = []
    try:
        result = CliRunner().invoke(app, argv)
    finally:
        opened, _opened = _opened, None
    leaked = [p for p in opened if p.startswith(str(secret.parent.resolve()))]
    assert not leaked, f"{argv} opened {leaked}"
    return result.exit_code, result.stderr


def assert_one_line_error(code: int, err: str, secret: Path) -> None:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), f"exit {code}: {err}"
    assert "Traceback" not in err and secret.read_text() not in err


@pytest.fixture
def work(base: Path) -> Iterator[tuple[Path, Path]]:
    """A fresh copy of the base per test (each example writes into its own subfolder) and a secret outside it."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "outside").mkdir()
        secret = root / "outside" / "secret.txt"
        secret.write_text("the secret no command may read")
        yield root, secret


def _case_dir(root: Path, base: Path, *names: str) -> Path:
    case = Path(tempfile.mkdtemp(dir=root))
    for name in names:
        (shutil.copytree if (base / name).is_dir() else shutil.copy)(base / name, case / name)
    return case


def _paths(data: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path to a value in a JSON document (keys and list indices)."""
    if prefix:
        yield prefix
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        yield from _paths(value, (*prefix, key))


def _kind(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return repr(value)
    return {int: "number", float: "number", str: "string", list: "list", dict: "object"}[type(value)]


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
ESCAPES = st.sampled_from(["/etc/passwd", "../outside/secret.txt", "../../outside/secret.txt", "a/../../outside/secret.txt", "", "stage_0.onnx\0x"])


@st.composite
def broken(draw: st.DrawFn, document: dict[str, Any], path_keys: tuple[str, ...]) -> tuple[dict[str, Any], str]:
    """`document` with one value replaced by a JSON value of another kind, a key deleted, or a file name
    pointed outside the directory; and what was done."""
    data = copy.deepcopy(document)
    paths = sorted(_paths(data), key=repr)
    where = draw(st.sampled_from(paths))
    parent = data
    for key in where[:-1]:
        parent = parent[key]
    old = parent[where[-1]]
    how = draw(st.sampled_from(["replace", "delete", "escape"] if where[-1] in path_keys else ["replace", "delete"]))
    if how == "escape":
        parent[where[-1]] = draw(ESCAPES)
    elif how == "delete" and isinstance(parent, dict) and where[-1] != "format":
        del parent[where[-1]]
    else:
        how = "replace"
        parent[where[-1]] = draw(JSON.filter(lambda v: _kind(v) != _kind(old) and (_kind(old) != "list" or v != [])))
    return data, f"{how} {'.'.join(map(str, where))}"




def _manifest(base: Path) -> dict[str, Any]:
    return json.loads((base / "stages" / "manifest.json").read_text())


def _plan(base: Path) -> dict[str, Any]:
    return json.loads((base / "stages" / "plan.json").read_text())


def _optional(*classes: type) -> set[str]:
    """Fields with a default (older files may leave them out): deleting one keeps a document valid."""
    return {f.name for cls in classes for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}


OPTIONAL_MANIFEST_KEYS = _optional(Manifest, Stage, StageInput, StageOutput, SharedInitializer)
OPTIONAL_PLAN_KEYS = _optional(Plan, StagePlan, SolveInfo, Candidate, Memory)


def _must_fail(change: str, optional: set[str]) -> bool:
    """A deleted optional key leaves a valid document; every other change breaks it."""
    how, where = change.split(" ", 1)
    return not (how == "delete" and where.split(".")[-1] in optional)


@SETTINGS
@given(data=st.data())
def test_broken_manifest_is_one_line_exit_2(base: Path, work: tuple[Path, Path], data: st.DataObject) -> None:
    root, secret = work
    document, change = data.draw(broken(_manifest(base), ("file", "data_file")))
    if not _must_fail(change, OPTIONAL_MANIFEST_KEYS):
        return
    case = _case_dir(root, base, "stages", "good.npz")
    (case / "stages" / "manifest.json").write_text(json.dumps(document))
    code, err = run(["run", str(case / "stages"), "--inputs", str(case / "good.npz"), "-o", str(case / "o.npz")], secret)
    assert_one_line_error(code, err, secret)
    assert not (case / "o.npz").exists(), change


@SETTINGS
@given(data=st.data())
def test_broken_plan_is_one_line_exit_2(base: Path, work: tuple[Path, Path], data: st.DataObject) -> None:
    root, secret = work
    document, change = data.draw(broken(_plan(base), ("model",)))
    if not _must_fail(change, OPTIONAL_PLAN_KEYS) or change.startswith(("replace model", "escape model", "replace target")):
        return  # the model path is a hint simulate does not read; a target name is looked up among the bundled ones
    case = _case_dir(root, base)
    (case / "p.json").write_text(json.dumps(document))
    code, err = run(["simulate", str(case / "p.json"), "--json", str(case / "sim.json")], secret)
    assert_one_line_error(code, err, secret)
    assert not (case / "sim.json").exists(), change


DTYPES = st.sampled_from(["<U3", "S2", "O", "float32", "float64", "int64", "bool", "complex64", "datetime64[s]", "V4"])
SHAPES = st.lists(st.integers(0, 5), max_size=3).map(tuple)


@SETTINGS
@given(arrays=st.dictionaries(st.sampled_from(["x", "y", "ids"]), st.tuples(DTYPES, SHAPES), min_size=1, max_size=3))
def test_broken_npz_is_one_line_exit_2(base: Path, work: tuple[Path, Path], arrays: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """No shape drawn is the model's (8, 16), so every file is wrong in name, dtype or shape."""
    root, secret = work
    case = _case_dir(root, base, "stages")
    values = {}
    for name, (dtype, shape) in arrays.items():
        values[name] = np.zeros(shape, dtype=dtype) if dtype != "O" else np.full(shape, None, dtype=object)
    np.savez(case / "in.npz", **values)
    code, err = run(["run", str(case / "stages"), "--inputs", str(case / "in.npz"), "-o", str(case / "o.npz")], secret)
    assert_one_line_error(code, err, secret)
    assert not (case / "o.npz").exists()
