"""Launching: ``megalith train --nproc-per-node 2`` end to end on CPU, a failing rank
failing the command, two "nodes" of two processes on one machine meeting on 127.0.0.1
(the loss curve of one node's run, a lost node and the retry, a SIGTERM to node 0), the
Prefect pretrain flow on two ranks with the layout in MLflow, and the sbatch script.

Every child gets one thread and a 120 s collective timeout unless a test sets its own.
Subprocess timeouts only guard against hangs; the bounds asserted on the two nodes'
failures are the ones docs/multi-node.md promises.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from parallel_helpers import (
    RECIPE,
    REPO,
    child_env,
    megalith,
    set_args,
    tiny_settings,
    tiny_shard_set,
)
from servers import alive, cmdline, descendants, free_port, run_group, stop_group

from pipelines.cli import main
from training.checkpoint.async_save import TEST_WRITE_DELAY_ENV
from training.checkpoint.sharded_index import latest_sharded_checkpoint
from training.checkpoint.sharded_reader import verify_sharded_checkpoint
from training.metrics.run_logger import read_metrics
from training.models.package import verify_model_package
from training.runtime.launch import TIMEOUT_ENV, LaunchSpec, slurm_script, torchrun_command

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
    pipelined = {
        "parallel.pipeline": 2,
        "parallel.pipeline_schedule": "zero-bubble",
        "training.compile": True,
    }
    args = train_args(shards, tmp_path / "run", pipelined)
    assert main([*args, "--nproc-per-node", "2"]) == 1
    assert "training.compile with parallel.pipeline_schedule=zero-bubble" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    settings = {"model.num_experts": 4, "parallel.tensor": 2}
    assert main([*train_args(shards, tmp_path / "run", settings), "--nproc-per-node", "2"]) == 1
    assert "model.num_experts=4 with parallel.tensor=2" in capsys.readouterr().err


def test_a_bad_layout_fails_before_any_process_starts(
    shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    args = train_args(shards, tmp_path / "run", {"training.global_batch_size": 6})
    assert main([*args, "--nproc-per-node", "4"]) == 1
    error = capsys.readouterr().err
    assert "global_batch_size 6 is not divisible by micro_batch_size 2 · data 4 = 8" in error
    assert not (tmp_path / "run").exists()


# --- two nodes on one machine -------------------------------------------------------------
# Two `megalith train` launchers of two processes each, meeting on 127.0.0.1: TP=2 inside
# a node (ranks 0-1 on node 0, 2-3 on node 1) x FSDP DP=2 across the nodes, so the
# gradient reductions, the parameter gathers and the checkpoint barriers cross "nodes".

NODE_STEPS = 6
ACROSS_NODES = {
    "parallel.tensor": 2,
    "parallel.data_parallel_mode": "fsdp",
    "training.train_iters": NODE_STEPS,
    "training.eval_interval": 0,
    "checkpoint.interval": 2,
    "checkpoint.keep_last": NODE_STEPS,
}
LOST_AFTER = 2  # node 1 is lost during the step after this checkpoint
LOST_NODE_TIMEOUT_S = 10  # MEGALITH_DIST_TIMEOUT_S of the run that loses a node
STOP_S = 10  # for node 0's ranks and launcher to exit once a collective has failed
STOP_BOUND_S = 20  # every process of both nodes gone after node 0's SIGTERM
LONG_RUN = 200  # steps: more than the SIGTERM test lets it take

# Node 1's ranks stop answering at the start of step LOST_AFTER + 1, after their part of
# the checkpoint of LOST_AFTER, and say so (a file each). A node that drops off the
# network or freezes sends no connection reset: its peers see only silence, and only the
# collective timeout ends their wait. At a fixed step, so the test never races a fast run.
HOLD_NODE_1 = """
import os, pathlib, time
if os.environ.get("GROUP_RANK") == "1":  # torchrun: this worker's node
    import training.trainer as trainer

    step = trainer.Trainer.launch_step

    def held_step(self, batches):
        if self.step == {after}:
            pathlib.Path("{marker}", os.environ["LOCAL_RANK"]).touch()
            time.sleep(3600)
        return step(self, batches)

    trainer.Trainer.launch_step = held_step
"""


@contextlib.contextmanager
def two_nodes(
    shards: Path, output: Path, logs: Path, values: dict, *extra: str, **env: str
) -> Iterator[list[subprocess.Popen]]:
    """Node 0 and node 1 (``megalith train --nnodes 2 --node-rank R``, each in a session
    of its own, output to LOGS/nodeR.log); both groups stopped afterwards."""
    endpoint = f"127.0.0.1:{free_port()}"
    logs.mkdir(parents=True)
    nodes = []
    try:
        for node_rank in (0, 1):
            command = megalith(
                *train_args(shards, output, values), "--quiet", *extra,
                "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", str(node_rank),
                "--rdzv-endpoint", endpoint, "--local-addr", "127.0.0.1",
            )  # fmt: skip
            with (logs / f"node{node_rank}.log").open("w") as log:
                nodes.append(
                    subprocess.Popen(command, env=child_env(**env), stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
                )  # fmt: skip
        yield nodes
    finally:
        for node in nodes:
            stop_group(node, grace_s=5)


def node_logs(logs: Path) -> str:
    return "\n".join(
        f"--- node {r} ---\n" + (logs / f"node{r}.log").read_text()[-3000:] for r in (0, 1)
    )


def wait_until(condition, nodes: list[subprocess.Popen], logs: Path, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert all(node.poll() is None for node in nodes), f"a node exited before {what}:\n" + (
            node_logs(logs)
        )
        assert time.monotonic() < deadline, f"no {what} after {HANG_GUARD_S} s:\n" + node_logs(logs)
        time.sleep(0.1)


def ranks(pids: set[int]) -> set[int]:
    """The training workers among ``pids`` (torchrun starts them unbuffered)."""
    return {pid for pid in pids if b"-u\x00-m\x00pipelines.cli\x00train" in cmdline(pid)}


def latest_step(output: Path) -> int | None:
    url = latest_sharded_checkpoint(str(output / "checkpoints"))
    return None if url is None else int(url.rstrip("/").rpartition("step-")[2])


def curve(run: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(run / "metrics.jsonl")]


@pytest.fixture(scope="module")
def one_node_run(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same layout as four processes of one launcher: the curve two nodes must give."""
    output = tmp_path_factory.mktemp("one-node") / "run"
    done = run(
        megalith(*train_args(shards, output, ACROSS_NODES), "--quiet", "--nproc-per-node", "4")
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return output


def test_two_nodes_train_as_one_and_resume_exactly_after_losing_a_node(
    shards: Path, tmp_path: Path, one_node_run: Path
) -> None:
    output = tmp_path / "run"
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        HOLD_NODE_1.format(after=LOST_AFTER, marker=tmp_path / "held")
    )
    (tmp_path / "held").mkdir()
    env = {"PYTHONPATH": f"{hook}:{REPO}", TIMEOUT_ENV: str(LOST_NODE_TIMEOUT_S)}
    with two_nodes(shards, output, tmp_path / "lost", ACROSS_NODES, **env) as (node0, node1):
        wait_until(
            lambda: len(list((tmp_path / "held").iterdir())) == 2
            and latest_step(output) == LOST_AFTER,
            [node0, node1], tmp_path / "lost", f"checkpoint {LOST_AFTER} with node 1 held",
        )  # fmt: skip
        lost = time.monotonic()
        node0.wait(timeout=HANG_GUARD_S)
        failed_after = time.monotonic() - lost
        node1_processes = {node1.pid, *descendants(node1.pid)}
        assert len(ranks(node1_processes)) == 2, node1_processes  # and launcher, torchrun
        for pid in node1_processes:  # and the node is gone for good
            os.kill(pid, signal.SIGKILL)
    log0 = (tmp_path / "lost" / "node0.log").read_text()
    assert node0.returncode == 1, log0[-3000:]
    print(f"node 0 failed {failed_after:.1f} s after node 1 stopped answering")
    assert failed_after < LOST_NODE_TIMEOUT_S + STOP_S, f"node 0 failed after {failed_after:.1f} s"
    # The first of node 0's ranks to fail says why in one line (torchrun may stop the
    # other before its own collective fails), and how to go on.
    assert re.search(r"error: rank [01] lost its peers \(", log0), log0[-3000:]
    assert "Relaunch every node with --resume" in log0
    assert "error: training failed on at least one rank" in log0

    # The retry: both nodes relaunched with --resume continue from the last commit.
    with two_nodes(shards, output, tmp_path / "retry", ACROSS_NODES, "--resume") as nodes:
        codes = [node.wait(timeout=HANG_GUARD_S) for node in nodes]
    assert codes == [0, 0], node_logs(tmp_path / "retry")
    resumed = (tmp_path / "retry" / "node0.log").read_text()
    assert f"step-{LOST_AFTER:08d} at step {LOST_AFTER}" in resumed
    # Steps 1-2 from the first launch, 3-6 from the retry, equal to one node's to the
    # last bit: the same ranks run the same gloo collectives in the same order whatever
    # process started them, and a resume restores the weights, the optimizer, the RNG and
    # the position in the data (a sample skipped or seen twice would change every loss
    # after it).
    assert curve(output) == curve(one_node_run)
    final = f"checkpoints/step-{NODE_STEPS:08d}/state.json"
    state, want = (json.loads((run / final).read_text()) for run in (output, one_node_run))
    assert state["consumed_samples"] == want["consumed_samples"] == NODE_STEPS * 8
    assert state["layout"]["world_size"] == 4 and state["layout"]["parallel.tensor"] == 2
    verify_model_package(json.loads((output / "result.json").read_text())["model_package"])


def test_sigterm_to_node_0_stops_every_rank_of_both_nodes(shards: Path, tmp_path: Path) -> None:
    # A checkpoint every step, each writer sleeping 0.5 s before its commit: the signal,
    # sent once one is committed, lands while the next is under way. The collective
    # timeout is far above the bound: node 1 stops because its peers left, not because a
    # collective timed out.
    values = {**ACROSS_NODES, "training.train_iters": LONG_RUN, "checkpoint.interval": 1}
    env = {TEST_WRITE_DELAY_ENV: "0.5", TIMEOUT_ENV: "300"}
    output, logs = tmp_path / "run", tmp_path / "logs"
    with two_nodes(shards, output, logs, values, **env) as nodes:
        wait_until(lambda: latest_step(output) is not None, nodes, logs, "step and checkpoint")
        everything = {pid for node in nodes for pid in (node.pid, *descendants(node.pid))}
        assert len(ranks(everything)) == 4, everything  # and two launchers, two torchruns
        os.kill(nodes[0].pid, signal.SIGTERM)  # what a cancelled flow run's process does
        stopped = time.monotonic()
        while any(alive(pid) for pid in everything) and time.monotonic() - stopped < STOP_BOUND_S:
            time.sleep(0.1)
        survivors = [pid for pid in everything if alive(pid)]
        gone_after = time.monotonic() - stopped
        codes = [node.wait(timeout=5) if not survivors else None for node in nodes]
    assert not survivors, f"alive {STOP_BOUND_S} s after the SIGTERM: {survivors}\n" + (
        node_logs(logs)
    )
    print(f"both nodes gone {gone_after:.1f} s after node 0's SIGTERM")
    assert codes == [-signal.SIGTERM, 1], node_logs(logs)  # node 0 by the signal, as sent
    log1 = (logs / "node1.log").read_text()
    assert re.search(r"error: rank [23] lost its peers \(", log1), log1[-3000:]
    # Nothing partial looks complete: each checkpoint a resume would take (step-N with its
    # index.json, the commit) verifies file by file, and the latest is one of them; an
    # interrupted save is still step-N.tmp, or was removed by the rank that saw it fail.
    checkpoints = output / "checkpoints"
    committed = sorted(
        p for p in checkpoints.iterdir()
        if re.fullmatch(r"step-\d{8}", p.name) and (p / "index.json").exists()
    )  # fmt: skip
    assert committed, sorted(p.name for p in checkpoints.iterdir())
    for checkpoint in committed:
        verify_sharded_checkpoint(checkpoint)
    assert Path(latest_sharded_checkpoint(str(checkpoints))) in committed


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
    assert run.data.tags["megalith.kernel_backend"] == "torch"  # auto, on CPU


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
        ("--rdzv-backend", "static"),  # node R holds ranks 8R..8R+7: rank 0 on node 0
        ("--rdzv-endpoint", "node0:29500"),
        ("--nnodes", "2"),
        ("--node-rank", "1"),
        ("--max-restarts", "0"),
    ]:
        assert multi[multi.index(flag) + 1] == value
    assert "--local-addr" not in multi
    # Without a node rank (one srun task per node) the nodes meet through c10d.
    unranked = torchrun_command(LaunchSpec(**{**spec.__dict__, "node_rank": None}), ["m"])
    assert unranked[unranked.index("--rdzv-backend") + 1] == "c10d"
    assert "--node-rank" not in unranked
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
