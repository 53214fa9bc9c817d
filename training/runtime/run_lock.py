"""One run at a time in a run folder: a lock file that names its holder.

``hold_run_folder(output)`` is held by whoever writes into the folder for the whole run:
the ``megalith train --nproc-per-node`` launcher on one node (its workers see
``HELD_ENV`` and take nothing), else rank 0. A second run into the same folder is
refused with the holder's pid, host and start time.

The lock is ``fcntl.flock`` on ``OUTPUT/.megalith-run.lock``, whose content (JSON)
describes the holder. The kernel drops a flock when its process dies however it dies,
so a crashed run's lock is free at once; its stale content is simply replaced. On a
filesystem whose flocks do not reach other hosts (some NFS and FUSE mounts), the content
is the second line of defence: a holder on another host is never taken over, since its
liveness cannot be checked from here; a holder on this host whose process is gone (pid
dead, or reused by another process since) is. The file is emptied, not deleted, on
release: deleting a locked file lets two runs lock two different files of one name.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from megalith.errors import MegalithError
from megalith.safe_read import UnsafeFileError, field, loads_json

log = logging.getLogger(__name__)

LOCK_NAME = ".megalith-run.lock"
HELD_ENV = "MEGALITH_RUN_LOCK_HELD"  # "PID:PATH": a parent process holds PATH's lock
MAX_LOCK_BYTES = 4096


class RunFolderLockedError(MegalithError):
    """Another run writes into this run folder."""


@dataclass(frozen=True)
class Holder:
    pid: int
    host: str
    started: str  # UTC, ISO 8601
    process_start: str  # the pid's start time since boot, so a reused pid is not taken for it
    boot_id: str

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}, started {self.started}"


_TEXT_FIELDS = ("host", "started", "process_start", "boot_id")


def this_process() -> Holder:
    pid = os.getpid()
    return Holder(
        pid=pid,
        host=socket.gethostname(),
        started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        process_start=_process_start(pid),
        boot_id=_boot_id(),
    )


def _proc_stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (state first); [] without it."""
    try:
        line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    return line.rpartition(")")[2].split()


def _process_start(pid: int) -> str:
    """Field 22 of /proc/PID/stat (start time in clock ticks); '' where there is no /proc."""
    fields = _proc_stat(pid)
    return fields[19] if len(fields) > 19 else ""


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def is_alive_here(holder: Holder) -> bool:
    """Whether ``holder`` (a process of this host) still runs: same boot, same pid start."""
    if holder.boot_id and holder.boot_id != _boot_id():
        return False
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    return not holder.process_start or holder.process_start == _process_start(holder.pid)


class RunLock:
    """The lock of one run folder; ``acquire`` raises ``RunFolderLockedError`` when held."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> Holder:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = self._open()
        try:
            flocked = self._flock(fd)
            previous = self._read(fd)
            if previous is not None:
                self._check_takeover(previous, flocked)
            me = this_process()
            _rewrite(fd, json.dumps(asdict(me)).encode())
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return me

    def _open(self) -> int:
        """The lock file, created if missing; a symlink or non-file there is refused."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise self._not_a_lock_file() from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise self._not_a_lock_file()
        return fd

    def _not_a_lock_file(self) -> RunFolderLockedError:
        return RunFolderLockedError(
            f"{self.path} is not a regular file (a link, pipe or device); expected the run "
            "folder's lock file: delete it"
        )

    def child_env(self) -> dict[str, str]:
        """The environment that tells this process's children the folder is theirs."""
        return {HELD_ENV: f"{os.getpid()}:{self.path.absolute()}"}

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)  # drops the flock

    def _flock(self, fd: int) -> bool:
        """True when flock holds; False where the filesystem has no flock (content only)."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._read(fd)
            who = holder.describe() if holder else "another process"
            raise RunFolderLockedError(
                f"{self.folder} is in use by another run ({who}); wait for it to end or "
                "choose another --output"
            ) from None
        except OSError as error:
            if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            log.warning("%s: no file locks on this filesystem; checking its holder only", self.path)
            return False
        return True

    def _read(self, fd: int) -> Holder | None:
        data = os.pread(fd, MAX_LOCK_BYTES + 1, 0)
        if not data.strip():
            return None
        try:
            if len(data) > MAX_LOCK_BYTES:
                raise UnsafeFileError(f"{self.path}: larger than {MAX_LOCK_BYTES} bytes")
            fields = loads_json(data, str(self.path))
            return Holder(
                pid=field(fields, "pid", int, str(self.path), minimum=1, maximum=2**31 - 1),
                **{key: field(fields, key, str, str(self.path)) for key in _TEXT_FIELDS},
            )
        except UnsafeFileError as error:
            log.warning("%s: unreadable holder (%s); replacing it", self.path, error)
            return None

    def _check_takeover(self, previous: Holder, flocked: bool) -> None:
        """A holder recorded in the file, though we may hold the flock: stale or not?"""
        if previous.pid == os.getpid() and previous.host == socket.gethostname():
            return
        if previous.host != socket.gethostname():
            if flocked:
                # On most shared filesystems a live holder's flock would have refused us;
                # the ones that keep flocks per host cannot tell, so say what to do.
                raise RunFolderLockedError(
                    f"{self.folder} is locked by a run on another host ({previous.describe()}); "
                    f"if that run is over, delete {self.path}"
                )
            raise RunFolderLockedError(f"{self.folder} is in use by {previous.describe()}")
        if is_alive_here(previous):
            raise RunFolderLockedError(
                f"{self.folder} is in use by another run ({previous.describe()})"
            )
        log.warning("%s: taking over the stale lock of %s", self.folder, previous.describe())


def _rewrite(fd: int, data: bytes) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


@contextlib.contextmanager
def hold_run_folder(folder: str | Path, rank: int = 0) -> Iterator[RunLock | None]:
    """Hold ``folder``'s lock for a block: rank 0 only, and not when a parent process
    holds it (``HELD_ENV``). Yields the lock, whose ``child_env`` a holder passes on to
    the processes it starts to run into the folder; None where nothing was locked."""
    lock = RunLock(folder)
    if rank != 0 or _held_by_parent(str(lock.path.absolute())):
        yield None
        return
    lock.acquire()
    try:
        yield lock
    finally:
        lock.release()


def _held_by_parent(path: str) -> bool:
    pid, _, held = os.environ.get(HELD_ENV, "").partition(":")
    return held == path and pid.isdigit() and int(pid) in _ancestors()


def _ancestors(limit: int = 8) -> list[int]:
    """This process's parent, grandparent, ... (a launcher is the workers' grandparent)."""
    found, pid = [], os.getppid()
    while pid > 1 and len(found) < limit:
        found.append(pid)
        fields = _proc_stat(pid)
        if len(fields) < 2:
            break
        pid = int(fields[1])
    return found
