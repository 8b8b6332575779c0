"""Cluster descriptions: devices, links, and for cpu worker processes sharing one host, its host model;
read from TOML and validated. How long things take on them is `onnxpipe.pricing.timemodel`.

Reading order: the dataclasses `Device`, `Link`, `MessageCpu`, `HostModel`, `BackendCosts`, `Target`, then
`load_target` (public entry) -> `_read_toml` -> `_parse_target` -> `_parse_device` /
`_parse_link` -> `_ensure_links` -> `_parse_host` -> `_parse_backends`, and the small `_ensure_*` validators at the end.

A target's `[backends.NAME]` table holds what an executor backend other than the local one costs on
its cpu workers (measured; `Target.for_backend` puts them in place of the local transport's figures).

Device instances are expanded from each `[[devices]]` group by its `count` and named
`f"{group}_{i}"`, i = 0..count-1 in file order: group "u280" with count 4 gives
"u280_0" .. "u280_3". Every pair of groups whose devices can talk (a group with itself
when its count > 1) needs exactly one `[[links]]` entry.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any, NoReturn

from onnxpipe.cost import OP_CLASSES
from onnxpipe.errors import OnnxpipeError
from onnxpipe.units import UnitError, parse_quantity

__all__ = ["Device", "KernelModel", "GPU_KERNELS", "Link", "MessageCpu", "HostModel", "BackendCosts", "Target", "BACKENDS", "DEVICE_KINDS", "DTYPES", "TOPOLOGIES", "bundled_targets", "load_target"]

#: Device kinds a target may hold.
DEVICE_KINDS = ("gpu", "fpga", "cpu")
#: Dtypes a device may give a peak rate for; "float32" is required (the fallback of the time model).
DTYPES = ("float32", "float16", "bfloat16", "int8")
#: Link topologies.
TOPOLOGIES = ("switch", "ring", "nvlink", "pcie", "ethernet", "shm")


@dataclass(frozen=True)
class KernelModel:
    """How a device's kernels fall short of the plain roofline (`onnxpipe.pricing.timemodel.node_seconds` applies it). The
    neutral values leave the roofline as it is; gpu devices default to `GPU_KERNELS`."""

    #: Fraction of `memory_bandwidth` that streaming kernels (elementwise, normalization, pooling) reach.
    memory_efficiency: float = 1.0
    #: GEMM-class kernels (matmuls, convolutions as implicit GEMMs) reach half their op-class efficiency at a
    #: reduction length K of `reduction_half` and at `columns_half` output columns N: factor K/(K+k½) x N/(N+n½).
    reduction_half: float = 0.0
    columns_half: float = 0.0
    #: Arithmetic a Winograd-class algorithm saves on a 3x3 stride-1 convolution (direct multiplies over its multiplies).
    winograd_speedup: float = 1.0
    #: Bytes such an algorithm moves through device memory per byte of the convolution's operands, beyond reading
    #: and writing them once: its transforms write them out in the transformed domain and read them back.
    #: It is what makes large feature maps with few channels lose the saving (they run as implicit GEMMs then).
    winograd_traffic: float = 0.0
    #: Streaming multiprocessors (compute units) a kernel's output tiles are spread over, one tile each per
    #: wave; 0 leaves the tile count out (a GEMM of few tiles then runs at its op class's efficiency).
    multiprocessors: float = 0.0
    #: Edge of a GEMM kernel's square output tile, in rows and columns.
    tile: float = 128.0


#: Defaults for gpu devices whose target file gives no `[devices.kernels]` table.
#: - memory_efficiency 0.9: streaming kernels reach ~90% of HBM's datasheet bandwidth (BabelStream-class
#:   copy/triad kernels on A100/H100; NVIDIA's CUDA best-practices guide reports effective vs theoretical
#:   bandwidth the same way). Estimate.
#: - reduction_half 64, columns_half 32: CUTLASS/cuDNN FP32 implicit-GEMM kernels work on output tiles of
#:   64-128 columns and K-steps of 8-32 with a multi-stage pipeline, so a K under ~64 or an N under ~32 leaves
#:   the pipeline and the tile mostly idle (NVIDIA "Matrix Multiplication Background User's Guide": tile and
#:   wave quantization; "Convolutional Layers User's Guide": few channels run far from peak). Estimate.
#: - winograd_speedup 2.25, winograd_traffic 8: F(2x2,3x3) Winograd computes each 2x2 output tile from a 4x4
#:   input tile with 16 multiplies instead of 36 (2.25x), and its transformed input and output hold 16 values
#:   per 4 outputs (4x the data), written by one kernel and read by the next (8x) (Lavin & Gray, "Fast
#:   Algorithms for Convolutional Neural Networks", CVPR 2016, sec. 4; cuDNN's WINOGRAD_NONFUSED runs the
#:   transforms and the batched GEMM as separate kernels). Exact counts of the algorithm, not estimates.
#:   measured: VGG-16's FP32 3x3 backward at 28x28 on an H100 runs at 1.6x the 67 TFLOP/s peak in direct-
#:   convolution FLOPs, which only a reduced-arithmetic algorithm does (shared/measured/h100).
#: - tile 128: CUTLASS's and cuBLAS's FP32 SGEMM kernels compute 128x128 output tiles, one per thread block
#:   (CUTLASS default SGEMM threadblock shape 128x128x8; NVIDIA "Matrix Multiplication Background User's
#:   Guide", tile quantization).
#: - multiprocessors 108: per device, from its datasheet (`[devices.kernels]`); where the file names none, the A100's
#:   108 SMs, between the V100's 80 and the H100's 132 (NVIDIA's Volta, Ampere and Hopper architecture whitepapers).
#:   Estimate: its x0.75 / x1.33 change no H100 partition by more than 1.041x (docs/benchmarks.md, cost model).
GPU_KERNELS = KernelModel(memory_efficiency=0.9, reduction_half=64.0, columns_half=32.0, winograd_speedup=2.25, winograd_traffic=8.0, multiprocessors=108.0, tile=128.0)


@dataclass(frozen=True)
class Device:
    """One accelerator (or CPU worker process) of a target."""

    #: Unique instance name, f"{group}_{i}", e.g. "u280_0".
    name: str
    #: The `[[devices]]` entry it was expanded from, e.g. "u280".
    group: str
    #: "gpu", "fpga" or "cpu".
    kind: str
    #: Peak FLOP/s per numpy dtype name ("float32", "float16", "bfloat16", "int8").
    peak_flops: Mapping[str, float]
    memory_bytes: float
    #: Bytes per second to device memory.
    memory_bandwidth: float
    #: Fraction of peak reached per op class; the key "default" covers classes not listed.
    efficiency: Mapping[str, float]
    #: Fixed seconds per node (kernel launch, dispatch).
    op_overhead: float
    #: Threads a cpu worker process runs with; 0 for accelerators.
    threads: int = 0
    #: Fixed seconds per forward or backward action of a stage, beyond its nodes (a runtime call: feeding
    #: the weights, allocating the outputs, the executor's bookkeeping); 0 when not measured.
    action_overhead: float = 0.0
    #: Fixed seconds per training step outside the schedule's actions (the driver posting the
    #: micro-batches, starting the step and collecting its results); 0 when not measured.
    step_overhead: float = 0.0
    #: Bytes per second at which a backward action hands its stage's weight gradients to the executor
    #: and adds them to the step's sums (beyond the node times: output copies, accumulation); 0 when not
    #: measured (free).
    gradient_bandwidth: float = 0.0
    #: Shape-dependent efficiency and achieved memory bandwidth of its kernels.
    kernels: KernelModel = KernelModel()
    #: The onnxruntime execution provider `--profile` measures with on this device; "" picks the kind's own
    #: (CUDAExecutionProvider for gpu, CPUExecutionProvider for cpu).
    provider: str = ""
    #: The Ray node (its address, as `ray start --node-ip-address` gives it) the Ray backend places this
    #: device's stages on; "" lets Ray choose among the nodes with the device group's resource.
    host: str = ""


@dataclass(frozen=True)
class Link:
    """A class of connection between two device groups."""

    #: The two device group names it joins (equal for links inside one group).
    between: tuple[str, str]
    #: Bytes per second in each direction.
    bandwidth: float
    #: Seconds per message.
    latency: float
    #: "switch", "ring", "nvlink", "pcie", "ethernet" or "shm".
    topology: str


@dataclass(frozen=True)
class MessageCpu:
    """The CPU worker processes spend per message on an "shm" link (measured): the sender's send_overhead +
    bytes / send_bandwidth (the copy included) and the receiver's recv_overhead + bytes / recv_bandwidth (inf
    where the receiver reads in place), each on a core before its next action. They replace the sender's
    wait for bytes / bandwidth; the link's latency is the wake-up."""

    send_overhead: float = 0.0
    send_bandwidth: float = math.inf
    recv_overhead: float = 0.0
    recv_bandwidth: float = math.inf

    def send_seconds(self, nbytes: float) -> float:
        """Seconds of the sender's CPU for one message of `nbytes`."""
        return self.send_overhead + nbytes / self.send_bandwidth

    def recv_seconds(self, nbytes: float) -> float:
        """Seconds of the receiver's CPU for one message of `nbytes`."""
        return self.recv_overhead + nbytes / self.recv_bandwidth


@dataclass(frozen=True)
class HostModel:
    """How cpu worker processes on one host share it: its cores, its last-level cache, the OS scheduler,
    and the CPU they spend per message. Only targets with cpu workers carry one."""

    #: Cores' worth of throughput the cpu devices (worker processes on one host) share, measured (two
    #: virtual CPUs need not give two cores); when more of them compute at once, each runs at
    #: cores / computing of its speed. 0: every device has its own.
    cores: float = 0.0
    #: While cpu workers computing at once keep more than `shared_cache` bytes between them (their working
    #: sets overflow the last-level cache the cores share), a node takes (its weight bytes read and
    #: written) / corun_bandwidth longer: those bytes come from memory, fought over. 0: no such slowdown.
    corun_bandwidth: float = 0.0
    #: Bytes of the cache the cores share (last-level cache).
    shared_cache: float = 0.0
    #: Seconds a cpu worker computes on a shared core before the OS scheduler hands that core to one
    #: waiting for it (measured); 0: a worker keeps its core until it blocks.
    time_slice: float = 0.0
    #: Extra CPU seconds a cpu worker spends when it gets a shared core that another worker held last (its
    #: private caches and TLB refill; measured); 0: none.
    switch_cost: float = 0.0
    #: Bytes/s at which a cpu worker taking a core another worker held last refills its working set (static
    #: memory, one micro-batch's stash and its messages in and out) when the workers' working sets together
    #: overflow `shared_cache` (each one's data is evicted while the others run; measured); 0: no refill beyond
    #: `switch_cost`.
    switch_bandwidth: float = 0.0
    #: Whether a cpu worker woken by a message while every shared core is busy joins its waker's core and
    #: takes it first (the OS's wake-affine placement and wake-up preemption; measured); False: it waits for
    #: the first core released.
    wake_affine: bool = False
    #: The workers' CPU per message on each "shm" link that gives it, by the link's `between`.
    messages: Mapping[tuple[str, str], MessageCpu] = field(default_factory=dict)

    def message_cpu(self, link: Link) -> MessageCpu | None:
        """The CPU per message on a link; None where it is not priced (the copy then runs at its bandwidth)."""
        return self.messages.get(link.between)


#: Executor backends: "local" (worker processes and shared memory, the figures of the devices and links
#: themselves) and "ray" (Ray actors and Ray's channels, figures from the target's [backends.ray]).
BACKENDS = ("local", "ray")


@dataclass(frozen=True)
class BackendCosts:
    """What a backend's executor costs on a target's cpu workers, in place of the local backend's figures
    (measured: tools/measure_ray.py for Ray): per action and per step beyond the nodes (`Device`), and per
    message on its "shm" links: the hop's wake-up latency and the workers' CPU (`MessageCpu`)."""

    action_overhead: float
    step_overhead: float
    latency: float
    messages: MessageCpu


@dataclass(frozen=True)
class Target:
    """A cluster: its devices in order and the links between them."""

    name: str
    description: str
    devices: tuple[Device, ...]
    links: tuple[Link, ...]
    #: True for targets whose node times come from profiling the model on this machine.
    profile: bool
    #: The file it was read from.
    source: str
    #: The host model of cpu workers sharing one machine; None for a target without one (accelerators).
    host: HostModel | None = None
    #: Measured costs of the backends other than "local", by name.
    backends: Mapping[str, BackendCosts] = field(default_factory=dict)

    def for_backend(self, backend: str) -> Target:
        """This target as `backend`'s executor runs on it: for "local" itself; otherwise its cpu devices'
        action and step overheads and its "shm" links' latency and CPU per message are the backend's."""
        if backend not in BACKENDS:
            raise OnnxpipeError(f"--backend {backend!r} is not one of {', '.join(BACKENDS)}")
        if backend == "local":
            return self
        costs = self.backends.get(backend)
        if costs is None:
            raise OnnxpipeError(f"target {self.name} has no measured costs for the {backend} backend; add a [backends.{backend}] table "
                                f"to its file (tools/measure_ray.py prints one for this machine), or simulate --backend local")
        devices = tuple(replace(d, action_overhead=costs.action_overhead, step_overhead=costs.step_overhead) if d.kind == "cpu" else d
                        for d in self.devices)
        shm = tuple(link for link in self.links if link.topology == "shm")
        links = tuple(replace(link, latency=costs.latency) if link.topology == "shm" else link for link in self.links)
        host = replace(self.host or HostModel(), messages={**(self.host.messages if self.host else {}), **{link.between: costs.messages for link in shm}})
        return replace(self, devices=devices, links=links, host=host)

    def device(self, name: str) -> Device:
        """The device of a given instance name (an index built once: pricing asks for every device of a
        1,000-device target many times)."""
        index = self.__dict__.get("_device_index")
        if index is None:
            index = {d.name: d for d in self.devices}
            object.__setattr__(self, "_device_index", index)
        return index[name]

    def groups(self) -> dict[str, tuple[Device, ...]]:
        """Device instances by group, in file order."""
        out: dict[str, list[Device]] = {}
        for d in self.devices:
            out.setdefault(d.group, []).append(d)
        return {g: tuple(ds) for g, ds in out.items()}

    def summary(self) -> str:
        """The devices in a few words, e.g. "2x v100 (gpu) + 2x u280 (fpga)"."""
        return " + ".join(f"{len(ds)}x {g} ({ds[0].kind})" for g, ds in self.groups().items())

    @property
    def total_memory(self) -> float:
        """Bytes of device memory over all devices."""
        return sum(d.memory_bytes for d in self.devices)

    def link(self, a: str, b: str) -> Link:
        """The link joining two devices (by instance name)."""
        ga, gb = self.device(a).group, self.device(b).group
        for link in self.links:
            if {ga, gb} == set(link.between) or (ga == gb and link.between == (ga, gb)):
                return link
        raise KeyError(f"no link between {ga} and {gb}")


_BUNDLED = ("fpga4", "gpu4", "h100x8", "hetero", "cpu2", "cpu4")

#: What to write for a missing key, shown in the error.
_EXAMPLES = {
    "name": 'name = "mycluster"',
    "description": 'description = "4 accelerators on a PCIe switch"',
    "devices": '[[devices]] name = "u280" ...',
    "kind": 'kind = "gpu"',
    "count": "count = 4",
    "memory": 'memory = "16 GiB"',
    "memory_bandwidth": 'memory_bandwidth = "460 GB/s"',
    "peak_flops": 'peak_flops = { float32 = "9.2 TFLOP/s" }',
    "float32": 'float32 = "9.2 TFLOP/s"',
    "op_overhead": 'op_overhead = "5 us"',
    "threads": "threads = 1",
    "action_overhead": 'action_overhead = "30 us"',
    "step_overhead": 'step_overhead = "200 us"',
    "gradient_bandwidth": 'gradient_bandwidth = "9 GB/s"',
    "efficiency": "efficiency = { default = 0.5 }",
    "kernels": "kernels = { memory_efficiency = 0.9 }",
    "provider": 'provider = "CUDAExecutionProvider"',
    "corun_bandwidth": 'corun_bandwidth = "45 GB/s"',
    "shared_cache": 'shared_cache = "32 MiB"',
    "time_slice": 'time_slice = "4 ms"',
    "switch_cost": 'switch_cost = "50 us"',
    "wake_affine": "wake_affine = true",
    "switch_bandwidth": 'switch_bandwidth = "20 GB/s"',
    "default": "default = 0.5",
    "between": 'between = ["u280", "u280"]',
    "bandwidth": 'bandwidth = "12 GB/s"',
    "latency": 'latency = "10 us"',
    "topology": 'topology = "pcie"',
    "send_overhead": 'send_overhead = "35 us"',
    "send_bandwidth": 'send_bandwidth = "29 GB/s"',
    "recv_overhead": 'recv_overhead = "65 us"',
    "recv_bandwidth": 'recv_bandwidth = "8 GB/s"',
}

_GROUP_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9-]*$")


def bundled_targets() -> tuple[str, ...]:
    """Names of the targets shipped with onnxpipe."""
    return _BUNDLED


def load_target(name_or_path: str) -> Target:
    """A bundled target by name (see `bundled_targets`) or a target file by path."""
    if name_or_path in _BUNDLED:
        resource = resources.files("onnxpipe.targets").joinpath(f"{name_or_path}.toml")
        return _parse_target(_read_toml(resource.read_text(encoding="utf-8"), f"targets/{name_or_path}.toml"), f"targets/{name_or_path}.toml", str(resource))
    path = Path(name_or_path)
    if path.suffix != ".toml" and len(path.parts) == 1 and not path.exists():
        raise OnnxpipeError(
            f"unknown target {name_or_path!r}; bundled targets: {', '.join(_BUNDLED)}; or pass the path of a .toml target file"
        )
    if not path.is_file():
        raise OnnxpipeError(f"{name_or_path}: no such target file; pass an existing .toml or one of {', '.join(_BUNDLED)}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise OnnxpipeError(f"{name_or_path}: cannot read target file ({exc})") from exc
    return _parse_target(_read_toml(text, name_or_path), name_or_path, str(path.resolve()))


def _read_toml(text: str, origin: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise OnnxpipeError(f"{origin}: invalid TOML: {str(exc).splitlines()[0]}; fix the syntax there") from exc


def _parse_target(doc: dict[str, Any], origin: str, source: str) -> Target:
    _ensure_keys(doc, ("name", "description", "devices"), ("profile", "links", "cores", "corun_bandwidth", "shared_cache", "time_slice", "switch_cost", "switch_bandwidth", "wake_affine", "backends"), origin, "")
    name = _ensure_str(doc, "name", origin, "")
    description = _ensure_str(doc, "description", origin, "")
    profile = doc.get("profile", False)
    if not isinstance(profile, bool):
        _fail(origin, "profile", f"expected true or false, got {profile!r}")
    groups = _ensure_table_list(doc, "devices", origin)
    if not groups:
        _fail(origin, "devices", "no devices; add at least one [[devices]] entry")
    devices: list[Device] = []
    counts: dict[str, int] = {}
    for i, table in enumerate(groups):
        group, count, device = _parse_device(table, origin, f"devices[{i}]")
        if group in counts:
            _fail(origin, f"devices[{i}].name", f"group {group!r} appears twice; give each [[devices]] entry its own name")
        counts[group] = count
        devices.extend(Device(**{**device, "name": f"{group}_{k}", "group": group}) for k in range(count))
    parsed = [_parse_link(table, origin, f"links[{i}]", counts) for i, table in enumerate(_ensure_table_list(doc, "links", origin))]
    links = tuple(link for link, _ in parsed)
    _ensure_links(links, counts, origin)
    messages = {link.between: cpu for link, cpu in parsed if cpu is not None}
    return Target(
        name=name, description=description, devices=tuple(devices), links=links, profile=profile, source=source,
        host=_parse_host(doc, devices, messages, origin), backends=_parse_backends(doc, devices, links, origin),
    )


def _parse_backends(doc: dict[str, Any], devices: list[Device], links: tuple[Link, ...], origin: str) -> dict[str, BackendCosts]:
    """The [backends.NAME] tables: only for backends other than "local", on targets with cpu devices."""
    tables = doc.get("backends", {})
    _ensure_keys(tables, (), tuple(b for b in BACKENDS if b != "local"), origin, "backends", "backend")
    if tables and not any(d.kind == "cpu" for d in devices):
        _fail(origin, "backends", "backend costs are for cpu worker processes; add cpu devices or remove it")
    out = {}
    for name, table in tables.items():
        path = f"backends.{name}"
        _ensure_keys(table, ("action_overhead", "step_overhead", "latency", *_MESSAGE_CPU), (), origin, path)  # all measured together
        out[name] = BackendCosts(
            action_overhead=_ensure_quantity(table, "action_overhead", "time", origin, path, allow_zero=True),
            step_overhead=_ensure_quantity(table, "step_overhead", "time", origin, path, allow_zero=True),
            latency=_ensure_quantity(table, "latency", "time", origin, path, allow_zero=True),
            messages=MessageCpu(**{key: _message_quantity(table, key, origin, path) for key in _MESSAGE_CPU}),
        )
    return out


def _parse_host(doc: dict[str, Any], devices: list[Device], messages: dict[tuple[str, str], MessageCpu], origin: str) -> HostModel | None:
    """The host model from the target's top-level host keys and its links' CPU per message; None when none is given."""
    cores = doc.get("cores", 0)
    if isinstance(cores, bool) or not isinstance(cores, (int, float)) or ("cores" in doc and not cores > 0):
        _fail(origin, "cores", f"expected a positive number (cores' worth of throughput, e.g. 1.8), got {cores!r}")
    if cores and not any(d.kind == "cpu" for d in devices):
        _fail(origin, "cores", "only cpu devices share cores; remove it or add cpu devices")
    corun = _ensure_corun(doc, bool(cores), origin)
    if "time_slice" in doc and not cores:
        _fail(origin, "time_slice", "only workers sharing `cores` take turns on them; add cores or remove it")
    time_slice = _ensure_quantity(doc, "time_slice", "time", origin, "") if "time_slice" in doc else 0.0
    if "switch_cost" in doc and not cores:
        _fail(origin, "switch_cost", "only workers sharing `cores` take each other's cores; add cores or remove it")
    switch_cost = _ensure_quantity(doc, "switch_cost", "time", origin, "", allow_zero=True) if "switch_cost" in doc else 0.0
    if "switch_bandwidth" in doc and "shared_cache" not in doc:
        _fail(origin, "switch_bandwidth", f"refills only what overflows the shared cache; add e.g. {_EXAMPLES['shared_cache']} or remove it")
    switch_bandwidth = _ensure_quantity(doc, "switch_bandwidth", "bandwidth", origin, "") if "switch_bandwidth" in doc else 0.0
    wake_affine = doc.get("wake_affine", False)
    if not isinstance(wake_affine, bool):
        _fail(origin, "wake_affine", f"expected true or false, got {wake_affine!r}")
    if wake_affine and not cores:
        _fail(origin, "wake_affine", "only workers sharing `cores` queue on each other's cores; add cores or remove it")
    if not cores and not messages:
        return None
    return HostModel(cores=float(cores), time_slice=time_slice, switch_cost=switch_cost, switch_bandwidth=switch_bandwidth, wake_affine=wake_affine, messages=messages, **corun)


def _ensure_corun(doc: dict[str, Any], shared: bool, origin: str) -> dict[str, float]:
    """`corun_bandwidth` (needs shared `cores`) and `shared_cache` (needs `corun_bandwidth`), when given."""
    out = {}
    if "corun_bandwidth" in doc:
        if not shared:
            _fail(origin, "corun_bandwidth", "only workers sharing `cores` slow each other down; add cores or remove it")
        out["corun_bandwidth"] = _ensure_quantity(doc, "corun_bandwidth", "bandwidth", origin, "")
    if "shared_cache" in doc:
        if "corun_bandwidth" not in doc:
            _fail(origin, "shared_cache", f"only used with corun_bandwidth; add e.g. {_EXAMPLES['corun_bandwidth']} or remove it")
        out["shared_cache"] = _ensure_quantity(doc, "shared_cache", "bytes", origin, "", allow_zero=True)
    return out


def _parse_device(table: Any, origin: str, path: str) -> tuple[str, int, dict[str, Any]]:
    """The group name, its count, and the Device fields shared by its instances."""
    required = ("name", "kind", "count", "memory", "memory_bandwidth", "peak_flops", "op_overhead", "efficiency")
    _ensure_keys(table, required, ("threads", "action_overhead", "step_overhead", "gradient_bandwidth", "kernels", "provider", "host"), origin, path)
    group = _ensure_str(table, "name", origin, path)
    if not _GROUP_NAME.match(group):
        _fail(origin, f"{path}.name", f"bad group name {group!r}; use letters, digits and '-', starting with a letter")
    kind = _ensure_str(table, "kind", origin, path, DEVICE_KINDS)
    count = _ensure_int(table, "count", origin, path)
    if kind == "cpu" and "threads" not in table:
        _fail(origin, f"{path}.threads", f"missing; cpu devices need it, e.g. {_EXAMPLES['threads']}")
    if kind != "cpu" and "threads" in table:
        _fail(origin, f"{path}.threads", f"only cpu devices have threads; remove it from this {kind} device")
    threads = _ensure_int(table, "threads", origin, path) if kind == "cpu" else 0
    peak = _ensure_subtable(table, "peak_flops", origin, path)
    _ensure_keys(peak, ("float32",), DTYPES, origin, f"{path}.peak_flops", "dtype")
    efficiency = _ensure_subtable(table, "efficiency", origin, path)
    _ensure_keys(efficiency, ("default",), OP_CLASSES, origin, f"{path}.efficiency", "op class")
    fields = {
        "kind": kind,
        "peak_flops": {k: _ensure_quantity(peak, k, "flops", origin, f"{path}.peak_flops") for k in peak},
        "memory_bytes": _ensure_quantity(table, "memory", "bytes", origin, path),
        "memory_bandwidth": _ensure_quantity(table, "memory_bandwidth", "bandwidth", origin, path),
        "efficiency": {k: _ensure_fraction(efficiency, k, origin, f"{path}.efficiency") for k in efficiency},
        "op_overhead": _ensure_quantity(table, "op_overhead", "time", origin, path, allow_zero=True),
        "threads": threads,
        **({"host": _ensure_str(table, "host", origin, path)} if "host" in table else {}),
        **{key: _ensure_quantity(table, key, "time", origin, path, allow_zero=True) for key in ("action_overhead", "step_overhead") if key in table},
        **({"gradient_bandwidth": _ensure_quantity(table, "gradient_bandwidth", "bandwidth", origin, path)} if "gradient_bandwidth" in table else {}),
        "kernels": _parse_kernels(table, kind, origin, path),
        **({"provider": _ensure_str(table, "provider", origin, path)} if "provider" in table else {}),
    }
    return group, count, fields


#: `[devices.kernels]` keys whose 0 leaves their term out of the time model.
_ZERO_MEANS_OFF = ("reduction_half", "columns_half", "winograd_traffic", "multiprocessors")


def _parse_kernels(table: dict[str, Any], kind: str, origin: str, path: str) -> KernelModel:
    """`[devices.kernels]` over the kind's defaults (`GPU_KERNELS` for gpu devices, neutral otherwise)."""
    base = GPU_KERNELS if kind == "gpu" else KernelModel()
    if "kernels" not in table:
        return base
    sub = _ensure_subtable(table, "kernels", origin, path)
    keys = tuple(f.name for f in fields(KernelModel))
    _ensure_keys(sub, (), keys, origin, f"{path}.kernels")
    values = {}
    for key in sub:
        value = sub[key]
        may_be_zero = key in _ZERO_MEANS_OFF
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (not may_be_zero and value <= 0):
            _fail(origin, f"{path}.kernels.{key}", f"expected a {'number >= 0' if may_be_zero else 'positive number'}, got {value!r}")
        if key == "memory_efficiency" and value > 1:
            _fail(origin, f"{path}.kernels.{key}", f"a fraction of memory_bandwidth must be in (0, 1], got {value!r}")
        values[key] = float(value)
    return replace(base, **values)


def _parse_link(table: Any, origin: str, path: str, counts: Mapping[str, int]) -> tuple[Link, MessageCpu | None]:
    """The link, and the CPU per message its workers spend when the entry gives it."""
    _ensure_keys(table, ("between", "bandwidth", "latency", "topology"), _MESSAGE_CPU, origin, path)
    between = table["between"]
    if not (isinstance(between, list) and len(between) == 2 and all(isinstance(g, str) for g in between)):
        _fail(origin, f"{path}.between", f"expected two device group names, e.g. {_EXAMPLES['between']}, got {between!r}")
    for g in between:
        if g not in counts:
            _fail(origin, f"{path}.between", f"unknown device group {g!r}; groups: {', '.join(counts)}")
    link = Link(
        between=(between[0], between[1]),
        bandwidth=_ensure_quantity(table, "bandwidth", "bandwidth", origin, path),
        latency=_ensure_quantity(table, "latency", "time", origin, path, allow_zero=True),
        topology=_ensure_str(table, "topology", origin, path, TOPOLOGIES),
    )
    cpu = MessageCpu(**_ensure_message_cpu(table, origin, path))
    return link, (None if cpu == MessageCpu() else cpu)


#: Optional "shm" link keys: the workers' CPU per message.
_MESSAGE_CPU = ("send_overhead", "send_bandwidth", "recv_overhead", "recv_bandwidth")


def _ensure_message_cpu(table: dict[str, Any], origin: str, path: str) -> dict[str, float]:
    given = [key for key in _MESSAGE_CPU if key in table]
    if given and table.get("topology") != "shm":
        _fail(origin, _key(path, given[0]), "only worker processes copying through shared memory spend CPU per message; set topology = \"shm\" or remove it")
    return {key: _message_quantity(table, key, origin, path) for key in given}


def _message_quantity(table: dict[str, Any], key: str, origin: str, path: str) -> float:
    bandwidth = key.endswith("_bandwidth")
    return _ensure_quantity(table, key, "bandwidth" if bandwidth else "time", origin, path, allow_zero=not bandwidth)


def _ensure_links(links: tuple[Link, ...], counts: Mapping[str, int], origin: str) -> None:
    """Exactly one link per pair of groups that can talk."""
    seen: dict[frozenset[str], int] = {}
    for i, link in enumerate(links):
        pair = frozenset(link.between)
        if pair in seen:
            _fail(origin, f"links[{i}]", f"second link between {link.between[0]} and {link.between[1]} (first is links[{seen[pair]}]); keep one")
        seen[pair] = i
    names = list(counts)
    for i, a in enumerate(names):
        for b in names[i:]:
            if (a != b or counts[a] > 1) and frozenset((a, b)) not in seen:
                raise OnnxpipeError(
                    f"{origin}: no link between device groups {a} and {b}; add [[links]] with between = [\"{a}\", \"{b}\"], bandwidth, latency and topology"
                )


def _fail(origin: str, path: str, message: str) -> NoReturn:
    raise OnnxpipeError(f"{origin}: {path}: {message}" if path else f"{origin}: {message}")


def _key(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _ensure_keys(table: Any, required: tuple[str, ...], optional: tuple[str, ...], origin: str, path: str, what: str = "key") -> None:
    if not isinstance(table, dict):
        _fail(origin, path, f"expected a table, got {table!r}")
    known = required + tuple(k for k in optional if k not in required)
    for key in table:
        if key not in known:
            _fail(origin, _key(path, key), f"unknown {what}; use {', '.join(known)}")
    for key in required:
        if key not in table:
            _fail(origin, _key(path, key), f"missing; add e.g. {_EXAMPLES[key]}")


def _ensure_table_list(doc: dict[str, Any], key: str, origin: str) -> list[Any]:
    value = doc.get(key, [])
    if not isinstance(value, list):
        _fail(origin, key, f"expected [[{key}]] entries, got {value!r}")
    return value


def _ensure_subtable(table: dict[str, Any], key: str, origin: str, path: str) -> dict[str, Any]:
    value = table[key]
    if not isinstance(value, dict):
        _fail(origin, _key(path, key), f"expected a table, e.g. {_EXAMPLES[key]}, got {value!r}")
    return value


def _ensure_str(table: dict[str, Any], key: str, origin: str, path: str, choices: tuple[str, ...] = ()) -> str:
    value = table[key]
    if not isinstance(value, str) or not value.strip():
        _fail(origin, _key(path, key), f"expected a non-empty string, e.g. {_EXAMPLES[key]}, got {value!r}")
    if choices and value not in choices:
        _fail(origin, _key(path, key), f"unknown {key} {value!r}; use {', '.join(choices)}")
    return value


def _ensure_int(table: dict[str, Any], key: str, origin: str, path: str) -> int:
    value = table[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        _fail(origin, _key(path, key), f"expected a positive whole number, got {value!r}")
    return value


def _ensure_quantity(table: dict[str, Any], key: str, kind: str, origin: str, path: str, allow_zero: bool = False) -> float:
    try:
        value = parse_quantity(table[key], kind)
    except UnitError as exc:
        _fail(origin, _key(path, key), str(exc))
    if value < 0 or (value == 0 and not allow_zero):
        _fail(origin, _key(path, key), f"must be {'zero or more' if allow_zero else 'positive'}, got {table[key]!r}")
    return value


def _ensure_fraction(table: dict[str, Any], key: str, origin: str, path: str) -> float:
    value = table[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        _fail(origin, _key(path, key), f"efficiency must be a number in (0, 1], got {value!r}")
    return float(value)
