"""The plan: stages in order with their devices, nodes, predicted times and memory; read and written as JSON."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from onnxpipe.errors import OnnxpipeError
from onnxpipe.fileio import write_json
from onnxpipe.pricing.stage import Memory, seconds_per_microbatch
from onnxpipe.records import RecordError, read_record
from onnxpipe.safepath import reference_from, reference_to

__all__ = ["Memory", "StagePlan", "SolveInfo", "Candidate", "Plan", "PLAN_FORMAT"]

PLAN_FORMAT = "onnxpipe.plan/1"


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage. Times are per micro-batch on one of its devices (replicas share the work)."""

    index: int
    #: Device instance names; more than one means the stage is replicated (data parallel inside the stage).
    devices: tuple[str, ...]
    #: Node names in topological order (compute nodes only; constant chains are copied where needed).
    nodes: tuple[str, ...]
    forward_seconds: float
    backward_seconds: float
    #: Seconds spent receiving inputs from earlier stages, per micro-batch.
    comm_in_seconds: float
    comm_out_seconds: float
    comm_in_bytes: float
    comm_out_bytes: float
    #: Gradient all-reduce per iteration for replicated stages.
    allreduce_seconds: float
    #: True: only stage inputs are stashed and backward recomputes the forward.
    recompute: bool
    memory: Memory
    #: Bytes one micro-batch leaves stashed on one device from its forward to its backward (its
    #: activations, or its inputs when recomputing); 0 when unknown (the simulator derives it from memory).
    stash_bytes: float = 0.0
    #: Other stages holding a copy of some of this stage's trained weights (tied weights): at STEP every
    #: holder waits for the others, then they exchange those weights' gradients.
    tied: tuple[int, ...] = ()
    #: Bytes of those shared weights.
    tied_bytes: float = 0.0
    #: How much longer its forward and backward take while other workers compute on the target's shared
    #: cores and their working sets overflow its shared cache (0.1: 10% longer); 0 where the target has no
    #: `corun_bandwidth`.
    corun_slowdown: float = 0.0
    #: The part of `backward_seconds` that computes weight gradients, which a split backward (ZB-H1) runs
    #: as W; 0 when unknown (such a stage's W takes no time and its B the whole backward).
    weight_seconds: float = 0.0

    def seconds_per_microbatch(self, microbatches: int) -> float:
        """Busy time plus this stage's share of its per-iteration all-reduce: what the planner balances."""
        return seconds_per_microbatch(self.forward_seconds, self.backward_seconds, self.comm_in_seconds + self.comm_out_seconds,
                                      self.allreduce_seconds, microbatches)


@dataclass(frozen=True)
class SolveInfo:
    """How the plan was found and how good it provably is. A coarsened problem is solved over blocks,
    then refined around the plan's cuts; what CP-SAT proves over blocks holds only for plans made of them."""

    #: "OPTIMAL" (no plan made of the `blocks` coarse blocks beats this one: every plan when `blocks` is
    #: the node count; a refined plan may beat the best of them; where a group of over 32 devices is offered some
    #: replica counts only, it meets `bound_seconds`), "FEASIBLE" (CP-SAT proved no such thing),
    #: or the name of the method for baselines ("dp", "uniform", ...).
    status: str
    #: A lower bound on the bottleneck (seconds per micro-batch) of every plan of this configuration,
    #: whatever its cuts: CP-SAT's proven bound when it searched single nodes (over stages that each run
    #: on one device type, the planner's space), else the first-principles one.
    bound_seconds: float
    #: (objective - bound) / objective: how far above the best possible plan this one may be, at most.
    gap: float
    solve_seconds: float
    #: Most work rounding a cut to the coarse blocks moves onto a stage, as a fraction of the objective: what
    #: the coarse solve may have lost (communication aside); refinement wins some of it back.
    coarsening_loss: float
    #: Blocks the graph was coarsened to for the first solve.
    blocks: int
    #: The least bottleneck among the plans found (`status` says whether it is proven least): the plan's own, unless the
    #: plan was chosen for a shorter predicted iteration at a larger bottleneck; 0 where not recorded.
    least_bottleneck_seconds: float = 0.0


@dataclass(frozen=True)
class Candidate:
    """One configuration tried during exploration."""

    schedule: str
    microbatches: int
    stages: int
    replicas: int
    iteration_seconds: float
    peak_memory_bytes: float
    feasible: bool
    note: str = ""
    #: Predicted latency of its plan (inference; 0 in training).
    latency_seconds: float = 0.0


@dataclass(frozen=True)
class Plan:
    """A partition of a model over a target, with its predicted quality."""

    #: Path of the model it was planned for.
    model: str
    #: Digest of the model's compute nodes (names and op types); a plan for another model is refused.
    fingerprint: str
    #: Target name or path.
    target: str
    dims: Mapping[str, int]
    #: Global batch per iteration.
    batch: int
    microbatches: int
    #: "gpipe" or "1f1b".
    schedule: str
    #: "sgd" or "adam".
    optimizer: str
    stages: tuple[StagePlan, ...]
    #: Bottleneck stage time per micro-batch (the objective).
    bottleneck_seconds: float
    #: First-principles lower bound on the bottleneck.
    lower_bound_seconds: float
    #: Predicted time of one iteration (all micro-batches, fill and drain, optimizer all-reduce).
    iteration_seconds: float
    solver: SolveInfo
    explored: tuple[Candidate, ...] = field(default=())
    #: "training" or "inference" (forward only: no gradients, optimizer state or stash; the bottleneck is the
    #: throughput objective).
    mode: str = "training"
    #: Predicted seconds one micro-batch takes through the whole pipeline (inference; 0 for training plans).
    latency_seconds: float = 0.0
    #: What the prices assumed that the reader should know (`pricing.notes`): a stage boundary sending int8 data
    #: at the float size a DequantizeLinear made of it, int8 kernels priced at float32 where a device has no int8 rate.
    notes: tuple[str, ...] = ()

    @property
    def bottleneck_stage(self) -> int:
        return max(range(len(self.stages)), key=lambda i: self.stages[i].seconds_per_microbatch(self.microbatches))

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["format"] = PLAN_FORMAT
        data["dims"] = dict(self.dims)
        return data

    @classmethod
    def from_json(cls, data: object, origin: str = "<plan>") -> Plan:
        """The plan in `data`, every field's type and value checked (an OnnxpipeError naming the field)."""
        return read_record(cls, data, origin, PLAN_FORMAT, _ensure_values, kind="plan",
                           write="write one with `onnxpipe plan`", rewrite="regenerate it with `onnxpipe plan`")

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically: a reader never sees half a plan. The model's path is recorded relative to the plan's folder."""
        try:
            write_json(path, self.to_json() | {"model": reference_from(self.model, Path(path).parent)})
        except OSError as exc:
            raise OnnxpipeError(f"{path}: cannot write the plan ({exc.strerror}); choose a writable -o path") from exc

    @classmethod
    def read(cls, path: str | os.PathLike) -> Plan:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError as exc:
            raise OnnxpipeError(f"{path}: no such plan file; write one with `onnxpipe plan ... -o {path}`") from exc
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise OnnxpipeError(f"{path}: not valid JSON ({exc}); regenerate it with `onnxpipe plan`") from exc
        plan = cls.from_json(data, str(path))
        return replace(plan, model=reference_to(plan.model, Path(path).parent))


def _ensure_values(plan: Plan) -> None:
    """Values the types alone do not rule out, checked before anything reads the plan."""
    from onnxpipe.schedule import TABLES

    if plan.schedule not in TABLES:
        raise RecordError(f"schedule: {plan.schedule!r} is not one of {', '.join(TABLES)}")
    if plan.microbatches < 1 or plan.batch < 1 or plan.batch % plan.microbatches:
        raise RecordError(f"batch {plan.batch}, microbatches {plan.microbatches}: need at least 1 micro-batch, each of the same whole size")
    if not plan.stages or [s.index for s in plan.stages] != list(range(len(plan.stages))):
        raise RecordError("stages: must be numbered 0..k-1 in order, at least one")
    for name, value in plan.dims.items():
        if value < 1:
            raise RecordError(f"dims.{name}: {value} is not a positive size")
    for stage in plan.stages:
        if not stage.devices:
            raise RecordError(f"stages[{stage.index}].devices: empty")
        numbers = {f.name: getattr(stage, f.name) for f in fields(stage) if isinstance(getattr(stage, f.name), float)}
        numbers.update({f"memory.{k}": v for k, v in asdict(stage.memory).items()})
        negative = next((k for k, v in numbers.items() if v < 0), None)
        if negative is not None:
            raise RecordError(f"stages[{stage.index}].{negative}: {numbers[negative]} is negative")
    if min(plan.bottleneck_seconds, plan.lower_bound_seconds, plan.iteration_seconds) < 0:
        raise RecordError("bottleneck_seconds, lower_bound_seconds and iteration_seconds must not be negative")
