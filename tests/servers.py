"""Processes the tests start: servers on 127.0.0.1 (mlflow, prefect, mlflow models
serve) and process trees (torchrun and its workers). Each runs in its own session and
is stopped as a whole group, so a hung or failed test never leaves workers behind to
slow the tests after it."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_process(
    command: list[str],
    env: dict[str, str],
    what: str,
    ready_url: str | None = None,
    timeout_s: float = 120,
    **popen: object,
) -> Iterator[subprocess.Popen]:
    """A server process started for a test, stopped after it; with ``ready_url``, yielded
    once that URL answers 200 (a process that exits first fails with its stderr)."""
    process = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        **popen,
    )
    try:
        if ready_url:
            deadline = time.monotonic() + timeout_s
            while not _answers(ready_url):
                if process.poll() is not None:
                    raise AssertionError(f"{what} exited: {process.stderr.read().decode()[-3000:]}")
                assert time.monotonic() < deadline, (
                    f"{what} did not answer {ready_url} in {timeout_s} s"
                )
                time.sleep(0.5)
        yield process
    finally:
        stop_group(process)


def stop_group(process: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM to the process's whole group, then SIGKILL after ``grace_s``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def run_group(
    command: list[str], env: dict[str, str], timeout_s: float, **popen: object
) -> subprocess.CompletedProcess:
    """``subprocess.run(capture_output=True, text=True)`` in a new session; a timeout kills
    the whole tree (torchrun's workers included) before it raises."""
    process = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **popen,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_group(process, grace_s=5)
        stdout, stderr = process.communicate()
        raise AssertionError(
            f"{command[:6]} still running after {timeout_s} s; killed.\n"
            f"{(stdout or '')[-3000:]}\n{(stderr or '')[-3000:]}"
        ) from None
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False
