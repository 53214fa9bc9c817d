"""Stops process groups once the process that started them is gone, however it went.

``megalith ui`` runs each server in a process group of its own (stopping the group stops
the server's workers too) and starts this watchdog with a pipe on its stdin, over which
it sends each group's id, one a line. When ``megalith ui`` exits the kernel closes the
pipe, even on SIGKILL, which nobody can catch, and the watchdog reads the end of it.
Unless the last line was ``done`` (an orderly exit that stopped the groups itself), it
stops every group it was told about: SIGTERM, then SIGKILL to what is left ``GRACE_S``
later.

A pipe rather than ``PR_SET_PDEATHSIG`` (``training.runtime.launch.die_with_parent``): the
kernel's signal reaches one process, a server's leader, never the workers it started
(mlflow's uvicorn), so something that outlives ``megalith ui`` has to stop the whole
group; and a pipe's end is seen on every system, not only Linux.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

DONE = "done"
GRACE_S = 10.0


def signal_group(group: int, signum: int) -> None:
    """``signum`` to every process of ``group``; nothing when the group is gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signum)


def stop_groups(groups: list[int], grace_s: float = GRACE_S) -> None:
    """SIGTERM to each group, SIGKILL to whatever of them is left ``grace_s`` later.
    The groups are not this process's children: it polls for them instead of waiting."""
    for group in groups:
        signal_group(group, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(_exists(group) for group in groups) and time.monotonic() < deadline:
        time.sleep(0.1)
    for group in groups:
        signal_group(group, signal.SIGKILL)


def _exists(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def main() -> int:
    groups: list[int] = []
    for line in sys.stdin:
        if line.strip() == DONE:
            return 0
        groups.append(int(line))
    stop_groups(groups)
    return 0


if __name__ == "__main__":
    sys.exit(main())
