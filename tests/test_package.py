"""The installed wheel carries the bundled targets and the model zoo, not only the source tree."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_ships_targets_and_models(tmp_path: Path) -> None:
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(wheels), str(ROOT)], check=True, capture_output=True, timeout=300)
    wheel = next(wheels.glob("onnxpipe-*.whl"))
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, capture_output=True, timeout=300)
    code = (
        "import onnxpipe, onnxpipe.models as zoo, onnxpipe.target as t\n"
        "print(onnxpipe.__file__)\n"
        "print(','.join(t.bundled_targets()), *[len(t.load_target(n).devices) for n in t.bundled_targets()])\n"
        "print(len(zoo.build('gpt2-tiny').graph.node))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    where, targets, nodes = run.stdout.splitlines()
    assert where.startswith(str(site))
    assert targets.split()[0] == "fpga4,gpu4,h100x8,hetero,cpu2,cpu4" and targets.split()[1:] == ["4", "4", "8", "4", "2", "4"]
    assert int(nodes) > 100
    cli = subprocess.run([sys.executable, "-m", "onnxpipe", "targets", "show", "hetero"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and "u280" in cli.stdout and "v100" in cli.stdout
