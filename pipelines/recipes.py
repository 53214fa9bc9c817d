"""The demo's recipes and corpus: what ``megalith demo`` and the served deployments run."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from megalith import CODE_ROOT
from megalith.config import MegalithConfig, load_config
from megalith.errors import MegalithError

DEMO_RECIPE = CODE_ROOT / "configs" / "tiny-cpu.yaml"
FINETUNE_RECIPE = CODE_ROOT / "configs" / "finetune-chat-tiny.yaml"
FINETUNE_CRON = "0 3 * * *"


def sample_corpus() -> Path:
    return Path(str(resources.files("preprocessing") / "sample_corpus" / "stories.jsonl"))


def demo_config(recipe: str, workdir: Path, overrides: list[str]) -> MegalithConfig:
    if not Path(recipe).exists():
        raise MegalithError(
            f"recipe {recipe} not found; pass --config configs/tiny-cpu.yaml from a checkout"
        )
    return load_config(
        recipe,
        overrides,
        {"data.inputs": [str(sample_corpus())], "data.output": str(workdir / "shards")},
    )


def check_finetune_cron(cron: str | None) -> None:
    """Refuse a ``--finetune-cron`` that is not a five-field cron expression (None: no
    schedule). Called before the flows are imported, so a typo costs no wait."""
    if cron is None:
        return
    # Imported here: prefect costs ~1 s of CPU, which `megalith --help` should not pay.
    from prefect.client.schemas.schedules import CronSchedule

    try:
        CronSchedule(cron=cron)
    except ValueError:  # pydantic's ValidationError is one
        raise MegalithError(
            f"--finetune-cron {cron!r} is not a cron expression: five fields, "
            f"minute hour day-of-month month day-of-week (default '{FINETUNE_CRON}')"
        ) from None
