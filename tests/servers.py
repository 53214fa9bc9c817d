"""Processes the tests start: servers on 127.0.0.1 (mlflow, prefect, mlflow models
serve) and process trees (torchrun and its workers). Each runs in its own session and
is stopped as a whole group, so a hung or failed test never leaves workers behind to
slow the tests after it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Below Linux's ephemeral range (32768-60999): a port handed out by bind(0) is free now but
# can be given to any process's next outgoing connection or bind(0) before the server
# binds it (a CI run lost `megalith ui`'s Prefect port that way); ports from here are
# taken only by whoever asks for them by number.
_PORTS = range(20000, 32000)


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now, outside the ephemeral range."""
    for port in random.Random().sample(_PORTS, 50):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
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
    log: Path | None = None,
    **popen: object,
) -> Iterator[subprocess.Popen]:
    """A server process started for a test, stopped after it; with ``ready_url``, yielded
    once that URL answers 200 (a process that exits first fails with its stderr). With
    ``log``, its stdout and stderr both go to that file (a test can read what it said)."""
    output = log.open("ab") if log else None
    process = subprocess.Popen(
        command,
        env=env,
        stdout=output or subprocess.DEVNULL,
        stderr=output or subprocess.PIPE,
        start_new_session=True,
        **popen,
    )
    try:
        if ready_url:
            deadline = time.monotonic() + timeout_s
            while not answers(ready_url):
                if process.poll() is not None:
                    said = log.read_bytes() if log else process.stderr.read()
                    raise AssertionError(f"{what} exited: {said.decode()[-3000:]}")
                assert time.monotonic() < deadline, (
                    f"{what} did not answer {ready_url} in {timeout_s} s"
                )
                time.sleep(0.5)
        yield process
    finally:
        stop_group(process)
        if output:
            output.close()


@contextlib.contextmanager
def prefect_server(
    home: Path, log: Path | None = None, settings: dict[str, str] | None = None
) -> Iterator[dict[str, str]]:
    """A real ``prefect server start`` on a free 127.0.0.1 port with its own database in
    ``home``; yields the environment that points Prefect clients (and its UI) at it."""
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")},
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": api,
        "PREFECT_UI_API_URL": api,  # the UI asks this address, not the default :4200
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        **(settings or {}),
    }
    command = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
               "--port", str(port)]  # fmt: skip
    with running_process(command, env, "prefect server", f"{api}/health", log=log):
        yield env


def prefect_post(api: str, path: str, body: dict | None = None) -> list | dict:
    """POST a JSON body to the Prefect API (e.g. ``/flow_runs/filter``); its JSON answer.

    A 503 is retried for up to 30 s: the Prefect server answers it while its SQLite
    database is busy (seen once in CI on a loaded 2-core machine), as its own client
    retries it."""
    request = urllib.request.Request(
        f"{api}{path}",
        data=json.dumps(body or {}).encode(),
        headers={"Content-Type": "application/json"},
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            if error.code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(1)


def wait_for_deployments(api: str, server: subprocess.Popen, count: int) -> list[dict]:
    """The deployments once ``count`` are registered (``server``: the serving process,
    which must not exit meanwhile)."""
    deadline = time.monotonic() + 120
    while len(found := prefect_post(api, "/deployments/filter")) < count:
        if server.poll() is not None:
            said = server.stderr.read().decode()[-3000:] if server.stderr else ""
            raise AssertionError(f"serve-pipelines exited: {said}")
        assert time.monotonic() < deadline, f"{len(found)} of {count} deployments after 120 s"
        time.sleep(1)
    return found


def flow_run_logs(flow_run_id) -> list[str]:
    """The messages a flow run logged to the Prefect API, in time order."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=30)  # the run's logs reach the API in batches

    async def read() -> list[str]:
        async with get_client() as client:
            logs = await client.read_logs(
                LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
            )
        return [log.message for log in sorted(logs, key=lambda log: log.timestamp)]

    return asyncio.run(read())


def run_and_cancel(flow: Any, parameters: dict, entrypoint: str, ready: Callable[[], bool]) -> Any:
    """Run a run of ``flow`` as a deployment's runner does (Prefect's ``Runner``, the flow
    in a process of its own; ``entrypoint``: ``path/to/file.py:function``) and cancel it
    as the UI does (the run set to Cancelling) once ``ready()`` is true; the flow run as
    it ended. The runner stops the process, which Prefect raises in the flow as
    ``TerminationSignal``. 120 s of waiting for ``ready`` is a hang guard only."""
    from prefect.client.orchestration import get_client
    from prefect.runner import Runner
    from prefect.states import Cancelling

    root = Path(__file__).resolve().parents[1]

    async def run() -> Any:
        async with get_client() as client:
            flow_run = await client.create_flow_run(flow, parameters=parameters)

            async def cancel_when_ready() -> None:
                deadline = time.monotonic() + 120
                while not ready() and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                await client.set_flow_run_state(flow_run.id, Cancelling(), force=True)

            canceller = asyncio.create_task(cancel_when_ready())
            await Runner().execute_flow_run(
                flow_run.id, entrypoint=entrypoint, env={"PYTHONPATH": str(root)}, cwd=str(root)
            )
            await canceller
            return await client.read_flow_run(flow_run.id)

    return asyncio.run(run())


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


def answers(url: str) -> bool:
    """Whether ``url`` answers 200 within 2 s."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


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


def cmdline(pid: int) -> bytes:
    """A process's arguments, NUL-separated; empty once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
