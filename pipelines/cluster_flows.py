"""Flows that run training on a cluster's scheduler: ``slurm-train`` submits the sbatch
script ``megalith launch slurm`` writes and follows the job to its end; ``k8s-train``
applies the TrainJob ``megalith launch k8s`` writes; ``ray-train`` places one
``megalith train`` launcher per node of a Ray cluster and follows them
(``training.runtime.ray_launch``, as ``megalith launch ray`` does).

How Prefect 3 stops a flow run (a cancel from the UI, a timeout): the runner or worker
that started the run's process sends it SIGTERM, which the flow engine raises inside the
flow's code as ``prefect.exceptions.TerminationSignal`` (a timeout raises there too).
So the follow loop's ``finally`` is where a job still queued or running is stopped
(scancel, kubectl delete, stopping the Ray launchers): it runs whatever ended the loop,
in the process that knows the job. A process killed with SIGKILL runs nothing: a Slurm or
Kubernetes job goes on until its time limit; Ray ends the actors of a driver that is
gone, and the training processes die with them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from prefect import flow, get_run_logger
from prefect.states import Cancelled, State

from megalith.config import MegalithConfig, dump_config, load_config
from megalith.errors import MegalithError
from pipelines import kubernetes, slurm
from pipelines.external import Outcome
from training.parallel.groups import validate_layout
from training.runtime import ray_launch
from training.runtime.launch import slurm_script
from training.runtime.trainjob import train_job

POLL_SECONDS = 30.0  # every half minute is gentle on a controller or API server
NO_OVERRIDES: list[str] = []
NO_ENV: dict[str, str] = {}
UNKNOWN_POLLS = 3  # an unknown job, or a failing command, this often in a row: give up


class SlurmJobFailed(RuntimeError):
    """The Slurm job ended FAILED, TIMEOUT, NODE_FAIL, OUT_OF_MEMORY, PREEMPTED, ..."""


@flow(name="slurm-train", log_prints=True)
def slurm_train(
    config: MegalithConfig,
    run_dir: str,
    nodes: int = 1,
    gpus_per_node: int = 8,
    partition: str | None = None,
    time_limit: str | None = None,
    poll_seconds: float = POLL_SECONDS,
) -> dict[str, Any] | State:
    """Write the recipe and the sbatch script (as ``megalith launch slurm``) into
    ``run_dir``, which every node must see, submit it and follow the job: its log lines
    stream here; it ends this run Completed, Failed or Cancelled as the job ends; a
    cancelled or timed-out flow run cancels the job (scancel). A resubmission resumes
    from the run's latest checkpoint."""
    run = Path(run_dir).resolve()
    run.mkdir(parents=True, exist_ok=True)
    validate_layout(config, nodes * gpus_per_node)
    recipe = run / "recipe.yaml"
    recipe.write_text(dump_config(config))
    script = run / "train.sbatch"
    script.write_text(
        slurm_script(
            str(recipe),
            nodes,
            gpus_per_node,
            output=str(run),
            job_name=config.name,
            partition=partition,
            time_limit=time_limit,
        )  # fmt: skip
    )
    return run_slurm_job(script, run, poll_seconds)


def run_slurm_job(script: Path, submit_dir: Path, poll_seconds: float) -> dict[str, Any] | State:
    """Submit ``script`` from ``submit_dir`` and follow it; scancel it if the follow ends
    early for any reason (a cancelled flow run's TerminationSignal included)."""
    logger = get_run_logger()
    job_id = slurm.submit(script, submit_dir)
    log_path = slurm.output_path(script.read_text(), job_id, submit_dir)
    logger.info("submitted Slurm job %s; its log: %s", job_id, log_path)
    log = slurm.LogFollower(log_path)
    status = None
    try:
        status = follow(job_id, log, poll_seconds)
    finally:
        if status is None:
            _stop(f"Slurm job {job_id}", lambda: slurm.cancel(job_id), f"scancel {job_id}")
    for line in log.new_lines(final=True):
        logger.info(line)
    return ending(status, log_path)


def _stop(label: str, stop: Callable[[], str], by_hand: str) -> None:
    """Stop a job; a failure to is logged, not raised: whatever ended the follow loop
    (a cancel, a timeout) is what the run must end with."""
    logger = get_run_logger()
    try:
        said = stop()
    except MegalithError as error:
        logger.error("could not stop %s: %s; %s", label, error, by_hand)
        return
    logger.warning("stopped %s: %s", label, said or "done")


def ending(status: slurm.JobStatus, log_path: Path) -> dict[str, Any] | State:
    """What the flow run ends with: the job's result when it completed, a Cancelled state
    when it was cancelled (scancel by hand), SlurmJobFailed (a Failed run) otherwise."""
    summary = status.describe()
    if status.outcome is Outcome.CANCELLED:
        return Cancelled(message=f"Slurm job {status.job_id} was cancelled: {summary}")
    if status.outcome is Outcome.FAILED:
        raise SlurmJobFailed(f"Slurm job {status.job_id} ended {summary}; its log: {log_path}")
    return {"job_id": status.job_id, "state": summary, "log": str(log_path)}


def follow(job_id: str, log: slurm.LogFollower, poll_seconds: float) -> slurm.JobStatus:
    """Poll the job until it ends, passing its new log lines and state changes to the
    run's logger; the final status."""
    logger = get_run_logger()

    def stream_log() -> None:
        for line in log.new_lines():
            logger.info(line)

    return watch(lambda: slurm.job_status(job_id), f"Slurm job {job_id}", poll_seconds, stream_log)


class Status(Protocol):
    @property
    def outcome(self) -> Outcome: ...

    def describe(self) -> str: ...


StatusT = TypeVar("StatusT", bound=Status)


def watch(
    read: Callable[[], StatusT | None],
    label: str,
    poll_seconds: float,
    each_poll: Callable[[], None] = lambda: None,
) -> StatusT:
    """``read()`` every ``poll_seconds`` until the status it returns has ended, logging
    each change. A status nobody knows (None) or a failing command (a controller or API
    server restarting) is borne ``UNKNOWN_POLLS`` times in a row, then raised."""
    logger = get_run_logger()
    shown, unknown, problem = "", 0, ""
    while True:
        try:
            status = read()
        except MegalithError as error:
            status, problem = None, str(error)
            logger.warning("%s: %s", label, error)
        each_poll()
        if status is None:
            unknown += 1
            if unknown >= UNKNOWN_POLLS:
                raise MegalithError(problem or f"the cluster does not know {label}")
        else:
            unknown = 0
            if status.outcome.terminal:
                return status
            if (text := status.describe()) != shown:
                logger.info("%s: %s (%s)", label, text, status.outcome.value)
                shown = text
        time.sleep(poll_seconds)


class TrainJobFailed(RuntimeError):
    """The TrainJob's Failed condition became true."""


@flow(name="k8s-train", log_prints=True)
def k8s_train(
    recipe: str,
    image: str,
    nodes: int = 1,
    gpus_per_node: int = 8,
    overrides: list[str] = NO_OVERRIDES,  # noqa: B006 - a read-only form default
    volume_claim: str | None = None,
    checkpoint_dir: str | None = None,
    memory: str = "64Gi",
    namespace: str | None = None,
    context: str | None = None,
    follow_job: bool = True,
    poll_seconds: float = POLL_SECONDS,
) -> dict[str, Any]:
    """Render the Kubeflow Trainer TrainJob ``megalith launch k8s`` writes and apply it
    with kubectl (``context``: a kubeconfig context; default the current one).
    ``recipe`` is the path inside the image (or the claim) and is read here to check the
    layout. With ``follow_job`` the run follows the TrainJob's conditions and ends as it
    ends; a cancelled, timed-out or failing flow run deletes it (its pods stop). Pod
    logs stay in Kubernetes (``kubectl logs``)."""
    config = load_config(recipe, overrides)
    validate_layout(config, nodes * gpus_per_node)
    manifest = train_job(
        recipe, nodes, gpus_per_node, image, name=config.name, sets=overrides,
        volume_claim=volume_claim, checkpoint_dir=checkpoint_dir, memory=memory,
        namespace=namespace,
    )  # fmt: skip
    name = manifest["metadata"]["name"]
    created = kubernetes.apply(manifest, context)
    logger = get_run_logger()
    logger.info("applied %s (%d nodes x %d GPUs)", created, nodes, gpus_per_node)
    result = {"trainjob": created, "name": name}
    if not follow_job:
        return result
    status = None
    try:
        status = watch(
            lambda: kubernetes.trainjob_status(name, namespace, context),
            f"TrainJob {name}", poll_seconds,
        )  # fmt: skip
    finally:
        if status is None:
            stop = lambda: kubernetes.delete(name, namespace, context)  # noqa: E731
            _stop(f"TrainJob {name}", stop, f"kubectl delete trainjob {name}")
    if status.outcome is Outcome.FAILED:
        raise TrainJobFailed(f"TrainJob {name} ended {status.describe()}")
    return {**result, "state": status.describe()}


@flow(name="ray-train", log_prints=True)
def ray_train(
    config: MegalithConfig,
    run_dir: str,
    nodes: int = 2,
    gpus_per_node: int = 8,
    cpus_per_node: float = 8,
    address: str | None = None,
    env: dict[str, str] = NO_ENV,  # noqa: B006 - a read-only form default
    placement_timeout_s: float = ray_launch.PLACEMENT_TIMEOUT_S,
    poll_seconds: float = ray_launch.POLL_SECONDS,
) -> dict[str, Any]:
    """Train on ``nodes`` nodes of the Ray cluster at ``address`` (default: $RAY_ADDRESS):
    one ``megalith train`` per node, ``gpus_per_node`` workers each through torchrun (with
    training.device=cpu, that many CPU processes and no GPUs asked of Ray), meeting at a
    rendezvous on the first node. ``run_dir`` must be a folder every node sees: the recipe
    is written there, and the run's checkpoints. Every node's output streams here; a node
    that fails or is lost fails the run, naming it; a cancelled run stops every node.
    Running it again with the same ``run_dir`` resumes from the last checkpoint. ``env``:
    more environment for every node's launcher (NCCL_*, MEGALITH_DIST_TIMEOUT_S, ...)."""
    run = Path(run_dir).resolve()
    run.mkdir(parents=True, exist_ok=True)
    recipe = run / "recipe.yaml"
    spec = ray_launch.job_spec(
        config, str(recipe), str(run), nodes, gpus_per_node, cpus_per_node=cpus_per_node,
        env=env, placement_timeout_s=placement_timeout_s,
    )  # fmt: skip
    recipe.write_text(dump_config(config))
    placed = ray_launch.run_job(spec, address, get_run_logger().info, poll_seconds)
    result = json.loads((run / "result.json").read_text())
    return {**result, "nodes": placed}
