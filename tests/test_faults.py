"""Faults a run must survive or refuse cleanly (issue 16, §4), with real processes:

- SIGKILL of the ``megalith train --nproc-per-node 2`` launcher takes every torchrun
  worker with it, and the folder it held is free again;
- a second ``megalith train`` into a folder another run is writing is refused, naming
  the holder;
- a full disk or a file-size limit (RLIMIT_FSIZE, so writes fail with EFBIG) during
  ``data prepare``, training and checkpoint saves: one line naming the file and the
  cause, nothing partial left looking complete;
- an MLflow server that dies mid-run and comes back: every metric arrives and the run
  ends FINISHED; one that stays down: one warning naming the run.

Subprocess timeouts only guard against hangs; the bounds asserted are the issue's.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from parallel_helpers import (
    CORPUS,
    RECIPE,
    child_env,
    fit_one_process,
    megalith,
    set_args,
    tiny_settings,
)
from safetensors import SafetensorError
from servers import alive, answers, cmdline, descendants, free_port, run_group, stop_group

from megalith.errors import MegalithError, storage_error_message
from training.checkpoint.async_save import Checkpointer
from training.checkpoint.format import CheckpointError, latest_checkpoint, save_checkpoint
from training.checkpoint.sharded_writer import Snapshot
from training.metrics.run_logger import MetricsFile
from training.mlflow_store.runs import OPEN_RUN_FILE
from training.runtime.run_lock import LOCK_NAME, RunLock

HANG_GUARD_S = 240
FOREVER = 1_000_000  # steps: a run that trains until it is killed


def train_args(shards: Path, output: Path, values: dict | None = None) -> list[str]:
    settings = tiny_settings(shards, {"training.eval_interval": 0, **(values or {})})
    return ["train", "--config", str(RECIPE), *set_args(settings), "--output", str(output)]


@contextlib.contextmanager
def training_forever(
    shards: Path,
    output: Path,
    *launch: str,
    via: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    values: dict | None = None,
) -> Iterator[subprocess.Popen]:
    """``megalith train`` (started by the command ``via``, if given) in its own session,
    yielded once it has written a step; its group is stopped afterwards."""
    settings = {"training.train_iters": FOREVER, **(values or {})}
    command = megalith(*train_args(shards, output, settings), "--quiet")
    process = subprocess.Popen(
        [*via, *command, *launch],
        env=child_env(**(env or {})),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for_a_step(process, output / "metrics.jsonl")
        yield process
    finally:
        stop_group(process, grace_s=5)


def tracked_by(store: str) -> dict:
    """``training_forever``'s options for a run tracked in ``store``."""
    return {"env": {"MLFLOW_TRACKING_URI": store}, "values": {"logging.mlflow": "true"}}


def wait_for_a_step(process: subprocess.Popen, metrics: Path) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not (metrics.exists() and metrics.read_text().strip()):
        if process.poll() is not None:
            raise AssertionError(f"training exited early: {process.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, "no training step was written"
        time.sleep(0.2)


def kill_and_expect_no_survivors(process: subprocess.Popen, tree: set[int]) -> None:
    """SIGKILL ``process``; every pid of ``tree`` (what it started) must be gone in 30 s."""
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = [pid for pid in tree if alive(pid)]
    for pid in survivors:  # leave nothing behind for the next test
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not survivors, f"still running 30 s after their parent died: {survivors}"


# --- processes --------------------------------------------------------------------------


def test_sigkill_of_the_launcher_stops_every_worker_and_frees_the_folder(
    shards: Path, tmp_path: Path
) -> None:
    output = tmp_path / "run"
    with training_forever(shards, output, "--nproc-per-node", "2") as launcher:
        tree = descendants(launcher.pid)
        workers = {pid for pid in tree if b"-u\x00-m\x00pipelines.cli" in cmdline(pid)}
        assert len(workers) == 2, f"expected 2 workers under the launcher, found {tree}"
        kill_and_expect_no_survivors(launcher, tree)
    # The dead launcher's lock is stale: the next run into the folder takes it over.
    done = run_group(
        megalith(*train_args(shards, output, {"training.train_iters": 2}), "--quiet"),
        child_env(),
        HANG_GUARD_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trained 2 steps" in done.stdout
    assert (output / LOCK_NAME).read_text() == ""  # released when the run ended


# A Prefect flow run's process running the pretrain task: Prefect's SIGTERM bridge (the
# runner cancels a run with SIGTERM to this process alone, SIGKILL 30 s later), then
# stream_process in the same thread, as the task engine calls it.
FLOW_PROCESS = """
import logging, sys
from prefect.utilities.engine import capture_sigterm
from pipelines.tasks import stream_process

logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr, force=True)
with capture_sigterm():
    stream_process(sys.argv[1:], logging.getLogger("task"))
"""


def test_a_cancelled_flow_run_unwinds_its_training_which_ends_by_the_signal(
    shards: Path, tmp_path: Path
) -> None:
    from mlflow import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    output = tmp_path / "run"
    via = (sys.executable, "-c", FLOW_PROCESS)
    with training_forever(shards, output, via=via, **tracked_by(store)) as flow:
        tree = descendants(flow.pid)
        flow.send_signal(signal.SIGTERM)  # a cancel from the UI, a flow run's timeout
        sent = time.monotonic()
        _, stderr = flow.communicate(timeout=HANG_GUARD_S)
        took = time.monotonic() - sent
    # The task passed the SIGTERM on: the training unwound, said so, and died of it, all
    # before the runner's SIGKILL; then the flow's process died of it too, as Prefect does.
    assert took < 20, f"{took:.1f} s"
    assert "terminated" in stderr.splitlines(), stderr[-3000:]
    assert flow.returncode == -signal.SIGTERM
    assert not [pid for pid in tree if alive(pid)]
    client = MlflowClient(tracking_uri=store)
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FAILED"  # ended at once, not RUNNING until the next run
    assert (output / LOCK_NAME).read_text() == ""


def test_a_run_left_running_by_a_killed_job_is_ended_by_the_next_job_in_its_folder(
    shards: Path, tmp_path: Path
) -> None:
    from mlflow import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    output = tmp_path / "run"
    with training_forever(shards, output, **tracked_by(store)) as first:
        first.kill()  # preemption, the OOM killer: nothing can end its MLflow run
        first.wait()
    again = {"training.train_iters": 2, "logging.mlflow": "true"}
    done = run_group(megalith(*train_args(shards, output, again), "--quiet"),
                     child_env(MLFLOW_TRACKING_URI=store), HANG_GUARD_S)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    client = MlflowClient(tracking_uri=store)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    statuses = sorted((r.info.start_time, r.info.status) for r in runs)
    assert [status for _, status in statuses] == ["KILLED", "FINISHED"]
    assert "was left RUNNING; ended KILLED" in done.stdout + done.stderr
    assert not (output / OPEN_RUN_FILE).exists()


# What the Prefect pretrain task does: stream_process in a worker thread, not the main one.
TASK_THREAD = """
import logging, sys, threading
from pipelines.tasks import stream_process

thread = threading.Thread(target=stream_process, args=(sys.argv[1:], logging.getLogger("task")))
thread.start()
thread.join()
"""


def test_sigkill_of_the_flow_process_stops_its_training_process(
    shards: Path, tmp_path: Path
) -> None:
    via = (sys.executable, "-c", TASK_THREAD)
    with training_forever(shards, tmp_path / "run", via=via) as flow:
        tree = descendants(flow.pid)
        assert any(b"pipelines.cli\x00train" in cmdline(pid) for pid in tree), tree
        kill_and_expect_no_survivors(flow, tree)


def test_a_second_run_into_a_busy_folder_is_refused_naming_the_holder(
    shards: Path, tmp_path: Path
) -> None:
    output = tmp_path / "run"
    with training_forever(shards, output) as first:
        steps_before = len((output / "metrics.jsonl").read_text().splitlines())
        second = run_group(
            megalith(*train_args(shards, output, {"training.train_iters": 2}), "--quiet"),
            child_env(),
            HANG_GUARD_S,
        )
        assert second.returncode == 1
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in second.stderr, second.stderr
        assert lines[0].startswith(f"error: {output} is in use by another run (pid {first.pid} ")
        assert f"on host {os.uname().nodename}, started " in lines[0]
        assert first.poll() is None  # the first run goes on, its metrics untouched
        time.sleep(1)
        assert len((output / "metrics.jsonl").read_text().splitlines()) > steps_before


# --- storage faults -----------------------------------------------------------------------


def limit_file_size(limit: int):
    """For ``preexec_fn``: writes past ``limit`` bytes fail with EFBIG (Python ignores
    SIGXFSZ), as on a full disk or a quota, without needing a small filesystem."""

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@contextlib.contextmanager
def limit_own_file_size(limit: int) -> Iterator[None]:
    """This process's writes past ``limit`` bytes fail with EFBIG while inside."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def run_limited(
    args: list[str], limit: int, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        megalith(*args), env=child_env(), capture_output=True, text=True, cwd=cwd,
        preexec_fn=limit_file_size(limit), timeout=HANG_GUARD_S,
    )  # fmt: skip


def one_error_line(done: subprocess.CompletedProcess) -> str:
    """The failed command's stderr: exactly one line, ``error: ...``, no traceback."""
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr[-3000:]
    return lines[0]


def test_data_prepare_past_a_file_size_limit_names_the_shard_and_leaves_nothing_partial(
    shards: Path, tmp_path: Path
) -> None:
    corpus = tmp_path / "corpus.jsonl"
    with CORPUS.open() as source:
        corpus.write_text("".join(source.readline() for _ in range(400)))
    args = ["data", "prepare", "--input", str(corpus), "--output", "out", "--workers", "1",
            "--tokenizer", str(shards / "tokenizer.model"), "--quiet"]  # fmt: skip
    line = one_error_line(run_limited(args, 50_000, cwd=tmp_path))
    assert line == "error: out/.prepare/shard-00000.bin: File too large (EFBIG)"
    out = tmp_path / "out"
    assert not (out / "manifest.json").exists()
    assert sorted(p.name for p in out.rglob("*") if p.is_file()) == ["scan.json"]
    # Nothing was left to confuse a rerun with space: it finishes the set.
    done = subprocess.run(megalith(*args), env=child_env(), capture_output=True, text=True,
                          cwd=tmp_path, timeout=HANG_GUARD_S)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "manifest.json").exists()


def test_an_output_under_a_file_is_one_line_naming_it(shards: Path, tmp_path: Path) -> None:
    args = ["data", "prepare", "--input", str(CORPUS), "--output", "/dev/null/shards",
            "--tokenizer", str(shards / "tokenizer.model"), "--quiet"]  # fmt: skip
    done = subprocess.run(megalith(*args), env=child_env(), capture_output=True, text=True,
                          timeout=HANG_GUARD_S)  # fmt: skip
    assert one_error_line(done).startswith("error: /dev/null/shards")
    assert one_error_line(done).endswith(": Not a directory (ENOTDIR)")


@pytest.mark.parametrize("background", ["true", "false"], ids=["async", "sync"])
def test_a_checkpoint_past_a_file_size_limit_is_one_line_and_never_latest(
    background: str, shards: Path, tmp_path: Path
) -> None:
    from training.checkpoint.sharded_index import latest_sharded_checkpoint

    output = tmp_path / "run"
    # Hidden size 128: the tensor files (> 512 KB) outgrow the data index cache (~360 KB).
    wider = {"checkpoint.interval": 2, "model.hidden_size": 128, "model.ffn_hidden_size": 256,
             "checkpoint.async_save": background}  # fmt: skip
    line = one_error_line(run_limited([*train_args(shards, output, wider), "--quiet"], 450_000))
    staging = output / "checkpoints" / "step-00000002.tmp"
    assert line.startswith(f"error: writing a checkpoint failed: {staging}/")
    assert line.endswith(".safetensors: File too large (EFBIG)")
    assert latest_sharded_checkpoint(str(output / "checkpoints")) is None
    assert list((output / "checkpoints").iterdir()) == []  # the failed save's space is back


def test_a_v1_checkpoint_save_that_fails_leaves_no_staging_folder(tmp_path: Path) -> None:
    model = torch.nn.Linear(256, 256)  # 256 KB of weights: past the limit below
    optimizer = torch.optim.AdamW(model.parameters())
    names = [name for name, _ in model.named_parameters()]
    # safetensors' own writer (v1 only) reports the OS error as a SafetensorError.
    with limit_own_file_size(100_000), pytest.raises(SafetensorError, match="File too large"):
        save_checkpoint(tmp_path, 1, model, optimizer, names, {"consumed_samples": 0})
    assert list(tmp_path.iterdir()) == []
    assert latest_checkpoint(tmp_path) is None


def test_a_failed_save_to_an_object_store_leaves_no_objects(
    s3_bucket: str, s3_endpoint: dict
) -> None:
    import s3fs

    root = f"{s3_bucket}/run/checkpoints"
    # Rank 1 of two never wrote its part: the commit fails after rank 0's files are up.
    snapshot = Snapshot(
        root=root, step=3, rank=0, world=2, state={"step": 3}, layout={}, keep_last=1,
        files={"model-r00000.safetensors": {"w": torch.ones(8)}},
        tensors={"w": {"shape": [16], "dtype": "float32", "shards": []}},
    )  # fmt: skip
    checkpointer = Checkpointer(storage_options=s3_endpoint)
    checkpointer.save(snapshot, background=True)
    with pytest.raises(CheckpointError, match="writing a checkpoint failed: .*rank-00001.json"):
        checkpointer.wait()
    store = s3fs.S3FileSystem(**s3_endpoint)
    store.invalidate_cache()
    assert store.find(root) == []


def test_export_past_a_file_size_limit_names_the_file_and_leaves_no_folder(
    shards: Path, tmp_path: Path
) -> None:
    run = fit_one_process(tiny_settings(shards, {"training.train_iters": 1}), tmp_path / "run")
    export = tmp_path / "hf"
    line = one_error_line(run_limited(["export", "hf", str(run / "model"), str(export)], 100_000))
    assert line == f"error: {export}/model.safetensors: File too large (EFBIG)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no temp folder either


def test_metrics_on_a_full_disk_name_the_file_and_the_cause(tmp_path: Path) -> None:
    metrics = MetricsFile("/dev/full")  # every write: ENOSPC
    with pytest.raises(OSError) as caught:
        metrics.write({"step": 1, "loss": 2.0})
    with contextlib.suppress(OSError):  # the line is still buffered: closing fails too
        metrics.close()
    assert storage_error_message(caught.value) == "/dev/full: No space left on device (ENOSPC)"


# --- MLflow outage ------------------------------------------------------------------------

# On the training process's path: before launching the step after STEP, when
# GATES/pause-STEP exists, touch GATES/at-STEP and wait for GATES/go-STEP. The test
# moves the MLflow server between those points.
SITECUSTOMIZE = """
import os
import pathlib
import time

if os.environ.get("MEGALITH_TEST_GATES"):
    import training.trainer as trainer

    gates = pathlib.Path(os.environ["MEGALITH_TEST_GATES"])
    launch_step = trainer.Trainer.launch_step

    def gated_step(self, batches):
        if (gates / f"pause-{self.step}").exists():
            (gates / f"at-{self.step}").touch()
            while not (gates / f"go-{self.step}").exists():
                time.sleep(0.05)
        return launch_step(self, batches)

    trainer.Trainer.launch_step = gated_step
"""
OUTAGE_STEPS = 8


class MLflowServer:
    """A real ``mlflow server`` on a fixed port and SQLite store, to kill and restart."""

    def __init__(self, root: Path):
        from training.mlflow_store.runs import ensure_tracking_store

        store = f"sqlite:///{root / 'mlflow.db'}"
        ensure_tracking_store(store)  # migrated once, before the server's workers start
        self.url = f"http://127.0.0.1:{free_port()}"
        port = self.url.rpartition(":")[2]
        self.command = [
            sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", port,
            "--workers", "1", "--backend-store-uri", store,
            "--artifacts-destination", str(root / "artifacts"),
        ]  # fmt: skip
        self.env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.env.pop("MLFLOW_TRACKING_URI", None)
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            self.command, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        wait_until(lambda: answers(f"{self.url}/health"), "mlflow server answering")

    def kill(self) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            self.process = None


def wait_until(condition, what: str, timeout_s: float = HANG_GUARD_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def killable_mlflow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MLflowServer]:
    """One server for the outage tests (each starts it again if an earlier one left it dead)."""
    server = MLflowServer(tmp_path_factory.mktemp("mlflow-outage"))
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def outage(killable_mlflow: MLflowServer, tmp_path: Path) -> tuple[MLflowServer, Path, Path]:
    """The running MLflow server, a gates folder and the sitecustomize folder."""
    if killable_mlflow.process is None:
        killable_mlflow.start()
    (tmp_path / "gates").mkdir()
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return killable_mlflow, tmp_path / "gates", tmp_path / "inject"


def start_tracked_training(
    shards: Path, output: Path, server: MLflowServer, gates: Path, inject: Path
) -> tuple[subprocess.Popen, Path]:
    settings = {"training.train_iters": OUTAGE_STEPS, "logging.mlflow": "true"}
    log = output.parent / "train.log"
    env = child_env(
        MLFLOW_TRACKING_URI=server.url,
        MEGALITH_TEST_GATES=str(gates),
        PYTHONPATH=f"{inject}:{Path(__file__).resolve().parents[1]}",
    )
    with log.open("w") as sink:
        process = subprocess.Popen(
            megalith(*train_args(shards, output, settings), "--quiet"),
            env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    return process, log


def pass_gate(gates: Path, step: int) -> None:
    wait_until(lambda: (gates / f"at-{step}").exists(), f"training to reach step {step}")


@pytest.mark.slow
def test_mlflow_server_down_mid_run_gets_every_metric_when_it_returns(
    outage: tuple[MLflowServer, Path, Path], shards: Path, tmp_path: Path
) -> None:
    from mlflow import MlflowClient

    server, gates, inject = outage
    for step in (3, 6):
        (gates / f"pause-{step}").touch()
    output = tmp_path / "run"
    process, log = start_tracked_training(shards, output, server, gates, inject)
    try:
        pass_gate(gates, 3)
        server.kill()
        (gates / "go-3").touch()  # steps 4-6 train with the server down
        pass_gate(gates, 6)
        wait_until(lambda: "training continues, keeping up to" in log.read_text(), "the warning")
        server.start()  # same port, same store
        (gates / "go-6").touch()
        assert process.wait(timeout=HANG_GUARD_S) == 0, log.read_text()[-3000:]
    finally:
        stop_group(process, grace_s=5)
    text = log.read_text()
    assert "Traceback" not in text
    assert text.count("MLflow tracking to") == 2, text  # gone once, back once
    assert "answers again after" in text
    run_id = json.loads((output / "result.json").read_text())["mlflow_run_id"]
    client = MlflowClient(tracking_uri=server.url)
    steps = sorted(m.step for m in client.get_metric_history(run_id, "loss"))
    assert steps == list(range(1, OUTAGE_STEPS + 1))
    assert client.get_run(run_id).info.status == "FINISHED"


def test_mlflow_server_still_down_at_the_end_is_named_in_one_warning(
    outage: tuple[MLflowServer, Path, Path], shards: Path, tmp_path: Path
) -> None:
    server, gates, inject = outage
    (gates / "pause-3").touch()
    output = tmp_path / "run"
    process, log = start_tracked_training(shards, output, server, gates, inject)
    try:
        pass_gate(gates, 3)
        server.kill()
        (gates / "go-3").touch()
        assert process.wait(timeout=HANG_GUARD_S) == 0, log.read_text()[-3000:]
    finally:
        stop_group(process, grace_s=5)
    text = log.read_text()
    assert "Traceback" not in text
    run_id = json.loads((output / "result.json").read_text())["mlflow_run_id"]
    ended = [line for line in text.splitlines() if "was not ended" in line]
    assert len(ended) == 1 and f"MLflow run {run_id} at {server.url}" in ended[0], text
    assert "stays RUNNING there until the next run in its folder ends it" in ended[0]
    left = json.loads((output / OPEN_RUN_FILE).read_text())
    assert (left["run_id"], left["status"]) == (run_id, "FINISHED")  # for the next run
    metrics = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, OUTAGE_STEPS + 1))


# --- the lock file as a reader --------------------------------------------------------------


def write_holder(folder: Path, pid: int, host: str) -> None:
    holder = {"pid": pid, "host": host, "started": "2026-01-01T00:00:00Z",
              "process_start": "1", "boot_id": ""}  # fmt: skip
    (folder / LOCK_NAME).write_text(json.dumps(holder))


def test_a_lock_left_by_another_host_is_never_taken_over(tmp_path: Path) -> None:
    write_holder(tmp_path, 4242, "elsewhere")
    with pytest.raises(MegalithError) as refused:
        RunLock(tmp_path).acquire()
    assert str(refused.value) == (
        f"{tmp_path} is locked by a run on another host (pid 4242 on host elsewhere, started "
        f"2026-01-01T00:00:00Z); if that run is over, delete {tmp_path / LOCK_NAME}"
    )


def test_a_lock_file_that_is_a_link_or_a_pipe_is_refused(tmp_path: Path) -> None:
    (tmp_path / "link" / LOCK_NAME).parent.mkdir()
    (tmp_path / "link" / LOCK_NAME).symlink_to("/dev/zero")
    (tmp_path / "pipe").mkdir()
    os.mkfifo(tmp_path / "pipe" / LOCK_NAME)
    for folder in ("link", "pipe"):
        with pytest.raises(MegalithError, match="is not a regular file"):
            RunLock(tmp_path / folder).acquire()


def test_a_lock_left_by_a_dead_process_of_this_host_is_taken_over(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    write_holder(tmp_path, int(dead.stdout), os.uname().nodename)
    lock = RunLock(tmp_path)
    assert lock.acquire().pid == os.getpid()
    lock.release()


HOLDER_KEYS = ("pid", "host", "started", "process_start", "boot_id")
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=10,
)
holder_like = st.fixed_dictionaries({}, optional={key: json_values for key in HOLDER_KEYS})


@settings(max_examples=150, deadline=None)
@given(
    content=st.binary(max_size=5000)
    | holder_like.map(lambda d: json.dumps(d).encode())
    | st.integers(min_value=0, max_value=2**40).map(
        lambda pid: json.dumps(
            {
                "pid": pid,
                "host": os.uname().nodename,
                "started": "",
                "process_start": "",
                "boot_id": "",
            }
        ).encode()  # fmt: skip
    )
)
def test_any_lock_file_content_is_taken_over_or_refused_cleanly(content: bytes) -> None:
    """Whatever a crash or a person left in the lock file: the run takes the lock or is
    refused with a MegalithError, nothing else."""
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / LOCK_NAME).write_bytes(content)
        lock = RunLock(folder)
        try:
            holder = lock.acquire()
        except MegalithError:
            return
        try:
            assert holder.pid == os.getpid()
            written = json.loads((Path(folder) / LOCK_NAME).read_text())
            assert written["pid"] == os.getpid()
        finally:
            lock.release()
