"""The command line as a user meets it: every command in a fresh `python -m onnxpipe` process, its
`--help`, and a happy path on a tiny zoo model with the key lines of its output checked.

The happy paths run in order on one module-wide directory (build -> annotate -> inspect -> plan -> split ->
verify -> run -> simulate -> report; train on its own training model)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

ENV = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}


def onnxpipe(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "onnxpipe", *argv], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)


def ok(*argv: str, cwd: Path) -> str:
    result = onnxpipe(*argv, cwd=cwd)
    assert result.returncode == 0, f"{argv}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    assert "Traceback" not in result.stderr
    return result.stdout


HELP = {
    (): ["--debug", "annotate", "split", "verify", "run", "plan", "train", "simulate", "report", "inspect", "models", "targets"],
    ("inspect",): ["--nodes", "--dim"],
    ("models",): ["build"],
    ("models", "build"): ["--output", "--set", "--train", "--sparse"],
    ("targets",): ["show"],
    ("targets", "show"): ["target", "bundled target name"],
    ("annotate",): ["--output", "--json", "--profile", "--dim"],
    ("plan",): ["--target", "--stages", "--microbatches", "--schedule", "--recompute", "--time-limit", "--compare", "--output"],
    ("split",): ["--target", "--output", "--stages", "--plan", "--cuts", "--force", "--annotated"],
    ("verify",): ["directory", "model", "--samples", "--seed", "--dim"],
    ("run",): ["--inputs", "--output", "--microbatches"],
    ("train",): ["--target", "--steps", "--microbatches", "--schedule", "--loss", "--labels", "--checkpoint-dir", "--resume", "--check", "--json"],
    ("simulate",): ["--target", "--schedule", "--microbatches", "--json"],
    ("report",): ["--output", "--target", "--model", "--schedule"],
}


@pytest.mark.parametrize("command", list(HELP), ids=[" ".join(c) or "onnxpipe" for c in HELP])
def test_help_exits_0_and_names_the_options(command: tuple[str, ...], tmp_path: Path) -> None:
    out = ok(*command, "--help", cwd=tmp_path)
    assert "Usage:" in out
    missing = [option for option in HELP[command] if option not in out]
    assert not missing, f"`onnxpipe {' '.join(command)} --help` does not mention {missing}:\n{out}"


def test_no_command_shows_usage(tmp_path: Path) -> None:
    result = onnxpipe(cwd=tmp_path)
    assert "Usage:" in result.stdout + result.stderr and "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model built by the CLI itself, shared by the happy paths."""
    root = tmp_path_factory.mktemp("cli")
    out = ok("models", "build", "mlp", "-o", "mlp.onnx", "--set", "layers=3", cwd=root)  # 7 compute nodes: 4 Gemm, 3 Relu
    assert re.search(r"wrote mlp\.onnx \(mlp, \d+ nodes, [\d.]+ MiB\)", out)
    return root


def test_models_lists_the_zoo(tmp_path: Path) -> None:
    out = ok("models", cwd=tmp_path)
    for name in ("mlp", "gpt2-tiny", "resnet50", "two-io"):
        assert name in out


def test_targets_lists_and_shows(tmp_path: Path) -> None:
    out = ok("targets", cwd=tmp_path)
    for name in ("fpga4", "gpu4", "hetero", "cpu2", "cpu4"):
        assert name in out
    shown = ok("targets", "show", "fpga4", cwd=tmp_path)
    assert "fpga4" in shown and "u280" in shown and "links" in shown and "8 GiB" in shown


def test_annotate(work: Path) -> None:
    out = ok("annotate", "mlp.onnx", "-o", "mlp.annotated.onnx", "--json", "costs.json", cwd=work)
    assert "Gemm" in out and re.search(r"total: \d+ nodes, .* forward, .* backward", out)
    assert "wrote mlp.annotated.onnx" in out and "wrote costs.json" in out
    data = json.loads((work / "costs.json").read_text())
    assert data["totals"]["flops"] > 0


def test_inspect(work: Path) -> None:
    out = ok("inspect", "mlp.onnx", "--nodes", cwd=work)
    assert "mlp.onnx: 7 compute nodes" in out and "op types: Gemm x4, Relu x3" in out and "fc0/Gemm" in out


def test_plan(work: Path) -> None:
    out = ok("plan", "mlp.onnx", "-t", "fpga4", "--stages", "2", "--time-limit", "5", "-o", "plan.json", "--compare", cwd=work)
    assert re.search(r"2 stages of mlp\.onnx on .*fpga4", out)
    assert re.search(r"lower bound: [\d.]+ ms \(bottleneck / bound = [\d.]+\)", out)
    assert re.search(r"solver: (OPTIMAL|FEASIBLE) node by node, bound [\d.]+ ms, gap", out) and "baselines" in out and "wrote plan.json" in out
    assert len(json.loads((work / "plan.json").read_text())["stages"]) == 2


def test_plan_compare_at_one_stage_says_there_is_nothing_to_compare(work: Path) -> None:
    out = ok("plan", "mlp.onnx", "-t", "fpga4", "--stages", "1", "--microbatches", "1", "--batch", "8", "--time-limit", "5", "--compare", cwd=work)
    assert re.search(r"1 stage of mlp\.onnx on fpga4: batch 8, 1 micro-batch, ", out)
    assert "(8 samples, 1 micro-batch)" in out  # a forward-only plan: no schedule named
    assert re.search(r"--compare: the plan is one stage \(on \d devices?\)", out) and "nothing to compare" in out
    assert "baselines (same cost model)" not in out and "uniform-nodes" not in out and not re.search(r"\d\.\d\dx", out)  # no uniform plan on one device sold as a speed-up
    assert "note: 2 stages would be faster" in out or "would be faster" not in out


def test_plan_on_many_devices_shows_a_wide_stage_briefly_and_small_times_in_three_digits(work: Path) -> None:
    """A stage of many replicas shows its first and last devices and their count (every name squeezed the table's other
    columns out on 1,000 devices), and times under 0.1 ms keep three significant digits (they read 0.000 ms)."""
    from onnxpipe.target import load_target

    target = work / "fpga64.toml"
    target.write_text(re.sub(r"(?m)^count = \d+", "count = 64", Path(load_target("fpga4").source).read_text()))
    out = ok("plan", "mlp.onnx", "-t", str(target), "--stages", "1", "--time-limit", "5", cwd=work)
    row = re.search(r"│\s*0 │ u280_0 \.\.\. u280_(\d+)\s*│\s*7\s*│\s*([\d.]+)\s*│", out)  # the count wraps to the next line
    assert row and int(row.group(1)) >= 4 and len(row.group(2).lstrip("0.")) >= 3, out
    assert f"({int(row.group(1)) + 1})" in out
    bottleneck = re.search(r"bottleneck: stage 0, ([\d.]+) ms per micro-batch", out)
    assert bottleneck and len(bottleneck.group(1).lstrip("0.")) >= 3, out


def test_split_verify_run(work: Path) -> None:
    out = ok("split", "mlp.onnx", "--plan", "plan.json", "-o", "stages", cwd=work)
    assert "2 stages of mlp.onnx" in out and "wrote stages/ (stage_*.onnx, manifest.json, plan.json)" in out
    assert sorted(p.name for p in (work / "stages").iterdir()) == ["manifest.json", "plan.json", "stage_0.onnx", "stage_1.onnx"]

    out = ok("verify", "stages", "mlp.onnx", cwd=work)
    assert re.search(r"the 1 output matches within 1e-05 relative", out)

    x = np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32)
    np.savez(work / "in.npz", x=x)
    out = ok("run", "stages", "--inputs", "in.npz", "-o", "out.npz", "--microbatches", "2", cwd=work)
    assert "wrote out.npz" in out
    session = ort.InferenceSession(str(work / "mlp.onnx"), providers=["CPUExecutionProvider"])
    want = np.concatenate([session.run(None, {"x": x[i * 8:(i + 1) * 8]})[0] for i in range(2)])
    with np.load(work / "out.npz") as got:
        np.testing.assert_allclose(got[list(got.files)[0]], want, rtol=1e-5, atol=1e-6)


def test_simulate_and_report(work: Path) -> None:
    out = ok("simulate", "plan.json", "--json", "sim.json", cwd=work)
    assert re.search(r"iteration [\d.]+ ms, .* samples/s, bubble [\d.]+%", out)
    assert json.loads((work / "sim.json").read_text())
    out = ok("report", "plan.json", "-o", "report/index.html", cwd=work)
    assert "index.html" in out
    page = (work / "report" / "index.html").read_text()
    assert "<html" in page.lower() and (work / "report" / "index_gantt.png").stat().st_size > 0


def test_train(work: Path) -> None:
    ok("models", "build", "mlp", "--train", "-o", "mlp-train.onnx", cwd=work)
    out = ok("train", "mlp-train.onnx", "-t", "cpu2", "--stages", "2", "--microbatches", "2", "--steps", "3", "--lr", "0.1",
             "--check", "--json", "train.json", cwd=work)
    assert "training 2 stages (1f1b, 2 micro-batches" in out
    assert re.search(r"losses: [\d.]+ [\d.]+ [\d.]+", out)
    assert re.search(r"check against the unpartitioned model: max loss difference [\d.e+-]+ \(relative\)", out)
    data = json.loads((work / "train.json").read_text())
    assert len(data["losses"]) == 3 and data["check"]["max_loss_rel_diff"] < 1e-5


def test_internal_error_has_its_own_exit_code(tmp_path: Path) -> None:
    """A bug (any exception that is not bad input) exits 3, apart from verify's mismatch (1) and bad input (2)."""
    code = ("import onnxpipe.graph as g\n"
            "def broken(*a, **k):\n    raise ZeroDivisionError('a bug')\n"
            "g.load = broken\n"
            "from onnxpipe.cli import app\napp(['inspect', 'any.onnx'])\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: internal error (ZeroDivisionError: a bug); rerun with --debug for the traceback and report it"]


def test_numpy_warnings_stay_off_stderr(work: Path) -> None:
    """float64 inputs beyond float32's range become inf on the way in; numpy's overflow warning is not shown."""
    np.savez(work / "huge.npz", x=np.full((8, 16), 1e300))
    result = onnxpipe("run", "stages", "--inputs", "huge.npz", "-o", "huge-out.npz", cwd=work)
    assert result.returncode == 0 and result.stderr == "", result.stderr



def test_report_finds_the_model_from_anywhere_and_after_a_move(work: Path, tmp_path: Path) -> None:
    """Plans and manifests record the model relative to themselves: another working directory, or the model and
    its stage directory moved together, still find it; a stage directory moved alone says where it looked."""
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(work / "mlp.onnx", project / "mlp.onnx")
    ok("split", "project/mlp.onnx", "--plan", str(work / "plan.json"), "-o", "project/stages", cwd=tmp_path)
    assert json.loads((project / "stages" / "manifest.json").read_text())["model"] == "../mlp.onnx"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert "not found" not in ok("report", str(project / "stages"), "-o", "r.html", cwd=elsewhere)
    shutil.move(project, tmp_path / "moved")
    assert "not found" not in ok("report", "../moved/stages", "-o", "r2.html", cwd=elsewhere)
    shutil.move(tmp_path / "moved" / "stages", tmp_path / "alone")
    out = ok("report", "alone", "-o", "r3.html", cwd=tmp_path)
    assert f"model not found at {tmp_path / 'mlp.onnx'} (where the plan records it)" in out


def test_verify_accepts_float16_rounding_and_takes_rtol_atol(work: Path) -> None:
    """A float16 model cut in 4 rounds activations at each boundary (~1e-3 relative here): within float16's
    default tolerance, outside an --rtol tighter than that rounding, inside again with a generous --atol."""
    import onnx
    from onnx import TensorProto, numpy_helper

    model = onnx.load(str(work / "mlp.onnx"))
    for t in model.graph.initializer:
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float16), t.name))
    for vi in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = TensorProto.FLOAT16
    onnx.save(model, str(work / "mlp16.onnx"))
    ok("split", "mlp16.onnx", "-t", "fpga4", "--stages", "4", "-o", "stages16", cwd=work)
    out = ok("verify", "stages16", "mlp16.onnx", "--samples", "4", cwd=work)
    error = float(re.search(r"out/Gemm\W+([\d.e+-]+)\W+0\.01\W+ok", out).group(1))
    assert 1e-5 < error < 1e-2, out  # fails the float32 tolerance, as every float16 model did
    tight = onnxpipe("verify", "stages16", "mlp16.onnx", "--rtol", "1e-6", cwd=work)
    assert tight.returncode == 1 and re.search(r"error: output 'out/Gemm' differs by [\d.e+-]+ relative \(> 1e-06\)", tight.stderr)
    ok("verify", "stages16", "mlp16.onnx", "--rtol", "1e-6", "--atol", "1", cwd=work)
