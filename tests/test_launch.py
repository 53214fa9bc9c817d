"""Launching: ``megalith train --nproc-per-node 2`` end to end on CPU, a failing rank
failing the command, two torchrun "nodes" on one machine meeting at a c10d rendezvous
on 127.0.0.1, the Prefect pretrain flow on two ranks with the layout in MLflow, and
the sbatch script.

Every child gets one thread and a 120 s collective timeout; subprocess timeouts only
guard against hangs, nothing asserts on time.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from parallel_helpers import RECIPE, child_env, megalith, set_args, tiny_settings, tiny_shard_set
from servers import free_port, run_group, stop_group

from pipelines.cli import main
from training.metrics.run_logger import read_metrics
from training.models.package import verify_model_package
from training.runtime.launch import LaunchSpec, slurm_script, torchrun_command

pytestmark = pytest.mark.slow
STEPS = 4
HANG_GUARD_S = 240


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_shard_set(tmp_path_factory)


def train_args(shards: Path, output: Path, values: dict | None = None) -> list[str]:
    settings = tiny_settings(shards, {"training.train_iters": STEPS, **(values or {})})
    return ["train", "--config", str(RECIPE), *set_args(settings), "--output", str(output)]


def run(command: list[str], **env: str) -> subprocess.CompletedProcess:
    return run_group(command, child_env(**env), HANG_GUARD_S)


# --- one node, two processes ------------------------------------------------------------


def test_train_on_two_processes_end_to_end(shards: Path, tmp_path: Path) -> None:
    output = tmp_path / "run"
    values = {"parallel.data_parallel_mode": "distributed_optimizer", "checkpoint.interval": 2}
    done = run(megalith(*train_args(shards, output, values), "--quiet", "--nproc-per-node", "2"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    metrics = read_metrics(output / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 1))  # rank 0 alone wrote it
    assert all("tokens_per_s_per_device" in r for r in metrics)
    assert done.stdout.count(f"step {STEPS}/{STEPS}") == 1  # only rank 0 logs progress
    assert f"trained {STEPS} steps" in done.stdout
    summary = json.loads((output / "result.json").read_text())
    assert summary["steps"] == STEPS and Path(summary["model_package"]).is_dir()
    state = json.loads((output / "checkpoints" / "step-00000004" / "state.json").read_text())
    assert state["layout"]["world_size"] == 2 and state["layout"]["parallel.data"] == 2
    assert (output / "checkpoints" / "step-00000002").is_dir()


SITECUSTOMIZE = """
import os
if os.environ.get("RANK") == "1":
    import training.trainer as trainer

    step = trainer.Trainer.launch_step

    def failing_step(self, batches):
        if self.step == 1:
            raise RuntimeError("injected failure on rank 1 at step 2")
        return step(self, batches)

    trainer.Trainer.launch_step = failing_step
"""


def test_a_failing_rank_fails_the_whole_command(shards: Path, tmp_path: Path) -> None:
    # A sitecustomize on the children's path makes rank 1 raise at its second step while
    # rank 0 waits in the gradient all-reduce.
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(SITECUSTOMIZE)
    pythonpath = f"{inject}:{Path(__file__).resolve().parents[1]}"
    output = tmp_path / "run"
    command = megalith(*train_args(shards, output), "--quiet", "--nproc-per-node", "2")
    done = run(command, PYTHONPATH=pythonpath)
    assert done.returncode != 0
    assert "injected failure on rank 1 at step 2" in done.stdout + done.stderr
    assert "training failed on at least one rank" in done.stderr
    assert [r["step"] for r in read_metrics(output / "metrics.jsonl")] == [1]


def test_a_layout_the_trainer_cannot_run_yet_is_refused_before_launch(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    pipelined = {"parallel.pipeline": 2, "mixed_precision.dtype": "fp16"}
    args = train_args(shards, tmp_path / "run", pipelined)
    assert main([*args, "--nproc-per-node", "2"]) == 1
    assert "fp16 with parallel.pipeline=2" in capsys.readouterr().err
    settings = {"parallel.data_parallel_mode": "fsdp", "mixed_precision.dtype": "fp16"}
    assert main([*train_args(shards, tmp_path / "run", settings), "--nproc-per-node", "2"]) == 1
    assert "fsdp with mixed_precision.dtype=fp16" in capsys.readouterr().err


def test_a_bad_layout_fails_before_any_process_starts(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    args = train_args(shards, tmp_path / "run", {"training.global_batch_size": 6})
    assert main([*args, "--nproc-per-node", "4"]) == 1
    error = capsys.readouterr().err
    assert "global_batch_size 6 is not divisible by micro_batch_size 2 · data 4 = 8" in error
    assert not (tmp_path / "run").exists()


# --- two nodes on one machine -------------------------------------------------------------


def test_two_nodes_meet_at_a_c10d_rendezvous_on_loopback(shards: Path, tmp_path: Path) -> None:
    # FSDP here, so the full-weight gathers for checkpoint and package run across "nodes".
    output = tmp_path / "run"
    endpoint = f"127.0.0.1:{free_port()}"
    rdzv_id = f"test-{uuid.uuid4().hex[:8]}"
    agents = []
    for node_rank in (0, 1):
        command = megalith(
            *train_args(shards, output, {"parallel.data_parallel_mode": "fsdp"}),
            "--quiet",
            "--nproc-per-node", "1",
            "--nnodes", "2",
            "--node-rank", str(node_rank),
            "--rdzv-endpoint", endpoint,
            "--rdzv-id", rdzv_id,
            "--local-addr", "127.0.0.1",
        )  # fmt: skip
        log = (tmp_path / f"node{node_rank}.log").open("w")
        process = subprocess.Popen(
            command, env=child_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        agents.append((process, log))
    codes = []
    for process, log in agents:
        try:
            codes.append(process.wait(timeout=HANG_GUARD_S))
        except subprocess.TimeoutExpired:
            codes.append(f"still running after {HANG_GUARD_S} s")
        finally:
            stop_group(process, grace_s=5)
            log.close()
    logs = "\n".join(
        f"--- node {r} ---\n" + (tmp_path / f"node{r}.log").read_text()[-3000:] for r in (0, 1)
    )
    assert codes == [0, 0], logs
    assert [r["step"] for r in read_metrics(output / "metrics.jsonl")] == list(range(1, STEPS + 1))
    state = json.loads((output / "checkpoints" / "step-00000004" / "state.json").read_text())
    assert state["layout"]["world_size"] == 2
    package = json.loads((output / "result.json").read_text())["model_package"]
    verify_model_package(package)


# --- the Prefect flow -----------------------------------------------------------------


def test_prefect_pretrain_on_two_ranks_records_the_layout(
    prefect_api, shards: Path, tmp_path: Path
) -> None:
    from mlflow import MlflowClient

    from megalith.config import load_config
    from pipelines.flows import pretrain
    from training.mlflow_store.runs import ensure_tracking_store

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    ensure_tracking_store(uri)
    settings = tiny_settings(shards, {"training.train_iters": 2, "logging.mlflow": "true"})
    config = load_config(RECIPE, [f"{k}={v}" for k, v in settings.items()])
    with pytest.MonkeyPatch.context() as patch:
        for name, value in child_env(MLFLOW_TRACKING_URI=uri).items():
            patch.setenv(name, value)
        result = pretrain(config, str(tmp_path / "run"), nproc_per_node=2)
    assert result["steps"] == 2
    run = MlflowClient(uri).get_run(result["mlflow_run_id"])
    assert run.data.params["layout.world_size"] == "2"
    assert run.data.params["layout.parallel.data"] == "2"
    assert run.data.params["parallel.data_parallel_mode"] == "ddp"
    assert run.data.tags["megalith.parallel.layout"] == "tp1-cp1-pp1-dp2"
    assert run.data.tags["megalith.world_size"] == "2"


# --- command lines and scripts, no processes ----------------------------------------------


def test_torchrun_command_lines() -> None:
    single = torchrun_command(LaunchSpec(nproc_per_node=2), ["pipelines.cli", "train"])
    assert single[:4] == [sys.executable, "-m", "training.runtime.launch", "--standalone"]
    assert single[single.index("--nproc-per-node") + 1] == "2"
    assert single[single.index("--max-restarts") + 1] == "0"
    assert single[single.index("-m", 3) + 1 :] == ["pipelines.cli", "train"]
    spec = LaunchSpec(nproc_per_node=8, nnodes=2, node_rank=1, rdzv_endpoint="node0:29500")
    multi = torchrun_command(spec, ["pipelines.cli", "train"])
    assert "--standalone" not in multi
    for flag, value in [
        ("--rdzv-backend", "c10d"),
        ("--rdzv-endpoint", "node0:29500"),
        ("--nnodes", "2"),
        ("--node-rank", "1"),
        ("--rdzv-conf", "is_host=0"),
        ("--max-restarts", "0"),
    ]:
        assert multi[multi.index(flag) + 1] == value
    assert "--local-addr" not in multi
    pinned = torchrun_command(LaunchSpec(**{**spec.__dict__, "local_addr": "10.0.0.2"}), ["m"])
    assert pinned[pinned.index("--local-addr") + 1] == "10.0.0.2"


def test_multi_node_needs_an_endpoint(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    args = ["train", "--config", str(RECIPE), "--set", "training.micro_batch_size=1"]
    assert main([*args, "--nproc-per-node", "2", "--nnodes", "2"]) == 1
    assert "--nnodes 2 needs --rdzv-endpoint" in capsys.readouterr().err


def test_slurm_script(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    script_path = tmp_path / "train.sbatch"
    code = main(
        [
            "launch", "slurm", "--config", str(RECIPE), "--nodes", "2", "--gpus-per-node", "4",
            "--set", "training.micro_batch_size=1", "--run-dir", "/shared/runs/tiny",
            "--partition", "gpu", "--time", "01:00:00", "--output", str(script_path),
        ]
    )  # fmt: skip
    assert code == 0
    script = script_path.read_text()
    assert script.startswith("#!/bin/bash\n")
    for line in [
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=01:00:00",
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'RDZV_ENDPOINT="$HEAD_NODE:29500"',
        "srun --kill-on-bad-exit=1 \\",
        '  --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$SLURM_JOB_ID"',
    ]:
        assert line in script.splitlines(), line
    srun = script[script.index("srun") :]
    assert f"train --config {RECIPE.resolve()}" in srun
    assert "--nnodes 2 --nproc-per-node 4" in srun
    assert "--output /shared/runs/tiny" in srun and "--resume" in srun
    assert script == slurm_script(
        str(RECIPE.resolve()), 2, 4, sets=["training.micro_batch_size=1"],
        output="/shared/runs/tiny", partition="gpu", time_limit="01:00:00",
    )  # fmt: skip


def test_slurm_refuses_a_layout_that_does_not_fit(capsys: pytest.CaptureFixture) -> None:
    args = ["launch", "slurm", "--config", str(RECIPE), "--nodes", "3", "--gpus-per-node", "1"]
    assert main([*args, "--set", "parallel.tensor=2"]) == 1
    assert "world size 3 is not divisible by tensor 2" in capsys.readouterr().err


def test_slurm_help_documents_the_script(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["launch", "slurm", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "sbatch" in text and "rendezvous on the first node" in text and "torchrun" in text
