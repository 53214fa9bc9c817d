"""The Slurm path without a Slurm cluster: sbatch, squeue, sacct and scancel are stand-ins
(tests/fake_commands.py) that print outputs recorded from the real commands with the flags
pipelines.slurm uses (tests/data/slurm/), first on PATH. Everything above that boundary
runs for real: the subprocess calls and their parsing, and the ``slurm-train`` flow in
Prefect (the session's test server), a cancel included, delivered by Prefect's runner as
the UI's Cancel button does."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import fake_commands
import pytest
from parallel_helpers import RECIPE
from servers import flow_run_logs, run_and_cancel

from megalith.config import load_config
from megalith.errors import MegalithError
from pipelines import slurm
from pipelines.cli import main
from pipelines.cluster_flows import SlurmJobFailed, ending, slurm_train

DATA = Path(__file__).parent / "data" / "slurm"
SETS = ["training.micro_batch_size=1"]


@pytest.fixture
def fake_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Install the stand-ins for a scenario folder of tests/data/slurm; the calls made."""
    state = tmp_path / "slurm-state"

    def use(scenario: Path, log_name: str = "") -> Path:
        env = fake_commands.install(tmp_path / "bin", scenario, state)
        for key, value in {**env, "FAKE_SLURM_LOG": log_name}.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.delenv(slurm.SLURM_BIN_ENV, raising=False)
        return state

    return use


# Each case's job, the outcome its recorded squeue/sacct outputs must give, and what the
# summary a user reads must name.
CASES = {
    "pending": ("4252", slurm.Outcome.WAITING, "4252 PENDING"),
    "completing": ("4253", slurm.Outcome.RUNNING, "4253 COMPLETING"),
    "timeout": (
        "4245",
        slurm.Outcome.FAILED,
        "4245 TIMEOUT (exit 0:0); steps: 4245.batch CANCELLED",
    ),
    "node_fail": ("4243", slurm.Outcome.FAILED, "4243 NODE_FAIL"),
    "out_of_memory": (
        "4244",
        slurm.Outcome.FAILED,
        "4244 OUT_OF_MEMORY (exit 0:125); steps: 4244.batch",
    ),
    "failed": (
        "4247",
        slurm.Outcome.FAILED,
        "4247 FAILED (exit 1:0); steps: 4247.batch FAILED (exit 1:0), 4247.0 FAILED",
    ),
    "cancelled": ("4246", slurm.Outcome.CANCELLED, "4246 CANCELLED by 1000"),
    "preempted": ("4248", slurm.Outcome.FAILED, "4248 PREEMPTED"),
    "boot_fail": ("4249", slurm.Outcome.FAILED, "4249 BOOT_FAIL"),
    "deadline": ("4251", slurm.Outcome.FAILED, "4251 DEADLINE"),
    "array_running": (
        "4250",
        slurm.Outcome.RUNNING,
        "4250_[2-3] PENDING, 4250_0 COMPLETED, 4250_1 RUNNING",
    ),
    "array_failed": ("4250", slurm.Outcome.FAILED, "4250_1 FAILED (exit 2:0)"),
    "het_running": ("4260", slurm.Outcome.RUNNING, "4260+0 RUNNING, 4260+1 CONFIGURING"),
    "het_completed": (
        "4260",
        slurm.Outcome.SUCCEEDED,
        "4260+0 COMPLETED (exit 0:0), 4260+1 COMPLETED",
    ),
    "purged": ("4254", slurm.Outcome.SUCCEEDED, "4254 COMPLETED (exit 0:0)"),
}
LIVE = (slurm.Outcome.WAITING, slurm.Outcome.RUNNING)


def test_slurm_states_map_to_outcomes_and_flow_endings(fake_cluster, tmp_path: Path) -> None:
    """Each case's outcome and summary; and how the flow run ends on a finished job: it
    returns the job when completed, ends Cancelled when the job was cancelled, and raises
    (Prefect records Failed) with the job's and its steps' states when it failed."""
    assert set(CASES) | {"accounting_off"} == {p.name for p in (DATA / "states").iterdir()}
    log = tmp_path / "tiny-4247.out"
    for case, (job_id, expected, summary) in CASES.items():
        state = fake_cluster(DATA / "states" / case)
        status = slurm.job_status(job_id)
        assert status is not None and status.outcome is expected, (case, status)
        assert summary in status.describe(), (case, status.describe())
        assert status.outcome.terminal == (expected not in LIVE)
        asked_accounting = bool(fake_commands.calls(state, "sacct"))
        assert asked_accounting == status.outcome.terminal, case  # the queue suffices while live
        if expected is slurm.Outcome.FAILED:
            with pytest.raises(SlurmJobFailed) as failed:
                ending(status, log)
            message = str(failed.value)
            assert message.startswith(f"Slurm job {job_id} ended ") and summary in message
            assert message.endswith(f"its log: {log}")
        elif expected is slurm.Outcome.CANCELLED:
            final = ending(status, log)
            assert final.is_cancelled() and summary in final.message
        elif expected is slurm.Outcome.SUCCEEDED:
            assert ending(status, log) == {
                "job_id": job_id,
                "state": status.describe(),
                "log": str(log),
            }
        shutil.rmtree(state)
    fake_cluster(DATA / "states" / "accounting_off")
    assert slurm.job_status("4254") is None  # left the queue, and no accounting to ask


def test_a_missing_slurm_command_says_how_to_point_at_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv(slurm.SLURM_BIN_ENV, raising=False)
    with pytest.raises(
        MegalithError,
        match=r"`sbatch` was not found on PATH: run this on a Slurm login node.*set MEGALITH_SLURM_BIN",
    ):
        slurm.submit(tmp_path / "train.sbatch", tmp_path)
    monkeypatch.setenv(slurm.SLURM_BIN_ENV, str(tmp_path / "slurm" / "bin"))
    with pytest.raises(
        MegalithError, match=r"`sbatch` was not found on MEGALITH_SLURM_BIN=.*slurm/bin"
    ):
        slurm.submit(tmp_path / "train.sbatch", tmp_path)


def test_the_log_follower_returns_whole_lines_as_the_file_grows(tmp_path: Path) -> None:
    log = tmp_path / "tiny-4242.out"
    follower = slurm.LogFollower(log)
    assert follower.new_lines() == []  # the job has not started
    log.write_bytes(b"step 1\nstep 2\nste")
    assert follower.new_lines() == ["step 1", "step 2"]
    with log.open("ab") as out:
        out.write(b"p 3\r\nsaved")
    assert follower.new_lines() == ["step 3"]
    assert follower.new_lines(final=True) == ["saved"]


def test_slurm_flow_submits_the_launch_script_and_follows_the_job(
    prefect_api, fake_cluster, tmp_path: Path
) -> None:

    config = load_config(RECIPE, SETS)
    run_dir = tmp_path / "shared" / "run"
    state = fake_cluster(DATA / "completed", log_name=f"{config.name}-4242.out")
    final = slurm_train(
        config=config, run_dir=str(run_dir), nodes=2, gpus_per_node=4, poll_seconds=0.01,
        return_state=True,
    )  # fmt: skip
    assert final.is_completed(), final
    result = final.result()
    assert result["job_id"] == "4242" and "4242 COMPLETED" in result["state"]

    (sbatch,) = fake_commands.calls(state, "sbatch")
    script = run_dir / "train.sbatch"
    assert sbatch["argv"] == ["--parsable", str(script)] and sbatch["cwd"] == str(run_dir)
    # the script is the one `megalith launch slurm` writes for the flow's recipe and sizes
    launch = tmp_path / "launch.sbatch"
    args = ["launch", "slurm", "--config", str(run_dir / "recipe.yaml"), "--nodes", "2",
            "--gpus-per-node", "4", "--run-dir", str(run_dir), "--job-name", config.name]  # fmt: skip
    assert main([*args, "--output", str(launch)]) == 0
    assert script.read_text() == launch.read_text()
    assert not fake_commands.calls(state, "scancel")  # a finished job is not cancelled

    logs = flow_run_logs(final.state_details.flow_run_id)
    job_log = (run_dir / f"{config.name}-4242.out").read_text().splitlines()
    streamed = [line for line in logs if line in job_log]
    assert streamed == job_log  # every line, once, in order, the unfinished last one too
    seen = [line for line in logs if line.startswith("Slurm job 4242: ")]
    assert seen == [
        "Slurm job 4242: 4242 PENDING (waiting)",
        "Slurm job 4242: 4242 CONFIGURING (waiting)",
        "Slurm job 4242: 4242 RUNNING (running)",
        "Slurm job 4242: 4242 COMPLETING (running)",
    ]


@pytest.mark.slow  # ~10 s: Prefect's runner starts the flow in a process of its own
def test_cancelling_the_flow_run_cancels_the_slurm_job(
    prefect_api, fake_cluster, tmp_path: Path
) -> None:
    """Cancel as the UI does (the run goes Cancelling); Prefect's runner, which started
    the run's process, stops it; the flow's scancel is the Slurm side of it."""
    config = load_config(RECIPE, SETS)
    state = fake_cluster(DATA / "cancel", log_name=f"{config.name}-4242.out")
    parameters = {
        "config": config.model_dump(mode="json"), "run_dir": str(tmp_path / "run"),
        "nodes": 1, "gpus_per_node": 1, "poll_seconds": 0.2,
    }  # fmt: skip
    entrypoint = f"{Path(__file__).parent.parent}/pipelines/cluster_flows.py:slurm_train"
    running = lambda: bool(fake_commands.calls(state, "squeue"))  # noqa: E731
    flow_run = run_and_cancel(slurm_train, parameters, entrypoint, running)
    assert [call["argv"] for call in fake_commands.calls(state, "scancel")] == [["4242"]]
    assert flow_run.state.is_cancelled(), flow_run.state
