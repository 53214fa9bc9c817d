"""Every flow as a Prefect deployment, with the demo recipe as the forms' defaults:
served in this process (``megalith serve-pipelines``), or registered to a work pool for
its workers (``megalith deploy-pipelines``)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import UUID

from prefect import serve
from prefect.deployments.runner import EntrypointType, RunnerDeployment

from megalith.config import load_config
from pipelines.cluster_train import cluster_train
from pipelines.finetune import finetune
from pipelines.flows import end_to_end, evaluate, pretrain, promote_model_flow, register_model_flow
from pipelines.recipes import (
    DEMO_RECIPE,
    FINETUNE_CRON,
    FINETUNE_RECIPE,
    check_finetune_cron,
    demo_config,
)
from pipelines.tokenize import tokenize_corpus


@dataclass(frozen=True)
class FinetuneSchedule:
    """When and on what the ``finetune`` deployment runs by itself."""

    cron: str | None = FINETUNE_CRON
    data_location: str | None = None  # default: WORKDIR/incoming-chat
    recipe: str = str(FINETUNE_RECIPE)

    def __post_init__(self) -> None:
        check_finetune_cron(self.cron)


@dataclass(frozen=True)
class PoolPlacement:
    """Deployments a worker of work pool ``pool`` runs, with these job variables."""

    pool: str
    job_variables: dict[str, Any] = field(default_factory=dict)

    def options(self) -> dict[str, Any]:
        """``to_deployment`` arguments; the flow named by module path
        (``pipelines.flows.pretrain``), which a worker imports from the installed
        megalith in whatever folder it starts the run."""
        return {
            "work_pool_name": self.pool,
            "job_variables": copy.deepcopy(self.job_variables),
            "entrypoint_type": EntrypointType.MODULE_PATH,
        }


def deployments(
    workdir: Path, schedule: FinetuneSchedule | None = None, placement: PoolPlacement | None = None
) -> list[RunnerDeployment]:
    """The deployments, served, or run by ``placement``'s work pool."""
    schedule = schedule or FinetuneSchedule()
    config = demo_config(str(DEMO_RECIPE), workdir, [])
    as_json = config.model_dump(mode="json")
    run = workdir / "run"
    placed = placement.options if placement else dict
    return [
        tokenize_corpus.to_deployment(
            name="tokenize-corpus",
            **placed(),
            parameters={"data": as_json["data"], "tokenizer": as_json["tokenizer"]},
            description="Corpus → tokenizer (SentencePiece or Hugging Face) → Megatron shards + manifest.",
        ),
        pretrain.to_deployment(
            name="pretrain",
            **placed(),
            parameters={"config": as_json, "output": str(run)},
            description="Train a GPT or T5 (model.family) on prepared shards (resumes from the "
            "latest checkpoint).",
        ),
        evaluate.to_deployment(
            name="evaluate",
            **placed(),
            parameters={
                "model_package": str(run / "model"),
                "config": as_json,
                "report_path": str(run / "eval.json"),
            },
            description="Perplexity, zero-shot tasks and sample generations of a model package.",
        ),
        register_model_flow.to_deployment(
            name="register-model",
            **placed(),
            description="Register a model package in MLflow as @candidate.",
        ),
        promote_model_flow.to_deployment(
            name="promote-model",
            **placed(),
            parameters={"name": config.logging.registered_model},
            description="Promotion gate: @candidate becomes @champion if it beats it.",
        ),
        end_to_end.to_deployment(
            name="end-to-end",
            **placed(),
            parameters={"config": as_json, "workdir": str(workdir)},
            description="Tokenize → pretrain → evaluate → register.",
        ),
        finetune.to_deployment(
            name="finetune",
            **placed(),
            cron=schedule.cron,
            parameters={
                "config": load_config(schedule.recipe).model_dump(mode="json"),
                "data_location": schedule.data_location or str(workdir / "incoming-chat"),
                "workdir": str(workdir / "finetune"),
            },
            description="New chat data since the last run → fine-tune @champion → evaluate "
            "against it → register @candidate → promotion gate. Skips when nothing is new.",
        ),
        cluster_train.to_deployment(
            name="cluster-train",
            **placed(),
            parameters={"config": as_json, "run_dir": str(workdir / "cluster-run")},
            description="Pretrain on a cluster target (processes here, Slurm, Kubernetes, "
            "Ray) at the size in the form, or the work pool's job variables.",
        ),
    ]


def deploy_to_pool(workdir: Path, placement: PoolPlacement) -> dict[str, UUID]:
    """Register every deployment to ``placement.pool``; name -> deployment id."""
    return {
        deployment.name: deployment.apply(work_pool_name=placement.pool)
        for deployment in deployments(workdir, None, placement)
    }


def serve_all(workdir: Path, schedule: FinetuneSchedule | None = None) -> None:
    serve(*deployments(workdir, schedule))
