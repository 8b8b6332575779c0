"""The Ray backend on real Ray, every process on this machine (loopback): one two-node cluster for the
module (`ray.cluster_utils.Cluster`, each node with a custom resource of its own). Stages land on the
nodes the target names; losses and weights equal the local backend's bit for bit; a killed actor fails
the run within 10 s with one line naming the stage and host, leaving no actor behind; resuming from the
last checkpoint gives the uninterrupted run's losses."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray resolves 127.0.0.1 to 127.0.0.1, not this host's address
ray = pytest.importorskip("ray")

from onnxpipe import models  # noqa: E402
from onnxpipe.errors import OnnxpipeError  # noqa: E402
from onnxpipe.train.fit import data_source, fit  # noqa: E402
from onnxpipe.train.pipeline import Pipeline  # noqa: E402
from onnxpipe.train.prepare import TrainConfig  # noqa: E402
from onnxpipe.train.leftovers import owner_alive  # noqa: E402
from onnxpipe.train.ray_backend import link_messages, local_raylets, remove_raylet_semaphores  # noqa: E402
from onnxpipe.train.ray_transport import PART_BYTES, ChannelTransport, open_channel  # noqa: E402
from onnxpipe.train.transport import LocalTransport  # noqa: E402
from procs import as_in_a_terminal  # noqa: E402
from test_train import SGD, M, _alive, _global_batches, stage_dir  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
#: Two cpu device groups, one per node of the test cluster.
TWO_HOSTS = (ROOT / "targets" / "cpu2.toml").read_text().replace(
    'name = "cpu"\nkind = "cpu"\ncount = 2', 'name = "left"\nkind = "cpu"\ncount = 1').replace(
    'between = ["cpu", "cpu"]', 'between = ["left", "right"]')


@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    """A head node with resource `left` and a second node with `right`, 2 CPUs each, all on 127.0.0.1."""
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"left": 1}, "node_ip_address": "127.0.0.1",
                                                      "include_dashboard": False})
    c.add_node(num_cpus=2, resources={"right": 1}, node_ip_address="127.0.0.1")
    ray.init(address=c.address, logging_level="ERROR", log_to_driver=False)
    yield c
    ray.shutdown()
    raylets = local_raylets()
    c.shutdown()
    remove_raylet_semaphores(raylets)


def _two_host_target(tmp: Path) -> Path:
    text = TWO_HOSTS
    right = text[text.index("[[devices]]"):text.index("[[links]]")].replace('name = "left"', 'name = "right"')
    text = text.replace("[[links]]", right + "[[links]]", 1)
    path = tmp / "two-hosts.toml"
    path.write_text(text)
    return path


def _train(pipe: Pipeline, steps: list[dict[str, np.ndarray]]) -> tuple[list[float], dict[str, np.ndarray]]:
    return [pipe.train_step(b) for b in steps], pipe.parameters()


def _assert_same(a: tuple[list[float], dict[str, np.ndarray]], b: tuple[list[float], dict[str, np.ndarray]]) -> None:
    assert a[0] == b[0]
    assert set(a[1]) == set(b[1])
    for key, value in a[1].items():
        np.testing.assert_array_equal(value, b[1][key], err_msg=key)


def test_stages_land_on_the_nodes_the_target_names(cluster: object, tmp_path: Path) -> None:
    target = _two_host_target(tmp_path)
    model = tmp_path / "gpt2.onnx"
    import onnx

    onnx.save(models.build("gpt2-tiny", train=True), str(model))
    rng = np.random.default_rng(0)
    steps = [{"input_ids": rng.integers(0, 256, (16, 32)), "labels": rng.integers(0, 256, (16, 32))} for _ in range(3)]
    with Pipeline(model, str(target), stages=2, batch=16, microbatches=2, schedule="1f1b", optimizer=SGD, backend="ray") as pipe:
        on_ray = _train(pipe, steps)
        nodes = [n[0] for n in pipe.engine.nodes]  # type: ignore[union-attr]
        devices = [st.devices[0] for st in pipe.manifest.stages]
        with Pipeline(pipe.directory, str(target), microbatches=2, schedule="1f1b", optimizer=SGD, processes=False) as local:
            _assert_same(on_ray, _train(local, steps))
    resources = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    assert sorted(devices) == ["left_0", "right_0"]
    for node, device in zip(nodes, devices):
        assert resources[node].get(device.rsplit("_", 1)[0]) == 1.0, (device, resources[node])
    assert len(set(nodes)) == 2


@pytest.mark.parametrize(("name", "k", "replicas", "schedule"), [
    ("resnet-tiny", 2, None, "gpipe"), ("gpt2-tiny", 2, None, "1f1b"), ("mlp", 2, (1, 2), "gpipe"), ("mlp", 2, (1, 2), "1f1b"),
    ("gpt2-tiny", 4, None, "zb-v")])  # ZB-V: 4 stages on 2 devices, one actor per stage on Ray, one host per device locally
def test_ray_trains_bit_for_bit_as_the_local_backend(cluster: object, name: str, k: int, replicas: tuple[int, ...] | None,
                                                      schedule: str) -> None:
    directory, manifest = stage_dir(name, k, replicas=replicas)
    steps = _global_batches(name, manifest, TrainConfig(schedule=schedule, microbatches=M, optimizer=SGD))[:3]
    runs = []
    for backend in ("ray", "local"):
        with Pipeline(directory, microbatches=M, schedule=schedule, optimizer=SGD, backend=backend, processes=False) as pipe:
            runs.append(_train(pipe, steps))
            if backend == "ray":
                pids = pipe.engine.pids  # type: ignore[union-attr]
                assert len(pids) == sum(replicas or (1,) * k)
    _assert_same(*runs)
    assert runs[0][0][-1] != runs[0][0][0]
    deadline = time.monotonic() + 10
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pids)


@pytest.mark.parametrize(("name", "replicas"), [("gpt2-tiny", None), ("mlp", (1, 2))])
def test_each_channel_has_a_buffer_per_message_a_command_sends(name: str, replicas: tuple[int, ...] | None,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Receivers hold what they read in place until their row ends, so a link needs a buffer for every
    message of a command: the count the Ray backend sizes them by is what one step really sends (the
    driver's link: the command and the model inputs; tied weights' and replicas' gradient sums included)."""
    directory, manifest = stage_dir(name, 2, replicas=replicas)
    batch = _global_batches(name, manifest, TrainConfig(microbatches=M, optimizer=SGD))[0]
    sent: Counter[tuple[int, int]] = Counter()
    send = LocalTransport.send

    def counted(self: LocalTransport, dst: int, key: str, microbatch: int, array: np.ndarray) -> None:
        sent[self.me, dst] += 1
        send(self, dst, key, microbatch, array)

    monkeypatch.setattr(LocalTransport, "send", counted)
    with Pipeline(directory, microbatches=M, optimizer=SGD, processes=False) as pipe:
        pipe.train_step(batch)
        specs = pipe.engine.specs  # type: ignore[union-attr]
    sent.update({(-1, s.worker): 1 for s in specs})
    assert +link_messages(specs) == sent
    if name == "gpt2-tiny":  # its tied embedding's gradients cross between the stages at STEP
        assert any(s.shared() for s in specs)


@ray.remote(num_cpus=0, max_concurrency=2)
class _Receiver:
    """A channel reader as a stage actor is one (a second slot serves Ray's own calls: a writer on another node
    grows the channel through one while `take` waits): it takes one tensor and says how it holds it."""

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def start(self, incoming: object) -> None:
        self.transport = ChannelTransport(0, {}, [incoming])

    def take(self, key: str) -> tuple[np.ndarray, bool]:
        """(a copy of the tensor, whether the tensor received owns its memory rather than viewing the channel's)."""
        got = self.transport.recv(key, 0)
        root = got
        while isinstance(root.base, np.ndarray):
            root = root.base
        owned = bool(root.flags.owndata)
        out = np.array(got)
        del got, root
        self.transport.close()
        return out, owned


@pytest.mark.parametrize(("node", "in_place"), [("left", True), ("right", False)])
def test_a_tensor_over_one_part_arrives_whole(cluster: object, node: str, in_place: bool) -> None:
    """A tensor larger than `PART_BYTES` travels in parts (each copied by one memcpy) and arrives equal, of
    its shape and dtype: on the driver's node as one view into the channel's buffer (no copy), from
    another node as a copy of the reader's own."""
    receiver = _Receiver.options(resources={node: 0.001}).remote()  # type: ignore[attr-defined]
    link = open_channel(None, receiver, ray.get(receiver.node.remote()), buffers=2)
    ray.get(receiver.start.remote(link))
    sent = np.arange(2 * PART_BYTES // 4 + 7, dtype=np.float32).reshape(-1, 1).repeat(3, axis=1).T  # not C-contiguous
    driver = ChannelTransport(-1, {0: link}, background=True)
    try:
        driver.send(0, "x", 0, sent)
        got, owned = ray.get(receiver.take.remote("x"), timeout=60)
    finally:
        driver.close()
    assert got.dtype == sent.dtype and got.shape == sent.shape
    np.testing.assert_array_equal(got, sent)
    assert owned is not in_place


def test_a_channel_whose_reader_never_started_leaves_no_fifo(cluster: object) -> None:
    """The writer made the wake-up FIFO; a start cut short before the reader opened it leaves its name, which the
    writer's close removes."""
    receiver = _Receiver.options(resources={"left": 0.001}).remote()  # type: ignore[attr-defined]
    link = open_channel(None, receiver, ray.get(receiver.node.remote()))
    assert link.wake is not None and Path(link.wake).exists()
    ChannelTransport(-1, {0: link}, background=True).close()
    assert not Path(link.wake).exists()
    ray.kill(receiver)


def test_killed_actor_fails_within_10s_and_resume_continues(cluster: object, tmp_path: Path) -> None:
    directory, _ = stage_dir("gpt2-tiny", 2)

    def pipeline(backend: str) -> Pipeline:
        return Pipeline(directory, microbatches=M, optimizer=SGD, backend=backend, processes=False)

    with pipeline("local") as whole:
        full = fit(whole, data_source(whole, "synthetic", seed=3), 6)
    killed: list[float] = []
    with pipeline("ray") as pipe:
        pids = pipe.engine.pids  # type: ignore[union-attr]
        group = pipe.engine.backend.group  # type: ignore[union-attr]
        source = data_source(pipe, "synthetic", seed=3)

        def kill_during_step(step: int, _: float) -> None:
            if step == 2:  # checkpointed: kill stage 1's actor while the next step runs
                timer = threading.Timer(0.02, lambda: (killed.append(time.monotonic()), os.kill(pids[1], signal.SIGKILL)))
                timer.start()

        with pytest.raises(OnnxpipeError) as failure:
            fit(pipe, source, 1000, checkpoint_dir=str(tmp_path / "ck"), every=1, on_step=kill_during_step)
    took = time.monotonic() - killed[0]
    message = str(failure.value)
    assert "\n" not in message and re.match(r"stage 1 \(stage_1\.onnx\) failed", message) and "host 127.0.0.1" in message, message
    assert took < 10, took
    # The failure ends every other actor (Ray ends their processes asynchronously). The one the test killed is the
    # kernel's to tear down: under load a SIGKILLed process was seen still exiting 10 s later, with Ray reporting it dead.
    survivors = [p for i, p in enumerate(pids) if i != 1]
    deadline = time.monotonic() + 10
    while _alive(survivors) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(survivors)
    assert ray.util.placement_group_table(group)["state"] == "REMOVED"
    with pipeline("ray") as again:
        resumed = fit(again, data_source(again, "synthetic", seed=3), 6, checkpoint_dir=str(tmp_path / "ck"), every=1, resume=True)
    assert resumed == full


def test_command_line_trains_on_ray_and_ctrl_c_stops_every_actor(cluster: object, tmp_path: Path) -> None:
    directory, _ = stage_dir("mlp", 2)
    cmd = [sys.executable, "-m", "onnxpipe", "train", str(directory), "--backend", "ray", "--address", cluster.address,  # type: ignore[attr-defined]
           "--microbatches", str(M), "--steps", "100000"]
    before = _actor_processes()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "200"},
                            preexec_fn=as_in_a_terminal)
    deadline = time.monotonic() + 120
    while len(_actor_processes() - before) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    deadline = time.monotonic() + 10
    while _actor_processes() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _actor_processes() - before


def test_without_address_a_run_starts_its_own_instance_and_leaves_nothing_in_dev_shm(tmp_path: Path) -> None:
    """Without --address the run starts Ray on this machine and stops it, even where RAY_ADDRESS names a cluster (here one
    that does not answer; Ray would connect to it); the named semaphores its raylet made for the channels' buffers go
    with it (Ray leaves them: 4 pairs for two stages)."""
    directory, _ = stage_dir("mlp", 2)
    before = set(os.listdir("/dev/shm"))
    run = subprocess.run([sys.executable, "-m", "onnxpipe", "train", str(directory), "--backend", "ray", "--microbatches", str(M), "--steps", "2"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200", "RAY_ADDRESS": "127.0.0.1:9"})
    assert run.returncode == 0, run.stderr[-2000:]
    left = [name for name in set(os.listdir("/dev/shm")) - before
            if (found := re.match(r"sem\.(hdr|obj)(\d+)-", name)) and not owner_alive(int(found.group(2)))]
    assert left == []


@pytest.mark.parametrize(("address", "expected"), [
    (None, r"^Ray could not start on this machine \(port 6379 in use\); run `ray start --head` and pass --address auto, or train with --backend local$"),
    ("127.0.0.1:6379", r"^no Ray cluster at 127.0.0.1:6379 \(port 6379 in use\); start one with `ray start --head`"),
])
def test_ray_that_cannot_start_or_connect_is_one_line(monkeypatch: pytest.MonkeyPatch, address: str | None, expected: str) -> None:
    from onnxpipe.train import ray_backend

    def refuse(**_: object) -> None:
        raise RuntimeError("port 6379 in use\nmore of Ray's text")

    monkeypatch.setattr(ray_backend.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_backend.ray, "init", refuse)
    monkeypatch.setattr(ray_backend, "local_resources", lambda placement, cpus: (cpus, {}))
    with pytest.raises(OnnxpipeError, match=expected):
        ray_backend.RaySession(address, placement=None)  # type: ignore[arg-type]


def _actor_processes() -> set[int]:
    """Processes running a stage actor (Ray names them after the actor class)."""
    out = set()
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if (p / "cmdline").read_bytes().startswith(b"ray::StageActor") and "zombie" not in (p / "status").read_text().lower():
                    out.add(int(p.name))
            except OSError:
                pass
    return out
