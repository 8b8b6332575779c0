"""The README's Python example runs as written: the documented API is the real one."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_python_api_example_runs(tmp_path: Path) -> None:
    section = README.read_text().split("## Python API", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    bottleneck, bound, status = lines[0].split()
    assert float(bound) <= float(bottleneck) and status in ("OPTIMAL", "FEASIBLE")
    errors = eval(lines[1], {})  # the printed dict of output -> max relative error
    assert errors and max(errors.values()) <= 1e-5
    losses = [float(x) for x in lines[2:5]]
    assert all(0 < loss < 20 for loss in losses)
    assert (tmp_path / "trained.onnx").is_file() and (tmp_path / "stages" / "manifest.json").is_file()
