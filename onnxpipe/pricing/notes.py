"""What a plan's prices assumed that its reader should know, as lines for the plan to carry: stage boundaries
that send int8 data at the float size a DequantizeLinear widened it to (and whose int8 readers, cut off from
their DequantizeLinear, run as float kernels), and int8 kernels priced at the float32 rate on devices whose
target lists no int8 rate."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from onnxpipe.pricing.problem import Problem
from onnxpipe.pricing.timemodel import rate_dtype
from onnxpipe.units import format_bytes

__all__ = ["pricing_notes"]

#: Tensors named in a note before the rest are counted.
_NAMED = 3


def pricing_notes(problem: Problem, stage_of: np.ndarray, devices: Sequence[Sequence[str]]) -> tuple[str, ...]:
    """The notes for an assignment: `stage_of` gives each node position's stage, `devices` each stage's devices."""
    return (*_dequantized_cuts(problem, stage_of), *_missing_rates(problem, devices))


def _dequantized_cuts(problem: Problem, stage_of: np.ndarray) -> tuple[str, ...]:
    sent = [(t, source) for t, source in problem.dequantized if (stage_of[problem.tensor_consumers[t]] != stage_of[problem.tensor_producer[t]]).any()]
    if not sent:
        return ()
    t, source = sent[0]
    name, graph = problem.tensor_names[t], problem.graph
    first = (f"'{name}' ({graph.tensors[name].dtype}, {format_bytes(problem.tensor_bytes[t])} per micro-batch) leaves stage "
             f"{int(stage_of[problem.tensor_producer[t]])} as a DequantizeLinear widened int8 '{source}' "
             f"({format_bytes(graph.tensors[source].nbytes * problem.scale)})")
    more = f"; {len(sent) - 1} more such boundary tensor{'s' if len(sent) > 2 else ''}" if len(sent) > 1 else ""
    return (f"{first}{more}: priced at the float size, and its int8 readers beyond the cut at the float rate (nothing fuses them with "
            f"their DequantizeLinear there; a cut before the DequantizeLinear would send the int8 data)",)


def _missing_rates(problem: Problem, devices: Sequence[Sequence[str]]) -> tuple[str, ...]:
    kernels = [c for c in problem.costs.nodes.values() if c.dtype]
    used = {problem.target.device(d).group: problem.target.device(d) for names in devices for d in names}
    notes = []
    for kernel in sorted({c.dtype for c in kernels}):
        # A node measured on the device's kind is priced by its measurement, not by a rate.
        lacking = sorted(g for g, d in used.items() if rate_dtype(d, kernel) != kernel
                         and any(c.dtype == kernel and (c.measured_seconds is None or c.measured_on != d.kind) for c in kernels))
        if lacking:
            notes.append(f"{', '.join(lacking)} in {problem.target.name} list{'s' if len(lacking) == 1 else ''} no {kernel} rate: "
                         f"its {kernel} kernels are priced at float32 (add peak_flops.{kernel}, with its source, to the target)")
    return tuple(notes)
