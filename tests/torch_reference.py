"""The PyTorch fixtures' references (tools/export_torch_fixtures.py): the batches in `<name>.npz` and the losses
PyTorch's own SGD reached on them in `<name>.json`, and the losses pipelined training reaches on the same batches."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from onnxpipe.train.optimizer import OptimizerConfig
from onnxpipe.train.pipeline import Pipeline

DATA = Path(__file__).parent / "data"


def reference(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


def pipelined_losses(name: str, stages: int, schedule: str, *, data: str | None = None, **options: object) -> np.ndarray:
    """SGD at the reference's rate on its batches, 2 micro-batches, `stages` stages on cpu4 (in this process).
    `data`: the reference's name where another export of the same model holds it (default `name`)."""
    ref, batches = reference(data or name), np.load(DATA / f"{data or name}.npz")
    with Pipeline(DATA / f"{name}.onnx", "cpu4", stages=stages, batch=ref["batch"], microbatches=2, schedule=schedule,
                  optimizer=OptimizerConfig("sgd", lr=ref["lr"]), processes=False, **options) as pipe:
        assert pipe.stages == stages
        return np.array([pipe.train_step({key: batches[key][s] for key in batches.files}) for s in range(ref["steps"])])
