"""Serve every flow as a Prefect deployment, with the demo recipe as the forms' defaults."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prefect import serve
from prefect.client.schemas.schedules import CronSchedule

from megalith.config import load_config
from megalith.errors import MegalithError
from pipelines.finetune import finetune
from pipelines.flows import end_to_end, evaluate, pretrain, promote_model_flow, register_model_flow
from pipelines.recipes import DEMO_RECIPE, FINETUNE_CRON, FINETUNE_RECIPE, demo_config
from pipelines.tokenize import tokenize_corpus


@dataclass(frozen=True)
class FinetuneSchedule:
    """When and on what the ``finetune`` deployment runs by itself."""

    cron: str | None = FINETUNE_CRON
    data_location: str | None = None  # default: WORKDIR/incoming-chat
    recipe: str = str(FINETUNE_RECIPE)

    def __post_init__(self) -> None:
        if self.cron is None:
            return
        try:
            CronSchedule(cron=self.cron)
        except ValueError:  # pydantic's ValidationError is one
            raise MegalithError(
                f"--finetune-cron {self.cron!r} is not a cron expression: five fields, "
                f"minute hour day-of-month month day-of-week (default '{FINETUNE_CRON}')"
            ) from None


def deployments(workdir: Path, schedule: FinetuneSchedule | None = None) -> list:
    schedule = schedule or FinetuneSchedule()
    config = demo_config(str(DEMO_RECIPE), workdir, [])
    as_json = config.model_dump(mode="json")
    run = workdir / "run"
    return [
        tokenize_corpus.to_deployment(
            name="tokenize-corpus",
            parameters={"data": as_json["data"], "tokenizer": as_json["tokenizer"]},
            description="Corpus → tokenizer (SentencePiece or Hugging Face) → Megatron shards + manifest.",
        ),
        pretrain.to_deployment(
            name="pretrain",
            parameters={"config": as_json, "output": str(run)},
            description="Train a GPT or T5 (model.family) on prepared shards (resumes from the "
            "latest checkpoint).",
        ),
        evaluate.to_deployment(
            name="evaluate",
            parameters={
                "model_package": str(run / "model"),
                "config": as_json,
                "report_path": str(run / "eval.json"),
            },
            description="Perplexity, zero-shot tasks and sample generations of a model package.",
        ),
        register_model_flow.to_deployment(
            name="register-model",
            description="Register a model package in MLflow as @candidate.",
        ),
        promote_model_flow.to_deployment(
            name="promote-model",
            parameters={"name": config.logging.registered_model},
            description="Promotion gate: @candidate becomes @champion if it beats it.",
        ),
        end_to_end.to_deployment(
            name="end-to-end",
            parameters={"config": as_json, "workdir": str(workdir)},
            description="Tokenize → pretrain → evaluate → register.",
        ),
        finetune.to_deployment(
            name="finetune",
            cron=schedule.cron,
            parameters={
                "config": load_config(schedule.recipe).model_dump(mode="json"),
                "data_location": schedule.data_location or str(workdir / "incoming-chat"),
                "workdir": str(workdir / "finetune"),
            },
            description="New chat data since the last run → fine-tune @champion → evaluate "
            "against it → register @candidate → promotion gate. Skips when nothing is new.",
        ),
    ]


def serve_all(workdir: Path, schedule: FinetuneSchedule | None = None) -> None:
    serve(*deployments(workdir, schedule))
