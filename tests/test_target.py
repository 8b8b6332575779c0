"""Target files: bundled targets load, units parse, every validation error names file and key, the time model's math."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from onnxpipe.cost import NodeCost
from onnxpipe.errors import OnnxpipeError
from onnxpipe.pricing.timemodel import allreduce_seconds, corun_seconds, message_cpu, node_seconds, ring_seconds, rings, transfer_seconds
from onnxpipe.target import bundled_targets, load_target
from onnxpipe.units import UnitError, format_bytes, format_flops, format_rate, format_seconds, parse_quantity

GOOD = """\
name = "tiny"
description = "one gpu group and one fpga group"

[[devices]]
name = "g"
kind = "gpu"
count = 2
memory = "16 GiB"
memory_bandwidth = "1000 GB/s"
op_overhead = "5 us"
peak_flops = { float32 = "10 TFLOP/s", float16 = "40 TFLOP/s" }
efficiency = { matmul = 0.5, default = 1.0 }

[[devices]]
name = "f"
kind = "fpga"
count = 1
memory = "8 GiB"
memory_bandwidth = "400 GB/s"
op_overhead = 0
peak_flops = { float32 = "1 TFLOP/s" }
efficiency = { default = 0.25 }

[[links]]
between = ["g", "g"]
bandwidth = "50 GB/s"
latency = "10 us"
topology = "nvlink"

[[links]]
between = ["f", "g"]
bandwidth = "10 GB/s"
latency = "30 us"
topology = "pcie"
"""


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return str(path)


def cost(flops: float, nbytes: float, op_class: str = "matmul", measured: float | None = None) -> NodeCost:
    return NodeCost(
        op_type="MatMul", op_class=op_class, flops=flops, bytes_read=nbytes / 2, bytes_written=nbytes / 2, param_bytes=0.0,
        activation_bytes=0.0, backward_flops=2 * flops, backward_bytes=2 * nbytes, measured_seconds=measured,
        measured_backward_seconds=None if measured is None else 2 * measured,
    )


@pytest.mark.parametrize("name", bundled_targets())
def test_bundled_target_loads(name: str) -> None:
    target = load_target(name)
    assert target.name == name
    assert target.devices and all(d.memory_bytes > 0 and d.peak_flops["float32"] > 0 for d in target.devices)
    assert target.profile == name.startswith("cpu")
    names = [d.name for d in target.devices]
    for a in names:
        for b in names:
            if a != b:
                assert transfer_seconds(target, a, b, 1e6) > 0


@pytest.mark.parametrize("path", sorted(str(p) for p in (Path(__file__).parents[1] / "tools").glob("*.toml")))
def test_benchmark_target_files_load(path: str) -> None:
    """The target files the benchmarks name by path (e.g. `bench_train.py --schedules --target tools/cpu4_vm16.toml`)
    load as a user's would, each a cpu target with a host model (its measured per-message CPU)."""
    target = load_target(path)
    assert target.devices and all(d.kind == "cpu" for d in target.devices) and target.profile
    assert target.host is not None and target.host.messages


def test_bundled_figures() -> None:
    fpga, gpu, hetero = load_target("fpga4"), load_target("gpu4"), load_target("hetero")
    assert [d.name for d in fpga.devices] == ["u280_0", "u280_1", "u280_2", "u280_3"]
    assert fpga.devices[0].memory_bytes == 8 * 2**30 and fpga.devices[0].memory_bandwidth == 460e9
    assert fpga.devices[0].peak_flops["int8"] == 24.5e12
    assert gpu.devices[0].peak_flops["float32"] == 15.7e12 and gpu.devices[0].peak_flops["float16"] == 125e12
    assert gpu.devices[0].memory_bandwidth == 900e9
    assert hetero.summary() == "2x v100 (gpu) + 2x u280 (fpga)"
    assert hetero.total_memory == 2 * 32 * 2**30 + 2 * 8 * 2**30
    assert len(load_target("cpu4").devices) == 4 and load_target("cpu2").devices[0].threads == 1


def test_units() -> None:
    assert parse_quantity("16 GiB", "bytes") == 16 * 2**30
    assert parse_quantity("1.5KB", "bytes") == 1500
    assert parse_quantity("460 GB/s", "bandwidth") == 460e9
    assert parse_quantity("100 Gbit/s", "bandwidth") == 12.5e9
    assert parse_quantity("9.2 TFLOP/s", "flops") == pytest.approx(9.2e12)
    assert parse_quantity("24.5 TOP/s", "flops") == pytest.approx(24.5e12)
    assert parse_quantity("5 us", "time") == pytest.approx(5e-6)
    assert parse_quantity("2e-3 s", "time") == pytest.approx(2e-3)
    assert parse_quantity(1024, "bytes") == 1024.0
    with pytest.raises(UnitError, match=r"bad unit 'parsecs'; use B, KB, MB, GB, KiB, MiB or GiB"):
        parse_quantity("16 parsecs", "bytes")
    with pytest.raises(UnitError, match="expected a number with a unit"):
        parse_quantity("lots", "time")
    with pytest.raises(UnitError):
        parse_quantity(True, "bytes")
    assert format_bytes(8 * 2**30) == "8 GiB"
    assert format_rate(460e9) == "460 GB/s"
    assert format_flops(15.7e12) == "15.7 TFLOP/s" and format_flops(24.5e12, "int8") == "24.5 TOP/s"
    assert format_seconds(5e-6) == "5 us"


def test_good_file_expands_groups(tmp_path: Path) -> None:
    target = load_target(write(tmp_path, GOOD))
    assert [d.name for d in target.devices] == ["g_0", "g_1", "f_0"]
    assert target.profile is False
    assert target.device("f_0").op_overhead == 0.0
    assert target.source == str((tmp_path / "cluster.toml").resolve())


BAD = [
    # (replace this, with this, expected message after the file name)
    ('count = 2\n', 'count = 2\ncolour = "red"\n', r"devices\[0\]\.colour: unknown key; use name, kind"),
    ('description = "one gpu group and one fpga group"\n', 'description = "x"\nversion = 2\n', r": version: unknown key"),
    ('memory = "8 GiB"\n', "", r"devices\[1\]\.memory: missing; add e.g. memory = \"16 GiB\""),
    ('memory = "16 GiB"', 'memory = "16 GiBs"', r"devices\[0\]\.memory: bad unit 'GiBs'; use B, KB, MB, GB, KiB, MiB or GiB"),
    ('memory = "16 GiB"', 'memory = "16 parsecs"', r"devices\[0\]\.memory: bad unit 'parsecs'"),
    ('memory_bandwidth = "400 GB/s"', 'memory_bandwidth = "-400 GB/s"', r"devices\[1\]\.memory_bandwidth: must be positive"),
    ('latency = "30 us"', 'latency = "-1 us"', r"links\[1\]\.latency: must be zero or more"),
    ("count = 2", "count = 0", r"devices\[0\]\.count: expected a positive whole number, got 0"),
    ('kind = "fpga"', 'kind = "tpu"', r"devices\[1\]\.kind: unknown kind 'tpu'; use gpu, fpga, cpu"),
    ("efficiency = { matmul = 0.5, default = 1.0 }", "efficiency = { matmul = 1.5, default = 1.0 }", r"devices\[0\]\.efficiency\.matmul: efficiency must be a number in \(0, 1\], got 1\.5"),
    ("efficiency = { default = 0.25 }", "efficiency = { default = 0 }", r"devices\[1\]\.efficiency\.default: efficiency must be a number in \(0, 1\]"),
    ("efficiency = { default = 0.25 }", "efficiency = { attention = 0.5, default = 0.25 }", r"devices\[1\]\.efficiency\.attention: unknown op class; use default, matmul"),
    ('peak_flops = { float32 = "1 TFLOP/s" }', 'peak_flops = { float32 = "1 TFLOP/s", fp8 = "4 TFLOP/s" }', r"devices\[1\]\.peak_flops\.fp8: unknown dtype; use float32, float16"),
    ('peak_flops = { float32 = "1 TFLOP/s" }', 'peak_flops = { float16 = "1 TFLOP/s" }', r"devices\[1\]\.peak_flops\.float32: missing"),
    ('op_overhead = "5 us"', 'op_overhead = "5 us"\nthreads = 2', r"devices\[0\]\.threads: only cpu devices have threads"),
    ('topology = "pcie"', 'topology = "carrier-pigeon"', r"links\[1\]\.topology: unknown topology 'carrier-pigeon'; use switch"),
    ('between = ["f", "g"]', 'between = ["f", "h"]', r"links\[1\]\.between: unknown device group 'h'; groups: g, f"),
    ('between = ["f", "g"]', 'between = ["g", "g"]', r"links\[1\]: second link between g and g \(first is links\[0\]\)"),
    ('between = ["f", "g"]', 'between = ["f", "f"]', r"no link between device groups g and f; add \[\[links\]\] with between = \[\"g\", \"f\"\]"),
    ('name = "f"', 'name = "g"', r"devices\[1\]\.name: group 'g' appears twice"),
    ("count = 2", "count = 2.5", r"devices\[0\]\.count: expected a positive whole number"),
    ('op_overhead = "5 us"', 'op_overhead = "5 us"\naction_overhead = "-3 us"', r"devices\[0\]\.action_overhead: must be zero or more"),
    ('op_overhead = "5 us"', 'op_overhead = "5 us"\naction_overhead = "3 GB"', r"devices\[0\]\.action_overhead: "),
    ('op_overhead = "5 us"', 'op_overhead = "5 us"\nstep_overhead = "-1 ms"', r"devices\[0\]\.step_overhead: must be zero or more"),
    ('op_overhead = "5 us"', 'op_overhead = "5 us"\ngradient_bandwidth = "3 us"', r"devices\[0\]\.gradient_bandwidth: bad unit 'us'; use "),
    ('op_overhead = "5 us"', 'op_overhead = "5 us"\ngradient_bandwidth = 0', r"devices\[0\]\.gradient_bandwidth: must be positive"),
    ('name = "tiny"', 'name = "tiny"\ncores = 0', r": cores: expected a positive number"),
    ('name = "tiny"', 'name = "tiny"\ncores = 2', r": cores: only cpu devices share cores"),
    ('name = "tiny"', 'name = "tiny"\ncorun_bandwidth = "45 GB/s"', r": corun_bandwidth: only workers sharing `cores` slow each other down; add cores or remove it"),
    ('name = "tiny"', 'name = "tiny"\ntime_slice = "4 ms"', r": time_slice: only workers sharing `cores` take turns on them; add cores or remove it"),
    ('name = "tiny"', 'name = "tiny"\nswitch_cost = "50 us"', r": switch_cost: only workers sharing `cores` take each other's cores; add cores or remove it"),
    ('name = "tiny"', 'name = "tiny"\nwake_affine = true', r": wake_affine: only workers sharing `cores` queue on each other's cores; add cores or remove it"),
    ('name = "tiny"', 'name = "tiny', r": invalid TOML: .*line 1"),
]


@pytest.mark.parametrize(("old", "new", "message"), BAD, ids=[m[:40] for _, _, m in BAD])
def test_validation_errors(tmp_path: Path, old: str, new: str, message: str) -> None:
    assert old in GOOD
    assert_one_line_error(write(tmp_path, GOOD.replace(old, new, 1)), message)


def test_cpu_devices_need_threads(tmp_path: Path) -> None:
    text = GOOD.replace('kind = "fpga"', 'kind = "cpu"')
    with pytest.raises(OnnxpipeError, match=r"devices\[1\]\.threads: missing; cpu devices need it"):
        load_target(write(tmp_path, text))
    assert load_target(write(tmp_path, text.replace("op_overhead = 0", "op_overhead = 0\nthreads = 1"))).device("f_0").threads == 1


def test_action_and_step_overheads_and_gradient_bandwidth_are_optional(tmp_path: Path) -> None:
    target = load_target(write(tmp_path, GOOD.replace('op_overhead = "5 us"', 'op_overhead = "5 us"\naction_overhead = "40 us"\nstep_overhead = "0.3 ms"', 1)))
    assert [d.action_overhead for d in target.devices] == pytest.approx([40e-6, 40e-6, 0.0])
    assert [d.step_overhead for d in target.devices] == pytest.approx([3e-4, 3e-4, 0.0])
    target = load_target(write(tmp_path, GOOD.replace('op_overhead = 0', 'op_overhead = 0\ngradient_bandwidth = "9 GB/s"', 1)))
    assert [d.gradient_bandwidth for d in target.devices] == pytest.approx([0.0, 0.0, 9e9])


#: A one-device cpu target sharing 2 cores, for the fields only such targets take.
CPU = GOOD.replace('kind = "fpga"', 'kind = "cpu"').replace("op_overhead = 0", "op_overhead = 0\nthreads = 1").replace('name = "tiny"', 'name = "tiny"\ncores = 2')


def assert_one_line_error(path: Path, message: str) -> None:
    """Loading `path` fails with one line naming the file and matching `message`."""
    with pytest.raises(OnnxpipeError) as info:
        load_target(path)
    assert str(info.value).startswith(f"{path}: ") and "\n" not in str(info.value)
    assert re.search(message, str(info.value)), str(info.value)


def test_corun_bandwidth_and_shared_cache(tmp_path: Path) -> None:
    plain = load_target(write(tmp_path, CPU))
    assert (plain.host.corun_bandwidth, plain.host.shared_cache, corun_seconds(plain, "f_0", 1e9)) == (0.0, 0.0, 0.0)
    target = load_target(write(tmp_path, CPU.replace("cores = 2", 'cores = 2\ncorun_bandwidth = "50 GB/s"\nshared_cache = "32 MiB"')))
    assert (target.host.corun_bandwidth, target.host.shared_cache) == (50e9, 32 * 2**20)
    assert corun_seconds(target, "f_0", 1e9) == pytest.approx(0.02)
    assert corun_seconds(target, "g_0", 1e9) == 0.0  # a gpu does not share the host's cores
    assert (plain.host.switch_bandwidth, plain.host.wake_affine) == (0.0, False)
    more = load_target(write(tmp_path, CPU.replace("cores = 2", 'cores = 2\ncorun_bandwidth = "50 GB/s"\nshared_cache = "32 MiB"\n'
                                                                   'switch_bandwidth = "20 GB/s"\nwake_affine = true')))
    assert (more.host.switch_bandwidth, more.host.wake_affine) == (20e9, True)
    for extra, message in [
        ('corun_bandwidth = "50 GB"', r": corun_bandwidth: bad unit 'GB'; use "),
        ('corun_bandwidth = "0 GB/s"', r": corun_bandwidth: must be positive"),
        ('shared_cache = "32 MiB"', r": shared_cache: only used with corun_bandwidth; add e\.g\. corun_bandwidth = \"45 GB/s\" or remove it"),
        ('corun_bandwidth = "50 GB/s"\nshared_cache = "-1 MiB"', r": shared_cache: must be zero or more"),
        ('switch_bandwidth = "20 GB/s"', r": switch_bandwidth: refills only what overflows the shared cache; add e\.g\. shared_cache = \"32 MiB\" or remove it"),
        ('corun_bandwidth = "50 GB/s"\nshared_cache = "32 MiB"\nswitch_bandwidth = "20 us"', r": switch_bandwidth: bad unit 'us'; use "),
        ('wake_affine = 1', r": wake_affine: expected true or false, got 1"),
    ]:
        path = write(tmp_path, CPU.replace("cores = 2", f"cores = 2\n{extra}"))
        assert_one_line_error(path, message)


@pytest.mark.parametrize(("field", "value", "seconds", "bad", "rule"), [
    ("time_slice", "4 ms", 4e-3, "0 ms", "must be positive"),
    ("switch_cost", "60 us", 60e-6, "-1 us", "must be zero or more"),
])
def test_scheduler_durations_are_optional(tmp_path: Path, field: str, value: str, seconds: float, bad: str, rule: str) -> None:
    assert getattr(load_target(write(tmp_path, CPU)).host, field) == 0.0
    assert getattr(load_target(write(tmp_path, CPU.replace("cores = 2", f'cores = 2\n{field} = "{value}"'))).host, field) == pytest.approx(seconds)
    for text, message in [("4 MB", rf": {field}: bad unit 'MB'; use "), (bad, rf": {field}: {rule}")]:
        assert_one_line_error(write(tmp_path, CPU.replace("cores = 2", f'cores = 2\n{field} = "{text}"')), message)


def test_unknown_name_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(OnnxpipeError, match=r"unknown target 'tpu8'; bundled targets: fpga4, gpu4, h100x8, hetero, cpu2, cpu4; or pass the path of a .toml"):
        load_target("tpu8")
    with pytest.raises(OnnxpipeError, match="no such target file"):
        load_target(str(tmp_path / "absent.toml"))


def test_node_seconds_roofline(tmp_path: Path) -> None:
    target = load_target(write(tmp_path, GOOD))
    # compute-bound matmul on g: 1e12 FLOP / (10 TFLOP/s * 0.5) = 0.2 s; bytes 1e9 / 1 TB/s = 1 ms
    assert node_seconds(target.device("g_0"), cost(1e12, 1e9)) == pytest.approx(0.2 + 5e-6)
    # float16 peak used when asked; efficiency default 1.0 for an unlisted class
    assert node_seconds(target.device("g_0"), cost(1e12, 1e9), dtype="float16") == pytest.approx(1e12 / 20e12 + 5e-6)
    assert node_seconds(target.device("g_0"), cost(1e12, 1e9, op_class="conv")) == pytest.approx(0.1 + 5e-6)
    # dtype without a peak falls back to float32
    assert node_seconds(target.device("g_0"), cost(1e12, 1e9), dtype="int8") == pytest.approx(0.2 + 5e-6)
    # memory-bound elementwise: 1e6 FLOP is nothing next to 4e9 bytes / (1 TB/s x the gpu's memory efficiency 0.9) = 4.44 ms
    assert node_seconds(target.device("g_0"), cost(1e6, 4e9, op_class="elementwise")) == pytest.approx(4e-3 / 0.9 + 5e-6)
    # backward uses backward flops/bytes; fpga efficiency default 0.25: 2e12 / (1e12 * 0.25) = 8 s
    assert node_seconds(target.device("f_0"), cost(1e12, 1e9), backward=True) == pytest.approx(8.0)
    # measured times are ignored on accelerators, win on cpu
    assert node_seconds(target.device("g_0"), cost(1e12, 1e9, measured=0.5)) == pytest.approx(0.2 + 5e-6)
    cpu = load_target("cpu2")
    assert node_seconds(cpu.device("cpu_0"), cost(1e12, 1e9, measured=0.5)) == 0.5
    assert node_seconds(cpu.device("cpu_0"), cost(1e12, 1e9, measured=0.5), backward=True) == 1.0
    d = cpu.device("cpu_0")
    assert node_seconds(cpu.device("cpu_0"), cost(1e12, 1e9)) == pytest.approx(1e12 / (d.peak_flops["float32"] * d.efficiency["matmul"]) + d.op_overhead)


def test_transfer_and_allreduce(tmp_path: Path) -> None:
    target = load_target(write(tmp_path, GOOD))
    assert transfer_seconds(target, "g_0", "g_1", 50e6) == pytest.approx(10e-6 + 1e-3)
    assert transfer_seconds(target, "g_1", "f_0", 10e6) == pytest.approx(30e-6 + 1e-3)
    assert transfer_seconds(target, "f_0", "g_0", 10e6) == pytest.approx(30e-6 + 1e-3)
    assert transfer_seconds(target, "g_0", "g_0", 1e9) == 0.0
    # ring over the two gpus: 2*(n-1) steps of latency + (bytes/n)/bandwidth
    assert allreduce_seconds(target, ("g_0", "g_1"), 100e6) == pytest.approx(2 * (10e-6 + 50e6 / 50e9))
    # the slowest link of the ring sets the pace
    assert allreduce_seconds(target, ("g_0", "g_1", "f_0"), 30e6) == pytest.approx(4 * (30e-6 + 10e6 / 10e9))
    assert allreduce_seconds(target, ("g_0",), 1e9) == 0.0


TRIANGLE = """\
name = "triangle"
description = "three devices: a-b and b-c fast, c-a slow"
""" + "".join(f"""
[[devices]]
name = "{g}"
kind = "gpu"
count = 1
memory = "16 GiB"
memory_bandwidth = "1000 GB/s"
op_overhead = 0
peak_flops = {{ float32 = "10 TFLOP/s" }}
efficiency = {{ default = 1.0 }}
""" for g in "abc") + "".join(f"""
[[links]]
between = ["{x}", "{y}"]
bandwidth = "{bandwidth}"
latency = "{latency}"
topology = "pcie"
""" for x, y, bandwidth, latency in (("a", "b", "50 GB/s", "10 us"), ("b", "c", "50 GB/s", "10 us"), ("a", "c", "1 GB/s", "100 us")))


@pytest.mark.parametrize("name", ["hetero", "cpu4", "gpu4", "triangle"])
def test_rings_found_in_one_pass_price_each_all_reduce_as_it_alone(name: str, tmp_path: Path) -> None:
    """`rings` gives each prefix of a device list its ring's slowest link in one pass; priced by `ring_seconds`, every prefix's
    all-reduce is the one `allreduce_seconds` finds link by link, in target order and reversed (on the triangle, the ring
    over a, b and c is slow only on its closing link, c to a)."""
    target = load_target(write(tmp_path, TRIANGLE) if name == "triangle" else name)
    for devices in (tuple(d.name for d in target.devices), tuple(d.name for d in reversed(target.devices))):
        found = rings(target, devices)
        assert len(found) == len(devices) - 1
        for n, (latency, bandwidth) in enumerate(found, start=2):
            assert ring_seconds(n, latency, bandwidth, 3e7) == allreduce_seconds(target, devices[:n], 3e7)


def test_heterogeneous_link_lookup() -> None:
    target = load_target("hetero")
    assert target.link("v100_0", "v100_1").topology == "nvlink"
    assert target.link("u280_0", "u280_1").bandwidth == 12e9
    cross = target.link("u280_1", "v100_0")
    assert cross is target.link("v100_0", "u280_1")
    assert cross.bandwidth == 10e9 and cross.latency == pytest.approx(30e-6)
    assert transfer_seconds(target, "v100_0", "v100_1", 1e9) < transfer_seconds(target, "v100_0", "u280_0", 1e9)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}  # keep rich from wrapping the lines asserted on
    return subprocess.run([sys.executable, "-m", "onnxpipe", *args], capture_output=True, text=True, timeout=60, env=env)


def test_cli_lists_and_shows_targets(tmp_path: Path) -> None:
    listed = cli("targets")
    assert listed.returncode == 0, listed.stderr
    for line in ("fpga4", "4x u280 (fpga)", "hetero", "2x v100 (gpu) + 2x u280", "cpu4", "32 GiB"):
        assert line in listed.stdout
    shown = cli("targets", "show", "fpga4")
    assert shown.returncode == 0, shown.stderr
    for line in ("u280_0..3", "8 GiB", "460 GB/s", "1.08 TFLOP/s", "24.5 TOP/s", "u280 <-> u280", "12 GB/s", "10 us", "pcie"):
        assert line in shown.stdout
    bad = cli("targets", "show", "tpu8")
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    assert "unknown target 'tpu8'" in bad.stderr
    broken = cli("targets", "show", write(tmp_path, GOOD.replace('memory = "16 GiB"', 'memory = "16 GiBs"')))
    assert broken.returncode == 2 and "devices[0].memory: bad unit 'GiBs'" in broken.stderr and "Traceback" not in broken.stderr


def test_shm_links_may_price_the_workers_cpu_per_message(tmp_path: Path) -> None:
    shm = GOOD.replace('topology = "nvlink"', 'topology = "shm"')
    plain = load_target(write(tmp_path, shm))
    assert plain.host is None and message_cpu(plain, "g_0", "g_1") is None
    fields = 'topology = "shm"\nsend_overhead = "35 us"\nsend_bandwidth = "29 GB/s"\nrecv_overhead = "65 us"'
    priced = load_target(write(tmp_path, GOOD.replace('topology = "nvlink"', fields)))
    cpu = message_cpu(priced, "g_0", "g_1")
    assert cpu is not None and message_cpu(priced, "g_0", "g_0") is None
    assert (cpu.send_overhead, cpu.send_bandwidth, cpu.recv_overhead) == pytest.approx((35e-6, 29e9, 65e-6))
    assert cpu.send_seconds(29e6) == pytest.approx(1035e-6)
    for text, message in [
        (GOOD.replace('topology = "nvlink"', 'topology = "nvlink"\nrecv_overhead = "65 us"'),
         r": links\[0\]\.recv_overhead: only worker processes copying through shared memory spend CPU per message; set topology = \"shm\" or remove it"),
        (shm.replace('topology = "shm"', 'topology = "shm"\nsend_bandwidth = "0 GB/s"'), r": links\[0\]\.send_bandwidth: must be positive"),
        (shm.replace('topology = "shm"', 'topology = "shm"\nsend_overhead = "-1 us"'), r": links\[0\]\.send_overhead: "),
        (shm.replace('topology = "shm"', 'topology = "shm"\nrecv_overhead = "65 GB/s"'), r": links\[0\]\.recv_overhead: bad unit"),
    ]:
        path = write(tmp_path, text)
        assert_one_line_error(path, message)


def test_cpu_targets_price_the_measured_cpu_per_message() -> None:
    for name in ("cpu2", "cpu4"):
        target = load_target(name)
        cpu = message_cpu(target, "cpu_0", "cpu_1")
        assert target.links[0].topology == "shm" and cpu is not None and cpu.recv_overhead > 0
