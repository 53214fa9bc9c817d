"""Launching training on many processes: torchrun for one or more nodes, Slurm scripts.

``megalith train --nproc-per-node N`` re-runs itself as ``python -m training.runtime.launch
... -m pipelines.cli train ...`` (torchrun, see below); each worker then sees torchrun's
RANK/WORLD_SIZE and joins the job (``training.runtime.distributed``). torchrun stops every
worker as soon as one fails, and exits non-zero. Commands are argument lists, never
shell strings.

Nothing outlives its launcher. torchrun starts each worker in a session of its own, so
killing the launcher's process group (or SIGKILL, which nobody can catch) used to leave
the workers training as orphans beside a retry. Now every hop dies with its parent:
the launcher passes its pid in ``PARENT_PID_ENV``; the child (torchrun, run in-process
by this module's ``__main__``, and each worker, in ``megalith train``) asks the kernel
for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``) and exits at once if the parent
is already gone. Linux only; elsewhere the old behaviour stays. SIGTERM is the orderly
stop: the launcher passes it to torchrun, which passes it to the workers, which unwind
(``unwinding_on_sigterm``). docs/faults.md has the whole picture.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from megalith.config import MegalithConfig
from megalith.errors import MegalithError

DEFAULT_RDZV_PORT = 29500
TIMEOUT_ENV = "MEGALITH_DIST_TIMEOUT_S"  # seconds before a stuck collective fails the job
DEFAULT_TIMEOUT_S = 600.0
PARENT_PID_ENV = "MEGALITH_PARENT_PID"  # the process this one must not outlive
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass(frozen=True)
class LaunchSpec:
    """Where the workers run: processes per node, nodes, and how they meet."""

    nproc_per_node: int
    nnodes: int = 1
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str = "megalith"
    local_addr: str | None = None  # the address other nodes reach this one at

    def check(self) -> None:
        if self.nproc_per_node < 1:
            raise MegalithError(f"--nproc-per-node must be at least 1, got {self.nproc_per_node}")
        if self.nnodes < 1:
            raise MegalithError(f"--nnodes must be at least 1, got {self.nnodes}")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise MegalithError(
                f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT (the first node's address)"
            )
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise MegalithError(f"--node-rank {self.node_rank} is outside --nnodes {self.nnodes}")


def torchrun_command(spec: LaunchSpec, module_args: Sequence[str]) -> list[str]:
    """torchrun (through this module, so it dies with us) with the rendezvous flags, then
    ``-m`` module args.

    One node without an endpoint uses ``--standalone`` (a private rendezvous on a free
    port, so concurrent jobs never collide). Nodes that know their rank meet at a static
    rendezvous hosted by node 0 at the endpoint: node R's workers are ranks R·N .. R·N+N-1,
    so rank 0 (progress lines, files, MLflow) is on node 0, whose launcher's output a
    Prefect flow streams. (c10d would order the nodes by host name and process id, and
    ignore ``--node-rank``.) Nodes that do not (an srun task) meet through c10d there.
    """
    spec.check()
    command = [sys.executable, "-m", "training.runtime.launch"]
    if spec.nnodes == 1 and not spec.rdzv_endpoint:
        command.append("--standalone")
    elif spec.node_rank is None:
        command += [
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", spec.rdzv_endpoint or "",
            "--rdzv-id", spec.rdzv_id,
        ]  # fmt: skip
    else:
        command += [
            "--rdzv-backend", "static",
            "--rdzv-endpoint", spec.rdzv_endpoint or "",
            "--node-rank", str(spec.node_rank),
        ]  # fmt: skip
    if spec.local_addr:
        command += ["--local-addr", spec.local_addr]
    command += [
        "--nnodes", str(spec.nnodes),
        "--nproc-per-node", str(spec.nproc_per_node),
        "--max-restarts", "0",  # a failed rank fails the job; resume is a new launch
        "-m", *module_args,
    ]  # fmt: skip
    return command


def comm_overlap_env(config: MegalithConfig) -> dict[str, str]:
    """What a training process needs in its environment before CUDA starts for
    ``parallel.tp_comm_overlap``: one CUDA work queue, so that each TP collective is
    queued ahead of the GEMM it overlaps (Transformer Engine's requirement), and TE's
    userbuffers mapped through CUDA IPC, never NVLink multicast (``UB_SKIPMC``)."""
    if not config.parallel.tp_comm_overlap:
        return {}
    return {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "UB_SKIPMC": "1"}


def worker_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Unbuffered workers, so each log line reaches a pipe (Prefect) as it is written;
    and this process named as the parent they die with."""
    env = dict(os.environ if environ is None else environ)
    env["PYTHONUNBUFFERED"] = "1"
    env[PARENT_PID_ENV] = str(os.getpid())
    return env


def run_torchrun(command: list[str], extra_env: Mapping[str, str] | None = None) -> int:
    """Run torchrun in this process group (a cancelled parent takes it down) and wait.

    A SIGTERM sent to this process alone is passed on, so torchrun stops its workers
    the orderly way (they close their records) instead of dying with us."""
    env = {**worker_env(), **(extra_env or {})}
    terminated: list[int] = []

    def forward(signum: int, frame: object) -> None:
        terminated.append(signum)
        process.send_signal(signum)

    with subprocess.Popen(command, env=env) as process:
        previous = signal.signal(signal.SIGTERM, forward)
        try:
            try:
                returncode = process.wait()
            except KeyboardInterrupt:  # torchrun had the Ctrl-C too: let it stop its workers
                returncode = process.wait()
        finally:
            signal.signal(signal.SIGTERM, previous)
    if terminated:
        raise Terminated
    return returncode


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the process is, so that it unwinds as on Ctrl-C."""


@contextmanager
def unwinding_on_sigterm() -> Iterator[None]:
    """Within the block SIGTERM (a cancelled flow, a scheduler's time limit, torchrun
    stopping its workers) raises ``Terminated``: the block unwinds, so its MLflow run is
    ended FAILED instead of staying RUNNING and its lock released. Then the process dies
    of SIGTERM after all, as whoever sent it expects (the pretrain task retries a
    training process killed by a signal)."""
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    except Terminated:
        print("terminated", file=sys.stderr, flush=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        os._exit(128 + signal.SIGTERM)  # not reached: the signal ends the process


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


def die_with_parent() -> None:
    """SIGKILL this process when the parent named in ``PARENT_PID_ENV`` dies.

    The kernel signals on the death of the parent *thread* that started this process, so
    a parent must wait for its child in the thread that started it (all ours do). Does
    nothing without the variable (a process the user started) or off Linux."""
    expected = os.environ.pop(PARENT_PID_ENV, "")  # not for this process's own children
    if not expected.isdigit() or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return
    if os.getppid() != int(expected):  # it died before the prctl: nobody will signal us
        os.kill(os.getpid(), signal.SIGKILL)


def _torchrun_main(argv: Sequence[str]) -> int:
    """torchrun in this process, after tying it to its parent and naming it the parent
    of its workers (it starts them itself, from its main thread). A failed job is one
    line per failed rank: the ranks printed their own errors, and torchrun's traceback
    of itself would bury them."""
    die_with_parent()
    os.environ[PARENT_PID_ENV] = str(os.getpid())
    # torch only here: `megalith train` imports this module before it needs torch.
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    sys.argv = ["torchrun", *argv]
    try:
        main()
    except ChildFailedError as failed:
        for rank, failure in sorted(failed.failures.items()):
            print(f"rank {rank} (pid {failure.pid}) {_how_it_ended(failure.exitcode)}",
                  file=sys.stderr)  # fmt: skip
        return 1
    except SignalException as stopped:  # it stopped its workers first
        print(f"torchrun stopped its workers on {stopped.sigval.name}", file=sys.stderr)
        return 128 + stopped.sigval
    return 0


def _how_it_ended(exitcode: int) -> str:
    if exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "WORLD_SIZE" in os.environ


# --- Slurm -------------------------------------------------------------------------------


def slurm_script(
    config: str,
    nodes: int,
    gpus_per_node: int,
    *,
    sets: Sequence[str] = (),
    output: str | None = None,
    job_name: str = "megalith",
    partition: str | None = None,
    time_limit: str | None = None,
    port: int = DEFAULT_RDZV_PORT,
    megalith: str = "megalith",
) -> str:
    """An sbatch script: one ``megalith train`` launcher per node (srun), each running
    ``gpus_per_node`` workers through torchrun, meeting at the first node."""
    if nodes < 1 or gpus_per_node < 1:
        raise MegalithError(f"--nodes ({nodes}) and --gpus-per-node ({gpus_per_node}) must be >= 1")
    header = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={gpus_per_node}",
        f"#SBATCH --cpus-per-task={8 * gpus_per_node}",
        "#SBATCH --output=%x-%j.out",
    ]
    if partition:
        header.append(f"#SBATCH --partition={partition}")
    if time_limit:
        header.append(f"#SBATCH --time={time_limit}")
    train = [megalith, "train", "--config", config]
    for setting in sets:
        train += ["--set", setting]
    if output:
        train += ["--output", output]
    train += [
        "--quiet", "--resume",
        "--nnodes", str(nodes), "--nproc-per-node", str(gpus_per_node),
    ]  # fmt: skip
    quoted = " ".join(shlex.quote(arg) for arg in train)
    body = [
        "set -euo pipefail",
        "",
        "# The first node of the allocation hosts the c10d rendezvous.",
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f'RDZV_ENDPOINT="$HEAD_NODE:{port}"',
        "",
        "# One launcher per node; each starts its GPUs' workers with torchrun. If any rank",
        "# fails, its node's torchrun exits non-zero and srun ends the job.",
        "srun --kill-on-bad-exit=1 \\",
        f"  {quoted} \\",
        '  --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$SLURM_JOB_ID"',
    ]
    return "\n".join(header + [""] + body) + "\n"


if __name__ == "__main__":
    sys.exit(_torchrun_main(sys.argv[1:]))
