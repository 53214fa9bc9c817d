"""Training on a real two-node Ray cluster on this machine (tests/ray_cluster.py: a head
and a worker node, each its own raylet) from the ``ray-train`` flow in the session's
Prefect server: data parallelism over the two nodes (one gloo process on each), a run
cancelled from Prefect, a worker node killed mid-run, and the run started again.

The cancelled run must stop every training process on both nodes; the killed run must
fail within the collective timeout, naming the lost node, with no training process left;
the run started again must resume from the last committed checkpoint and end with the
loss curve and sample count of a plain torchrun run of the same layout (two processes on
one machine), which also shows that Ray's placement gives the torchrun result. Every
child has one thread; timeouts only guard against hangs, except the one the failure
must beat.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import pytest
from parallel_helpers import (
    RECIPE,
    child_env,
    config_of,
    megalith,
    metrics,
    set_args,
    tiny_settings,
)
from servers import flow_run_logs, run_and_cancel, run_group

from megalith.config import load_config
from pipelines.cli import main
from pipelines.cluster_flows import ray_train
from pipelines.cluster_train import ClusterSize, target_arguments
from training.runtime.ray_launch import RayJobFailed

pytestmark = pytest.mark.slow
STEPS = 4
CHECKPOINT = 2  # committed before the node is lost; the second run resumes from it
DIST_TIMEOUT_S = 30  # MEGALITH_DIST_TIMEOUT_S: the lost node must fail the run sooner
ENV = {"OMP_NUM_THREADS": "1", "MEGALITH_DIST_TIMEOUT_S": str(DIST_TIMEOUT_S)}
HANG_GUARD_S = 240
# With MEGALITH_TEST_HOLD_DIR set, every rank waits before step CHECKPOINT + 1, once the
# checkpoint is committed (the background writer joined: its last barrier follows rank
# 0's commit), and says so with a file there: the run is stopped mid-run whatever the
# machine's speed. (Without the join, a loaded CI machine once killed the node before the
# commit, and the second run started from scratch.)
HOLD = f"""
import os
from pathlib import Path
if "RANK" in os.environ and os.environ.get("MEGALITH_TEST_HOLD_DIR"):
    import time

    import training.trainer as trainer

    launch_step = trainer.Trainer.launch_step

    def held_step(self, batches):
        if self.step == {CHECKPOINT}:
            self.checkpointer.wait()
            Path(os.environ["MEGALITH_TEST_HOLD_DIR"], "rank-" + os.environ["RANK"]).touch()
            while True:
                time.sleep(0.1)
        return launch_step(self, batches)

    trainer.Trainer.launch_step = held_step
"""


def settings(shards: Path) -> dict:
    return tiny_settings(shards, {"training.train_iters": STEPS, "checkpoint.interval": CHECKPOINT})


def torchrun_run(shards: Path, output: Path) -> Path:
    args = ["train", "--config", str(RECIPE), *set_args(settings(shards)), "--output", str(output)]
    done = run_group(megalith(*args, "--quiet", "--nproc-per-node", "2"), child_env(), HANG_GUARD_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return output


def processes_of(run_dir: Path) -> list[str]:
    """The command lines ("PID: ARGS") of the live processes that name the run folder."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if proc.name.isdigit() and str(run_dir) in command:
            found.append(f"{proc.name}: {command}")
    return found


def gone_within(run_dir: Path, seconds: float) -> list[str]:
    """The processes of the run still alive after ``seconds`` (shortened), else []."""
    deadline = time.monotonic() + seconds
    while (left := processes_of(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [command[:200] for command in left]


def held(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """The environment that makes every rank hold (see HOLD), and the folder it reports to."""
    inject = tmp_path / "inject"
    inject.mkdir(exist_ok=True)
    (inject / "sitecustomize.py").write_text(HOLD)
    holding = tmp_path / "holding"
    holding.mkdir(exist_ok=True)
    return {"PYTHONPATH": str(inject), "MEGALITH_TEST_HOLD_DIR": str(holding)}, holding


def wait_for_both_ranks(holding: Path) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while len(list(holding.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)


def flow_parameters(ray_cluster, shards: Path, run_dir: Path, env: dict[str, str]) -> dict:
    return {
        "config": config_of(settings(shards)), "run_dir": str(run_dir), "nodes": 2,
        "gpus_per_node": 1, "cpus_per_node": 1, "address": ray_cluster.address,
        "env": {**ENV, **env}, "placement_timeout_s": 60, "poll_seconds": 0.2,
    }  # fmt: skip


def test_cancelling_the_flow_run_stops_every_node(
    prefect_api, ray_cluster, shards: Path, tmp_path: Path
) -> None:
    """Cancel as the UI does (the run goes Cancelling; Prefect's runner stops the flow's
    process) while both ranks train: the flow's ``finally`` stops both nodes' launchers,
    and they their torchrun and workers."""
    hold, holding = held(tmp_path)
    run_dir = tmp_path / "ray"
    parameters = flow_parameters(ray_cluster, shards, run_dir, hold)
    parameters["config"] = parameters["config"].model_dump(mode="json")
    entrypoint = f"{Path(__file__).parent.parent}/pipelines/cluster_flows.py:ray_train"
    both_hold = lambda: len(list(holding.iterdir())) == 2  # noqa: E731
    flow_run = run_and_cancel(ray_train, parameters, entrypoint, both_hold)
    assert len(list(holding.iterdir())) == 2  # both ranks were training
    assert flow_run.state.is_cancelled(), flow_run.state
    assert gone_within(run_dir, 30) == []  # every launcher and worker, on both nodes
    stopped = [line for line in flow_run_logs(flow_run.id) if line.startswith("Ray: stopping")]
    assert stopped and "node 0 stopped" in stopped[0] and "node 1 stopped" in stopped[0]


def test_ray_train_loses_a_node_and_resumes_to_the_torchrun_curve(
    prefect_api, ray_cluster, shards: Path, tmp_path: Path
) -> None:
    reference = torchrun_run(shards, tmp_path / "torchrun")
    run_dir = tmp_path / "ray"
    hold, holding = held(tmp_path)

    # The worker node dies while every rank holds before step 3.
    killed: dict = {}

    def kill_the_worker() -> None:
        wait_for_both_ranks(holding)
        killed["at"] = time.monotonic()
        killed["node_id"] = ray_cluster.kill_worker()

    killer = threading.Thread(target=kill_the_worker, daemon=True)
    killer.start()
    failed = ray_train(**flow_parameters(ray_cluster, shards, run_dir, hold), return_state=True)
    ended = time.monotonic()
    killer.join(timeout=10)
    assert failed.is_failed(), failed
    error = failed.result(raise_on_failure=False)
    assert isinstance(error, RayJobFailed), error
    message = str(error)
    assert f"Ray node {killed['node_id']}) was lost" in message, message
    assert "run the job again to resume" in message
    assert ended - killed["at"] < DIST_TIMEOUT_S, f"failed {ended - killed['at']:.1f} s after"
    assert gone_within(run_dir, 30) == []  # the surviving node's launcher was stopped
    assert [r["step"] for r in metrics(run_dir)] == [1, CHECKPOINT]

    # Started again on the cluster's two nodes (a new worker), it resumes at the checkpoint.
    new_worker = ray_cluster.add_worker()
    final = ray_train(**flow_parameters(ray_cluster, shards, run_dir, {}), return_state=True)
    assert final.is_completed(), final
    result = final.result()
    assert result["steps"] == STEPS
    assert new_worker in {node["node_id"] for node in result["nodes"]}
    assert len({node["node_id"] for node in result["nodes"]}) == 2
    logs = flow_run_logs(final.state_details.flow_run_id)
    # Rank 0, wherever the rendezvous put it, logs the resume and the end.
    resumed = [line for line in logs if "] resumed from " in line]
    assert len(resumed) == 1 and f"step-{CHECKPOINT:08d} at step {CHECKPOINT} in " in resumed[0]
    assert sum(f"] trained {STEPS} steps" in line for line in logs) == 1

    # No sample skipped or repeated: the torchrun run's curve, step for step, and its count.
    keys = ("step", "loss", "val_loss", "grad_norm")
    got = [{k: r.get(k) for k in keys} for r in metrics(run_dir)]
    want = [{k: r.get(k) for k in keys} for r in metrics(reference)]
    assert got == want
    last = f"checkpoints/step-{STEPS:08d}/state.json"
    state, want_state = (json.loads((run / last).read_text()) for run in (run_dir, reference))
    assert state["consumed_samples"] == want_state["consumed_samples"] == STEPS * 8
    assert state["layout"]["world_size"] == 2


def test_launch_ray_checks_the_layout_and_the_address_before_connecting(
    capsys: pytest.CaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    args = ["launch", "ray", "--config", str(RECIPE), "--run-dir", str(tmp_path / "run")]
    args += ["--set", "training.micro_batch_size=1"]
    assert main([*args, "--nodes", "3", "--gpus-per-node", "1", "--set", "parallel.tensor=2"]) == 1
    assert "world size 3 is not divisible by tensor 2" in capsys.readouterr().err
    assert main([*args, "--nodes", "2", "--gpus-per-node", "1"]) == 1
    error = capsys.readouterr().err
    assert "no Ray cluster given" in error and "RAY_ADDRESS" in error
    with pytest.raises(SystemExit):
        main(["launch", "ray", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "STRICT_SPREAD" in text and "torchrun" in text and "resume" in text


def test_the_cluster_train_form_reaches_ray_train() -> None:
    """The work pools' run form (target ray) calls this flow with the form's sizes and the
    options it has no field for."""
    config = load_config(RECIPE, ["training.micro_batch_size=1"])
    size = ClusterSize(nodes=2, gpus_per_node=8, source="the run form")
    options = {"address": "head:6379", "cpus_per_node": 16}
    flow, arguments = target_arguments("ray", config, "/shared/run", size, options)
    assert flow is ray_train
    assert arguments == {
        "config": config,
        "run_dir": "/shared/run",
        "nodes": 2,
        "gpus_per_node": 8,
        **options,
    }


def test_a_driver_killed_outright_leaves_no_training_behind(
    ray_cluster, shards: Path, tmp_path: Path
) -> None:
    """``megalith launch ray`` (the job without Prefect) killed with SIGKILL while both
    ranks train, so that nothing of it can stop the job: Ray ends the actors of a driver
    that is gone, and each node's launcher, torchrun and worker die with their parent."""
    hold, holding = held(tmp_path)
    run_dir = tmp_path / "ray"
    env = [f"--env={key}={value}" for key, value in {**ENV, **hold}.items()]
    command = megalith(
        "launch", "ray", "--config", str(RECIPE), *set_args(settings(shards)),
        "--nodes", "2", "--gpus-per-node", "1", "--cpus-per-node", "1",
        "--run-dir", str(run_dir), "--address", ray_cluster.address, *env,
    )  # fmt: skip
    log = tmp_path / "driver.log"
    with log.open("w") as output:
        driver = subprocess.Popen(
            command, env=child_env(), stdout=output, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + HANG_GUARD_S
        while len(list(holding.iterdir())) < 2 and driver.poll() is None:
            assert time.monotonic() < deadline, driver_said(log)
            time.sleep(0.1)
        assert driver.poll() is None, driver_said(log)
        driver.kill()
        driver.wait()
    assert log.read_text().count("started megalith train") == 2, driver_said(log)
    assert gone_within(run_dir, 30) == []


def driver_said(log: Path) -> str:
    """The driver's own lines, then the nodes' last ones."""
    lines = log.read_text().splitlines()
    own = [line for line in lines if not line.startswith("[node ")]
    return "\n".join([*own[-40:], "...", *lines[-40:]])
