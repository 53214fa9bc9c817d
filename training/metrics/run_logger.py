"""The small interface the trainer reports through.

Training knows nothing of MLflow: it calls a ``RunLogger``. ``training.mlflow_store.runs``
provides the MLflow implementation; ``MetricsFile`` writes ``metrics.jsonl``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

from megalith.errors import naming_path


class RunLogger(Protocol):
    def log_params(self, params: dict[str, Any]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None: ...

    def set_tags(self, tags: dict[str, str]) -> None: ...

    def close(self, status: str = "FINISHED") -> None: ...


class NullLogger:
    """Logs nothing: ranks other than 0, and runs with tracking switched off."""

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        pass

    def set_tags(self, tags: dict[str, str]) -> None:
        pass

    def close(self, status: str = "FINISHED") -> None:
        pass


class MetricsFile:
    """Appends one JSON object per optimizer step to ``metrics.jsonl``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.handle = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        with naming_path(self.path):  # a full disk: one line naming metrics.jsonl
            self.handle.write(json.dumps(record) + "\n")
            self.handle.flush()

    def close(self) -> None:
        self.handle.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    with Path(path).open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
