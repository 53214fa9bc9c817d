"""Server processes the tests start on 127.0.0.1 (mlflow, prefect, mlflow models serve)."""

from __future__ import annotations

import contextlib
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
) -> Iterator[subprocess.Popen]:
    """A server process started for a test, stopped after it; with ``ready_url``, yielded
    once that URL answers 200 (a process that exits first fails with its stderr)."""
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
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
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False
