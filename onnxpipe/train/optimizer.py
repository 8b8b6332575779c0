"""Optimizers in numpy: the worker holds weights as arrays and updates them after the gradients of all micro-batches are in.

Semantics follow torch.optim (SGD with momentum, AdamW), so losses compare with any framework's. With master weights
(mixed precision as DeepSpeed and Megatron train float16 models), each float16 weight has a float32 copy that the
update is computed on, its state in float32, and the weight is that copy rounded: in float16 alone AdamW's eps (1e-8)
and small squared gradients are 0, and updates below half a float16 step are lost.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from onnxpipe.errors import OnnxpipeError
from onnxpipe.pricing.problem import MASTER_SUFFIX

__all__ = ["OptimizerConfig", "Optimizer", "OPTIMIZERS"]

OPTIMIZERS = ("sgd", "adamw")


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = "sgd"
    lr: float = 0.01
    #: SGD only.
    momentum: float = 0.0
    #: AdamW only (torch defaults).
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    #: Float32 master copies (and float32 state) of float16 weights.
    master_weights: bool = False

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise OnnxpipeError(f"unknown optimizer {self.name!r}; choose one of: {', '.join(OPTIMIZERS)}")
        if not self.lr > 0:
            raise OnnxpipeError(f"--lr must be positive (got {self.lr})")
        if not 0 <= self.momentum < 1:
            raise OnnxpipeError(f"--momentum must be in [0, 1) (got {self.momentum})")

    @property
    def planned_as(self) -> str:
        """The planner's name for the state this optimizer keeps per weight: "sgd" none, "momentum" one, "adam" two;
        "-master" with master weights (`pricing.problem.optimizer_states`)."""
        base = "adam" if self.name == "adamw" else "momentum" if self.momentum else "sgd"
        return base + MASTER_SUFFIX if self.master_weights else base


class Optimizer:
    """Updates parameters in place; its state (`state()`/`load_state`) goes into checkpoints."""

    def __init__(self, config: OptimizerConfig) -> None:
        self.config = config
        self.steps = 0
        self.slots: dict[str, np.ndarray] = {}

    def step(self, params: dict[str, np.ndarray], grads: Mapping[str, np.ndarray]) -> None:
        """One step of every weight with a gradient. Quietly: a step that makes NaN or inf (float16 AdamW's 0/0) shows
        in the next loss, where the run stops naming the way out (`fit`), not as numpy's warning in the terminal."""
        self.steps += 1
        with np.errstate(all="ignore"):
            self._step(params, grads)

    def _step(self, params: dict[str, np.ndarray], grads: Mapping[str, np.ndarray]) -> None:
        for name, g in grads.items():
            weight = params[name]
            if self.config.master_weights and weight.dtype == np.float16:
                master = self.slots.setdefault(f"{name}/master", weight.astype(np.float32))
                self._update(name, master, g.astype(np.float32))
                weight[...] = master
            else:
                self._update(name, weight, g)

    def _update(self, name: str, p: np.ndarray, g: np.ndarray) -> None:
        """One step of `p` in place, its state in `p`'s type."""
        c = self.config
        if c.name == "sgd":
            if c.momentum:
                buf = self.slots.get(f"{name}/momentum")
                buf = g.copy() if buf is None else buf * np.float32(c.momentum) + g
                self.slots[f"{name}/momentum"] = buf
                g = buf
            p -= np.asarray(c.lr, p.dtype) * g
        else:
            b1, b2 = c.betas
            m = self.slots.setdefault(f"{name}/exp_avg", np.zeros_like(p))
            v = self.slots.setdefault(f"{name}/exp_avg_sq", np.zeros_like(p))
            p *= np.asarray(1 - c.lr * c.weight_decay, p.dtype)
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * g * g
            bias1 = 1 - b1**self.steps
            bias2 = 1 - b2**self.steps
            denom = np.sqrt(v) / np.asarray(np.sqrt(bias2), p.dtype) + np.asarray(c.eps, p.dtype)
            p -= np.asarray(c.lr / bias1, p.dtype) * m / denom

    def state(self) -> dict[str, np.ndarray]:
        return {"steps": np.asarray(self.steps), **{f"slot:{k}": v for k, v in self.slots.items()}}

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        self.steps = int(state["steps"])
        self.slots = {k[len("slot:"):]: np.array(v) for k, v in state.items() if k.startswith("slot:")}
