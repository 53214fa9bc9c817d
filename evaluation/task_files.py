"""Where task files are: a path, or the name of a task shipped in ``evaluation/tasks/``.

Light (no torch), so that curation can find the files the pipelines evaluate on and
decontaminate the corpus against them before anything is trained.
"""

from __future__ import annotations

from pathlib import Path

from evaluation import EvaluationError

TASKS_DIR = Path(__file__).parent / "tasks"
SAMPLE_TASK = TASKS_DIR / "sample_facts.jsonl"


class TaskFileError(EvaluationError):
    """A task file that cannot be read; the message names file:line and the problem."""


def resolve_task_file(name: str | Path) -> Path:
    """A path, or the name of a shipped task (``sample_facts``)."""
    path = Path(name)
    if path.exists():
        return path
    shipped = TASKS_DIR / f"{name}.jsonl"
    if path.parent == Path(".") and shipped.is_file():
        return shipped
    available = ", ".join(sorted(p.stem for p in TASKS_DIR.glob("*.jsonl")))
    raise TaskFileError(f"{name}: no such task file (shipped tasks: {available})")
