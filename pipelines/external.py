"""Running a cluster's command-line tools (sbatch, kubectl, ...): found on PATH or where
an environment variable points, run as argument lists with a time limit, and a missing
or silent tool reported in one line that says what to do; and the outcomes their job
states map to."""

from __future__ import annotations

import enum
import os
import shutil
import subprocess
from pathlib import Path

from megalith.errors import MegalithError


class Outcome(enum.Enum):
    """What a scheduler's job state means for whoever follows the job."""

    WAITING = "waiting"  # queued, held, requeued, suspended: not started (again) yet
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (Outcome.SUCCEEDED, Outcome.FAILED, Outcome.CANCELLED)


COMMAND_TIMEOUT_S = 60.0  # a controller or API server that does not answer in a minute is down


def find_command(name: str, folder_env: str, where: str) -> str:
    """``name``'s path: in the folder ``$folder_env`` names when set, else on PATH.
    ``where`` tells a user who lacks it where it is installed."""
    folder = os.environ.get(folder_env)
    found = shutil.which(name, path=folder) if folder else shutil.which(name)
    if found:
        return found
    searched = f"{folder_env}={folder}" if folder else "PATH"
    raise MegalithError(
        f"the command `{name}` was not found on {searched}: {where}, or set {folder_env} "
        f"to the folder that holds it"
    )


def run_command(
    command: list[str], cwd: Path | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            command, cwd=cwd, input=stdin, capture_output=True, text=True,
            timeout=COMMAND_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise MegalithError(
            f"`{' '.join(command)}` did not answer in {COMMAND_TIMEOUT_S:.0f} s: is the "
            "cluster reachable from here?"
        ) from None
