"""Training on a Ray cluster: Ray places one ``megalith train`` launcher per node, and
torch.distributed spans the nodes as it does under Slurm or Kubernetes.

Ray is the node scheduler only. A placement group with one bundle per node
(STRICT_SPREAD: never two on one node) reserves each node's GPUs and CPUs; a small actor
in each bundle (``NodeAgent``) starts that node's launcher, ``megalith train
--nproc-per-node G --nnodes N --node-rank I --rdzv-endpoint HOST:PORT``, which starts
the node's workers through torchrun. All nodes meet at torchrun's static rendezvous
hosted on node 0's address and a port free there (given a node rank, node I holds
ranks I·G to I·G+G-1: training.runtime.launch). The training itself never runs in a Ray process:
checkpoints, the run lock, the collective timeout and the chain of processes that die
with their parent (docs/faults.md) are those of every other launch.

The driver (the ``ray-train`` flow, or ``megalith launch ray``) follows the agents: their
output lines and exit codes. A node whose agent dies (its raylet or machine is lost) or
stops answering fails the job: the other nodes are stopped and the error names the node.
A launcher dies with its agent (PR_SET_PDEATHSIG), and Ray ends a driver's actors when
the driver goes, so no training outlives the job. Every launch passes ``--resume``:
running the job again continues from the last committed checkpoint.

Why not Ray Train's TorchTrainer: it runs the training function inside Ray's worker
processes and forms the process group itself, around the launcher the other engines use
(torchrun's worker management, the run lock, the die-with-parent chain), and it needs
``ray[train]``. Nor Ray Jobs: its entry point runs on one node, and submitting needs the
dashboard (``ray[default]``).

Ray is an optional dependency (``pip install 'megalith[ray]'``), imported when a job
starts (``megalith.ray_cluster``), so that ``megalith --help`` and the other flows do not
pay for it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from megalith import CODE_ROOT
from megalith.config import MegalithConfig
from megalith.errors import MegalithError
from megalith.ray_cluster import connected, import_ray
from training.parallel.groups import validate_layout
from training.runtime.launch import worker_env

PLACEMENT_TIMEOUT_S = 600.0  # an autoscaler may take minutes to bring nodes up
ANSWER_TIMEOUT_S = 30.0  # how long one poll of an agent may take
AGENT_START_TIMEOUT_S = 120.0  # a node may have to start a Python worker for its agent
UNANSWERED_POLLS = 3  # an agent that does not answer this often in a row is lost
LAST_LOOK_S = 5.0  # after a failure: how long the other agents get to answer once more
STOP_GRACE_S = 15.0  # SIGTERM, then SIGKILL: a rank stuck in a collective may not unwind
POLL_SECONDS = 1.0
# The launcher an agent starts imports the same megalith code as the agent (CODE_ROOT on
# its path), however the agent found it.


class RayJobFailed(MegalithError):
    """A node's launcher failed, or a node was lost; the message names them."""


def train_args(config: str, output: str, sets: Sequence[str] = ()) -> list[str]:
    """``megalith train``'s arguments for every node, less the launch flags; with
    ``--resume``, so that running the job again continues from its last checkpoint."""
    args = ["train", "--config", config]
    for setting in sets:
        args += ["--set", setting]
    return [*args, "--output", output, "--quiet", "--resume"]


@dataclass(frozen=True)
class RayJobSpec:
    """``train_args`` on ``nodes`` nodes, ``processes_per_node`` workers on each; each
    node's bundle asks Ray for ``gpus_per_node`` GPUs (0 on CPU) and ``cpus_per_node``."""

    train_args: tuple[str, ...]
    nodes: int
    processes_per_node: int
    gpus_per_node: int
    cpus_per_node: float = 1.0
    env: Mapping[str, str] = field(default_factory=dict)  # for every node's launcher
    placement_timeout_s: float = PLACEMENT_TIMEOUT_S

    def check(self) -> None:
        if self.nodes < 1 or self.processes_per_node < 1:
            raise MegalithError(
                f"nodes ({self.nodes}) and processes per node ({self.processes_per_node}) "
                "must be >= 1"
            )
        if self.cpus_per_node <= 0 or self.gpus_per_node < 0:
            raise MegalithError(
                f"CPUs per node ({self.cpus_per_node}) must be > 0 and GPUs per node "
                f"({self.gpus_per_node}) >= 0"
            )

    def bundle(self) -> dict[str, float]:
        """What one node's launcher reserves."""
        bundle = {"CPU": float(self.cpus_per_node)}
        if self.gpus_per_node:
            bundle["GPU"] = float(self.gpus_per_node)
        return bundle

    def node_args(self, rank: int, endpoint: str, rdzv_id: str, address: str) -> list[str]:
        """Node ``rank``'s launcher: the rendezvous on node 0, this node's own address."""
        return [
            *self.train_args,
            "--nnodes", str(self.nodes), "--nproc-per-node", str(self.processes_per_node),
            "--node-rank", str(rank), "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id,
            "--local-addr", address,
        ]  # fmt: skip


def job_spec(
    config: MegalithConfig,
    recipe: str,
    run_dir: str,
    nodes: int,
    gpus_per_node: int,
    *,
    sets: Sequence[str] = (),
    cpus_per_node: float = 1.0,
    env: Mapping[str, str] | None = None,
    placement_timeout_s: float = PLACEMENT_TIMEOUT_S,
) -> RayJobSpec:
    """The job that trains ``config`` (read from ``recipe`` with ``sets`` by every node)
    into ``run_dir``, after checking its layout fits ``nodes`` x ``gpus_per_node``. With
    training.device=cpu the nodes run that many CPU processes and ask Ray for no GPUs."""
    validate_layout(config, nodes * gpus_per_node)
    return RayJobSpec(
        train_args=tuple(train_args(recipe, run_dir, sets)),
        nodes=nodes,
        processes_per_node=gpus_per_node,
        gpus_per_node=0 if config.training.device == "cpu" else gpus_per_node,
        cpus_per_node=cpus_per_node,
        env=dict(env or {}),
        placement_timeout_s=placement_timeout_s,
    )


class NodeAgent:
    """One node's launcher, run as a Ray actor in that node's bundle: starts ``megalith
    train`` there, keeps its output lines until the driver asks for them, stops it."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._returncode: int | None = None
        self._ended = threading.Event()

    def describe(self) -> dict[str, str]:
        """Where this agent runs: the node's address (as Ray knows it) and Ray node id."""
        ray = import_ray()
        return {
            "address": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "host": socket.gethostname(),
        }

    def free_port(self, address: str) -> int:
        """A port free on this node now, for the rendezvous."""
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family) as sock:
            sock.bind((address, 0))
            return sock.getsockname()[1]

    def start(self, args: list[str], env: dict[str, str]) -> int:
        """Start ``megalith train ARGS``; its pid."""
        started = threading.Event()
        threading.Thread(target=self._run, args=(args, env, started), daemon=True).start()
        started.wait()
        return self._process.pid if self._process else -1

    def _run(self, args: list[str], env: dict[str, str], started: threading.Event) -> None:
        """Start the launcher and wait for it in this thread: the kernel's parent-death
        signal follows the thread that started a child, not the process."""
        command = [sys.executable, "-m", "pipelines.cli", *args]
        child_env = worker_env({**os.environ, **env})
        child_env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(CODE_ROOT), child_env.get("PYTHONPATH")])
        )
        try:
            process = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                bufsize=1, env=child_env, start_new_session=True,
            )  # fmt: skip
        except OSError as error:
            with self._lock:
                self._lines.append(f"could not start {command[0]}: {error}")
            self._returncode = 127
            self._ended.set()
            started.set()
            return
        self._process = process
        started.set()
        with process:
            for line in process.stdout:
                with self._lock:
                    self._lines.append(line.rstrip("\n"))
            self._returncode = process.wait()
        self._ended.set()

    def poll(self) -> tuple[list[str], int | None]:
        """The lines printed since the last poll, and the exit code once it has ended."""
        returncode = self._returncode  # first: once it is set, every line is in
        with self._lock:
            lines, self._lines = self._lines, []
        return lines, returncode

    def stop(self, grace_s: float = STOP_GRACE_S) -> str:
        """SIGTERM to the launcher (it passes it on to torchrun, which stops the workers),
        then SIGKILL to its process group after ``grace_s`` (the workers die with it)."""
        if self._process is None or self._ended.is_set():
            return "had ended"
        with contextlib.suppress(ProcessLookupError):
            self._process.send_signal(signal.SIGTERM)
        if self._ended.wait(grace_s):
            return "stopped"
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signal.SIGKILL)
        self._ended.wait(10)
        return f"killed (still running {grace_s:.0f} s after SIGTERM)"


@dataclass
class NodeRun:
    """The driver's view of one node's launcher."""

    rank: int
    agent: Any  # the NodeAgent actor's handle
    address: str = ""
    node_id: str = ""
    returncode: int | None = None
    lost: str | None = None  # why the node counts as lost
    unanswered: int = 0

    def __str__(self) -> str:
        return f"node {self.rank} ({self.address}, Ray node {self.node_id})"

    @property
    def running(self) -> bool:
        return self.returncode is None and self.lost is None

    def describe(self) -> dict[str, Any]:
        return {"rank": self.rank, "address": self.address, "node_id": self.node_id}


class RayTrainJob:
    """The launchers of one training job on a Ray cluster (``connected`` to it); ``say``
    gets every line they print, prefixed by their node, and the job's own news."""

    def __init__(self, spec: RayJobSpec, say: Callable[[str], None] = print):
        spec.check()
        self.spec = spec
        self.say = say
        self.name = f"megalith-{uuid.uuid4().hex[:8]}"  # placement group and rendezvous id
        self.nodes: list[NodeRun] = []
        self._group: Any = None

    def start(self) -> list[NodeRun]:
        """Reserve the nodes, place an agent on each and start their launchers."""
        ray = import_ray()
        spec = self.spec
        self._group = ray.util.placement_group(
            [spec.bundle()] * spec.nodes, strategy="STRICT_SPREAD", name=self.name
        )
        self.say(f"Ray: placing {spec.nodes} nodes x {spec.bundle()} (placement group {self.name})")
        ready, _ = ray.wait([self._group.ready()], timeout=spec.placement_timeout_s)
        if not ready:
            raise RayJobFailed(self._unplaceable(ray))
        agent = ray.remote(NodeAgent)
        for rank in range(spec.nodes):
            strategy = ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy(
                placement_group=self._group, placement_group_bundle_index=rank
            )
            handle = agent.options(
                name=f"{self.name}-node{rank}", num_cpus=spec.cpus_per_node,
                num_gpus=spec.gpus_per_node, scheduling_strategy=strategy, max_restarts=0,
            ).remote()  # fmt: skip
            self.nodes.append(NodeRun(rank, handle))
        self._locate(ray)
        head = self.nodes[0]
        port = ray.get(head.agent.free_port.remote(head.address), timeout=ANSWER_TIMEOUT_S)
        host = f"[{head.address}]" if ":" in head.address else head.address
        endpoint = f"{host}:{port}"
        for node in self.nodes:
            args = spec.node_args(node.rank, endpoint, self.name, node.address)
            pid = ray.get(node.agent.start.remote(args, dict(spec.env)), timeout=ANSWER_TIMEOUT_S)
            self.say(f"Ray: {node} started megalith train (pid {pid}), rendezvous {endpoint}")
        return self.nodes

    def _locate(self, ray: ModuleType) -> None:
        for node in self.nodes:
            try:
                place = ray.get(node.agent.describe.remote(), timeout=AGENT_START_TIMEOUT_S)
            except ray.exceptions.RayError as error:
                raise RayJobFailed(
                    f"the Ray actor for node {node.rank} did not start: {_gist(error)} "
                    "(is megalith installed on every node? pip install 'megalith[ray]')"
                ) from None
            node.address, node.node_id = place["address"], place["node_id"]

    def _unplaceable(self, ray: ModuleType) -> str:
        alive = [node for node in ray.nodes() if node.get("Alive")]
        have = "; ".join(
            f"{node.get('NodeManagerAddress')}: {_resources(node.get('Resources', {}))}"
            for node in alive
        )
        return (
            f"the Ray cluster did not give {self.spec.nodes} distinct nodes with "
            f"{self.spec.bundle()} each in {self.spec.placement_timeout_s:.0f} s; it has "
            f"{len(alive)} alive node(s): {have or 'none'}. Add nodes, ask for fewer "
            "(nodes, GPUs or CPUs per node), or set training.device=cpu for a CPU cluster"
        )

    def follow(self, poll_seconds: float = POLL_SECONDS) -> None:
        """Until every launcher has exited 0; ``RayJobFailed`` when one failed or a node was
        lost (the caller stops the others: ``stop``)."""
        ray = import_ray()
        while True:
            for node in self.running():
                self._poll(ray, node, ANSWER_TIMEOUT_S, patient=True)
            if any(node.lost or node.returncode for node in self.nodes):
                # A rank that failed because its peer's node went away: name that node.
                for node in self.running():
                    self._poll(ray, node, LAST_LOOK_S, patient=False)
                raise RayJobFailed(self._failure())
            if not self.running():
                return
            time.sleep(poll_seconds)

    def running(self) -> list[NodeRun]:
        return [node for node in self.nodes if node.running]

    def _poll(self, ray: ModuleType, node: NodeRun, timeout: float, patient: bool) -> None:
        try:
            lines, returncode = ray.get(node.agent.poll.remote(), timeout=timeout)
        except ray.exceptions.ActorDiedError as error:
            node.lost = _why_lost(error)
            return
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as error:
            node.unanswered += 1
            if node.unanswered >= UNANSWERED_POLLS or not patient:
                node.lost = f"its agent does not answer ({_gist(error)})"
            return
        node.unanswered = 0
        for line in lines:
            self.say(f"[node {node.rank}] {line}")
        node.returncode = returncode

    def _failure(self) -> str:
        lost = [f"{node} was lost: {node.lost}" for node in self.nodes if node.lost]
        failed = [
            f"{node} exited with code {node.returncode} (its last lines are above)"
            for node in self.nodes
            if node.returncode
        ]
        return (
            "the Ray training job failed: " + "; ".join(lost + failed) + ". The other nodes "
            "were stopped; run the job again to resume from the last committed checkpoint."
        )

    def stop(self) -> str:
        """Stop every launcher still running (SIGTERM, then SIGKILL), pass on their last
        lines, then ``close``. What each node said, for the log."""
        ray = import_ray()
        stopping = {node.rank: node.agent.stop.remote(STOP_GRACE_S) for node in self.running()}
        said = []
        for node in self.running():
            try:
                said.append(
                    f"node {node.rank} {ray.get(stopping[node.rank], timeout=STOP_GRACE_S + 15)}"
                )
            except ray.exceptions.RayError as error:
                said.append(f"node {node.rank} not reached ({_gist(error)})")
                continue
            self._poll(ray, node, LAST_LOOK_S, patient=False)
        self.close()
        return "; ".join(said) or "nothing was running"

    def close(self) -> None:
        """End the agents and free the nodes' reservation."""
        ray = import_ray()
        for node in self.nodes:
            with contextlib.suppress(ray.exceptions.RayError, ValueError):
                ray.kill(node.agent)
        if self._group is not None:
            with contextlib.suppress(ray.exceptions.RayError, ValueError):
                ray.util.remove_placement_group(self._group)
            self._group = None


def run_job(
    spec: RayJobSpec,
    address: str | None = None,
    say: Callable[[str], None] = print,
    poll_seconds: float = POLL_SECONDS,
) -> list[dict[str, Any]]:
    """Connect, start, follow to the end; stop the job if anything ends it early (a failed
    node, Ctrl-C). Where each node ran."""
    with connected(address) as where:
        say(f"Ray: connected to {where}")
        job = RayTrainJob(spec, say)
        finished = False
        try:
            job.start()
            job.follow(poll_seconds)
            finished = True
        finally:
            if not finished:
                say(f"Ray: stopping {job.name}: {job.stop()}")
            job.close()
    return [node.describe() for node in job.nodes]


def _gist(error: BaseException | str) -> str:
    """An exception's message on one line, at most 400 characters."""
    text = " ".join(str(error).split())
    return text if len(text) <= 400 else text[:397] + "..."


def _why_lost(error: BaseException) -> str:
    """Ray's reason an actor died, without the actor's ids and class that precede it."""
    text = " ".join(str(error).split())
    start = text.find("The actor died because")
    return _gist(text[start:] if start >= 0 else text)


def _resources(resources: Mapping[str, float]) -> str:
    shown = {key: value for key, value in resources.items() if key in ("CPU", "GPU")}
    return str(shown or dict(resources))
