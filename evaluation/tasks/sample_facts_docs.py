"""The documents of the lm-eval task ``sample_facts.yaml``: the shipped task file, read
and checked by :func:`evaluation.tasks.load_task` (lm-eval loads this file by path)."""

from __future__ import annotations

from typing import Any

import datasets

from evaluation.tasks import SAMPLE_TASK, load_task


def load(**_: Any) -> dict[str, datasets.Dataset]:
    """``{"test": the items}`` with ``context``, ``choices``, ``answer`` and ``kind``."""
    items = [
        {"context": i.context, "choices": list(i.choices), "answer": i.answer, "kind": i.kind}
        for i in load_task(SAMPLE_TASK)
    ]
    return {"test": datasets.Dataset.from_list(items)}
