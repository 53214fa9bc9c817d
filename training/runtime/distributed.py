"""torch.distributed from torchrun's environment: init, device per local rank, teardown.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT for every worker. Without them (a plain ``python`` or ``megalith train``
without ``--nproc-per-node``) everything runs in one process and torch.distributed is
never initialised.

Every collective has a timeout (``MEGALITH_DIST_TIMEOUT_S``, default 600 s) so that a
rank that died or hangs fails the job instead of leaving the others waiting forever. A
rank whose collective fails that way (a peer's process or node died, was stopped, or did
not answer in time) says so in one line, not a transport traceback (``lost_peer``).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import traceback
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megalith.errors import MegalithError, storage_error_message
from training.runtime.device import resolve_device
from training.runtime.launch import DEFAULT_TIMEOUT_S, TIMEOUT_ENV

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistributedEnv:
    """This process's place in the job, as torchrun describes it."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_from_torchrun(environ: Mapping[str, str] | None = None) -> DistributedEnv:
    """Read torchrun's variables; the single-process default when they are absent."""
    environ = os.environ if environ is None else environ
    if "WORLD_SIZE" not in environ:
        return DistributedEnv()
    try:
        world = int(environ["WORLD_SIZE"])
        env = DistributedEnv(
            rank=int(environ["RANK"]),
            world_size=world,
            local_rank=int(environ.get("LOCAL_RANK", "0")),
            local_world_size=int(environ.get("LOCAL_WORLD_SIZE", str(world))),
        )
    except (KeyError, ValueError) as error:
        raise MegalithError(
            f"torchrun environment is incomplete or malformed ({error}): RANK and WORLD_SIZE "
            "must be integers"
        ) from error
    if not 0 <= env.rank < env.world_size:
        raise MegalithError(f"RANK {env.rank} is outside WORLD_SIZE {env.world_size}")
    return env


def timeout_s(environ: Mapping[str, str] | None = None) -> float:
    environ = os.environ if environ is None else environ
    value = environ.get(TIMEOUT_ENV)
    try:
        seconds = float(value) if value else DEFAULT_TIMEOUT_S
    except ValueError as error:
        raise MegalithError(f"{TIMEOUT_ENV}={value!r} is not a number of seconds") from error
    if seconds <= 0:
        raise MegalithError(f"{TIMEOUT_ENV} must be positive, got {seconds}")
    return seconds


def local_device(env: DistributedEnv, name: str = "auto") -> torch.device:
    """``cuda:LOCAL_RANK`` when training on CUDA, else the CPU."""
    device = resolve_device(name)
    if device.type != "cuda":
        return device
    if env.local_rank >= torch.cuda.device_count():
        raise MegalithError(
            f"LOCAL_RANK {env.local_rank} has no GPU: this node has {torch.cuda.device_count()} "
            "(--nproc-per-node must not exceed the GPUs per node)"
        )
    return torch.device("cuda", env.local_rank)


def init_distributed(device_name: str = "auto") -> tuple[DistributedEnv, torch.device]:
    """Join the job's process group (NCCL on CUDA, else gloo); a no-op in one process."""
    env = env_from_torchrun()
    device = local_device(env, device_name)
    if env.world_size == 1 and "MASTER_ADDR" not in os.environ:
        return env, device
    if dist.is_initialized():
        return env, device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s())
    dist.init_process_group(
        backend=backend, timeout=timeout, device_id=device if device.type == "cuda" else None
    )
    # A group made without a timeout gets torch's default (30 min on gloo, 10 on NCCL), not
    # the world's: the device mesh's TP/CP/DP/PP groups, the checkpoint barriers' group. A
    # node that hangs or drops off the network (no connection reset) kept the others
    # waiting that long; the default is now ours, so it bounds their collectives too.
    dist.distributed_c10d.default_pg_timeout = timeout
    dist.distributed_c10d.default_pg_nccl_timeout = timeout
    logger.debug("rank %d/%d joined (%s on %s)", env.rank, env.world_size, backend, device)
    return env, device


def teardown() -> None:
    """Leave the process group; safe to call when none was joined."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def distributed(device_name: str = "auto") -> Iterator[tuple[DistributedEnv, torch.device]]:
    """``init_distributed`` for the duration of a block, torn down however it ends.

    A rank whose block raises while its peers still run prints the traceback and exits
    at once: tearing down a process group with transfers still queued (NCCL) can wait
    forever, and a prompt non-zero exit lets torchrun stop the other ranks."""
    try:
        yield init_distributed(device_name)
    except Exception as error:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            _report(error)
            print(f"rank {dist.get_rank()} failed; exiting without waiting for its peers",
                  file=sys.stderr, flush=True)  # fmt: skip
            os._exit(1)
        raise
    finally:
        teardown()


def _report(error: Exception) -> None:
    """One line for an error the user can act on (as ``megalith`` prints it), else the
    traceback."""
    message = str(error) if isinstance(error, MegalithError | FileNotFoundError) else None
    if isinstance(error, OSError) and message is None:
        message = storage_error_message(error)
    if (cause := lost_peer(error)) is not None:
        message = (
            f"rank {dist.get_rank()} lost its peers ({cause}): a rank or a node of this job "
            f"died, was stopped, or did not answer within {TIMEOUT_ENV}={timeout_s():g} s. "
            "Relaunch every node with --resume to continue from the last committed checkpoint"
        )
    if message is None:
        traceback.print_exc()
    else:
        print(f"error: {message}", file=sys.stderr, flush=True)


# What the transport says, without gloo's source location and its advice to read the
# remote worker's log (the line above does that).
_GLOO_LOCATION = re.compile(r"^\[[^\]]*gloo/transport[^\]]*\]\s*")
_GLOO_ADVICE = re.compile(r"\.?\s*This is typically caused by.*$")


def lost_peer(error: BaseException) -> str | None:
    """The transport's own words when ``error``, or an error it was raised from (a
    checkpoint barrier's, re-raised by the save), is a collective that failed on its
    peers (connection closed or reset, a timeout): any ``torch.distributed.DistError``,
    and the plain RuntimeError gloo raises through autograd. None for anything else."""
    chain = [error]
    while chain[-1].__cause__ is not None:
        chain.append(chain[-1].__cause__)
    for cause in reversed(chain):  # the transport's error itself, not a wrapper's message
        text = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        if isinstance(cause, dist.DistError) or "gloo/transport" in text:
            return _GLOO_ADVICE.sub("", _GLOO_LOCATION.sub("", text)) or type(cause).__name__
    return None
