"""One self-contained HTML page about a plan: stage table, schedule Gantt chart, memory, the model by stage.

Reading order: `write` (public entry) -> the figures `gantt_figure`, `memory_figure`, `model_figure`
-> `_html` (the page) -> small drawing helpers. matplotlib (Agg) is imported inside the figure
functions only, so importing onnxpipe never pulls it in.
"""

from __future__ import annotations

import base64
import html
import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from onnxpipe.cost import Costs
from onnxpipe.errors import OnnxpipeError
from onnxpipe.fileio import write_bytes
from onnxpipe.graph import Graph
from onnxpipe.plan.result import Plan
from onnxpipe.simulate import Event, Simulation
from onnxpipe.units import format_bytes, format_seconds, plural

__all__ = ["write", "model_costs", "gantt_figure", "memory_figure", "model_figure", "COLORS"]

#: One colour per kind of time, shared by every chart.
COLORS = {
    "F": "#4C72B0",
    "B": "#DD8452",
    "W": "#E8B07A",
    "SEND": "#8172B3",
    "RECV": "#B3A2D9",
    "ALLREDUCE": "#C44E52",
    "STEP": "#55A868",
    "idle": "#EEEEEE",
}
_LABELS = {"F": "forward", "B": "backward", "W": "weight gradients", "SEND": "send", "RECV": "receive", "ALLREDUCE": "all-reduce", "STEP": "optimizer step", "idle": "idle"}
_MEMORY_COLORS = {"parameters": "#4C72B0", "gradients": "#DD8452", "optimizer": "#55A868", "activations": "#C44E52"}


def write(
    path: str | os.PathLike,
    plan: Plan,
    simulation: Simulation,
    *,
    graph: Graph | None = None,
    costs: Costs | None = None,
    measured: Sequence[Event] | None = None,
) -> tuple[Path, ...]:
    """Write `path` (HTML with the figures embedded) and the figures beside it as `<stem>_*.png`, so two
    reports in one directory keep their own pictures.

    `measured` is a timeline in the simulator's event format (e.g. recorded by the executor); it is
    drawn under the simulated one on the same time axis. The model strip needs `graph` and `costs`.
    Returns the files written; each is written to a temporary name first and then renamed.
    """
    path = Path(path)
    figures = {"gantt": gantt_figure(simulation, plan, measured), "memory": memory_figure(plan, simulation)}
    if graph is not None and costs is not None:
        figures["model"] = model_figure(graph, costs, plan)
    pngs = {name: _png(fig) for name, fig in figures.items()}
    page = _html(plan, simulation, pngs, measured)
    written: list[Path] = []
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for name, data in pngs.items():
            written.append(write_bytes(path.with_name(f"{path.stem}_{name}.png"), data))
        written.append(write_bytes(path, page.encode("utf-8")))
    except OSError as exc:  # all or nothing: drop the figures already written
        for done in written:
            done.unlink(missing_ok=True)
        raise OnnxpipeError(f"{path}: cannot write the report ({exc.strerror or exc}); choose a writable -o") from exc
    return tuple(written)


def model_costs(plan: Plan, model: str | os.PathLike | None = None) -> tuple[Graph, Costs] | None:
    """The graph and analytic costs of the plan's model (or `model`), for the model strip; None when absent."""
    from onnxpipe.cost import annotate
    from onnxpipe.graph import load

    source = Path(model) if model else Path(plan.model)
    if not source.is_file():
        if model:
            raise OnnxpipeError(f"{model}: no such model file; pass the .onnx the plan was made for with --model")
        return None
    graph = load(source, plan.dims)
    if graph.fingerprint != plan.fingerprint:
        raise OnnxpipeError(f"{source}: not the model this plan was made for (fingerprints differ); pass the right one with --model")
    return graph, annotate(graph)


def gantt_figure(simulation: Simulation, plan: Plan, measured: Sequence[Event] | None = None) -> Any:
    """Per worker (stage s, replica j), a compute lane (F, B, all-reduce, step on idle grey) and a thin
    communication lane: replicas of a stage run different micro-batches at once, so each has its own."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    timelines = [("simulated", simulation.events)] + ([("measured", tuple(measured))] if measured else [])
    span = max(max((e.end for e in events), default=0.0) for _, events in timelines) or 1.0
    scale, unit = _time_unit(span)
    lanes = [(s, j) for s, stage in enumerate(plan.stages) for j in range(len(stage.devices))]
    k = len(lanes)
    fig, axes = plt.subplots(len(timelines), 1, figsize=(13, 0.9 * k * len(timelines) + 1.6), squeeze=False, sharex=True)
    for ax, (title, events) in zip(axes[:, 0], timelines):
        for i, lane in enumerate(lanes):
            y = k - 1 - i
            ax.broken_barh([(0, span * scale)], (y - 0.3, 0.6), color=COLORS["idle"])
            for e in (e for e in events if (e.stage, e.replica) == lane):
                x, w = e.start * scale, (e.end - e.start) * scale
                if e.kind in ("SEND", "RECV"):
                    ax.broken_barh([(x, w)], (y - 0.45, 0.12) if e.kind == "SEND" else (y + 0.33, 0.12), color=COLORS[e.kind])
                    continue
                ax.broken_barh([(x, w)], (y - 0.3, 0.6), facecolor=COLORS[e.kind], edgecolor="white", linewidth=0.5)
                if e.microbatch >= 0 and w > span * scale / 70:
                    ax.text(x + w / 2, y, str(e.microbatch), ha="center", va="center", fontsize=8, color="white")
        ax.set_yticks(range(k))
        ax.set_yticklabels([_lane_label(plan, s, j) for s, j in reversed(lanes)], fontsize=8)
        ax.set_ylim(-0.6, k - 0.4)
        ax.set_xlim(0, span * scale * 1.01)
        ax.set_title(f"{title}: {plan.schedule if title == 'simulated' else simulation.schedule}, {plural(simulation.microbatches, 'micro-batch')}", fontsize=10, loc="left")
        ax.grid(axis="x", color="#cccccc", linewidth=0.5)
        ax.set_axisbelow(True)
    axes[-1, 0].set_xlabel(f"time ({unit})")
    kinds = tuple(c for c in ("F", "B", "W", "SEND", "RECV", "ALLREDUCE", "STEP", "idle") if c != "W" or any(e.kind == "W" for _, events in timelines for e in events))
    fig.legend([Patch(color=COLORS[c]) for c in kinds], [_LABELS[c] for c in kinds], loc="upper right", ncol=len(kinds), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    return fig


def _lane_label(plan: Plan, stage: int, replica: int) -> str:
    devices = plan.stages[stage].devices
    if len(devices) == 1:
        return f"stage {stage}\n{devices[0]}"
    return f"stage {stage} replica {replica}\n{devices[replica]}"


def memory_figure(plan: Plan, simulation: Simulation) -> Any:
    """Left: peak memory per stage stacked by kind against capacity. Right: memory over the iteration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = len(plan.stages)
    top = max(simulation.peak_memory_bytes + tuple(s.memory.total for s in plan.stages)) or 1.0
    factor, unit = _byte_unit(top)
    fig, (bars, lines) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [1, 1.6]})
    for s, stage in enumerate(plan.stages):
        live = simulation.peak_memory_bytes[s] - simulation.static_memory_bytes[s]
        parts = {"parameters": stage.memory.parameters, "gradients": stage.memory.gradients, "optimizer": stage.memory.optimizer, "activations": live}
        bottom = 0.0
        for kind, value in parts.items():
            bars.bar(s, value / factor, bottom=bottom, color=_MEMORY_COLORS[kind], width=0.6, label=kind if s == 0 else None)
            bottom += value / factor
        capacity = simulation.capacity_bytes[s] / factor
        if capacity <= 1.4 * top / factor:
            bars.hlines(capacity, s - 0.4, s + 0.4, colors="black", linewidth=2, label="capacity" if s == 0 else None)
        else:
            bars.text(s, bottom, f"cap. {format_bytes(simulation.capacity_bytes[s])}\n(off scale)", ha="center", va="bottom", fontsize=7)
    bars.set_ylim(0, 1.4 * top / factor)
    bars.set_xticks(range(k))
    bars.set_xticklabels([f"stage {s}" for s in range(k)], fontsize=8)
    bars.set_ylabel(f"peak memory per device ({unit})")
    bars.set_title("peak memory by kind", fontsize=10, loc="left")
    bars.legend(fontsize=7, loc="upper right", ncol=1)
    span = simulation.iteration_seconds or 1.0
    scale, tunit = _time_unit(span)
    for s, samples in enumerate(simulation.memory):
        xs = [t * scale for t, _ in samples] + [span * scale]
        ys = [b / factor for _, b in samples] + [samples[-1][1] / factor]
        lines.step(xs, ys, where="post", label=f"stage {s}", linewidth=1.2)
    lines.set_xlabel(f"time ({tunit})")
    lines.set_ylabel(unit)
    lines.set_title("memory over the iteration (simulated)", fontsize=10, loc="left")
    lines.legend(fontsize=7, loc="upper right")
    lines.grid(color="#dddddd", linewidth=0.5)
    fig.tight_layout()
    return fig


def model_figure(graph: Graph, costs: Costs, plan: Plan) -> Any:
    """The compute nodes in topological order as blocks as wide as their FLOPs, coloured by stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    stage_of = {n: s.index for s in plan.stages for n in s.nodes}
    nodes = [n for n in graph.order if n in costs.nodes]
    flops = [costs.nodes[n].flops + costs.nodes[n].backward_flops for n in nodes]
    total = sum(flops) or 1.0
    floor = total / max(len(nodes), 1) / 50  # zero-FLOP nodes stay visible as slivers
    widths = [max(f, floor) for f in flops]
    width = sum(widths)
    cmap = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(13, 2.0))
    x = 0.0
    for name, w in zip(nodes, widths):
        s = stage_of.get(name, -1)
        ax.add_patch(plt.Rectangle((x, 0), w, 1, facecolor=cmap(s % 10) if s >= 0 else "#999999", edgecolor="white", linewidth=0.3))
        if w > width * 0.035:
            ax.text(x + w / 2, 0.5, costs.nodes[name].op_type, ha="center", va="center", rotation=90, fontsize=7, color="white")
        x += w
    ax.set_xlim(0, width)
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    ax.xaxis.set_major_formatter(lambda v, _: f"{v / 1e9:g}")
    ax.set_xlabel("nodes in topological order; width = forward + backward GFLOP (per batch)")
    ax.set_title(f"{Path(graph.source).name}: {plural(len(nodes), 'node')} in {plural(len(plan.stages), 'stage')}", fontsize=10, loc="left")
    handles = [Patch(color=cmap(s.index % 10)) for s in plan.stages]
    shares = [sum(f for n, f in zip(nodes, flops) if stage_of.get(n) == s.index) / total for s in plan.stages]
    ax.legend(handles, [f"stage {s.index} ({p:.0%})" for s, p in zip(plan.stages, shares)], loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=min(8, len(plan.stages)), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def _html(plan: Plan, sim: Simulation, pngs: dict[str, bytes], measured: Sequence[Event] | None) -> str:
    rows = []
    for s, stage in enumerate(plan.stages):
        cells = (
            str(s),
            _devices(stage.devices),
            str(len(stage.nodes)),
            format_seconds(stage.forward_seconds),
            format_seconds(stage.backward_seconds),
            format_bytes(stage.comm_in_bytes),
            format_bytes(stage.comm_out_bytes),
            format_seconds(stage.allreduce_seconds) if stage.allreduce_seconds else "-",
            "yes" if stage.recompute else "no",
            format_seconds(sim.busy_seconds[s]),
            f"{format_bytes(sim.peak_memory_bytes[s])} / {format_bytes(sim.capacity_bytes[s])}",
        )
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    heads = ("stage", "devices", "nodes", "forward / mb", "backward / mb", "in / mb", "out / mb", "all-reduce", "recompute", "busy / iteration", "peak memory / capacity")
    figures = "".join(
        f'<h2>{title}</h2><img alt="{title}" src="data:image/png;base64,{base64.b64encode(pngs[name]).decode("ascii")}">'
        for name, title in (("gantt", "Schedule" + (" (simulated and measured)" if measured else "")), ("memory", "Memory"), ("model", "Model by stage"))
        if name in pngs
    )
    inference = plan.mode == "inference"
    summary = (
        f"{plural(len(plan.stages), 'stage')}, {'inference (forward only)' if inference else plan.schedule}, "
        f"{plural(sim.microbatches, 'micro-batch')} of a batch of {plan.batch}; "
        f"iteration {format_seconds(sim.iteration_seconds)}, {sim.samples_per_s:.4g} samples/s, bubble {sim.bubble_fraction:.1%}"
        + (f", latency {format_seconds(sim.latency_seconds)} per micro-batch; " if inference else "; ") +
        f"planner bound {format_seconds(plan.lower_bound_seconds)} per micro-batch at the bottleneck, solver {plan.solver.status}"
    )
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>onnxpipe report: {html.escape(Path(plan.model).name)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1400px}}table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}}th{{background:#f3f3f3}}img{{max-width:100%}}</style></head>
<body><h1>{html.escape(Path(plan.model).name)} on {html.escape(plan.target)}</h1>
<p>{html.escape(summary)}</p>
<h2>Stages</h2><table><tr>{"".join(f"<th>{h}</th>" for h in heads)}</tr>{"".join(rows)}</table>
{figures}
</body></html>
"""


def _png(fig: Any) -> bytes:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def _devices(devices: tuple[str, ...]) -> str:
    return devices[0] if len(devices) == 1 else f"{devices[0]} +{len(devices) - 1}"


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds >= 1.0:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "us"


def _byte_unit(n: float) -> tuple[float, str]:
    for factor, unit in ((2.0**30, "GiB"), (2.0**20, "MiB"), (2.0**10, "KiB")):
        if n >= factor:
            return factor, unit
    return 1.0, "B"
