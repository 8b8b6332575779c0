"""The command line: parse, call the API, print. Errors become one line and exit code 2."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from onnxpipe.errors import OnnxpipeError
from onnxpipe.startup import interrupts_raise
from onnxpipe.units import format_ms, plural

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Cut ONNX models into balanced pipeline stages and train them as a pipeline.")
#: Tables keep their columns when output goes to a file or pipe (rich would assume 80 columns).
console = Console(width=None if sys.stdout.isatty() else 132)
err_console = Console(stderr=True)
_state = {"debug": False}


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors.")) -> None:
    _state["debug"] = debug


#: Exit codes: a check that found a difference (`verify`), bad input, a bug in onnxpipe.
EXIT_MISMATCH, EXIT_BAD_INPUT, EXIT_INTERNAL = 1, 2, 3


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would be, so a terminated command cleans up as an interrupted one does."""


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """While a command runs in the main thread, SIGTERM raises `Terminated`; the previous handler comes back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def friendly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn OnnxpipeError and OSError (a path that cannot be read or written) into one line on stderr and
    exit code 2, Ctrl-C into exit code 130 (SIGTERM: 143, after the same clean-up), and any other failure into a one-line internal error with
    exit code 3; `--debug` re-raises them all with their tracebacks. Python warnings (numpy's
    overflow and invalid-value notes) stay off stderr unless `--debug`."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        interrupts_raise()  # from here Ctrl-C is a KeyboardInterrupt the command cleans up after
        try:
            with warnings.catch_warnings(), _terminate_as_interrupt():
                if not _state["debug"]:
                    warnings.simplefilter("ignore")
                return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, typer.exceptions.TyperException):
            raise
        except Terminated:
            err_console.print("[bold red]terminated[/]")
            sys.exit(143)
        except OnnxpipeError as exc:
            _fail(exc, str(exc), EXIT_BAD_INPUT)
        except OSError as exc:
            where = f"{exc.filename}: " if exc.filename else ""
            _fail(exc, f"{where}{exc.strerror or exc}; check the path exists and is writable, or choose another", EXIT_BAD_INPUT)
        except KeyboardInterrupt:
            err_console.print("[bold red]interrupted[/]")
            sys.exit(130)
        except Exception as exc:  # a bug: still one line, the traceback behind --debug
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            _fail(exc, f"internal error ({type(exc).__name__}: {first}); rerun with --debug for the traceback and report it", EXIT_INTERNAL)

    return wrapper


def _fail(exc: BaseException, message: str, code: int) -> None:
    if _state["debug"]:
        raise exc
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    sys.exit(code)


def parse_dims(values: list[str] | None) -> dict[str, int]:
    """`--dim NAME=VALUE` pairs as a dict."""
    dims: dict[str, int] = {}
    for item in values or []:
        name, sep, value = item.partition("=")
        if not sep or not name or not value.strip().isdigit() or int(value) < 1:
            raise OnnxpipeError(f"--dim {item!r}: expected NAME=VALUE with a positive integer, e.g. --dim batch=8")
        dims[name.strip()] = int(value)
    return dims


def parse_ties(tie: list[str] | None, untie: list[str] | None) -> Any:
    """`--tie NAME` / `--untie NAME` overrides as an `onnxpipe.initializers.TieChoice`."""
    from onnxpipe.initializers import TieChoice

    return TieChoice.of(tie, untie)


_MODE_HELP = ("training (forward, backward and optimizer step: the default for a model whose first output is its loss) or inference "
              "(a forward-only pipeline, throughput objective, latency reported: the default for a model without a loss).")


_TIE_HELP = "Train this weight read by several nodes as one tensor (default for ties and reuse in one module), repeatable."
_MAX_LATENCY_HELP = ("Inference: take only plans whose latency (one micro-batch through the whole pipeline: forwards and transfers) "
                     "is at most this many seconds, e.g. 0.005.")
_UNTIE_HELP = "Give each module reading this weight its own copy (default for constant-valued exporter merges), repeatable."


def _warn_missing_gradients(graph: Any) -> None:
    """Plans are for training: say which ops onnxruntime-training cannot differentiate (the plan still prices inference use)."""
    from onnxpipe.gradients import describe_missing, missing_gradients

    missing = missing_gradients(graph.model)
    if missing:
        err_console.print(f"[yellow]warning:[/] onnxruntime-training 1.19.2 has no gradient for {escape(describe_missing(missing))}; "
                          "`onnxpipe train` will refuse this model", highlight=False)


def ensure_latency(plan: Any, max_latency: float) -> None:
    """A plan given by hand (`--plan`, `--cuts`) keeps `--max-latency`."""
    if plan.mode != "inference":
        raise OnnxpipeError("--max-latency bounds an inference pipeline's latency; add --mode inference")
    if plan.latency_seconds > max_latency * (1 + 1e-9):
        raise OnnxpipeError(f"the plan's latency {plan.latency_seconds * 1e3:.4g} ms is over --max-latency {max_latency * 1e3:.4g} ms; "
                            "raise --max-latency, or plan without --plan/--cuts so the planner keeps the bound")


def print_batch(binding: Any, batch: int, microbatches: int) -> None:
    """The batch convention as applied (`onnxpipe.batching`)."""
    console.print(escape(binding.describe(batch, microbatches)), highlight=False)


def directory_binding(directory: str, dims: dict[str, int]) -> Any:
    """A stage directory's batch binding (`batching.stage_binding`): its files' shapes, `--dim`s checked
    against the dims its plan recorded."""
    from onnxpipe.batching import stage_binding
    from onnxpipe.manifest import Manifest
    from onnxpipe.plan.result import Plan

    manifest = Manifest.read(directory)
    plan_path = Path(directory) / "plan.json"
    recorded = Plan.read(plan_path).dims if plan_path.is_file() else {}
    return stage_binding(None, {i.name: i.shape for i in manifest.inputs}, dims, recorded)


def _readable(path: str) -> str | None:
    """A plan's model when it is where the plan records it (its header names the batch dim), else None."""
    return path if os.path.isfile(path) else None


def print_shared(shared: Any) -> None:
    """What loading decided about weights read by several nodes (nothing when there are none)."""
    from onnxpipe.initializers import describe

    if shared:
        console.print(escape(describe(shared)), highlight=False)


def ensure_counts(**counts: tuple[int | None, int]) -> None:
    """Each `flag=(value, least)` given on the command line is at least `least` (flag names with _ for -)."""
    for flag, (value, least) in counts.items():
        if value is not None and value < least:
            raise OnnxpipeError(f"--{flag.replace('_', '-')} {value}: must be {least} or more")


def ensure_finite(flag: str, value: float | None, *, positive: bool = True) -> None:
    """A number given on the command line is finite (and positive)."""
    if value is not None and (not math.isfinite(value) or (positive and value <= 0) or value < 0):
        raise OnnxpipeError(f"{flag} {value}: must be a finite number {'above 0' if positive else '0 or more'}")


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
    sparse: bool = typer.Option(False, "--sparse", help="Weights in a sparse FILE.data (zeros but for one number each), never drawn "
                                "nor held in memory: a full-size model to plan in seconds, not to train."),
) -> None:
    """Build one model of the zoo and write it (weights go to FILE.data when over 1.5 GB, or with --sparse)."""
    from onnxpipe import models

    knobs = dict(models.parse_knob(name, item) for item in knob or [])
    if train:
        knobs["train"] = True
    if sparse:
        import onnx

        written = models.build_sparse(name, output, **knobs)
        model = onnx.load(str(written[0]), load_external_data=False)  # its weights are headers: a small read
    else:
        model = models.build(name, **knobs)
        written = models.save(model, output)
    size = sum(p.stat().st_size for p in written)
    kind = "; weights sparse on disk, not for training" if sparse else ""
    console.print(f"wrote {', '.join(str(p) for p in written)} ({name}, {plural(len(model.graph.node), 'node')}, {size / 2**20:.1f} MiB{kind})")


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
        kind = f"{d.kind}, {plural(d.threads, 'thread')}" if d.kind == "cpu" else d.kind
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
    profile: bool = typer.Option(False, "--profile", help="Measure node times in onnxruntime, forward and backward, with the execution provider "
                                                           "of --target's device (CUDA for gpu; without --target: the CPU, one thread)."),
    times: str = typer.Option(None, "--times", help="Import measured times: onnxruntime's profiling JSON, or block times "
                                                    "{\"blocks\": [{\"block\", \"nodes\", \"fwd_ms\", \"bwd_ms\"}]} (needs --target)."),
    target: str = typer.Option(None, "--target", "-t", help="The target whose first device the times are for (--profile, --times)."),
    dim: list[str] = typer.Option(None, "--dim", help="Bind a symbolic dim NAME=VALUE, repeatable, e.g. --dim batch=8."),
    shapes_by_running: bool = typer.Option(False, "--shapes-by-running", help="Learn shapes static inference cannot find by running the model once on zeros (needs its full memory)."),
) -> None:
    """Cost every node (FLOPs, bytes, parameters, activations, backward) and print them per op type."""
    from rich.table import Table

    from onnxpipe.calibrate import import_for_target
    from onnxpipe.cost import annotate as annotate_costs
    from onnxpipe.cost import summarize, write_annotated, write_summary
    from onnxpipe.graph import load
    from onnxpipe.target import load_target
    from onnxpipe.units import format_bytes, format_flops, format_seconds

    if profile and times:
        raise OnnxpipeError("--profile and --times both give measured times; pick one")
    graph = load(model, parse_dims(dim), shapes_by_running=shapes_by_running)
    tgt = load_target(target) if target else None
    first = tgt.devices[0] if tgt else None
    costs = annotate_costs(graph, profile=profile, device_kind=first.kind if first else "cpu", provider=first.provider if first else "")
    if times:
        costs = import_for_target(graph, costs, times, tgt)
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
    line = (f"total: {plural(totals['nodes'], 'node')}, {flops(totals['flops'])} forward, {flops(totals['backward_flops'])} backward, "
            f"params {format_bytes(totals['params_bytes'])}, activations {format_bytes(totals['activation_bytes'])}")
    if costs.profiled:
        line += f", measured {format_seconds(totals['measured_seconds'])} forward + {format_seconds(totals['measured_backward_seconds'])} backward"
    console.print(line, highlight=False)
    if costs.profiled:
        sources: dict[str, int] = {}
        for c in costs.nodes.values():
            key = f"{c.source.partition('#')[0]} ({c.measured_on})" if c.measured_seconds is not None else "analytic"
            sources[key] = sources.get(key, 0) + 1
        console.print("node times: " + ", ".join(f"{n} from {k}" for k, n in sources.items()), highlight=False)
    if costs.unknown_ops:
        err_console.print(f"[yellow]warning:[/] no cost formula for {', '.join(costs.unknown_ops)}: bytes-only estimates", highlight=False)
    if output:
        write_annotated(graph, costs, output)
        console.print(f"wrote {escape(output)}", highlight=False)
    if json_file:
        write_summary(costs, json_file)
        console.print(f"wrote {escape(json_file)}", highlight=False)


@app.command()
@friendly
def calibrate(
    models: list[str] = typer.Argument(..., help="Annotated models carrying measured times (annotate --times or --profile)."),
    target: str = typer.Option(..., "--target", "-t", help="The base target (a bundled name or a .toml file)."),
    group: str = typer.Option(None, "--group", help="The device group the times were measured on (default: the first)."),
    output: str = typer.Option(..., "-o", "--output", help="Write the calibrated target file here."),
) -> None:
    """Fit a target's per-op-class efficiencies, launch overhead and kernel model to measured times; write a new target."""
    from rich.table import Table

    from onnxpipe.calibrate import calibrate as fit
    from onnxpipe.calibrate import units, write_target
    from onnxpipe.cost import read_annotated
    from onnxpipe.graph import load
    from onnxpipe.target import load_target

    base = load_target(target)
    measured = []
    for model in models:
        graph = load(model)
        costs = read_annotated(graph)
        if costs is None or not costs.profiled:
            raise OnnxpipeError(f"{model}: no measured times in it; annotate it with --times FILE or --profile and -o first")
        measured += units(Path(model).stem, costs)
    result = fit(measured, base, group)
    for title, rows in (("per block", result.blocks), ("per op class", result.classes)):
        table = Table(title=f"fit {title} (forward + backward)")
        for column in ("name", "measured ms", "before ms", "after ms", "after / measured"):
            table.add_column(column, justify="left" if column == "name" else "right", no_wrap=True)
        for r in rows:
            table.add_row(escape(r.name), format_ms(r.measured), format_ms(r.before), format_ms(r.after), f"{r.after / r.measured:.2f}" if r.measured else "-")
        console.print(table)
    console.print("fitted: " + ", ".join(f"{k} = {v:.4g}" for k, v in result.parameters.items()), highlight=False)
    console.print(f"fit error (weighted RMS of log predicted/measured): {result.error_before:.3f} -> {result.error_after:.3f}", highlight=False)
    write_target(result, base.source, "measured on " + ", ".join(Path(m).name for m in models), output)
    console.print(f"wrote {escape(output)}", highlight=False)


# --- split, verify, run ----------------------------------------------------


@app.command()
@friendly
def split(
    model: str = typer.Argument(..., help="The .onnx model to cut."),
    target: str = typer.Option(None, "--target", "-t", help="A bundled target name or a .toml target file (not needed with --plan)."),
    output: str = typer.Option(None, "-o", "--output", help="Stage directory to write (default: <model stem>-stages beside the model)."),
    stages: int = typer.Option(None, "--stages", help="Number of stages (default: the planner chooses)."),
    batch: int = typer.Option(None, "--batch", help="Global batch per iteration (default: the model's batch x micro-batches)."),
    microbatches: int = typer.Option(None, "--microbatches", help="Micro-batches per iteration."),
    schedule: str = typer.Option(None, "--schedule", help="Pipeline schedule: gpipe, 1f1b, zb-h1, interleaved or zb-v (2 stages per device)."),
    optimizer: str = typer.Option(None, "--optimizer", help="Optimizer whose state counts in memory: sgd, momentum or adam; with -master (adam-master...) float32 master copies of float16 weights too."),
    recompute: str = typer.Option(None, "--recompute", help="Activation policy: auto, never or always."),
    mode: str = typer.Option(None, "--mode", help=_MODE_HELP),
    max_latency: float = typer.Option(None, "--max-latency", help=_MAX_LATENCY_HELP),
    time_limit: float = typer.Option(None, "--time-limit", help="Seconds planning may take in all (default 30); it ends with the best plan found by then."),
    dim: list[str] = typer.Option(None, "--dim", help="Bind a symbolic dim NAME=VALUE, repeatable, e.g. --dim batch=8."),
    shapes_by_running: bool = typer.Option(False, "--shapes-by-running", help="Learn shapes static inference cannot find by running the model once on zeros (needs its full memory)."),
    plan_file: str = typer.Option(None, "--plan", help="Reuse a plan JSON written by `onnxpipe plan` or an earlier split."),
    cuts: str = typer.Option(None, "--cuts", help="Cut by hand after these tensors, comma-separated in data-flow order; devices in target order."),
    force: bool = typer.Option(False, "--force", help="Replace an existing non-empty output directory."),
    annotated: str = typer.Option(None, "--annotated", help="Also write the model with each node tagged by its stage (metadata onnxpipe.stage)."),
    tie: list[str] = typer.Option(None, "--tie", help=_TIE_HELP),
    untie: list[str] = typer.Option(None, "--untie", help=_UNTIE_HELP),
) -> None:
    """Cut a model into pipeline stages: one standalone ONNX model per stage plus manifest.json and plan.json."""
    from pathlib import Path

    from rich.table import Table

    from onnxpipe.batching import bind_batch
    from onnxpipe.graph import load
    from onnxpipe.split import plan_cuts
    from onnxpipe.split import split as split_model
    from onnxpipe.units import format_bytes

    ensure_counts(stages=(stages, 1), batch=(batch, 1), microbatches=(microbatches, 1))
    ensure_finite("--time-limit", time_limit)
    ensure_finite("--max-latency", max_latency)
    from onnxpipe.plan.deadline import Deadline

    started = Deadline(time_limit) if time_limit is not None else None  # loading the model counts against --time-limit too
    options = {key: value for key, value in {"batch": batch, "microbatches": microbatches, "schedule": schedule, "optimizer": optimizer,
                                              "recompute": recompute, "mode": mode}.items() if value is not None}
    if not plan_file and not target:
        raise OnnxpipeError("missing --target; name a target (see `onnxpipe targets`) or reuse a plan with --plan")
    if plan_file:
        from onnxpipe.plan.result import Plan

        plan = Plan.read(plan_file)
        binding = bind_batch(model, {**plan.dims, **parse_dims(dim)}, plan.batch, plan.microbatches)
        graph = load(model, binding.dims, parse_ties(tie, untie), shapes_by_running=shapes_by_running)
    elif cuts:
        from onnxpipe.cost import annotate as annotate_costs
        from onnxpipe.target import load_target

        binding = bind_batch(model, parse_dims(dim), batch, microbatches or 1)
        graph = load(model, binding.dims, parse_ties(tie, untie), shapes_by_running=shapes_by_running)
        from onnxpipe.plan import choose_mode
        from onnxpipe.plan.planner import TIME_LIMIT

        options["mode"] = choose_mode(graph, mode)
        plan = plan_cuts(graph, annotate_costs(graph), load_target(target), [c.strip() for c in cuts.split(",") if c.strip()], **options,
                         deadline=started or Deadline(TIME_LIMIT))
    else:
        from onnxpipe.plan import plan_model

        binding = bind_batch(model, parse_dims(dim), batch, microbatches)
        extra = {key: value for key, value in {"stages": stages, "time_limit": time_limit, "max_latency": max_latency,
                                                "deadline": started}.items() if value is not None}
        with err_console.status("planning ...") as status:
            graph, _, _, plan = plan_model(model, target, dims=binding.dims, ties=parse_ties(tie, untie), shapes_by_running=shapes_by_running,
                                           progress=lambda text: status.update(escape(text)), **options, **extra)
    if max_latency is not None and (plan_file or cuts):
        ensure_latency(plan, max_latency)
    out = output or str(Path(model).with_name(f"{Path(model).stem}-stages"))
    manifest = split_model(graph, plan, out, force=force, annotated_path=annotated)
    print_batch(binding, plan.batch, plan.microbatches)  # once written: a failed split prints its one error line alone
    print_shared(graph.shared)
    if mode is None and not plan_file:
        _print_chosen_mode(plan)

    table = Table(title=f"{plural(len(manifest.stages), 'stage')} of {escape(graph.source)} on {escape(plan.target)}")
    _stage_columns(table, ("stage", "device(s)", "nodes", "params", "inputs", "outputs", "file size"))
    for s in manifest.stages:
        table.add_row(str(s.index), escape(_devices(s.devices)), str(s.nodes), format_bytes(s.parameter_bytes), str(len(s.inputs)),
                      str(len(s.outputs)), format_bytes(s.file_bytes))
    console.print(table)
    _print_plan_quality(plan)
    if manifest.shared:
        console.print(f"shared initializers (copied into several stages): {escape(', '.join(s.name for s in manifest.shared))}", highlight=False)
    console.print(f"wrote {escape(out)}/ (stage_*.onnx, manifest.json, plan.json)", highlight=False)
    if annotated:
        console.print(f"wrote {escape(annotated)}", highlight=False)


@app.command()
@friendly
def verify(
    directory: str = typer.Argument(..., help="Stage directory written by `onnxpipe split`."),
    model: str = typer.Argument(..., help="The unsplit .onnx model."),
    samples: int = typer.Option(2, "--samples", help="Random input sets to compare on."),
    seed: int = typer.Option(0, "--seed", help="Random seed of the inputs."),
    dim: list[str] = typer.Option(None, "--dim", help="NAME=VALUE: a dim the stages were split with (their files' shapes bind every dim; a value they do not have is refused)."),
    rtol: float = typer.Option(None, "--rtol", help="Relative error accepted per output (default by dtype: 1e-5 for float32/64, 1e-2 float16, 5e-2 bfloat16, exact for integers)."),
    atol: float = typer.Option(0.0, "--atol", help="Absolute difference that counts as none."),
) -> None:
    """Compare the chained stages with the unsplit model on random inputs; exit 1 if an output differs."""
    from rich.table import Table

    from onnxpipe.manifest import Manifest
    from onnxpipe.verify import op_by_op, stage_batch, tolerance
    from onnxpipe.verify import verify as verify_stages

    ensure_counts(samples=(samples, 1))
    ensure_finite("--rtol", rtol, positive=False)
    ensure_finite("--atol", atol, positive=False)
    if Path(directory).is_file() and Path(model).is_dir():
        raise OnnxpipeError(f"verify takes the stage directory first, then the model: onnxpipe verify {model} {directory}")
    errors = verify_stages(directory, model, dims=parse_dims(dim), samples=samples, seed=seed, atol=atol)
    print_batch(*stage_batch(directory, model, parse_dims(dim)))
    limits = {o.name: tolerance(o.dtype, rtol) for o in Manifest.read(directory).outputs}
    table = Table(title=f"chained stages vs {escape(model)} ({plural(samples, 'random input set')})")
    for column in ("output", "max relative error", "accepted", ""):
        table.add_column(column, justify="right" if column else "left")
    for name, error in errors.items():
        table.add_row(escape(name), f"{error:.2e}", f"{limits[name]:g}", "ok" if error <= limits[name] else "[red]FAIL[/]")
    console.print(table)
    if op_by_op(model):
        console.print("quantized model: stages and model run op by op (onnxruntime's int8 fusions off on both sides, "
                      "as they round differently where a stage boundary splits a DequantizeLinear -> op -> QuantizeLinear pattern)", highlight=False)
    bad = [name for name, error in errors.items() if error > limits[name]]
    if bad:
        err_console.print(f"[bold red]error:[/] output '{escape(bad[0])}' differs by {errors[bad[0]]:.2e} relative (> {limits[bad[0]]:g})", highlight=False)
        sys.exit(EXIT_MISMATCH)
    accepted = sorted(set(limits.values()))
    within = f"{accepted[0]:g}" if len(accepted) == 1 else "the tolerance of its dtype"
    matched = f"all {len(errors)} outputs match" if len(errors) != 1 else "the 1 output matches"
    console.print(f"{matched} within {within} relative", highlight=False)


@app.command()
@friendly
def run(
    directory: str = typer.Argument(..., help="Stage directory written by `onnxpipe split`."),
    inputs: str = typer.Option(..., "--inputs", help="An .npz with one array per model input."),
    output: str = typer.Option(..., "-o", "--output", help="The .npz to write, one array per model output."),
    microbatches: int = typer.Option(None, "--microbatches", help="Micro-batches the inputs hold along axis 0 (default: their batch / the stage files' micro-batch)."),
    dim: list[str] = typer.Option(None, "--dim", help="NAME=VALUE: a dim the stages were split with (their files' shapes bind every dim; a value they do not have is refused)."),
    repeat: int = typer.Option(1, "--repeat", help="Stream the micro-batches through this many times; above 1 the first pass is a warm-up and the figures are medians of the rest."),
    json_path: str = typer.Option(None, "--json", help="Write the measured figures and timeline as JSON (the keys `simulate --json` uses)."),
) -> None:
    """Run a stage directory as an inference pipeline on onnxruntime: one worker process per stage, the
    micro-batches streamed through the stages; prints the measured throughput and latency."""
    from onnxpipe.chain import write_npz
    from onnxpipe.feeds import read_npz
    from onnxpipe.fileio import write_json
    from onnxpipe.manifest import Manifest
    from onnxpipe.train.infer import feed_microbatches, stream

    ensure_counts(microbatches=(microbatches, 1), repeat=(repeat, 1))
    binding = directory_binding(directory, parse_dims(dim))
    feeds = read_npz(inputs)
    count = microbatches or feed_microbatches(Manifest.read(directory), feeds)
    streamed = stream(directory, feeds, microbatches=count, repeat=repeat)
    outputs, m = streamed.outputs, streamed.metrics
    print_batch(binding, (binding.microbatch or 1) * count, count)
    over = f" (median of {plural(repeat - 1, 'pass')} after a warm-up)" if repeat > 1 else " (one pass, warm-up included: --repeat 3 for steady figures)"
    console.print(f"measured: {m['samples_per_s']:.4g} samples/s, pass {format_ms(m['iteration_seconds'])} ms, latency "
                  f"{format_ms(m['latency_seconds'])} ms per micro-batch (first stage in to last stage out), bubble {m['bubble_fraction']:.1%}{over}",
                  highlight=False, soft_wrap=True)
    write_npz(outputs, output)
    console.print(f"wrote {escape(output)} ({', '.join(escape(n) for n in outputs)})", highlight=False)
    if json_path:
        write_json(json_path, m)
        console.print(f"wrote {escape(json_path)}", highlight=False)


# --- plan --------------------------------------------------------------------


#: A stage table lists a stage's devices up to this many; a wider stage shows its first and last and their count.
_LISTED = 4


def _stage_columns(table: Any, columns: Sequence[str]) -> None:
    """A stage table's columns: figures right-aligned on one line; the devices left-aligned, wrapping where the table is wide."""
    for column in columns:
        table.add_column(column, justify="left" if column == "device(s)" else "right", no_wrap=column != "device(s)")


def _devices(names: Sequence[str]) -> str:
    """A stage's devices in a table cell: every name of a stage of 982 replicas squeezed the table's other columns out."""
    return ", ".join(names) if len(names) <= _LISTED else f"{names[0]} ... {names[-1]} ({len(names)})"


def _print_chosen_mode(plan: Any) -> None:
    """Say that a model without a loss was planned for inference, as no --mode was given."""
    if plan.mode == "inference":
        console.print("mode: inference (forward only), as the model has no loss output; training needs one (--loss with `onnxpipe train`)",
                      highlight=False)


def _print_plan_quality(plan: Any) -> None:
    """Bottleneck, lower bound and solver status: how good a plan provably is."""
    info = plan.solver
    console.print(f"bottleneck: stage {plan.bottleneck_stage}, {format_ms(plan.bottleneck_seconds)} ms per micro-batch; "
                  f"iteration {format_ms(plan.iteration_seconds)} ms ({plural(plan.batch, 'sample')}, {plural(plan.microbatches, 'micro-batch')}"
                  f"{', ' + plan.schedule if plan.mode == 'training' else ''})",
                  highlight=False)
    if plan.mode == "inference":
        console.print(f"inference (forward only): {plan.batch / plan.iteration_seconds:.4g} samples/s, "
                      f"latency {format_ms(plan.latency_seconds)} ms per micro-batch", highlight=False)
    console.print(f"lower bound: {format_ms(plan.lower_bound_seconds)} ms (bottleneck / bound = {plan.bottleneck_seconds / plan.lower_bound_seconds:.3f})",
                  highlight=False)
    nodes = sum(len(s.nodes) for s in plan.stages)
    over = ("node by node" if info.blocks >= nodes else
            f"over {plural(info.blocks, 'block')} (rounding cuts to them may cost up to {info.coarsening_loss:.2%}; then refined node by node)")
    console.print(f"solver: {info.status} {over}, bound {format_ms(info.bound_seconds)} ms, gap {info.gap:.2%}, "
                  f"{info.solve_seconds:.2f} s", highlight=False)
    least = info.least_bottleneck_seconds
    if 0 < least < plan.bottleneck_seconds * (1 - 1e-9):
        console.print(f"least bottleneck found: {format_ms(least)} ms (gap {max(0.0, least - info.bound_seconds) / least:.2%}); this plan's is "
                      f"{plan.bottleneck_seconds / least - 1:.2%} more, taken for its shorter predicted iteration", highlight=False)
    for note in plan.notes:
        console.print(f"note: {escape(note)}", highlight=False)


@app.command("plan")
@friendly
def plan_command(
    model: str = typer.Argument(..., help="The .onnx model (an annotated one keeps its stored costs)."),
    target: str = typer.Option(..., "--target", "-t", help="A bundled target name or a .toml target file."),
    stages: int = typer.Option(None, "--stages", help="Number of stages (default: the fastest count, at most one per device)."),
    batch: int = typer.Option(None, "--batch", help="Global batch per iteration (default: the model's batch x micro-batches)."),
    microbatches: str = typer.Option(None, "--microbatches",
                                     help="Micro-batches per iteration, or 'auto' to explore (default: 2 x stages, or 2 x devices without --stages)."),
    schedule: str = typer.Option("1f1b", "--schedule", help="gpipe, 1f1b, zb-h1, interleaved or zb-v (2 stages per device: --stages up to 2 x devices), or auto to explore them all."),
    optimizer: str = typer.Option("adam", "--optimizer", help="Optimizer whose state counts in memory: sgd, momentum or adam; with -master (adam-master...) float32 master copies of float16 weights too."),
    recompute: str = typer.Option("auto", "--recompute", help="Activation policy: auto, always or never."),
    mode: str = typer.Option(None, "--mode", help=_MODE_HELP),
    max_latency: float = typer.Option(None, "--max-latency", help=_MAX_LATENCY_HELP),
    time_limit: float = typer.Option(30.0, "--time-limit", help="Seconds the whole command may plan (loading, exploring, solving); it ends with the best plan found by then."),
    compare: bool = typer.Option(False, "--compare", help="Also print every baseline side by side."),
    profile: bool = typer.Option(None, "--profile/--no-profile", help="Measure node times with onnxruntime (default: as the target says)."),
    dim: list[str] = typer.Option(None, "--dim", help="Bind a symbolic dim NAME=VALUE, repeatable."),
    shapes_by_running: bool = typer.Option(False, "--shapes-by-running", help="Learn shapes static inference cannot find by running the model once on zeros (needs its full memory)."),
    output: str = typer.Option(None, "-o", "--output", help="Write the plan JSON here."),
    tie: list[str] = typer.Option(None, "--tie", help=_TIE_HELP),
    untie: list[str] = typer.Option(None, "--untie", help=_UNTIE_HELP),
) -> None:
    """Find balanced pipeline stages for a model on a target, with the lower bound and the solver's gap."""
    from rich.table import Table

    from onnxpipe.batching import bind_batch
    from onnxpipe.plan import compare as compare_baselines
    from onnxpipe.plan import faster_stage_count, fits, plan_model
    from onnxpipe.plan.deadline import Deadline
    from onnxpipe.units import format_bytes

    if microbatches is None or microbatches == "auto":
        mb: int | str | None = microbatches
    elif microbatches.isdigit() and int(microbatches) > 0:
        mb = int(microbatches)
    else:
        raise OnnxpipeError(f"--microbatches {microbatches!r}: expected a positive integer or 'auto'")
    ensure_counts(stages=(stages, 1), batch=(batch, 1))
    ensure_finite("--time-limit", time_limit)
    ensure_finite("--max-latency", max_latency)
    deadline = Deadline(time_limit)  # the whole command's: loading, annotating, planning and --compare's stage counts
    binding = bind_batch(model, parse_dims(dim), batch, mb if isinstance(mb, int) else None)
    with err_console.status("planning ...") as status:  # on stderr, shown on a terminal only
        graph, costs, tgt, plan = plan_model(
            model, target, dims=binding.dims, profile=profile, stages=stages, batch=batch, microbatches=mb, schedule=schedule,
            optimizer=optimizer, recompute=recompute, time_limit=time_limit, progress=lambda text: status.update(escape(text)),
            ties=parse_ties(tie, untie), shapes_by_running=shapes_by_running, mode=mode, max_latency=max_latency, deadline=deadline,
        )
    print_batch(binding, plan.batch, plan.microbatches)
    print_shared(graph.shared)
    if mode is None:
        _print_chosen_mode(plan)
    if plan.mode == "training":  # an inference plan needs no gradient
        _warn_missing_gradients(graph)
    table = Table(title=f"{plural(len(plan.stages), 'stage')} of {escape(graph.source)} on {escape(plan.target)}: batch {plan.batch}, "
                        f"{plural(plan.microbatches, 'micro-batch')}, " + (f"{plan.schedule}, {plan.optimizer}" if plan.mode == "training" else "inference"))
    _stage_columns(table, ("stage", "device(s)", "nodes", "fwd ms", "bwd ms", "comm ms", "params+grads+opt", "activations", "used / capacity", "recompute"))
    for s in plan.stages:
        mem = s.memory
        table.add_row(str(s.index), escape(_devices(s.devices)), str(len(s.nodes)), format_ms(s.forward_seconds), format_ms(s.backward_seconds),
                      format_ms(s.comm_in_seconds + s.comm_out_seconds), format_bytes(mem.parameters + mem.gradients + mem.optimizer),
                      format_bytes(mem.activations), f"{format_bytes(mem.total)} / {format_bytes(mem.capacity)}", "yes" if s.recompute else "no")
    console.print(table)
    _print_plan_quality(plan)
    if plan.explored:
        best = [c for c in plan.explored if c.feasible][:5]
        console.print("explored: " + "; ".join(f"{c.schedule} m={c.microbatches} k={c.stages} r={c.replicas}: {c.iteration_seconds * 1e3:.2f} ms"
                                               for c in best) + f" ({plural(len(plan.explored), 'candidate')} tried)", highlight=False)
    if compare and len(plan.stages) == 1:  # every baseline cuts stages: at one there is no cut to compare
        devices = plural(len(plan.stages[0].devices), "device")
        console.print(f"--compare: the plan is one stage (on {devices}); the baselines are ways of cutting a model into stages, so at one "
                      "stage there is nothing to compare; pass --stages K (K >= 2) to compare cuts", highlight=False)
    elif compare:
        others = compare_baselines(graph, costs, tgt, plan, recompute, deadline=deadline)
        side = Table(title="baselines (same cost model)")
        for column in ("plan", "stages", "iteration ms", "bottleneck ms", "peak memory", "fits", "iteration vs ours"):
            side.add_column(column, justify="left" if column == "plan" else "right")
        for name, p in {"onnxpipe": plan, **others}.items():
            peak = max(s.memory.total for s in p.stages)
            side.add_row(name, str(len(p.stages)), format_ms(p.iteration_seconds), format_ms(p.bottleneck_seconds), format_bytes(peak),
                         "yes" if fits(p) else "[red]no[/]", f"{p.iteration_seconds / plan.iteration_seconds:.2f}x")
        console.print(side)
    if compare:
        bound = math.inf if max_latency is None else max_latency
        faster = faster_stage_count(graph, costs, tgt, plan, recompute, max_latency=bound, deadline=deadline) if stages is not None else None
        if faster is not None:
            count = plural(len(faster.stages), "stage")
            console.print(f"note: {count} would be faster (iteration {format_ms(faster.iteration_seconds)} ms vs {format_ms(plan.iteration_seconds)} ms); "
                          "drop --stages to let the planner choose", highlight=False)
    if output:
        plan.save(output)
        console.print(f"wrote {escape(output)}", highlight=False)


@app.command()
@friendly
def train(
    model: str = typer.Argument(..., help="An .onnx model (planned and split first) or a stage directory written by `onnxpipe split`."),
    target: str = typer.Option(None, "--target", "-t", help="A bundled target name or a .toml target file (default: a stage directory's own, else cpu2)."),
    stages: int = typer.Option(None, "--stages", help="Number of stages when planning a model (default: the planner chooses)."),
    batch: int = typer.Option(None, "--batch", help="Global batch per step (micro-batches x the stage files' batch)."),
    microbatches: int = typer.Option(4, "--microbatches", help="Micro-batches per step."),
    schedule: str = typer.Option("1f1b", "--schedule", help="Pipeline schedule: gpipe, 1f1b, zb-h1, interleaved or zb-v (2 stages per device; each stage still its own worker, in its device's order)."),
    steps: int = typer.Option(10, "--steps", help="Optimizer steps to train (a resumed run continues up to this count)."),
    data: str = typer.Option("synthetic", "--data", help="FILE.npz with one array per model input (and labels), or 'synthetic'."),
    lr: float = typer.Option(0.01, "--lr", help="Learning rate."),
    optimizer: str = typer.Option("sgd", "--optimizer", help="sgd or adamw (torch semantics)."),
    momentum: float = typer.Option(0.0, "--momentum", help="SGD momentum."),
    master_weights: bool = typer.Option(False, "--master-weights", help="Mixed precision: float32 copies of float16 weights, updated in float32 (and the optimizer state), the weights their rounding; planned with their memory."),
    loss: str = typer.Option(None, "--loss", help="Append a loss to a model without one: cross_entropy or mse (with --labels)."),
    labels: str = typer.Option(None, "--labels", help="With --loss: OUTPUT=LABELS or OUTPUT (labels input named 'labels')."),
    class_axis: int = typer.Option(1, "--class-axis", help="With --loss cross_entropy: the axis of the class scores (1 as in PyTorch; -1 for [N, S, vocab])."),
    recompute: str = typer.Option("auto", "--recompute", help="Activation policy: auto (the plan's), always or never."),
    checkpoint_dir: str = typer.Option(None, "--checkpoint-dir", help="Directory for checkpoints."),
    checkpoint_every: int = typer.Option(0, "--checkpoint-every", help="Checkpoint every N steps (and after the last)."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the checkpoint in --checkpoint-dir."),
    do_check: bool = typer.Option(False, "--check", help="Also train the unpartitioned model; print the loss and weight differences."),
    json_path: str = typer.Option(None, "--json", help="Write losses and measurements (step_seconds, bubble_fraction, per stage) as JSON."),
    dim: list[str] = typer.Option(None, "--dim", help="Bind a symbolic dim NAME=VALUE, repeatable."),
    seed: int = typer.Option(0, "--seed", help="Seed of synthetic data."),
    report_path: str = typer.Option(None, "--report", help="Write FILE.html: the measured timeline of the last step beside the simulated one."),
    trained_path: str = typer.Option(None, "--output", "-o", help="Write the trained model to FILE.onnx: the model with its trained weights (written whole or not at all)."),
    tie: list[str] = typer.Option(None, "--tie", help=_TIE_HELP),
    untie: list[str] = typer.Option(None, "--untie", help=_UNTIE_HELP),
    shapes_by_running: bool = typer.Option(False, "--shapes-by-running", help="Learn shapes static inference cannot find by running the model once on zeros (needs its full memory)."),
    backend: str = typer.Option("local", "--backend", help="local: worker processes on this machine (nothing to start); ray: Ray actors, placed as the plan says."),
    address: str = typer.Option(None, "--address", help="With --backend ray: the Ray cluster (HOST:PORT, or auto for the one `ray start` runs here); default: start one on this machine."),
    device: str = typer.Option("auto", "--device", help="auto: stages on gpu devices run on CUDA; cpu: every stage runs on the CPU."),
    bind_cores: bool = typer.Option(False, "--bind-cores", help="Bind each worker process to CPUs of its own, one thread of each physical core first (on a host this run has to itself)."),
) -> None:
    """Train a model as a pipeline: one worker per stage replica (a process, or a Ray actor), the schedule's table."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from onnxpipe.fileio import write_json
    from onnxpipe.train.checkpoint import ensure_checkpoint_dir
    from onnxpipe.train.fit import check, data_source, fit
    from onnxpipe.train.loss import LossSpec
    from onnxpipe.train.pipeline import Pipeline
    from onnxpipe.train.optimizer import OptimizerConfig
    from onnxpipe.units import format_bytes

    ensure_counts(stages=(stages, 1), batch=(batch, 1), microbatches=(microbatches, 1), steps=(steps, 1), checkpoint_every=(checkpoint_every, 0))
    ensure_finite("--lr", lr)
    ensure_finite("--momentum", momentum, positive=False)
    loss_spec = None
    if loss or labels:
        if not (loss and labels):
            raise OnnxpipeError("--loss and --labels go together, e.g. --loss cross_entropy --labels logits=labels")
        output, _, label_name = labels.partition("=")
        loss_spec = LossSpec(loss, output, label_name or "labels", class_axis=class_axis)
    if resume and not checkpoint_dir:
        raise OnnxpipeError("--resume needs --checkpoint-dir DIR")
    if checkpoint_dir:
        ensure_checkpoint_dir(checkpoint_dir)  # before any worker starts
    if trained_path and (Path(trained_path).is_dir() or not Path(trained_path).absolute().parent.is_dir()):
        raise OnnxpipeError(f"-o {trained_path}: {'a directory' if Path(trained_path).is_dir() else 'its folder does not exist'}; "
                            "pass the path of the .onnx file to write")
    opt = OptimizerConfig(optimizer, lr=lr, momentum=momentum, master_weights=master_weights)
    from_files = directory_binding(model, parse_dims(dim)) if Path(model).is_dir() else None  # --dim checked before any worker starts
    with Pipeline(model, target, stages=stages, batch=batch, microbatches=microbatches, schedule=schedule, optimizer=opt,
                  loss=loss_spec, recompute=recompute, dims=parse_dims(dim), tie=tuple(tie or ()), untie=tuple(untie or ()),
                  shapes_by_running=shapes_by_running, backend=backend, address=address, device=device, bind_cores=bind_cores) as pipe:
        print_shared(pipe.shared)
        for needs, purpose in ((trained_path, "-o"), (do_check, "--check")):
            if needs:
                pipe.ensure_original(purpose)
        if do_check:
            pipe.ensure_checkable()
        if batch is not None and batch != pipe.batch:
            raise OnnxpipeError(f"--batch {batch}: the stages take {plural(microbatches, 'micro-batch')} of {pipe.batch // microbatches}; pass --batch {pipe.batch}")
        print_batch(pipe.binding or from_files, pipe.batch, microbatches)
        source = data_source(pipe, data, seed)
        workers = f" on {plural(len(pipe.places), 'worker')}" if len(pipe.places) != pipe.stages else ""
        console.print(f"training {plural(pipe.stages, 'stage')}{workers} ({schedule}, {plural(microbatches, 'micro-batch')}, batch {pipe.batch}) on {escape(pipe.target)}", highlight=False)
        if bind_cores:
            replicated = len(pipe.places) != pipe.stages
            console.print("worker processes bound to CPUs: " + ", ".join(f"stage {s}{f' replica {r}' if replicated else ''}: {' '.join(map(str, c))}"
                                                                         for (s, r), c in zip(pipe.places, pipe.cpus)), highlight=False)
        with Progress(TextColumn("step"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                      console=console, transient=False) as bar:
            task = bar.add_task("train", total=steps, info="")

            def on_step(step: int, value: float) -> None:
                m = pipe.metrics()
                bar.update(task, completed=step, info=f"loss {value:.4f}  {m['samples_per_s']:.0f} samples/s")

            fit(pipe, source, steps, checkpoint_dir=checkpoint_dir, every=checkpoint_every, resume=resume, on_step=on_step)
        metrics = pipe.metrics()
        table = Table(title=f"{plural(steps, 'step')}: step {metrics['step_seconds'] * 1e3:.2f} ms, {metrics['samples_per_s']:.0f} samples/s, "
                            f"bubble {metrics['bubble_fraction']:.1%}")
        for column in ("stage", "busy ms", "transfer ms", "peak RSS", "peak activations"):
            table.add_column(column, justify="right")
        for s in metrics["stages"]:
            table.add_row(str(s["stage"]), f"{s['busy_seconds'] * 1e3:.2f}", f"{s['transfer_seconds'] * 1e3:.2f}",
                          format_bytes(s["peak_memory_bytes"]) if s["peak_memory_bytes"] else "-", format_bytes(s["peak_activation_bytes"] or 0))
        console.print(table)
        console.print("losses: " + " ".join(f"{x:.5f}" for x in metrics["losses"]), highlight=False)
        if do_check:
            result = check(pipe, source, steps)
            metrics["check"] = result
            console.print(f"check against the unpartitioned model: max loss difference {result['max_loss_rel_diff']:.2e} (relative), "
                          f"max weight difference {result['max_weight_abs_diff']:.2e}", highlight=False)
        if trained_path:
            pipe.export(trained_path)
            console.print(f"wrote {escape(trained_path)} (the model with its trained weights)", highlight=False)
        if json_path:
            write_json(json_path, metrics)
            console.print(f"wrote {escape(json_path)}", highlight=False)
        if report_path:
            from onnxpipe.train.report import write_report

            for written in write_report(pipe, report_path):
                console.print(f"wrote {escape(str(written))}", highlight=False)


# --- simulate, report ----------------------------------------------------------


@app.command("simulate")
@friendly
def simulate_command(
    plan_path: str = typer.Argument(..., metavar="PLAN|DIR", help="A plan JSON or a stage directory (holding plan.json)."),
    target: str = typer.Option(None, "--target", "-t", help="Target name or .toml (default: the plan's)."),
    schedule: str = typer.Option(None, "--schedule", help="Simulate another schedule: gpipe, 1f1b, zb-h1, or interleaved / zb-v with each device running the stages the schedule places on it (default: the plan's)."),
    batch: int = typer.Option(None, "--batch", help="Global batch per iteration (default: the plan's); per-micro-batch costs scale with the micro-batch."),
    microbatches: int = typer.Option(None, "--microbatches", help="Micro-batches per iteration (default: the plan's)."),
    dim: list[str] = typer.Option(None, "--dim", help="BATCH_DIM=V: micro-batches of V (the model's symbolic batch dim), batch = V x micro-batches."),
    json_path: str = typer.Option(None, "--json", help="Write the figures and the timeline as JSON (the names `train --json` uses)."),
    backend: str = typer.Option("local", "--backend", help="The executor whose costs to predict: local (worker processes, shared memory) or ray (Ray actors and channels: the target's [backends.ray] figures)."),
) -> None:
    """Predict one training iteration of a plan: per-device busy and idle time, peak memory, throughput, bubble."""
    from rich.table import Table

    from onnxpipe import schedule as schedules
    from onnxpipe.batching import plan_binding
    from onnxpipe.plan.predict import plan_target, read_plan, simulate_plan
    from onnxpipe.pricing.problem import schedule_table
    from onnxpipe.fileio import write_json
    from onnxpipe.units import format_bytes

    ensure_counts(batch=(batch, 1), microbatches=(microbatches, 1))
    plan = read_plan(plan_path)
    binding, total, m = plan_binding(_readable(plan.model), plan.dims, plan.batch, plan.microbatches, parse_dims(dim), batch, microbatches)
    sim = simulate_plan(plan, plan_target(plan, target).for_backend(backend), schedule=schedule, microbatches=m, batch=total)
    print_batch(binding, total, m)
    table = Table(title=f"{plural(len(plan.stages), 'stage')}, {sim.schedule}")
    _stage_columns(table, ("stage", "device(s)", "busy ms", "idle ms", "busy", "peak memory / capacity"))
    for s, devices in enumerate(sim.devices):
        busy = sim.busy_seconds[s]
        table.add_row(str(s), escape(_devices(devices)), format_ms(busy), format_ms(sim.iteration_seconds - busy),
                      f"{busy / sim.iteration_seconds:.0%}", f"{format_bytes(sim.peak_memory_bytes[s])} / {format_bytes(sim.capacity_bytes[s])}")
    console.print(table)
    latency = f", latency {format_ms(sim.latency_seconds)} ms per micro-batch" if plan.mode == "inference" else ""
    console.print(f"iteration {format_ms(sim.iteration_seconds)} ms, {sim.samples_per_s:.4g} samples/s, bubble {sim.bubble_fraction:.1%}{latency} "
                  f"(planner's estimate {format_ms(plan.iteration_seconds)} ms)", highlight=False)
    if len(sim.devices) <= 8 and sim.microbatches <= 8:
        console.print(escape(schedules.render(schedule_table(plan.mode, sim.schedule, len(sim.devices), sim.microbatches))), highlight=False)
    if json_path:
        write_json(json_path, sim.to_json())
        console.print(f"wrote {escape(json_path)}", highlight=False)


@app.command("report")
@friendly
def report_command(
    plan_path: str = typer.Argument(..., metavar="DIR|PLAN", help="A stage directory (holding plan.json) or a plan JSON."),
    output: str = typer.Option("report.html", "-o", "--output", help="The HTML page; the figures go beside it as <name>_*.png."),
    target: str = typer.Option(None, "--target", "-t", help="Target name or .toml (default: the plan's)."),
    model: str = typer.Option(None, "--model", help="The .onnx the plan was made for (default: the plan's model path, if it exists)."),
    schedule: str = typer.Option(None, "--schedule", help="Draw another schedule: gpipe, 1f1b, zb-h1, interleaved or zb-v (default: the plan's)."),
    microbatches: int = typer.Option(None, "--microbatches", help="Micro-batches for the same global batch (default: the plan's)."),
) -> None:
    """Write one HTML page about a plan: stage table, schedule Gantt chart, memory per device, the model by stage."""
    from onnxpipe import report
    from onnxpipe.plan.predict import plan_target, read_plan, simulate_plan

    ensure_counts(microbatches=(microbatches, 1))
    plan = read_plan(plan_path)
    sim = simulate_plan(plan, plan_target(plan, target), schedule=schedule, microbatches=microbatches)
    with console.status("drawing ..."):
        found = report.model_costs(plan, model)
        graph, costs = found if found else (None, None)
        written = report.write(output, plan, sim, graph=graph, costs=costs)
    if found is None:
        console.print(f"model not found at {escape(os.path.abspath(plan.model))} (where the plan records it): no model figure (pass --model)",
                      highlight=False)
    console.print("wrote " + ", ".join(escape(str(p)) for p in written), highlight=False)


@app.command("inspect")
@friendly
def inspect_command(
    model: str = typer.Argument(..., help="The .onnx model."),
    dim: list[str] = typer.Option(None, "--dim", help="Bind a symbolic dim NAME=VALUE, repeatable."),
    shapes_by_running: bool = typer.Option(False, "--shapes-by-running", help="Learn shapes static inference cannot find by running the model once on zeros (needs its full memory)."),
    nodes: bool = typer.Option(False, "--nodes", help="List every compute node with its outputs (names to give --cuts)."),
    tie: list[str] = typer.Option(None, "--tie", help=_TIE_HELP),
    untie: list[str] = typer.Option(None, "--untie", help=_UNTIE_HELP),
) -> None:
    """Show a model as onnxpipe sees it: inputs, outputs, weights, op types, and the nodes that cannot be trained."""
    from collections import Counter

    from rich.table import Table

    from onnxpipe.cost import weight_owners
    from onnxpipe.graph import load
    from onnxpipe.gradients import describe_missing, missing_gradients
    from onnxpipe.rewrites import rewrite_for_training
    from onnxpipe.units import format_bytes

    graph = load(model, parse_dims(dim), parse_ties(tie, untie), shapes_by_running=shapes_by_running)
    console.print(f"[bold]{graph.source}[/]: {len(graph.compute_nodes)} compute nodes, {len(graph.constant_nodes)} constant nodes, "
                  f"{len(graph.derived_nodes)} derived from the inputs (made again in each stage reading them), "
                  f"ir_version {graph.model.ir_version}, opsets " + ", ".join(f"{o.domain or 'ai.onnx'} {o.version}" for o in graph.model.opset_import))
    io = Table("", "name", "dtype", "shape", title="inputs and outputs")
    for kind, names in (("input", graph.inputs), ("output", graph.outputs)):
        for name in names:
            info = graph.tensors.get(name)
            io.add_row(kind, name, info.dtype if info else "?", str(list(info.shape)) if info else "?")
    console.print(io)
    held = {w for mine in weight_owners(graph).values() for w in mine if w in graph.tensors}
    trained = graph.trained
    console.print(f"weights: {plural(len(held), 'tensor')}, {format_bytes(sum(graph.tensors[w].nbytes for w in held))} "
                  f"({len(trained)} trained, {format_bytes(sum(graph.tensors[w].nbytes for w in trained))}; int8 weights, constant fills, "
                  "normalization statistics and the exporter's constants and buffers are only held)", highlight=False)
    if graph.shared:
        shared = Table("weight", "kind", "decision", "readers (node: module)", title="weights read by several nodes")
        for s in graph.shared:
            readers = ", ".join(f"{node}: {module or '?'}" for node, module in s.readers[:6]) + (" ..." if len(s.readers) > 6 else "")
            if s.kind == "copy":
                decision = f"trained apart from {s.of}" if s.untied else f"tied back: the transpose of {s.of}"
            else:
                decision = "untied (a copy per module)" if s.untied else "shared"
            shared.add_row(escape(s.name), s.kind, escape(decision), escape(readers))
        console.print(shared)
    ops = Counter(graph.node(n).op_type for n in graph.compute_nodes)
    console.print("op types: " + ", ".join(f"{op} x{count}" for op, count in ops.most_common()))
    missing = missing_gradients(graph.model)
    if missing:
        console.print(f"[yellow]no gradient in onnxruntime-training 1.19.2 for:[/] {escape(describe_missing(missing))}", highlight=False)
    rewritten = Counter(r.pattern for r in rewrite_for_training(graph.model)[1])
    if rewritten:
        console.print("written out for training (the stage files keep them): " + ", ".join(
            f"{pattern} x{count}" for pattern, count in rewritten.most_common()), highlight=False)
    if nodes:
        table = Table("#", "node", "op", "outputs", "shape", title="compute nodes in topological order")
        for i, name in enumerate(graph.compute_nodes):
            outs = [o for o in graph.node(name).output if o]
            info = graph.tensors.get(outs[0]) if outs else None
            table.add_row(str(i), name, graph.node(name).op_type, ", ".join(outs), str(list(info.shape)) if info else "")
        console.print(table)
