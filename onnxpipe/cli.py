"""The command line: parse, call the API, print. Errors become one line and exit code 2."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from onnxpipe.errors import OnnxpipeError

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Cut ONNX models into balanced pipeline stages and train them as a pipeline.")
console = Console()
err_console = Console(stderr=True)
_state = {"debug": False}


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors.")) -> None:
    _state["debug"] = debug


def friendly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn OnnxpipeError (and Ctrl-C) into one line on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except OnnxpipeError as exc:
            if _state["debug"]:
                raise
            err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
            sys.exit(2)
        except KeyboardInterrupt:
            err_console.print("[bold red]interrupted[/]")
            sys.exit(130)

    return wrapper


def parse_dims(values: list[str] | None) -> dict[str, int]:
    """`--dim NAME=VALUE` pairs as a dict."""
    dims: dict[str, int] = {}
    for item in values or []:
        name, sep, value = item.partition("=")
        if not sep or not name or not value.strip().isdigit():
            raise OnnxpipeError(f"--dim {item!r}: expected NAME=VALUE with a positive integer, e.g. --dim batch=8")
        dims[name.strip()] = int(value)
    return dims


# -- onnxpipe models: the model zoo ------------------------------------------------------------

models_app = typer.Typer(add_completion=False, help="List the built-in model zoo and build its models to .onnx files.")
app.add_typer(models_app, name="models")


@models_app.callback(invoke_without_command=True)
def _models(ctx: typer.Context) -> None:
    """List the models: name, description, whether a training variant exists, whether full size."""
    if ctx.invoked_subcommand is not None:
        return
    from rich.table import Table

    from onnxpipe import models

    table = Table(title="onnxpipe models")
    table.add_column("name", no_wrap=True)
    for column in ("description", "trainable", "full size", "knobs"):
        table.add_column(column)
    for spec in models.specs():
        knobs = " ".join(f"{k}={v}" for k, v in spec.knobs.items() if k not in ("train", "seed"))
        table.add_row(spec.name, spec.description, "yes" if spec.trainable else "no", "yes" if spec.full_size else "no", knobs)
    console.print(table)


@models_app.command("build")
@friendly
def _models_build(
    name: str = typer.Argument(..., help="Model name (see `onnxpipe models`)."),
    output: str = typer.Option(..., "-o", "--output", help="Where to write the .onnx file."),
    knob: list[str] = typer.Option(None, "--set", help="Knob override KEY=VALUE, repeatable, e.g. --set layers=4 --set batch=2."),
    train: bool = typer.Option(False, "--train", help="Build the training variant (first output: scalar loss; extra `labels` input)."),
) -> None:
    """Build one model of the zoo and write it (weights go to FILE.data when over 1.5 GB)."""
    from onnxpipe import models

    knobs = dict(models.parse_knob(name, item) for item in knob or [])
    if train:
        knobs["train"] = True
    model = models.build(name, **knobs)
    written = models.save(model, output)
    size = sum(p.stat().st_size for p in written)
    console.print(f"wrote {', '.join(str(p) for p in written)} ({name}, {len(model.graph.node)} nodes, {size / 2**20:.1f} MiB)")


# --- targets ---------------------------------------------------------------

targets_app = typer.Typer(help="Cluster descriptions: list the bundled targets, show one in detail.")
app.add_typer(targets_app, name="targets")


@targets_app.callback(invoke_without_command=True)
@friendly
def targets_list(ctx: typer.Context) -> None:
    """List the bundled targets (`--target NAME` also takes a path to a .toml)."""
    if ctx.invoked_subcommand is not None:
        return
    from rich.table import Table

    from onnxpipe.target import bundled_targets, load_target
    from onnxpipe.units import format_bytes

    table = Table(title="bundled targets (or pass --target path/to/cluster.toml)")
    for column in ("name", "devices", "memory", "description"):
        table.add_column(column)
    for name in bundled_targets():
        target = load_target(name)
        table.add_row(name, target.summary(), format_bytes(target.total_memory), target.description)
    console.print(table)


@targets_app.command("show")
@friendly
def targets_show(target: str = typer.Argument(..., help="A bundled target name or the path of a .toml target file.")) -> None:
    """Show a target's devices and links."""
    from rich.table import Table

    from onnxpipe.cost import OP_CLASSES
    from onnxpipe.target import DTYPES, load_target
    from onnxpipe.units import format_bytes, format_flops, format_rate, format_seconds

    t = load_target(target)
    console.print(f"[bold]{t.name}[/]: {t.description}  [dim]({t.source}; node times {'profiled here' if t.profile else 'from the roofline'})[/]")
    dtypes = [dtype for dtype in DTYPES if any(dtype in d.peak_flops for d in t.devices)]
    classes = [c for c in (*OP_CLASSES, "default") if any(c in d.efficiency for d in t.devices)]
    devices = Table(title="devices")
    peak = Table(title="peak rate per dtype")
    efficiency = Table(title="efficiency: share of peak per op class")
    for column in ("group", "kind", "devices", "memory", "memory bandwidth", "op overhead"):
        devices.add_column(column)
    for column in ("group", *dtypes):
        peak.add_column(column)
    for column in ("group", *classes):
        efficiency.add_column(column)
    for group, members in t.groups().items():
        d = members[0]
        kind = f"{d.kind}, {d.threads} thread{'s' if d.threads > 1 else ''}" if d.kind == "cpu" else d.kind
        instances = f"{members[0].name}..{len(members) - 1}" if len(members) > 1 else d.name
        devices.add_row(group, kind, instances, format_bytes(d.memory_bytes), format_rate(d.memory_bandwidth), format_seconds(d.op_overhead))
        peak.add_row(group, *(format_flops(d.peak_flops[dtype], dtype) if dtype in d.peak_flops else "-" for dtype in dtypes))
        efficiency.add_row(group, *(f"{d.efficiency[c]:g}" if c in d.efficiency else "-" for c in classes))
    console.print(devices)
    console.print(peak)
    console.print(efficiency)
    links = Table(title="links")
    for column in ("between", "topology", "bandwidth", "latency"):
        links.add_column(column)
    for link in t.links:
        links.add_row(" <-> ".join(link.between), link.topology, format_rate(link.bandwidth), format_seconds(link.latency))
    console.print(links)


# --- annotate --------------------------------------------------------------


@app.command()
@friendly
def annotate(
    model: str = typer.Argument(..., help="The .onnx model to cost."),
    output: str = typer.Option(None, "-o", "--output", help="Write the annotated model here (costs in each node's metadata_props)."),
    json_file: str = typer.Option(None, "--json", help="Also write the cost summary as JSON."),
    profile: bool = typer.Option(False, "--profile", help="Measure node times in onnxruntime (CPU, one thread), forward and backward."),
    dim: list[str] = typer.Option(None, "--dim", help="Bind a symbolic dim NAME=VALUE, repeatable, e.g. --dim batch=8."),
) -> None:
    """Cost every node (FLOPs, bytes, parameters, activations, backward) and print them per op type."""
    from rich.table import Table

    from onnxpipe.cost import annotate as annotate_costs
    from onnxpipe.cost import summarize, write_annotated, write_summary
    from onnxpipe.graph import load
    from onnxpipe.units import format_bytes, format_flops, format_seconds

    graph = load(model, parse_dims(dim))
    costs = annotate_costs(graph, profile=profile)
    rows, totals = summarize(costs)
    flops = lambda value: format_flops(value).removesuffix("/s")  # noqa: E731 - an amount, not a rate
    table = Table(title=f"costs of {escape(graph.source)}")
    for column in ("op type", "class", "nodes", "FLOPs", "share", "backward", "params", "activations", *(("measured",) if costs.profiled else ())):
        table.add_column(column, justify="left" if column in ("op type", "class") else "right", no_wrap=True)
    for r in rows:
        measured = (format_seconds(r.measured_seconds or 0.0),) if costs.profiled else ()
        table.add_row(r.op_type, r.op_class, str(r.count), flops(r.flops), f"{100 * r.flops_share:.1f}%", flops(r.backward_flops),
                      format_bytes(r.param_bytes), format_bytes(r.activation_bytes), *measured)
    console.print(table)
    line = (f"total: {totals['nodes']} nodes, {flops(totals['flops'])} forward, {flops(totals['backward_flops'])} backward, "
            f"params {format_bytes(totals['params_bytes'])}, activations {format_bytes(totals['activation_bytes'])}")
    if costs.profiled:
        line += f", measured {format_seconds(totals['measured_seconds'])} forward + {format_seconds(totals['measured_backward_seconds'])} backward"
    console.print(line, highlight=False)
    if costs.unknown_ops:
        err_console.print(f"[yellow]warning:[/] no cost formula for {', '.join(costs.unknown_ops)}: bytes-only estimates", highlight=False)
    if output:
        write_annotated(graph, costs, output)
        console.print(f"wrote {escape(output)}", highlight=False)
    if json_file:
        write_summary(costs, json_file)
        console.print(f"wrote {escape(json_file)}", highlight=False)
