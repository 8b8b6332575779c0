"""The stage-directory contract: `manifest.json` says how the `stage_<i>.onnx` files chain into the model.

Plain JSON on purpose: a runtime without onnxpipe chains the stages by reading it alone.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from onnxpipe.errors import OnnxpipeError

__all__ = ["MANIFEST_FORMAT", "StageInput", "StageOutput", "Stage", "SharedInitializer", "Manifest"]

MANIFEST_FORMAT = "onnxpipe.stages/1"


@dataclass(frozen=True)
class StageInput:
    name: str
    dtype: str
    shape: tuple[int, ...]
    #: "model" for a model input, else the index of the producing stage.
    source: str | int


@dataclass(frozen=True)
class StageOutput:
    name: str
    dtype: str
    shape: tuple[int, ...]
    #: Stage indices that read it, and/or "model" when it is a model output.
    consumers: tuple[str | int, ...]


@dataclass(frozen=True)
class Stage:
    index: int
    #: File name relative to the directory.
    file: str
    #: Device instance names from the plan.
    devices: tuple[str, ...]
    inputs: tuple[StageInput, ...]
    outputs: tuple[StageOutput, ...]
    #: Trainable initializers held by the stage.
    parameters: tuple[str, ...]
    #: Activation policy chosen by the plan: recompute in backward instead of stashing.
    recompute: bool
    #: Compute nodes placed in the stage (constant chains copied in are not counted).
    nodes: int = 0
    #: Bytes of the stage's trainable initializers.
    parameter_bytes: int = 0
    #: Bytes of the stage file plus its external-data file, if any.
    file_bytes: int = 0
    #: External-data file beside the stage file (models over 2 GB), else None.
    data_file: str | None = None


@dataclass(frozen=True)
class SharedInitializer:
    """An initializer copied into several stages (tied weights): its gradients are summed across them."""

    name: str
    stages: tuple[int, ...]


@dataclass(frozen=True)
class Manifest:
    model: str
    target: str
    inputs: tuple[StageInput, ...]
    #: Model outputs in the original order; `consumers` is ("model",) and the producing stage is found from the stages.
    outputs: tuple[StageOutput, ...]
    stages: tuple[Stage, ...]
    shared: tuple[SharedInitializer, ...]
    #: Name of the model's scalar loss output when it has one.
    loss: str | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["format"] = MANIFEST_FORMAT
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any], origin: str = "<manifest>") -> Manifest:
        if data.get("format") != MANIFEST_FORMAT:
            raise OnnxpipeError(f"{origin}: not an onnxpipe manifest (format {data.get('format')!r}); write the directory with `onnxpipe split`")
        try:
            def inp(d: Mapping[str, Any]) -> StageInput:
                return StageInput(d["name"], d["dtype"], tuple(d["shape"]), d["source"])

            def out(d: Mapping[str, Any]) -> StageOutput:
                return StageOutput(d["name"], d["dtype"], tuple(d["shape"]), tuple(d["consumers"]))

            stages = tuple(
                Stage(
                    index=s["index"],
                    file=s["file"],
                    devices=tuple(s["devices"]),
                    inputs=tuple(inp(i) for i in s["inputs"]),
                    outputs=tuple(out(o) for o in s["outputs"]),
                    parameters=tuple(s["parameters"]),
                    recompute=bool(s["recompute"]),
                    nodes=int(s.get("nodes", 0)),
                    parameter_bytes=int(s.get("parameter_bytes", 0)),
                    file_bytes=int(s.get("file_bytes", 0)),
                    data_file=s.get("data_file"),
                )
                for s in data["stages"]
            )
            return cls(
                model=data["model"],
                target=data["target"],
                inputs=tuple(inp(i) for i in data["inputs"]),
                outputs=tuple(out(o) for o in data["outputs"]),
                stages=stages,
                shared=tuple(SharedInitializer(s["name"], tuple(s["stages"])) for s in data["shared"]),
                loss=data.get("loss"),
            )
        except (KeyError, TypeError) as exc:
            raise OnnxpipeError(f"{origin}: manifest is missing or has a bad field ({exc}); rewrite the directory with `onnxpipe split`") from exc

    @classmethod
    def read(cls, directory: str | os.PathLike) -> Manifest:
        path = Path(directory) / "manifest.json"
        if not path.is_file():
            raise OnnxpipeError(f"{directory}: no manifest.json; pass a directory written by `onnxpipe split`")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise OnnxpipeError(f"{path}: not valid JSON ({exc}); rewrite the directory with `onnxpipe split`") from exc
        return cls.from_json(data, str(path))

    def write(self, directory: str | os.PathLike) -> None:
        path = Path(directory) / "manifest.json"
        path.write_text(json.dumps(self.to_json(), indent=2))
