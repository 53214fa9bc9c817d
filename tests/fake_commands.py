"""Stand-ins for sbatch, squeue, sacct, scancel and kubectl at the command boundary: each
prints outputs recorded from the real command (tests/data/slurm/...) and records its
argv, working folder and stdin, one JSON line per call.

``install(bin_dir, scenario, state)`` writes one executable per command into ``bin_dir``
(put it first on PATH). A scenario folder holds ``sbatch.txt``, ``squeue-N.txt`` (the
queue at the N-th squeue call; the last one stays), ``sacct.txt`` and ``log-N.txt``
(appended to the job's log file, ``$FAKE_SLURM_LOG`` in sbatch's working folder, at the
N-th squeue call); for kubectl, ``kubectl-VERB-N.txt`` answers its N-th ``kubectl VERB``
(the last one stays). A file whose text starts with ``ERROR:`` is printed on stderr and the
command exits 1, as Slurm's commands do on an error.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

COMMANDS = ("sbatch", "squeue", "sacct", "scancel", "kubectl")
SHARED = Path(__file__).parent / "data" / "slurm"


def install(bin_dir: Path, scenario: Path, state: Path) -> dict[str, str]:
    """Executables in ``bin_dir``; the environment variables they read."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    state.mkdir(parents=True, exist_ok=True)
    for name in COMMANDS:
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "{__file__}" {name} "$@"\n')
        path.chmod(0o755)
    return {"FAKE_SLURM_SCENARIO": str(scenario), "FAKE_SLURM_STATE": str(state)}


def calls(state: Path, command: str | None = None) -> list[dict]:
    log = state / "calls.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return [record for record in records if command in (None, record["command"])]


def _reply(path: Path) -> int:
    text = path.read_text() if path.exists() else ""
    if text.startswith("ERROR:"):
        sys.stderr.write(text[len("ERROR:") :])
        return 1
    sys.stdout.write(text)
    return 0


def _kubectl_verb(args: list[str]) -> str:
    """``apply``, ``get``, ``delete``: the first word after the global flags."""
    words = iter(args)
    for word in words:
        if word in ("--context", "--namespace"):
            next(words, None)
        elif not word.startswith("-"):
            return word
    return ""


def main(command: str, args: list[str]) -> int:
    scenario = Path(os.environ["FAKE_SLURM_SCENARIO"])
    state = Path(os.environ["FAKE_SLURM_STATE"])
    stdin = sys.stdin.read() if command == "kubectl" else ""
    record = {"command": command, "argv": args, "cwd": os.getcwd(), "stdin": stdin}
    with (state / "calls.jsonl").open("a") as log:
        log.write(json.dumps(record) + "\n")
    if command == "sbatch":
        (state / "submit_dir").write_text(os.getcwd())
        return _reply(
            scenario / "sbatch.txt" if (scenario / "sbatch.txt").exists() else SHARED / "sbatch.txt"
        )
    if command == "squeue":
        polls = len(calls(state, "squeue"))
        chunk = scenario / f"log-{polls}.txt"
        if chunk.exists() and (state / "submit_dir").exists():
            job_log = Path((state / "submit_dir").read_text()) / os.environ["FAKE_SLURM_LOG"]
            with job_log.open("a") as out:
                out.write(chunk.read_text())
        replies = sorted(scenario.glob("squeue-*.txt"), key=lambda p: int(p.stem.split("-")[1]))
        return _reply(next((p for p in replies if p.stem == f"squeue-{polls}"), replies[-1]))
    if command == "kubectl":
        verb = _kubectl_verb(args)
        count = sum(_kubectl_verb(call["argv"]) == verb for call in calls(state, "kubectl"))
        replies = sorted(scenario.glob(f"kubectl-{verb}*.txt"))
        numbered = scenario / f"kubectl-{verb}-{count}.txt"
        return _reply(numbered if numbered.exists() else replies[-1])
    if command == "sacct":
        return _reply(scenario / "sacct.txt")
    return 0  # scancel: silent, as on success


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
