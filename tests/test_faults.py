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
import os
import resource
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from parallel_helpers import RECIPE, child_env, megalith, set_args, tiny_settings
from servers import run_group, stop_group

from training.run_lock import LOCK_NAME

HANG_GUARD_S = 240
FOREVER = 1_000_000  # steps: a run that trains until it is killed


def train_args(shards: Path, output: Path, values: dict | None = None) -> list[str]:
    settings = tiny_settings(shards, {"training.eval_interval": 0, **(values or {})})
    return ["train", "--config", str(RECIPE), *set_args(settings), "--output", str(output)]


@contextlib.contextmanager
def training_forever(shards: Path, output: Path, *launch: str) -> Iterator[subprocess.Popen]:
    """``megalith train`` in its own session, yielded once it has written a step; stopped
    (its group, then any process it left) afterwards."""
    command = megalith(*train_args(shards, output, {"training.train_iters": FOREVER}), "--quiet")
    process = subprocess.Popen(
        [*command, *launch],
        env=child_env(),
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


def wait_for_a_step(process: subprocess.Popen, metrics: Path) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not (metrics.exists() and metrics.read_text().strip()):
        if process.poll() is not None:
            raise AssertionError(f"training exited early: {process.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, "no training step was written"
        time.sleep(0.2)


def descendants(pid: int) -> set[int]:
    """Every process below ``pid``, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                parent = int(stat.rpartition(")")[2].split()[1])
                children.setdefault(parent, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for its reaper."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


# --- processes --------------------------------------------------------------------------


def test_sigkill_of_the_launcher_stops_every_worker_and_frees_the_folder(
    shards: Path, tmp_path: Path
) -> None:
    output = tmp_path / "run"
    with training_forever(shards, output, "--nproc-per-node", "2") as launcher:
        tree = descendants(launcher.pid)
        workers = {pid for pid in tree if b"-u\x00-m\x00pipelines.cli" in _cmdline(pid)}
        assert len(workers) == 2, f"expected 2 workers under the launcher, found {tree}"
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in tree) and time.monotonic() < deadline:
            time.sleep(0.2)
        survivors = [pid for pid in tree if alive(pid)]
        for pid in survivors:  # leave nothing behind for the next test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        assert not survivors, f"still running 30 s after the launcher died: {survivors}"
    # The dead launcher's lock is stale: the next run into the folder takes it over.
    done = run_group(
        megalith(*train_args(shards, output, {"training.train_iters": 2}), "--quiet"),
        child_env(),
        HANG_GUARD_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trained 2 steps" in done.stdout
    assert (output / LOCK_NAME).read_text() == ""  # released when the run ended


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


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
