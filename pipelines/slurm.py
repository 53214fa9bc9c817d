"""A small Slurm client: submit an sbatch script, read its job's state, follow its log,
cancel it. Plain subprocess calls (argument lists) to sbatch, squeue, sacct and scancel,
parsed from their machine-readable outputs; no Prefect and no torch here, so the flow in
``pipelines.cluster_flows`` stays thin and this module can be tested on recorded outputs.

The commands are looked up in ``SLURM_BIN_ENV`` (a folder) when it is set, else on PATH.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from megalith.errors import MegalithError
from pipelines import external
from pipelines.external import Outcome, find_command

SLURM_BIN_ENV = "MEGALITH_SLURM_BIN"  # the folder that holds sbatch, squeue, sacct, scancel


# Job states as squeue's %T and sacct's State print them (Slurm's JOB_STATE_STRING names).
OUTCOMES = {
    "PENDING": Outcome.WAITING,
    "CONFIGURING": Outcome.WAITING,  # nodes booting for the job
    "REQUEUED": Outcome.WAITING,
    "REQUEUE_HOLD": Outcome.WAITING,
    "REQUEUE_FED": Outcome.WAITING,
    "RESV_DEL_HOLD": Outcome.WAITING,
    "SUSPENDED": Outcome.WAITING,
    "STOPPED": Outcome.WAITING,
    "RUNNING": Outcome.RUNNING,
    "COMPLETING": Outcome.RUNNING,  # processes still ending on some nodes
    "STAGE_OUT": Outcome.RUNNING,
    "SIGNALING": Outcome.RUNNING,
    "RESIZING": Outcome.RUNNING,
    "COMPLETED": Outcome.SUCCEEDED,
    "CANCELLED": Outcome.CANCELLED,
    "FAILED": Outcome.FAILED,
    "TIMEOUT": Outcome.FAILED,
    "NODE_FAIL": Outcome.FAILED,
    "PREEMPTED": Outcome.FAILED,  # a requeued job shows REQUEUED/PENDING instead
    "OUT_OF_MEMORY": Outcome.FAILED,
    "BOOT_FAIL": Outcome.FAILED,
    "DEADLINE": Outcome.FAILED,
    "SPECIAL_EXIT": Outcome.FAILED,
    "REVOKED": Outcome.CANCELLED,  # a federated sibling ran it
}


def outcome(state: str) -> Outcome:
    """``CANCELLED by 1000`` (sacct) and ``CANCELLED+`` (truncated) are CANCELLED; a state
    this table does not know is taken as still running, so the follow loop goes on."""
    name = re.split(r"[\s+]", state.strip(), maxsplit=1)[0]
    return OUTCOMES.get(name, Outcome.RUNNING)


@dataclass(frozen=True)
class JobRecord:
    """One line of squeue or sacct: the job, an array task, a het component or a step."""

    job_id: str  # 123, 123_4, 123+1, 123.batch, 123.0
    state: str  # as Slurm printed it
    exit_code: str = ""  # sacct's "code:signal"

    @property
    def is_step(self) -> bool:
        return "." in self.job_id

    @property
    def outcome(self) -> Outcome:
        return outcome(self.state)


@dataclass(frozen=True)
class JobStatus:
    """A job's state summed over its array tasks or het components, with the records read."""

    job_id: str
    outcome: Outcome
    records: tuple[JobRecord, ...]

    def describe(self) -> str:
        """``4242 FAILED (exit 1:0); steps: 4242.0 FAILED 1:0, ...``"""
        jobs = [record for record in self.records if not record.is_step]
        steps = [record for record in self.records if record.is_step]
        text = ", ".join(_record_text(record) for record in jobs)
        failed = [step for step in steps if step.outcome is not Outcome.SUCCEEDED]
        if failed:
            text += "; steps: " + ", ".join(_record_text(step) for step in failed)
        return text


def _record_text(record: JobRecord) -> str:
    code = f" (exit {record.exit_code})" if record.exit_code else ""
    return f"{record.job_id} {record.state}{code}"


def combine(job_id: str, records: Iterable[JobRecord]) -> JobStatus | None:
    """The job's status from its own records (steps excluded): running while any array
    task or het component is not finished; then failed if any failed, else cancelled if
    any was, else succeeded. None when no record names the job."""
    records = tuple(record for record in records if _belongs_to(record.job_id, job_id))
    outcomes = {record.outcome for record in records if not record.is_step}
    if not outcomes:
        return None
    for candidate in (Outcome.RUNNING, Outcome.WAITING, Outcome.FAILED, Outcome.CANCELLED):
        if candidate in outcomes:
            return JobStatus(job_id, candidate, records)
    return JobStatus(job_id, Outcome.SUCCEEDED, records)


def _belongs_to(record_id: str, job_id: str) -> bool:
    return re.fullmatch(re.escape(job_id) + r"(?:[_+][^.]*)?(?:\.\S+)?", record_id) is not None


# --- the commands ----------------------------------------------------------------------


def run_command(name: str, args: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    where = "run this on a Slurm login node (where sbatch, squeue, sacct and scancel are)"
    return external.run_command([find_command(name, SLURM_BIN_ENV, where), *args], cwd)


def submit(script: Path, cwd: Path) -> str:
    """``sbatch --parsable SCRIPT`` from ``cwd`` (where %x-%j.out lands); the job id."""
    done = run_command("sbatch", ["--parsable", str(script)], cwd=cwd)
    if done.returncode:
        raise MegalithError(
            f"sbatch refused {script}: {done.stderr.strip() or done.stdout.strip()}"
        )
    # "123" or, on a multi-cluster setup, "123;cluster"; warnings may precede it
    lines = done.stdout.strip().splitlines()
    job_id = lines[-1].split(";")[0].strip() if lines else ""
    if not job_id.isdigit():
        raise MegalithError(f"sbatch printed no job id: {done.stdout!r}")
    return job_id


SQUEUE_FORMAT = "%i|%T"  # job id (with _task or +component), long state name


def squeue_records(job_id: str) -> list[JobRecord]:
    """The job's lines in the queue; empty once it has left it."""
    args = [f"--jobs={job_id}", "--noheader", "--states=all", f"--format={SQUEUE_FORMAT}"]
    done = run_command("squeue", args)
    if done.returncode:
        if "Invalid job id" in done.stderr:  # purged from the controller's memory
            return []
        raise MegalithError(f"squeue failed for job {job_id}: {done.stderr.strip()}")
    return [JobRecord(*line.split("|", 1)) for line in done.stdout.splitlines() if "|" in line]


SACCT_FIELDS = "JobID,State,ExitCode"


def sacct_records(job_id: str) -> list[JobRecord]:
    """The job's accounting lines (the job, then its steps: batch, extern, 0, 1 ...);
    empty when accounting has not recorded it (yet) or is disabled."""
    args = [f"--jobs={job_id}", "--noheader", "--parsable2", f"--format={SACCT_FIELDS}"]
    done = run_command("sacct", args)
    if done.returncode:
        return []
    return [JobRecord(*line.split("|")[:3]) for line in done.stdout.splitlines() if "|" in line]


def job_status(job_id: str) -> JobStatus | None:
    """The queue's view while the job is in it; the accounting's (with its steps) once it
    has finished or left the queue. None when neither knows the job."""
    live = combine(job_id, squeue_records(job_id))
    if live is not None and not live.outcome.terminal:
        return live
    return combine(job_id, sacct_records(job_id)) or live


def cancel(job_id: str) -> str:
    """``scancel JOB``; what it said (an already finished job is not an error here)."""
    done = run_command("scancel", [job_id])
    return (done.stderr or done.stdout).strip()


# --- the job's log -----------------------------------------------------------------------


def output_path(script: str, job_id: str, submit_dir: Path) -> Path:
    """Where the script's ``#SBATCH --output`` pattern puts the log (%x job name, %j job
    id; relative to the submit folder). Slurm's default is slurm-%j.out."""
    pattern = _sbatch_option(script, "output") or "slurm-%j.out"
    name = _sbatch_option(script, "job-name") or "sbatch"
    path = pattern.replace("%x", name).replace("%j", job_id).replace("%%", "%")
    if "%" in path:
        raise MegalithError(f"cannot follow the log {pattern!r}: only %x and %j are understood")
    return submit_dir / path


def _sbatch_option(script: str, option: str) -> str | None:
    match = re.search(rf"^#SBATCH\s+--{option}=(\S+)", script, re.MULTILINE)
    return match.group(1) if match else None


class LogFollower:
    """The complete lines a growing file gained since the last read."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0
        self._partial = b""

    def new_lines(self, final: bool = False) -> list[str]:
        """Lines completed since the last call; with ``final`` also an unfinished last one."""
        try:
            with self.path.open("rb") as log:
                log.seek(self._offset)
                chunk = log.read()
        except FileNotFoundError:  # not started yet
            return []
        self._offset += len(chunk)
        data = self._partial + chunk
        *lines, self._partial = data.split(b"\n")
        if final and self._partial:
            lines.append(self._partial)
            self._partial = b""
        return [line.decode(errors="replace").rstrip("\r") for line in lines]
