"""Asynchronous checkpoint saves: the training loop waits only for the copy to host memory.

:class:`Checkpointer` takes a :class:`~training.checkpoint.sharded_writer.Snapshot` in the
caller's thread (this rank's boxes copied to host memory, pinned buffers reused on
CUDA), then a background thread writes the rank's files and, after a barrier, rank 0
commits the checkpoint (index.json last, then latest.json). The barriers run on a
dedicated gloo group made once at trainer start (:func:`checkpoint_group`), never on
the training process group, which the training thread keeps using meanwhile. At most
one save is in flight: the next save, :meth:`Checkpointer.wait` and the end of
training wait for it; an error in the thread is raised there.

A kill at any moment leaves the previous checkpoint complete: the new one has no
index.json yet (object stores) or is still ``step-X.tmp`` (local disk); the next save
removes it. A save that fails (a full disk, a quota, a file-size limit) removes it at
once, on the failing rank.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megalith.errors import storage_error_message
from megalith.storage import is_local
from training.checkpoint.format import CheckpointError
from training.checkpoint.sharded_files import checkpoint_url, discard_staging, remove_tree
from training.checkpoint.sharded_writer import (
    HostBuffers,
    SaveRequest,
    Snapshot,
    commit,
    staging_url,
    take_snapshot,
    write_rank_files,
)

logger = logging.getLogger(__name__)

# Test-only: seconds the writer sleeps after writing its files, before the commit, so a
# test can kill a run in the middle of a save. Never set outside tests.
TEST_WRITE_DELAY_ENV = "MEGALITH_TEST_CHECKPOINT_WRITE_DELAY_S"


def checkpoint_group() -> dist.ProcessGroup | None:
    """A gloo group for the writer thread's barriers, made once per process (collective
    the first time: every rank builds its trainer at the same point)."""
    global _GROUP
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    default = dist.distributed_c10d._get_default_group()
    if _GROUP is None or _GROUP[0] is not default:
        _GROUP = (default, dist.new_group(backend="gloo"))
    return _GROUP[1]


_GROUP: tuple[Any, Any] | None = None


@dataclass
class Checkpointer:
    """Saves sharded checkpoints, in a background thread when ``background``; at most one
    save is in flight (a new save, :meth:`wait` and the end of training wait for it)."""

    group: dist.ProcessGroup | None = None
    storage_options: dict[str, Any] | None = None
    buffers: HostBuffers = field(default_factory=HostBuffers)
    timings: dict[str, float] = field(default_factory=dict)  # for the next metrics record
    _thread: threading.Thread | None = None
    _error: BaseException | None = None

    def save(self, what: SaveRequest | Snapshot, background: bool) -> str:
        """Wait for the previous save (its host buffers are reused), snapshot a training
        state (or take a snapshot made elsewhere, e.g. a conversion), write it now or in
        the background. Returns the URL the checkpoint will have."""
        self.wait()
        snapshot = take_snapshot(what, self.buffers) if isinstance(what, SaveRequest) else what
        self.timings["checkpoint_blocked_s"] = snapshot.blocked_s
        if background:
            self._thread = threading.Thread(
                target=self._run, args=(snapshot,), name="checkpoint-writer", daemon=True
            )
            self._thread.start()
        else:
            self._run(snapshot)
            self._raise()
        return checkpoint_url(snapshot.root, snapshot.step)

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            cause = storage_error_message(error) if isinstance(error, OSError) else None
            raise CheckpointError(f"writing a checkpoint failed: {cause or error}") from error

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def _run(self, snapshot: Snapshot) -> None:
        staging = staging_url(snapshot.root, snapshot.step)
        try:
            started = time.perf_counter()
            if snapshot.rank == 0:
                remove_tree(staging, self.storage_options)
                if is_local(staging):
                    Path(staging.removeprefix("file://")).mkdir(parents=True)
            self._barrier()
            write_rank_files(snapshot, staging, self.storage_options)
            delay = float(os.environ.get(TEST_WRITE_DELAY_ENV, "0"))
            if delay:
                time.sleep(delay)
            self._barrier()
            if snapshot.rank == 0:
                commit(snapshot, staging, self.storage_options)
            self._barrier()
            written = time.perf_counter() - started
            self.timings["checkpoint_write_s"] = written
            if snapshot.rank == 0:
                logger.info(
                    "checkpoint step %d: training blocked %.3f s, written in %.3f s",
                    snapshot.step, snapshot.blocked_s, written,
                )  # fmt: skip
        except BaseException as error:  # re-raised in the training thread by wait()
            self._error = error
            # Any failing rank: the others may be stuck at a barrier until the launcher
            # stops them, and a full disk should not wait for the next save to empty.
            discard_staging(staging, self.storage_options)

    def pop_timings(self) -> dict[str, float]:
        """``checkpoint_blocked_s`` of the last save and, once written,
        ``checkpoint_write_s``: reported with the next step's metrics."""
        timings, self.timings = self.timings, {}
        return timings
